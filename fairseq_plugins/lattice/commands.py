"""``fairseq-plugins lattice-table`` and ``lattice-recall``: build the candidate table, measure its lattices."""

import json
import os

from ..common.textio import InputError, atomic_output, positive_int
from ..tools.align import read_pharaoh
from ..tools.prepared import binarized_dir
from .ibm2 import CandidateTable, lattice_recall, never_candidates, read_binarized_pairs


def _data_arguments(p, split: str, split_help: str):
    # --data as bench and saliency spell it (a prepared directory); --data-bin, its first name, stays.
    p.add_argument("--data", "--data-bin", dest="data_bin", metavar="DIR", required=True, type=binarized_dir,
                   help="prepared data directory (`fairseq-plugins prepare`) or its bin/, the fairseq-preprocess "
                        "output (dictionaries and binarised splits)")
    p.add_argument("-s", "--source-lang", required=True, help="source language suffix, e.g. en")
    p.add_argument("-t", "--target-lang", required=True, help="target language suffix, e.g. de")
    p.add_argument("--split", default=split, help=split_help)


def add_lattice_table_parser(subparsers):
    p = subparsers.add_parser(
        "lattice-table", help="count IBM-Model-2 candidate tables from word alignments (sequence-to-lattice)",
        description="P(y | x_a, a - t), P(a | S, t) and the target-length line from the alignments of a binarised "
                    "split; one versioned file tied to the split's dictionaries.")
    _data_arguments(p, "train", "binarised split the alignments belong to")
    p.add_argument("--alignment", required=True,
                   help="Pharaoh i-j alignments of that split's token sequences (`fairseq-plugins align` of the "
                        "tokenised text the split was binarised from)")
    p.add_argument("--top-n", type=positive_int, default=40, help="target tokens kept per (source token, offset)")
    p.add_argument("--output", required=True, help="write the table here (.pt)")
    p.set_defaults(run=_run_lattice_table)


def _run_lattice_table(args, argv=None) -> None:
    sources, targets, src_dict, tgt_dict = read_binarized_pairs(args.data_bin, args.split, args.source_lang,
                                                                args.target_lang)
    alignments = read_pharaoh(args.alignment)
    table = CandidateTable.build(sources, targets, alignments, src_dict, tgt_dict, top_n=args.top_n,
                                 alignment_path=args.alignment, progress=True)
    table.save(args.output)
    print(f"{args.output}: {table.summary()}")  # the result line, shown without -v


def add_lattice_recall_parser(subparsers):
    p = subparsers.add_parser(
        "lattice-recall", help="share of reference tokens inside the top-K lattice of their position (paper Fig. 1)")
    p.add_argument("--table", required=True, help="candidate table from `fairseq-plugins lattice-table`")
    _data_arguments(p, "valid", "binarised split whose references to look up")
    p.add_argument("--k", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="lattice widths to report")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.set_defaults(run=_run_lattice_recall)


def _run_lattice_recall(args, argv=None) -> None:
    if min(args.k) < 1:
        raise InputError(f"--k {min(args.k)}: widths must be at least 1")
    sources, targets, src_dict, tgt_dict = read_binarized_pairs(args.data_bin, args.split, args.source_lang,
                                                                args.target_lang)
    table = CandidateTable.load(args.table, src_dict, tgt_dict)
    recall = lattice_recall(table, sources, targets, sorted(set(args.k)), len(tgt_dict), never_candidates(tgt_dict),
                            progress=True)
    print("K\trecall")
    for k, share in recall.items():
        print(f"{k}\t{share:.4f}")
    if args.json:
        result = {"table": os.path.abspath(args.table), "data_bin": os.path.abspath(args.data_bin), "split": args.split,
                  "sentences": len(sources), "reference_tokens": sum(len(t) for t in targets),
                  "recall": {str(k): share for k, share in recall.items()}}
        with atomic_output(args.json) as f:
            json.dump(result, f, indent=2)
            f.write("\n")
