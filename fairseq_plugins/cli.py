"""``fairseq-plugins <subcommand>``: data preparation, detokenisation and benchmarking.

Method subpackages add their own subcommands by listing them in ``SUBCOMMANDS``.
"""

import argparse
import logging
import os
import sys

from . import user_dir
from .common.textio import InputError

logger = logging.getLogger("fairseq_plugins.cli")


def add_prepare_parser(subparsers):
    p = subparsers.add_parser(
        "prepare",
        help="raw parallel text -> SentencePiece or character tokens -> fairseq-preprocess binaries",
        description="Tokenise a raw parallel corpus (Multi30k layout: train.L, val.L, test_2016_flickr.L) "
        "and binarise it with fairseq-preprocess into OUT/bin. See fairseq_plugins/common/prepared.py.",
    )
    p.add_argument("raw_dir", help="directory of raw text files <split>.<lang>")
    p.add_argument("out_dir", help="output directory (built aside, renamed into place when complete)")
    p.add_argument("-s", "--source-lang", required=True, help="source language suffix, e.g. en")
    p.add_argument("-t", "--target-lang", required=True, help="target language suffix, e.g. de")
    p.add_argument("--tokenizer", choices=("sentencepiece", "char"), default="sentencepiece",
                   help="subword (SentencePiece) or character tokens (spaces become a visible symbol)")
    p.add_argument("--char", dest="tokenizer", action="store_const", const="char",
                   help="shorthand for --tokenizer char")
    p.add_argument("--vocab-size", type=int, default=8000, help="SentencePiece vocabulary size per model")
    p.add_argument("--separate", dest="joint", action="store_false",
                   help="one SentencePiece model and dictionary per language (default: joint, shared)")
    p.add_argument("--spm-model-type", choices=("unigram", "bpe"), default="unigram",
                   help="SentencePiece model type")
    for split in ("train", "valid", "test"):
        p.add_argument(f"--{split}-name", default=None,
                       help=f"file stem of the {split} split (default: Multi30k names, then '{split}')")
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N training pairs (0: all)")
    p.add_argument("--workers", type=int, default=1, help="fairseq-preprocess worker processes")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(run=run_prepare)


def run_prepare(args, argv):
    from .common.prepared import prepare

    stems = {split: getattr(args, f"{split}_name") for split in ("train", "valid", "test")}
    prepare(
        args.raw_dir, args.out_dir, args.source_lang, args.target_lang,
        tokenizer=args.tokenizer, vocab_size=args.vocab_size, joint=args.joint,
        spm_model_type=args.spm_model_type, split_stems=stems, train_limit=args.train_limit,
        workers=args.workers, overwrite=args.overwrite, command=["fairseq-plugins"] + argv,
    )


def add_prepare_lm_parser(subparsers):
    p = subparsers.add_parser(
        "prepare-lm",
        help="raw text -> character tokens -> fairseq-preprocess binaries for --task language_modeling",
        description="One token per character (spaces as a visible symbol), one sample line per text line with "
        "fairseq's EOS standing for the newline. See prepare_lm in fairseq_plugins/common/prepared.py.",
    )
    p.add_argument("train", help="training text file")
    p.add_argument("valid", help="validation text file")
    p.add_argument("out_dir", help="output directory (built aside, renamed into place when complete)")
    p.add_argument("--test", default=None, help="test text file (optional)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(run=run_prepare_lm)


def run_prepare_lm(args, argv):
    from .common.prepared import prepare_lm

    prepare_lm(args.train, args.valid, args.out_dir, test=args.test, overwrite=args.overwrite,
               command=["fairseq-plugins"] + argv)


def add_detok_parser(subparsers):
    p = subparsers.add_parser(
        "detok", help="tokens (or fairseq-generate output) -> text, with a prepared directory's tokenizer",
    )
    p.add_argument("data", help="prepared data directory (has prepare.json)")
    p.add_argument("--lang", default=None, help="language whose tokenizer to use (default: the target)")
    p.add_argument("--input", default="-", help="input file (default: standard input)")
    p.add_argument("--from-generate", action="store_true",
                   help="input is fairseq-generate output: take its H- lines in sentence order")
    p.add_argument("--keep-pieces", action="store_true",
                   help="write the tokens as they are (e.g. fairseq-generate hypotheses in corpus order, "
                        "for distillation) instead of detokenizing them")
    p.set_defaults(run=run_detok)


def run_detok(args, argv):
    from .common.prepared import PreparedData, detokenize_stream

    data = PreparedData(args.data)
    lang = args.lang or data.target_lang
    if args.input == "-":
        detokenize_stream(data, lang, sys.stdin, args.from_generate, keep_pieces=args.keep_pieces)
    else:
        if not os.path.isfile(args.input):
            raise InputError(f"--input {args.input}: no such file")
        with open(args.input, encoding="utf-8") as f:
            detokenize_stream(data, lang, f, args.from_generate, keep_pieces=args.keep_pieces)


def add_user_dir_parser(subparsers):
    p = subparsers.add_parser("user-dir", help="print the path to pass to fairseq as --user-dir")
    p.set_defaults(run=lambda args, argv: print(user_dir()))


def add_bench_parser(subparsers):
    from .bench.harness import add_bench_parser as add

    add(subparsers)


def add_saliency_parser(subparsers):
    from .bytenet.saliency import add_saliency_parser as add

    add(subparsers)


def add_ngram_precision_parser(subparsers):
    from .double_token.ngram import add_ngram_precision_parser as add

    add(subparsers)


def add_align_parser(subparsers):
    from .common.align import add_align_parser as add

    add(subparsers)


def add_lattice_parsers(subparsers):
    from .lattice.commands import add_lattice_recall_parser, add_lattice_table_parser

    add_lattice_table_parser(subparsers)
    add_lattice_recall_parser(subparsers)


def add_shortlist_parser(subparsers):
    from .rnn_fc.commands import add_shortlist_parser as add

    add(subparsers)


SUBCOMMANDS = [add_prepare_parser, add_prepare_lm_parser, add_detok_parser, add_bench_parser, add_saliency_parser,
               add_ngram_precision_parser, add_align_parser, add_lattice_parsers, add_shortlist_parser,
               add_user_dir_parser]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        level=os.environ.get("LOGLEVEL", "INFO").upper(), stream=sys.stderr,
    )
    parser = argparse.ArgumentParser(prog="fairseq-plugins", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    args, rest = parser.parse_known_args(argv)
    # Only bench forwards unknown flags (to fairseq's own parser, which rejects what it does not know).
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        args.run(args, argv)
    except InputError as error:
        logger.error("%s", error)
        sys.exit(2)


if __name__ == "__main__":
    main()
