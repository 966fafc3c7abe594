"""``fairseq-plugins <subcommand>``: data preparation, benchmarking and the methods' own tools.

A subcommand lives with its code (``add_<name>_parser`` sets ``run``); this module lists them in ``SUBCOMMANDS``.
"""

import argparse
import logging
import os
import sys

from . import __version__, user_dir
from .bench.harness import add_bench_parser
from .bytenet.saliency import add_saliency_parser
from .common.align import add_align_parser
from .common.average import add_average_parser
from .common.prepared import add_detok_parser, add_prepare_lm_parser, add_prepare_parser
from .common.textio import InputError
from .double_token.ngram import add_ngram_precision_parser
from .lattice.commands import add_lattice_recall_parser, add_lattice_table_parser
from .rnn_fc.commands import add_shortlist_parser

logger = logging.getLogger("fairseq_plugins.cli")


def add_user_dir_parser(subparsers):
    p = subparsers.add_parser("user-dir", help="print the path to pass to fairseq as --user-dir")
    p.set_defaults(run=lambda args, argv: print(user_dir()))


# Each subcommand's parser and code live with what it does.
SUBCOMMANDS = [add_prepare_parser, add_prepare_lm_parser, add_detok_parser, add_bench_parser, add_saliency_parser,
               add_ngram_precision_parser, add_align_parser, add_lattice_table_parser, add_lattice_recall_parser,
               add_shortlist_parser, add_average_parser, add_user_dir_parser]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        level=os.environ.get("LOGLEVEL", "INFO").upper(), stream=sys.stderr,
    )
    parser = argparse.ArgumentParser(prog="fairseq-plugins", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
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
