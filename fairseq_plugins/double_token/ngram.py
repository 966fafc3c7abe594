"""``fairseq-plugins ngram-precision``: where in a sentence each system is accurate (the paper's Table 3).

For every hypothesis, its first N and its last N tokens are scored separately: the n-grams lying wholly
inside that span are matched against the reference's n-grams (clipped counts, as in BLEU), and a system's
precision is matched / total over the corpus. A left-to-right decoder tends to be better at the start, a
right-to-left one at the end; a bidirectional one should hold both ends. Tokens are sacreBLEU's (13a by
default), so the figures read like BLEU's n-gram precisions.
"""

import json
import logging
from collections import Counter
from typing import Dict, List, Sequence

from ..common.textio import InputError, atomic_output, read_lines

logger = logging.getLogger(__name__)


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def span_precision(hypotheses: List[List[str]], references: List[List[str]], span: int, order: int,
                   part: str) -> Dict:
    """Corpus n-gram precision of the first (``part`` = "first") or last ``span`` tokens of each hypothesis."""
    matched = total = 0
    for hypothesis, reference in zip(hypotheses, references):
        window = hypothesis[:span] if part == "first" else hypothesis[-span:] if span else []
        counts = _ngrams(window, order)
        reference_counts = _ngrams(reference, order)
        matched += sum(min(count, reference_counts[gram]) for gram, count in counts.items())
        total += sum(counts.values())
    return {"matched": matched, "total": total, "precision": 100.0 * matched / total if total else 0.0}


def ngram_precision_table(systems: Dict[str, List[str]], references: List[str], span: int, orders: Sequence[int],
                          tokenize: str = "13a") -> Dict:
    from sacrebleu.metrics.bleu import BLEU

    tokenizer = BLEU(tokenize=tokenize).tokenizer  # KeyError for an unknown name
    reference_tokens = [tokenizer(line).split() for line in references]
    table = {}
    for name, lines in systems.items():
        hypothesis_tokens = [tokenizer(line).split() for line in lines]
        table[name] = {f"{part}{span}_{order}gram": span_precision(hypothesis_tokens, reference_tokens, span, order, part)
                       for part in ("first", "last") for order in orders}
    return table


def add_ngram_precision_parser(subparsers):
    p = subparsers.add_parser(
        "ngram-precision",
        help="n-gram precision of the first and last N tokens of each system's hypotheses (paper Table 3)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--reference", required=True, help="reference file, one detokenised sentence per line")
    p.add_argument("--hypotheses", required=True, nargs="+",
                   help="system outputs, one detokenised sentence per line, line-aligned with --reference")
    p.add_argument("--labels", nargs="+", help="system names (default: the file names)")
    p.add_argument("--span", type=int, default=5, help="N: tokens scored at each end of a hypothesis")
    p.add_argument("--orders", type=int, nargs="+", default=[1, 4], help="n-gram orders")
    p.add_argument("--tokenize", default="13a", help="sacreBLEU tokenizer (13a, intl, char, none, ...)")
    p.add_argument("--json", help="also write the table here (JSON)")
    p.set_defaults(run=run_ngram_precision)


def run_ngram_precision(args, argv):
    labels = args.labels or args.hypotheses
    if len(labels) != len(args.hypotheses):
        raise InputError(f"--labels: {len(labels)} names for {len(args.hypotheses)} --hypotheses files")
    if len(set(labels)) != len(labels):
        raise InputError(f"--labels: names must differ, got {' '.join(labels)}")
    if args.span < 1:
        raise InputError(f"--span must be at least 1, got {args.span}")
    for order in args.orders:
        if not 1 <= order <= args.span:
            raise InputError(f"--orders {order}: must be 1..--span ({args.span})")
    references = read_lines(args.reference, allow_empty_lines=True)
    systems = {}
    for label, path in zip(labels, args.hypotheses):
        lines = read_lines(path, allow_empty_lines=True)
        if len(lines) != len(references):
            raise InputError(f"{path} has {len(lines)} lines but --reference {args.reference} has {len(references)}")
        systems[label] = lines
    try:
        table = ngram_precision_table(systems, references, args.span, args.orders, args.tokenize)
    except KeyError:
        raise InputError(f"--tokenize {args.tokenize}: not a sacreBLEU tokenizer")
    columns = list(next(iter(table.values())))
    print("| system | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for label, row in table.items():
        print(f"| {label} | " + " | ".join(f"{row[c]['precision']:.1f}" for c in columns) + " |")
    if args.json:
        result = {"reference": args.reference, "span": args.span, "orders": args.orders, "tokenize": args.tokenize,
                  "hypotheses": dict(zip(labels, args.hypotheses)), "precision": table,
                  "command": ["fairseq-plugins"] + argv}
        with atomic_output(args.json) as f:
            json.dump(result, f, indent=1)
            f.write("\n")
