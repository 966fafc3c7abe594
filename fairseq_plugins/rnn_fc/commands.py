"""``fairseq-plugins shortlist``: candidate lists from an aligner's lexical table and the data's dictionaries."""

import os

from fairseq.data import Dictionary

from ..kernels.shortlist import Shortlist, read_lexical_table
from ..common.textio import InputError, non_negative_int, positive_int
from ..tools.prepared import binarized_dir


def add_shortlist_parser(subparsers):
    p = subparsers.add_parser(
        "shortlist", help="candidate lists for fast decoding: top translations per source word + frequent words",
        description="Each source token's top --top translations by p(target | source) from a lexical table "
                    "(`fairseq-plugins align --lexical-table`, or fast_align -p), plus the --frequent most "
                    "frequent target tokens; decode with --task rnn_fc_translation --rnn-fc-shortlist FILE.")
    p.add_argument("--lexical-table", required=True,
                   help="source<TAB>target<TAB>ln p(target | source) lines, in the tokens the data was binarised from")
    # --data as bench and saliency spell it (a prepared directory); --data-bin, its first name, stays.
    p.add_argument("--data", "--data-bin", dest="data_bin", metavar="DIR", required=True, type=binarized_dir,
                   help="prepared data directory (`fairseq-plugins prepare`) or its bin/, the fairseq-preprocess "
                        "output (its dictionaries)")
    p.add_argument("-s", "--source-lang", required=True, help="source language suffix, e.g. en")
    p.add_argument("-t", "--target-lang", required=True, help="target language suffix, e.g. de")
    p.add_argument("--top", type=positive_int, default=20, help="translations kept per source token")
    p.add_argument("--frequent", type=non_negative_int, default=100,
                   help="most frequent target tokens every list holds")
    p.add_argument("--output", required=True, help="write the candidate lists here (.pt)")
    p.set_defaults(run=_run_shortlist)


def _dictionary(data_bin: str, lang: str) -> Dictionary:
    path = os.path.join(data_bin, f"dict.{lang}.txt")
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such dictionary (is --data a prepared directory, or fairseq-preprocess "
                         "output, for -s/-t?)")
    return Dictionary.load(path)


def _run_shortlist(args, argv=None) -> None:
    src_dict = _dictionary(args.data_bin, args.source_lang)
    tgt_dict = _dictionary(args.data_bin, args.target_lang)
    table = read_lexical_table(args.lexical_table, progress=True)
    shortlist = Shortlist.build(table, src_dict, tgt_dict, top=args.top, frequent=args.frequent,
                                source=os.path.abspath(args.lexical_table), progress=True)
    shortlist.save(args.output)
    meta = shortlist.meta
    print(f"{args.output}: {shortlist.summary()}; table words not in the dictionaries: "
          f"{meta['source_words_not_in_dictionary']} source, {meta['target_words_not_in_dictionary']} target")
