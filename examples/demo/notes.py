"""The lines `make demo` prints under its table (`fairseq-plugins report`), from the same bench JSON files:
what each row's BLEU is computed on, how many outputs equal the stock side's, and what blockwise decoding's
blocks add over the fast step's own greedy decoding of the same weights.

Usage: python examples/demo/notes.py BENCH_DIR
"""

import glob
import json
import os
import sys


def load(bench_dir):
    """(file stem, result) of every row, in the table's order (file names)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(bench_dir, "*.json"))):
        with open(path, encoding="utf-8") as f:
            rows.append((os.path.basename(path)[:-len(".json")], json.load(f)))
    return rows


def label(result):
    return result.get("label") or result["method"]


def bleu_basis(rows):
    """Each row's BLEU, method and stock alike, is on the sentences it timed (or on the whole split where
    the bench scored it); say how many, once when every row has the same."""
    bases = {}
    for _, result in rows:
        split = result.get("split_bleu")
        basis = f"all {split['sentences']}" if split else f"the first {result['sentences']}"
        bases.setdefault(basis, []).append(label(result))
    if len(bases) == 1:
        return f"BLEU basis: every row, method and stock side alike, on {next(iter(bases))} test sentences."
    parts = [f"on {basis} test sentences: {'; '.join(labels)}" for basis, labels in bases.items()]
    return "BLEU basis, method and stock side alike, " + " | ".join(parts) + "."


def identical_outputs(rows):
    shares = [f"{label(r)} {100 * r['stats']['outputs_identical_to_baseline']:.0f}%" for _, r in rows
              if "outputs_identical_to_baseline" in r.get("stats", {})]
    return "Outputs identical to the stock side's, token for token: " + "; ".join(shares) + "."


def blocks_alone(rows):
    """Blockwise on the fast step against the fast step's own greedy decoding: the ratio of the two rows'
    speed ratios (both against stock greedy on the same weights, the blockwise base being frozen), beside the
    mean accepted block A and the cost C of one call in fast-step greedy steps, from the blockwise run."""
    by_method = {}
    for _, result in rows:
        by_method.setdefault(result["method"], result)
    blockwise, fast_step = by_method.get("blockwise"), by_method.get("fast_step")
    if not blockwise or not fast_step:
        return None
    stats = blockwise.get("stats", {})
    line = (f"Blockwise's blocks alone: {blockwise['speed_ratio'] / fast_step['speed_ratio']:.2f}x the fast step's "
            f"own greedy decoding ({blockwise['speed_ratio']:.2f}x / {fast_step['speed_ratio']:.2f}x, the two rows "
            "against stock greedy on the same weights; above 1 the blocks would pay for their calls)")
    if "mean_accepted_block_size" in stats and "call_cost_vs_greedy_step" in stats:
        line += (f"; a call accepts {stats['mean_accepted_block_size']:.2f} tokens on average and costs "
                 f"{stats['call_cost_vs_greedy_step']:.2f} fast-step greedy steps")
    return line + "."


def main(bench_dir):
    rows = load(bench_dir)
    if not rows:
        return
    for line in (bleu_basis(rows), identical_outputs(rows), blocks_alone(rows)):
        if line:
            print(line)


if __name__ == "__main__":
    main(sys.argv[1])
