"""The methods' targets (docs/results/targets.json), each judged on the bench rows it names: met, not met, or
"not met (flagged)" when the figure passes but a ratio behind it is flagged (fewer than 3 runs, a spread over
10%, an oversubscribed machine, pass-by-pass alternation): a flagged ratio never supports a "met"."""

import json
import os
from typing import Dict, List, Optional

from ..common.textio import InputError
from .report import flag_reasons, headline_bleu

TARGETS_FILE = "targets.json"
MET, NOT_MET, FLAGGED = "met", "not met", "not met (flagged)"


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
    if "value" in target:  # a figure of a summary JSON, no speed ratio behind it
        value = json_value(results_dir, target["value"])
        ok = value <= target["at_most"] if "at_most" in target else value >= target["at_least"]
        return {"status": MET if ok else NOT_MET, "measured": f"{value:g}", "file": target["value"]["file"]}
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
        status = FLAGGED if flags and "min_speed_ratio" in target else MET
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
        issue = f" (issue {target['issue']})" if target.get("issue") else ""
        lines.append(f"| {target['target']}{issue} | {verdict['measured']} | **{verdict['status']}** | {link} |")
    return lines
