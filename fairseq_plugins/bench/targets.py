"""The methods' targets (docs/results/targets.json), each judged on the bench rows it names: met, not met, or
"not met (flagged)" when the figure passes but a ratio behind it is flagged (fewer than 3 runs, a spread over
10%, an oversubscribed machine, pass-by-pass alternation): a flagged ratio never supports a "met".

A target's criteria: ``min_speed_ratio`` (against stock, or ``relative_to`` another row), ``min_stats``,
``max_bleu_loss`` (against stock), ``identical_outputs`` (every output the stock generator's), and against the
same run's CTranslate2 reference (``bench --reference ctranslate2``): ``min_ctranslate2_ratio`` (CTranslate2's
time / the method's) and ``max_bleu_loss_vs_ctranslate2`` (on the whole split where the bench scored it)."""

import json
import os
from typing import Dict, List, Optional

from ..common.textio import InputError
from .measure import SPREAD_FLAG
from .report import flag_reasons, headline_bleu

TARGETS_FILE = "targets.json"
MET, NOT_MET, FLAGGED, NOT_MEASURED = "met", "not met", "not met (flagged)", "not measured"


def load_targets(path: str) -> List[Dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        targets = json.load(f).get("targets", [])
    for number, target in enumerate(targets):
        if not {"method", "target", "row"} <= set(target) and not {"method", "target", "value"} <= set(target):
            raise InputError(f"{path}: target {number} needs method, target and row (or value)")
    return targets


def find_row(results_dir: str, spec: Dict, oriented) -> Dict:
    """The one bench row of ``spec['file']`` (relative to results_dir) with ``spec['label']`` (and, where given,
    ``spec['batch_size']``); ``oriented`` turns a cache ablation round as the overview does."""
    from .report import load_results

    path = os.path.join(results_dir, spec["file"])
    rows = [oriented(r) for r in load_results(path)  # matched on the label the file holds, then turned round
            if r.get("label") == spec["label"] and spec.get("batch_size", r.get("batch_size")) == r.get("batch_size")]
    if len(rows) != 1:
        raise InputError(f"{path}: {len(rows)} rows labelled {spec['label']!r} (a target needs exactly one)")
    return rows[0]


def json_value(results_dir: str, spec: Dict):
    """A figure of a JSON that is not a bench result (a summary): ``spec['key']`` is a dotted path."""
    with open(os.path.join(results_dir, spec["file"]), encoding="utf-8") as f:
        value = json.load(f)
    for key in spec["key"].split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def judge(target: Dict, results_dir: str, oriented) -> Dict:
    """{"status", "measured", "file"} of one target."""
    spec = target.get("value") or target["row"]
    if not os.path.isfile(os.path.join(results_dir, spec["file"])):  # (a recipe stage not run yet)
        return {"status": NOT_MEASURED, "measured": "-", "file": spec["file"]}
    if "value" in target:  # a figure of a summary JSON (its own ratio flagged at "flag_key", where it has one)
        value = json_value(results_dir, spec)
        ok = value <= target["at_most"] if "at_most" in target else value >= target["at_least"]
        flagged = "flag_key" in spec and json_value(results_dir, {**spec, "key": spec["flag_key"]})
        status = (FLAGGED if flagged else MET) if ok else NOT_MET
        measured = f"{value:g}" + ("; flagged: its runs spread over 10% or the machine was busy" if flagged else "")
        return {"status": status, "measured": measured, "file": spec["file"]}
    row = find_row(results_dir, target["row"], oriented)
    flags = list(flag_reasons(row))
    ratio, low, high = row["speed_ratio"], row["speed_ratio_min"], row["speed_ratio_max"]
    measured = []
    if "relative_to" in target:  # a speedup over another row of the same model (both against stock)
        base = find_row(results_dir, target["relative_to"], oriented)
        flags += [f for f in flag_reasons(base) if f not in flags]
        ratio, low, high = ratio / base["speed_ratio"], low / base["speed_ratio_max"], high / base["speed_ratio_min"]
        measured.append(f"{ratio:.2f}x ({low:.2f}-{high:.2f}) over {target['relative_to']['label']}")
    elif "min_speed_ratio" in target:
        measured.append(f"{ratio:.2f}x ({low:.2f}-{high:.2f})")
    ok = True
    if "min_speed_ratio" in target:
        ok = ratio >= target["min_speed_ratio"]
    reference = row.get("ctranslate2")
    if "min_ctranslate2_ratio" in target or "max_bleu_loss_vs_ctranslate2" in target:
        if not reference:
            raise InputError(f"{target['row']['file']}: {target['row']['label']!r} has no CTranslate2 reference "
                             f"(bench --reference ctranslate2), which target {target['target']!r} is judged on")
    if "min_ctranslate2_ratio" in target:
        measured.append(f"{reference['speed_ratio']:.2f}x ({reference['speed_ratio_min']:.2f}-"
                        f"{reference['speed_ratio_max']:.2f}) CTranslate2 {reference['compute_type']}")
        if reference.get("speed_ratio_spread", 0) > SPREAD_FLAG:
            flags.append(f"the CTranslate2 ratios spread over {100 * reference['speed_ratio_spread']:.0f}% of the "
                         f"median")
        ok = ok and reference["speed_ratio"] >= target["min_ctranslate2_ratio"]
    if "max_bleu_loss_vs_ctranslate2" in target:
        whole = row.get("split_bleu") or {}
        delta, basis = ((whole["ctranslate2_bleu_delta"], whole["sentences"]) if "ctranslate2_bleu_delta" in whole
                        else (reference["bleu_delta"], reference["sentences"]))
        measured.append(f"BLEU {delta:+.2f} against CTranslate2 ({basis} sentences)")
        ok = ok and delta >= -target["max_bleu_loss_vs_ctranslate2"]
    if target.get("identical_outputs"):
        share = (row.get("stats") or {}).get("outputs_identical_to_baseline")
        measured.append(f"outputs identical to stock: {'?' if share is None else f'{100 * share:.1f}%'}")
        ok = ok and share == 1.0
    for stat, least in target.get("min_stats", {}).items():  # e.g. blockwise's mean accepted block size
        value = (row.get("stats") or {}).get(stat)
        measured.append(f"{stat.replace('_', ' ')} {value}")
        ok = ok and value is not None and value >= least
    if "max_bleu_loss" in target:
        bleu = headline_bleu(row)
        measured.append(f"ΔBLEU {bleu['delta']:+.2f} ({bleu['sentences']} sentences)")
        ok = ok and bleu["delta"] >= -target["max_bleu_loss"]
    status = NOT_MET
    if ok:
        timed = {"min_speed_ratio", "min_ctranslate2_ratio"} & set(target)
        status = FLAGGED if flags and timed else MET
    text = ", ".join(measured)
    if status == FLAGGED:
        text += f"; flagged: {'; '.join(flags)}"
    return {"status": status, "measured": text, "file": target["row"]["file"]}


def targets_table(method: str, targets: List[Dict], results_dir: str, oriented,
                  link_prefix: Optional[str] = None) -> List[str]:
    """Markdown lines: one row per target of ``method`` (none: no lines)."""
    mine = [t for t in targets if t["method"] == method]
    if not mine:
        return []
    lines = ["| target | measured | status | from |", "|---|---|---|---|"]
    for target in mine:
        verdict = judge(target, results_dir, oriented)
        name = verdict["file"]
        link = f"[{name}]({link_prefix}{name})" if link_prefix is not None else name
        if verdict["status"] == NOT_MEASURED:  # no such file yet: nothing to link to
            link = f"{name} (not written yet)"
        issue = f" (issue {target['issue']})" if target.get("issue") else ""
        lines.append(f"| {target['target']}{issue} | {verdict['measured']} | **{verdict['status']}** | {link} |")
    return lines
