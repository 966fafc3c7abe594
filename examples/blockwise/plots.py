"""Blockwise figures from bench JSON: BLEU against mean accepted block size (Table 1's cells), and speedup
over stock greedy against block size k (paper Fig. 4). Usage: plots.py RESULTS_PREFIX (e.g. docs/results/blockwise)
"""

import logging
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
        points = sorted((r["stats"]["block_size"], r["ratios"]["sentences_per_s"]) for r in load_results(sweep))
        right.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_xlabel("block size k")
        right.set_ylabel("speedup over stock greedy (sentences/s)")
        right.set_title("Speedup against k (batch 1, one thread)")
    fig.tight_layout()
    out = f"{prefix}_figures.png"
    fig.savefig(out + ".tmp.png", dpi=110)
    os.replace(out + ".tmp.png", out)


if __name__ == "__main__":
    main(sys.argv[1])
