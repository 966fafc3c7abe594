"""Re-state bench results measured before the speed ratio was defined as a time ratio (docs/bench.md).

Until then ``speed_ratio`` was method tokens/s over stock tokens/s, which rewards longer outputs, and each run
timed the two generators one whole pass after the other. Every such result stored both generators' per-run
seconds over the same sentences, so the current definition can be computed from them without decoding again:
per-run ratios stock / method (run i of each generator: the same sentences, adjacent passes), their median
and min-max spread. What cannot be recomputed is marked: the runs alternated pass by pass, not batch by
batch; the load average was not recorded; BLEU's brevity penalty and precisions need the outputs, which were
not stored. The old figure is kept under ``speed_ratio_restated.tokens_per_s_ratio``.

Usage: python examples/results/restate_speed_ratios.py docs/results/*.json
Files that hold no bench results (summaries, recall tables) are skipped; restated results are left alone,
so running it twice changes nothing.
"""

import json
import sys

from fairseq_plugins.bench import report
from fairseq_plugins.bench.measure import speed_ratio_figures


# What speed_ratio is in a re-stated result: the current definition, but for how its runs alternated.
RESTATED_DEFINITION = (
    "stock time / method time on the same input sentences: the median over runs of (stock generator's run "
    "seconds / method generator's run seconds), runs alternating the two generators pass by pass (re-stated "
    "from the stored run times of a run made before batch-by-batch alternation); equal to the ratio of "
    "sentences per second, not of tokens per second")


def restate(result: dict) -> bool:
    """Re-state one result in place; False when it already follows the current definition."""
    if "speed_ratio_definition" in result:
        return False
    old = result["speed_ratio"]
    figures = speed_ratio_figures(result["baseline"]["run_seconds"], result["run_seconds"])
    result.update(figures, speed_ratio_definition=RESTATED_DEFINITION)
    result["speed_ratio_restated"] = {
        "tokens_per_s_ratio": old,
        "how": "recomputed from the stored per-run seconds of both generators; these runs alternated pass by "
               "pass (which generator went first alternated per run), not batch by batch",
    }
    result.setdefault("timing", {
        "alternation": "per pass",
        "runs": result.get("runs"),
        "warmup_batches": result.get("warmup_batches"),
        "sentences_timed": result.get("sentences"),
        "threads": result.get("threads"),
        "load_average_before": None,  # not recorded then
        "load_average_after": None,
        "oversubscribed": None,
    })
    return True


def main(paths):
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        entries = data if isinstance(data, list) else [data]
        if not all(isinstance(e, dict) and "baseline" in e and "run_seconds" in e for e in entries):
            print(f"{path}: not bench results, skipped")
            continue
        changed = sum(restate(entry) for entry in entries)
        if changed:
            report.save_results(path, entries)
        print(f"{path}: {changed} of {len(entries)} result(s) re-stated")


if __name__ == "__main__":
    main(sys.argv[1:])
