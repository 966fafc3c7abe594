"""What every subcommand shares (issue: a new user's first commands): quiet by default, -v for the logs, every
default in --help, one spelling per flag with the old ones kept as aliases, progress bars on the long steps."""

import argparse
import json
import logging
import os
import warnings

import pytest

from conftest import plugins_cli, word_dictionary
from fairseq_plugins.kernels.shortlist import read_lexical_table
from fairseq_plugins.cli import build_parser, configure_logging, log_level, main, subcommand_parsers
from fairseq_plugins.tools.prepared import binarized_dir
from fairseq_plugins.tools.synthetic import write_corpus


@pytest.fixture
def restore_logging():
    """main() sets the root logger's level and its stream handler's format: give the next tests theirs back."""
    root = logging.getLogger()
    level, formatters = root.level, [(handler, handler.formatter) for handler in root.handlers]
    yield
    root.setLevel(level)
    for handler, formatter in formatters:
        handler.setFormatter(formatter)


# ---- quiet by default, -v for the INFO logs ----

@pytest.fixture(scope="module")
def tiny_raw(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("raw")), sizes={"train": 40, "val": 5, "test_2016_flickr": 5})


def test_a_plain_command_prints_its_result_and_no_info_logs(tiny_raw, tmp_path):
    proc = plugins_cli("prepare", tiny_raw, tmp_path / "prep", "-s", "src", "-t", "tgt", "--char")
    assert "INFO" not in proc.stderr and "tensorboardX" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith(f"prepared {tiny_raw} -> {tmp_path / 'prep'}: train 40, valid 5, test 5 sentence "
                                  "pairs; dictionary src ")
    # fairseq-preprocess's figures (INFO logs) still reach its log file
    assert "Dictionary:" in (tmp_path / "prep" / "bin" / "preprocess.log").read_text()


@pytest.mark.parametrize("flag, env", [("-v", {}), (None, {"LOGLEVEL": "INFO"})])
def test_verbose_or_loglevel_shows_the_info_logs_fairseqs_included(flag, env, tiny_raw, tmp_path):
    proc = plugins_cli("prepare", tiny_raw, tmp_path / "prep", "-s", "src", "-t", "tgt", "--char",
                       *([flag] if flag else []), env=env)
    assert "| INFO | fairseq_cli.preprocess | [src] Dictionary:" in proc.stderr, proc.stderr
    assert "tensorboardX" not in proc.stderr  # fairseq's import-time notice, of no use here
    assert proc.stdout.startswith("prepared ")


def test_prepare_lm_prints_its_result(tmp_path, capsys, restore_logging):
    (tmp_path / "train.txt").write_text("First Citizen:\nBefore we proceed\n")
    (tmp_path / "valid.txt").write_text("All:\nSpeak.\n")
    main(["prepare-lm", str(tmp_path / "train.txt"), str(tmp_path / "valid.txt"), str(tmp_path / "lm")])
    assert capsys.readouterr().out.startswith(f"prepared character LM data -> {tmp_path / 'lm'}: train 2 lines (")


def test_log_level_from_flag_then_environment(monkeypatch):
    parser = build_parser()
    monkeypatch.delenv("LOGLEVEL", raising=False)
    assert log_level(None, parser) == logging.WARNING
    assert log_level(1, parser) == logging.INFO and log_level(2, parser) == logging.DEBUG
    monkeypatch.setenv("LOGLEVEL", "error")
    assert log_level(None, parser) == logging.ERROR
    assert log_level(1, parser) == logging.INFO  # the command line wins over the environment
    monkeypatch.setenv("LOGLEVEL", "loud")
    with pytest.raises(SystemExit) as exit:
        log_level(None, parser)
    assert exit.value.code == 2


def test_quiet_runs_hide_hydras_deprecation_notices_only(restore_logging):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configure_logging(logging.WARNING)
        # as fairseq's hydra calls raise them (some 20 lines on every bench): from hydra, or from fairseq's line
        warnings.warn_explicit("hydra.experimental.compose() is no longer experimental", UserWarning,
                               "hydra/experimental/compose.py", 25, module="hydra.experimental.compose")
        warnings.warn("\n'config' is validated against ConfigStore schema with the same name.", UserWarning)
        warnings.warn("a warning of our own", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning of our own"]


# ---- every default in --help ----

def all_parsers():
    parser = build_parser()
    return {"fairseq-plugins": parser, **subcommand_parsers(parser)}


def action_help(parser, action) -> str:
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


@pytest.mark.parametrize("name, parser", all_parsers().items())
def test_help_shows_every_default_once(name, parser):
    for action in parser._actions:
        shown = action_help(parser, action)
        assert shown.count("(default:") <= 1, shown  # never the formatter's and a hand-written one
        # A switch's default is its absence, and None or [] mean "see the help text": those show none.
        if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
            continue
        assert f"(default: {action.default})" in shown, shown


def test_help_through_the_command_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["prepare", "--help"])
    assert exit.value.code == 0 and "(default: 8000)" in " ".join(capsys.readouterr().out.split())


# ---- one spelling per flag, the old ones kept ----

@pytest.fixture
def prepared_dir(tmp_path):
    """What --data tells apart: a prepared directory (manifest and bin/) and its bin/."""
    (tmp_path / "prep" / "bin").mkdir(parents=True)
    (tmp_path / "prep" / "prepare.json").write_text(json.dumps({"version": 1}))
    return tmp_path / "prep"


def test_data_names_a_prepared_directory_or_its_bin(prepared_dir, tmp_path):
    bin_dir = str(prepared_dir / "bin")
    assert binarized_dir(str(prepared_dir)) == bin_dir and binarized_dir(bin_dir) == bin_dir
    assert binarized_dir(str(tmp_path)) == str(tmp_path)  # anything else as given, for its own error later


PARSER = build_parser()  # one parser: its subcommands' `run` defaults are then the same functions


def parse(argv):
    return vars(PARSER.parse_args([str(arg) for arg in argv]))


LATTICE_TABLE = ["lattice-table", "-s", "en", "-t", "de", "--alignment", "a", "--output", "o"]
LATTICE_RECALL = ["lattice-recall", "--table", "t", "-s", "en", "-t", "de"]
SHORTLIST = ["shortlist", "--lexical-table", "l", "-s", "en", "-t", "de", "--output", "o"]


@pytest.mark.parametrize("command", [LATTICE_TABLE, LATTICE_RECALL, SHORTLIST], ids=lambda c: c[0])
def test_data_and_data_bin_are_one_flag(command, prepared_dir):
    bin_dir = str(prepared_dir / "bin")
    spellings = [["--data", prepared_dir], ["--data", bin_dir], ["--data-bin", bin_dir], ["--data-bin", prepared_dir]]
    parsed = [parse(command + spelling) for spelling in spellings]
    assert parsed[0]["data_bin"] == bin_dir and all(p == parsed[0] for p in parsed)


@pytest.mark.parametrize("main_form, alias_form", [
    (["detok", "d", "--input", "f"], ["detok", "d", "--inputs", "f"]),
    (["average-checkpoints", "--inputs", "a", "b", "--output", "o"],
     ["average-checkpoints", "--input", "a", "b", "--output", "o"]),
    (["prepare", "r", "o", "--source-lang", "en", "--target-lang", "de"],
     ["prepare", "r", "o", "-s", "en", "-t", "de"]),
    (["prepare", "r", "o", "-s", "en", "-t", "de", "--tokenizer", "char"],
     ["prepare", "r", "o", "-s", "en", "-t", "de", "--char"]),
    (["-v", "user-dir"], ["user-dir", "--verbose"]),
    (["--verbose", "align", "--source", "s", "--target", "t", "--output", "o"],
     ["align", "--source", "s", "--target", "t", "--output", "o", "-v"]),
])
def test_each_alias_parses_as_its_main_name(main_form, alias_form):
    assert parse(main_form) == parse(alias_form)


def test_verbose_counts_and_defaults_to_none():
    assert parse(["user-dir"])["verbose"] is None and parse(["-vv", "user-dir"])["verbose"] == 2


# ---- progress bars on the long steps ----

def test_shortlist_draws_progress_bars_and_prints_its_result(tmp_path, capsys, restore_logging):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for lang in ("en", "de"):
        word_dictionary(5).save(str(bin_dir / f"dict.{lang}.txt"))
    table = tmp_path / "lex.txt"
    table.write_text("w0\tw1\t-0.1\nw1\tw2\t-0.2\n")
    read_lexical_table(str(table))
    assert capsys.readouterr().err == ""  # called from code: no bar
    main(["shortlist", "--lexical-table", str(table), "--data", str(bin_dir), "-s", "en", "-t", "de", "--output",
          str(tmp_path / "list.pt")])
    out, err = capsys.readouterr()
    assert "shortlist: reading the lexical table" in err and "shortlist: lists" in err
    assert out.startswith(f"{tmp_path / 'list.pt'}: 2 source words with translations")
    assert os.path.isfile(tmp_path / "list.pt")
