"""``fairseq-plugins <subcommand>``: data preparation, benchmarking and the methods' own tools.

A subcommand lives with its code (``add_<name>_parser`` sets ``run``); this module lists them in ``SUBCOMMANDS``.
Quiet by default: warnings, progress bars and each command's result only; ``-v`` adds the INFO logs (fairseq's
included), ``-vv`` DEBUG; without ``-v`` the environment variable LOGLEVEL sets the level.
"""

import argparse
import logging
import os
import sys
import warnings
from typing import Dict

from . import __version__, user_dir
from .bench.harness import add_bench_parser
from .bytenet.saliency import add_saliency_parser
from .common.textio import InputError
from .double_token.ngram import add_ngram_precision_parser
from .lattice.commands import add_lattice_recall_parser, add_lattice_table_parser
from .rnn_fc.commands import add_shortlist_parser
from .tools.align import add_align_parser
from .tools.average import add_average_parser
from .tools.prepared import add_detok_parser, add_prepare_lm_parser, add_prepare_parser

logger = logging.getLogger("fairseq_plugins.cli")

LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"  # fairseq's own
DEFAULT_LOG_LEVEL = "WARNING"  # fairseq logs a screenful at INFO (14 lines for one fairseq-preprocess call)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where the value says nothing: None or an empty list (the
    help text says what happens instead) and on/off switches (off is the flag's absence; a store_false would
    read "True")."""

    def _get_help_string(self, action):
        if action.default is None or action.default == [] or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


class DefaultsShowingParser(argparse.ArgumentParser):
    """The main parser; ``add_subparsers`` makes every subcommand's parser of its class, so all show defaults."""

    def __init__(self, *args, formatter_class=DefaultsHelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def add_user_dir_parser(subparsers):
    p = subparsers.add_parser("user-dir", help="print the path to pass to fairseq as --user-dir")
    p.set_defaults(run=lambda args, argv: print(user_dir()))


# Each subcommand's parser and code live with what it does.
SUBCOMMANDS = [add_prepare_parser, add_prepare_lm_parser, add_detok_parser, add_bench_parser, add_saliency_parser,
               add_ngram_precision_parser, add_align_parser, add_lattice_table_parser, add_lattice_recall_parser,
               add_shortlist_parser, add_average_parser, add_user_dir_parser]

VERBOSE_HELP = "show the INFO logs, fairseq's included (-vv: DEBUG); without it LOGLEVEL sets the level, if set"


def build_parser() -> argparse.ArgumentParser:
    parser = DefaultsShowingParser(prog="fairseq-plugins", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="count", default=None, help=VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    # -v after the subcommand too (where one types it); SUPPRESS keeps a subcommand from resetting the main -v.
    for subparser in subcommand_parsers(parser).values():
        subparser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def subcommand_parsers(parser: argparse.ArgumentParser) -> Dict[str, argparse.ArgumentParser]:
    """Subcommand name -> its parser."""
    (subparsers,) = (action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return dict(subparsers.choices)


def log_level(verbose, parser: argparse.ArgumentParser) -> int:
    """-v: INFO, -vv: DEBUG; else $LOGLEVEL, else WARNING."""
    if verbose:
        return logging.INFO if verbose == 1 else logging.DEBUG
    name = os.environ.get("LOGLEVEL") or DEFAULT_LOG_LEVEL
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):  # getLevelName maps an unknown name to the string "Level NAME"
        parser.error(f"LOGLEVEL={name}: not a logging level (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    return level


def configure_logging(level: int) -> None:
    """One level for every logger, fairseq's included, in fairseq's format on stderr."""
    if level > logging.INFO:
        # Hydra's deprecation notices about fairseq's use of its API (some 20 lines on every bench): nothing a
        # user can act on. One is raised from fairseq's call site, so it is matched by its text.
        warnings.filterwarnings("ignore", module=r"hydra\.")
        warnings.filterwarnings("ignore", message=r"\s*'config' is validated against ConfigStore schema")
    logging.basicConfig(format=LOG_FORMAT, stream=sys.stderr)
    root = logging.getLogger()
    root.setLevel(level)
    # Importing fairseq already called logging.basicConfig (fairseq.models.wav2vec: DEBUG, the default format),
    # which makes ours a no-op: give its plain stream handler fairseq's format (test-capture handlers are
    # subclasses, left alone; basicConfig(force=True) would remove them).
    for handler in root.handlers:
        if type(handler) is logging.StreamHandler:
            handler.setFormatter(logging.Formatter(LOG_FORMAT))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    configure_logging(log_level(args.verbose, parser))
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
