"""Blockwise figures from bench JSON: BLEU against mean accepted block size (Table 1's cells), and speedup
over stock greedy against block size k (paper Fig. 4). Usage: plots.py RESULTS_PREFIX (e.g. docs/results/blockwise)

The speedup is the bench result's speed ratio: stock greedy time / blockwise time on the same sentences, the
median of the runs' ratios; the bars are their min-max, and a point whose runs spread over 10% of the median
is drawn hollow.
"""

import logging
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fairseq_plugins.bench.measure import SPREAD_FLAG  # noqa: E402
from fairseq_plugins.bench.report import load_results  # noqa: E402

logging.getLogger("matplotlib").setLevel(logging.WARNING)  # importing fairseq leaves the root logger chatty


def main(prefix: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    table = f"{prefix}_table1.json"
    if os.path.exists(table):
        by_variant = {}
        for r in load_results(table):
            variant = r["label"].split(" k=")[0]
            by_variant.setdefault(variant, []).append((r["stats"]["mean_accepted_block_size"], r["bleu"]))
        for variant, points in by_variant.items():
            points.sort()
            left.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
        left.set_xlabel("mean accepted block size")
        left.set_ylabel("BLEU (test_2016_flickr)")
        left.set_title("BLEU against mean accepted block size")
        left.legend()
    sweep = f"{prefix}_speed_vs_k.json"
    if os.path.exists(sweep):
        results = sorted(load_results(sweep), key=lambda r: r["stats"]["block_size"])
        ks = [r["stats"]["block_size"] for r in results]
        ratios = [r["speed_ratio"] for r in results]
        right.plot(ks, ratios, color="C0")
        for k, r in zip(ks, results):
            wide = r["speed_ratio_spread"] > SPREAD_FLAG
            right.errorbar(k, r["speed_ratio"], yerr=[[r["speed_ratio"] - r["speed_ratio_min"]],
                                                      [r["speed_ratio_max"] - r["speed_ratio"]]],
                           marker="o", color="C0", mfc="white" if wide else "C0", capsize=3)
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_xlabel("block size k")
        right.set_ylabel("stock greedy time / blockwise time")
        runs = min(len(r["speed_ratio_runs"]) for r in results)
        right.set_title("Speedup against k (batch 1, one thread)\n"
                        f"same sentences, median of {runs} runs, bars: min-max", fontsize=9)
    fig.tight_layout()
    out = f"{prefix}_figures.png"
    fig.savefig(out + ".tmp.png", dpi=110)
    os.replace(out + ".tmp.png", out)


if __name__ == "__main__":
    main(sys.argv[1])
