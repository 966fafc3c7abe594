"""Bench results: JSON files (one object or a list), Markdown tables, PNG charts, provenance."""

import json
import os
import platform
import shlex
import subprocess
from typing import Dict, List, Optional

from ..common.plots import pyplot, save_png
from ..common.textio import InputError, atomic_output, read_json, read_lines

# Columns of the Markdown table: (header, key in a figures dict, format).
COLUMNS = [
    ("BLEU", "bleu", "{:.2f}"),
    ("sent/s", "sentences_per_s", "{:.2f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("p50 ms", "latency_ms_p50", "{:.1f}"),
    ("p90 ms", "latency_ms_p90", "{:.1f}"),
    ("peak MB", "peak_memory_mb", "{:.0f}"),
]


def load_results(path: str) -> List[Dict]:
    """Results in a bench JSON file, always as a list."""
    data = read_json(path, "bench result file")
    results = data if isinstance(data, list) else [data]
    for number, result in enumerate(results):
        if not isinstance(result, dict) or "method" not in result or "baseline" not in result:
            raise InputError(f"{path}: entry {number} is not a bench result (needs 'method' and 'baseline')")
    return results


def save_results(path: str, results: List[Dict]) -> None:
    with atomic_output(path) as f:
        json.dump(results[0] if len(results) == 1 else results, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _cell(figures: Dict, key: str, fmt: str) -> str:
    value = figures.get(key)
    return "-" if value is None else fmt.format(value)


def flag_reasons(result: Dict) -> List[str]:
    """Why a result's speed ratio should not be taken at face value (empty when nothing is wrong)."""
    from .measure import SPREAD_FLAG

    reasons = []
    runs = result.get("speed_ratio_runs") or []
    if len(runs) < 3:
        reasons.append(f"{len(runs) or 'no'} timed run(s), fewer than 3")
    spread = result.get("speed_ratio_spread")
    if spread is not None and spread > SPREAD_FLAG:
        reasons.append(f"the runs' ratios spread over {100 * spread:.0f}% of the median (more than "
                       f"{100 * SPREAD_FLAG:.0f}%)")
    timing = result.get("timing") or {}
    if timing.get("oversubscribed"):
        if timing.get("runnable_threads_median") is not None:
            reasons.append(f"a median of {timing['runnable_threads_median']:g} threads wanted the "
                           f"{timing.get('cores')} cores while batches were timed")
        else:
            reasons.append("threads + load average exceeded the cores during the run")
    if timing.get("alternation") == "per pass":
        reasons.append("runs alternated pass by pass, not batch by batch (measured before the current bench)")
    return reasons


def ratio_cell(result: Dict) -> str:
    """``1.23x (1.20-1.25)``: the median speed ratio with its min-max over runs; ``!`` marks a flagged one."""
    text = f"{result['speed_ratio']:.2f}x"
    if result.get("speed_ratio_min") is not None:
        text += f" ({result['speed_ratio_min']:.2f}-{result['speed_ratio_max']:.2f})"
    return text + (" !" if flag_reasons(result) else "")


def reference_ratio(result: Dict) -> Dict:
    """The same-run CTranslate2 reference's speed figures (CTranslate2 time / method time) with the run's timing,
    so that ``flag_reasons`` and ``ratio_cell`` read it as they read the stock ratio; {} without a reference."""
    reference = result.get("ctranslate2")
    if not reference:
        return {}
    return {**{key: reference[key] for key in SPEED_KEYS[:-1]}, "timing": result.get("timing") or {}}


def reference_cell(result: Dict) -> str:
    """``1.23x (1.20-1.25)`` CTranslate2 time / method time, ``!`` when flagged; ``-`` without a reference."""
    figures = reference_ratio(result)
    return ratio_cell(figures) if figures else "-"


def _flag_notes(results: List[Dict]) -> str:
    flagged = [result for result in results if flag_reasons(result)]
    names = [result.get("label") or result["method"] for result in flagged]
    notes = []
    for name, result in zip(names, flagged):
        if names.count(name) > 1:  # results of one label (e.g. a sweep): say which
            name += f" ({result['generator']['description']}, batch {result['batch_size']})"
        notes.append(f"! {name}: {'; '.join(flag_reasons(result))}\n")
    for result in results:  # a CTranslate2 ratio flagged for its own spread
        own = [reason for reason in flag_reasons(reference_ratio(result)) if reason not in flag_reasons(result)] \
            if result.get("ctranslate2") else []
        if own:
            notes.append(f"! {result.get('label') or result['method']} against CTranslate2: {'; '.join(own)}\n")
    return "".join(notes)


def headline_bleu(result: Dict) -> Dict:
    """The BLEU a result is quoted with: on the whole split where the bench scored it (``split_bleu``: the
    timed sentences plus the others, decoded once untimed), else on the sentences timed."""
    split = result.get("split_bleu")
    if split:
        return {"bleu": split["method"]["bleu"], "stock": split["stock"]["bleu"], "delta": split["bleu_delta"],
                "sentences": split["sentences"], "whole_split": True}
    return {"bleu": result["bleu"], "stock": result["baseline"]["bleu"],
            "delta": result.get("bleu_delta", result["bleu"] - result["baseline"]["bleu"]),
            "sentences": result.get("sentences"), "whole_split": False}


def markdown_table(results: List[Dict]) -> str:
    """One row per generator: each method result, then the stock generator measured beside it. "BLEU" is on the
    sentences timed, "BLEU all" on the whole split (when the bench scored it)."""
    header = (["method", "generator", "device", "threads", "batch"] + [c[0] for c in COLUMNS] + ["BLEU all"]
              + ["speed ratio"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        split = result.get("split_bleu") or {}
        rows = [(result.get("label") or result["method"], result, split.get("method"), ratio_cell(result)),
                ("stock", result["baseline"], split.get("stock"), "1.00x")]
        if result.get("ctranslate2"):  # its speed in the same column: stock time / CTranslate2 time
            reference = result["ctranslate2"]
            stock_over_reference = result["speed_ratio"] / reference["speed_ratio"]
            rows.append(("CTranslate2", reference, split.get("ctranslate2"), f"{stock_over_reference:.2f}x"))
        for name, figures, whole, ratio in rows:
            row = [name, figures["generator"]["description"], result["device"], str(result["threads"]),
                   str(result["batch_size"])]
            row += [_cell(figures, key, fmt) for _, key, fmt in COLUMNS]
            row += [f"{whole['bleu']:.2f} ({split['sentences']})" if whole else "-", ratio]
            lines.append("| " + " | ".join(row) + " |")
    notes = _flag_notes(results)
    if any(result.get("ctranslate2") for result in results):
        notes += ("CTranslate2: the stock side's checkpoint converted by CTranslate2's fairseq converter, decoded in "
                  "the same runs; its speed ratio is the medians' quotient. The method against it (CTranslate2 "
                  "time / method time, median over runs): "
                  + "; ".join(f"{result.get('label') or result['method']} {reference_cell(result)}"
                              for result in results if result.get("ctranslate2")) + ".\n")
    return "\n".join(lines) + "\n" + (f"\nSpeed ratio: {SPEED_RATIO_HEADER}.\n" + notes if results else "")


PROFILE_COLUMNS = {  # the split's figures and their headers: CUDA, then the CPU's
    True: (("device_ms_per_token", "kernels ms"), ("gap_ms_per_token", "gaps ms"),
           ("device_busy_share", "device busy"), ("device_activities_per_token", "kernels/token")),
    False: (("op_ms_per_token", "aten ops ms"), ("outside_ops_ms_per_token", "outside ops ms"),
            ("op_share", "in ops"), ("ops_per_token", "ops/token")),
}


def profile_table(results: List[Dict]) -> str:
    """Where a token's time goes (bench --profile): per result, the method's and the stock generator's profiled
    time per output token, split into device kernels and the gaps between them (CUDA) or aten operators and
    the rest (CPU); a table for each of the two."""
    tables = []
    for on_device in (True, False):
        columns = PROFILE_COLUMNS[on_device]
        header = ["method", "generator", "device", "tokens", "ms/token"] + [title for _, title in columns]
        lines, splits = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)], set()
        for result in results:
            profile = result.get("profile")
            if not profile or ("device_ms_per_token" in profile["method"]) != on_device:
                continue
            splits.add(profile["split"])
            for name, figures in (("method", result), ("stock", result["baseline"])):
                p = profile[name]
                label = (result.get("label") or result["method"]) if name == "method" else "stock"
                cells = [f"{p[key]:.3f}" for key, _ in columns[:2]] + [f"{100 * p[columns[2][0]]:.0f}%",
                                                                        f"{p[columns[3][0]]:.1f}"]
                lines.append("| " + " | ".join([label, figures["generator"]["description"], result["device"],
                                                 str(p["tokens"]), f"{p['wall_ms_per_token']:.3f}"] + cells) + " |")
        if splits:
            tables.append("\n".join(lines) + "\n\nPer output token of the profiled decode: "
                          + "; ".join(sorted(splits)) + ".\n")
    return "\n".join(tables) or "no profile in these results (bench --profile N)\n"


# What every table's "speed ratio" column is (the full definition: measure.SPEED_RATIO_DEFINITION).
SPEED_RATIO_HEADER = ("stock time / method time on the same sentences, median over runs (min-max); "
                      "! = flagged, see below")


def summary_table(results: List[Dict]) -> str:
    """The demo's table: per result, BLEU beside the stock generator's on the same model, the speed ratio with
    its spread, the batch size, and what the model is."""
    with_reference = any(result.get("ctranslate2") for result in results)
    rows = [("method", "BLEU", "stock BLEU", "dBLEU", "speed ratio (min-max)")
            + (("CT2 BLEU", "vs CTranslate2 (min-max)") if with_reference else ()) + ("batch", "model")]
    for result in results:
        base, bleu = result["baseline"], headline_bleu(result)
        reference = result.get("ctranslate2")
        reference_bleu = ((result.get("split_bleu") or {}).get("ctranslate2") or reference or {}).get("bleu")
        reference_cells = (("-" if reference_bleu is None else f"{reference_bleu:.2f}", reference_cell(result))
                           if with_reference else ())
        rows.append((
            f"{result.get('label') or result['method']} ({result['generator']['description']} vs stock "
            f"{base['generator']['description']})",
            f"{bleu['bleu']:.2f}" + ("" if bleu["whole_split"] else "*"),
            f"{bleu['stock']:.2f}",
            f"{bleu['delta']:+.2f}",
            ratio_cell(result),
            *reference_cells,
            str(result["batch_size"]),
            result.get("model_note") or "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
    reference_note = ("vs CTranslate2: CTranslate2 time / method time, same runs (CTranslate2 decoding the stock "
                      "side's model, converted by its fairseq converter)\n" if with_reference else "")
    return (table + f"\n\nspeed ratio: {SPEED_RATIO_HEADER}\n{reference_note}BLEU: on the whole split; * on the "
            "sentences timed only (a result from before the bench scored the rest, or --no-whole-split-bleu)\n"
            + _flag_notes(results))


# ---- the speed figures of a summary (examples/*/summarize.py): one dict per result, a cell, notes

SPEED_KEYS = ("speed_ratio", "speed_ratio_min", "speed_ratio_max", "speed_ratio_spread", "speed_ratio_runs",
              "speed_ratio_flags")


def speed_figures(r: Dict) -> Dict:
    """The speed ratio (stock time / method time, same sentences) with every run's ratio, their min-max and
    spread, and why it should not be taken at face value (`flag_reasons`); unrounded, as bench wrote them."""
    return {key: r[key] for key in SPEED_KEYS[:-1]} | {"speed_ratio_flags": flag_reasons(r)}


def speed_cell(figures: Dict) -> str:
    """``1.45x (1.40-1.49)``; a spread over 10% of the median is written out, and ``!`` marks any flag."""
    from .measure import SPREAD_FLAG

    text = f"{figures['speed_ratio']:.2f}x ({figures['speed_ratio_min']:.2f}-{figures['speed_ratio_max']:.2f})"
    if figures["speed_ratio_spread"] > SPREAD_FLAG:
        text += f", spread {100 * figures['speed_ratio_spread']:.0f}%"
    return text + (" !" if figures["speed_ratio_flags"] else "")


def flag_note_lines(labelled) -> List[str]:
    """Markdown lines under a table: the definition, the flags every row shares once, then each row's own."""
    if not labelled:
        return []
    shared = [flag for flag in labelled[0][1]["speed_ratio_flags"]
              if all(flag in figures["speed_ratio_flags"] for _, figures in labelled)]
    lines = ["", f"Speed ratio: {SPEED_RATIO_HEADER}."]
    if shared:
        lines.append(f"! every row: {'; '.join(shared)}.")
    for label, figures in labelled:
        own = [f for f in figures["speed_ratio_flags"] if f not in shared]
        if own:
            lines.append(f"! {label}: {'; '.join(own)}.")
    return lines


def plot_speed_against_bleu(results: List[Dict], path: str) -> None:
    """Speed ratio (x; the stock generator is 1) against BLEU (y): each method point with an arrow from its
    stock baseline measured in the same run, and the ratio's min-max over runs as an error bar."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for result in results:
        base, label, ratio = result["baseline"], result.get("label") or result["method"], result["speed_ratio"]
        low, high = result.get("speed_ratio_min", ratio), result.get("speed_ratio_max", ratio)
        ax.scatter(1.0, base["bleu"], color="grey", marker="s")
        ax.errorbar(ratio, result["bleu"], xerr=[[ratio - low], [high - ratio]], marker="o", capsize=3)
        ax.annotate("", xy=(ratio, result["bleu"]), xytext=(1.0, base["bleu"]),
                    arrowprops={"arrowstyle": "->", "color": "grey", "alpha": 0.6})
        ax.annotate(f"{label} ({result['generator']['description']})", (ratio, result["bleu"]),
                    fontsize=8, xytext=(4, 4), textcoords="offset points")
    first = results[0]
    ax.set_xlabel("speed ratio: stock time / method time, same sentences (grey squares: stock = 1)")
    ax.set_ylabel("BLEU (sacrebleu, detokenised)")
    ax.set_title(f"{first['device']}, {first['threads']} thread(s), batch {first['batch_size']}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)


def read_provenance(paths: List[str]) -> List[str]:
    """Commands recorded by a recipe (one per line, '#' comments skipped) that produced the checkpoint."""
    commands = []
    for path in paths:
        for line in read_lines(path, allow_empty_lines=True):
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def command_line(argv: List[str]) -> str:
    return shlex.join(["fairseq-plugins"] + list(argv))


# Where a copy of the tree without .git (a lent GPU machine) finds the commit it was copied from: written here
# by `examples/gpu/run.sh stamp` before the copy; FAIRSEQ_PLUGINS_GIT_COMMIT overrides it.
COMMIT_STAMP = os.path.join(".gpu", "commit")
COMMIT_VARIABLE = "FAIRSEQ_PLUGINS_GIT_COMMIT"


def git_commit(repo: Optional[str] = None) -> str:
    """HEAD of the repository holding this package, '+dirty' when tracked files differ from it; in a copy without
    .git, $FAIRSEQ_PLUGINS_GIT_COMMIT or the stamp the GPU kit carries (COMMIT_STAMP); else 'unknown'.

    docs/results is left out: a recipe that benches several settings rewrites its own result files."""
    repo = repo or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    if not os.path.exists(os.path.join(repo, ".git")):
        try:
            with open(os.path.join(repo, COMMIT_STAMP), encoding="utf-8") as f:
                return f.read().strip() or "unknown"
        except OSError:
            return "unknown"
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)docs/results"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def versions() -> Dict[str, str]:
    import fairseq
    import sacrebleu
    import torch

    from .. import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fairseq": fairseq.__version__,
        "sacrebleu": sacrebleu.__version__,
        "fairseq_plugins": __version__,
    }


def device_name(device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
