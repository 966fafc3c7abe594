"""`fairseq-plugins prepare` and `detok`: layout, exact inverses, and clear errors that leave nothing behind."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import plugins_cli
from fairseq_plugins.tools.prepared import PreparedData, parse_generate_output, prepare
from fairseq_plugins.tools.synthetic import write_corpus
from fairseq_plugins.common.textio import InputError
from fairseq_plugins.tools.tokenization import VISIBLE_SPACE, CharTokenizer

TINY = {"train": 300, "val": 20, "test_2016_flickr": 20}


@pytest.fixture
def tiny_raw(tmp_path):
    return write_corpus(str(tmp_path / "raw"), sizes=TINY)


def leftovers(parent):
    """Hidden build directories or temp files a failed run might have left."""
    return [name for name in os.listdir(parent) if name.startswith(".")]


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=VISIBLE_SPACE + "\n"),
               max_size=60))
@settings(max_examples=300, deadline=None)
def test_char_tokenizer_round_trips_any_text(text):
    tokenizer = CharTokenizer()
    encoded = tokenizer.encode(text)
    assert tokenizer.decode(encoded) == text
    assert len(encoded.split(" ")) == len(text) or text == ""  # one token per character
    assert all(token and not any(c.isspace() for c in token) for token in encoded.split(" ") if text)


def test_char_tokenizer_refuses_the_visible_space_symbol_in_text():
    tokenizer = CharTokenizer()
    with pytest.raises(InputError, match=r"f\.txt:3: .*visible space"):
        tokenizer.check(f"a{VISIBLE_SPACE}b", "f.txt:3")


def test_sentencepiece_prepare_writes_the_documented_layout(tiny_raw, tmp_path):
    out = str(tmp_path / "prep")
    manifest = prepare(tiny_raw, out, "src", "tgt", vocab_size=60, command=["x"])
    for name in ("prepare.json", "spm.model", "bin/dict.src.txt", "bin/dict.tgt.txt",
                 "bin/train.src-tgt.src.bin", "bin/test.src-tgt.tgt.idx", "raw/test.tgt", "tok/valid.src"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert manifest["splits"]["test"]["lines"] == TINY["test_2016_flickr"]
    assert manifest["splits"]["valid"]["from"].endswith("/val")  # Multi30k's name for the dev split
    with open(os.path.join(out, "bin/dict.src.txt")) as a, open(os.path.join(out, "bin/dict.tgt.txt")) as b:
        assert a.read() == b.read()  # joint model -> joined dictionary (shared embeddings)
    data = PreparedData(out)
    with open(os.path.join(out, "raw/test.tgt")) as raw, open(os.path.join(out, "tok/test.tgt")) as tok:
        for line, pieces in zip(raw, tok):
            assert data.tokenizer("tgt").decode(pieces.rstrip("\n")) == line.rstrip("\n")


def test_preparing_twice_in_one_process_leaves_no_log_file_handler_behind(tiny_raw, tmp_path):
    """fairseq-preprocess adds a handler for bin/preprocess.log at every call and never removes it."""
    import logging

    log = logging.getLogger("fairseq_cli.preprocess")
    before = list(log.handlers)
    for name in ("alpha", "beta"):
        prepare(tiny_raw, str(tmp_path / name), "src", "tgt", vocab_size=60)
        assert log.handlers == before
    first, second = ((tmp_path / name / "bin" / "preprocess.log").read_text() for name in ("alpha", "beta"))
    assert "alpha" in first and "beta" not in first  # the second call's logs did not reach the first file
    assert "beta" in second


def test_separate_sentencepiece_models_and_dictionaries(tiny_raw, tmp_path):
    out = str(tmp_path / "prep")
    prepare(tiny_raw, out, "src", "tgt", vocab_size=60, joint=False)
    assert os.path.isfile(os.path.join(out, "spm.src.model")) and os.path.isfile(os.path.join(out, "spm.tgt.model"))
    with open(os.path.join(out, "bin/dict.src.txt")) as a, open(os.path.join(out, "bin/dict.tgt.txt")) as b:
        assert a.read() != b.read()
    assert json.load(open(os.path.join(out, "prepare.json")))["joined_dictionary"] is False


def test_char_prepare_and_detok_cli_restore_the_text(tiny_raw, tmp_path):
    out = str(tmp_path / "prep")
    plugins_cli("prepare", tiny_raw, out, "-s", "src", "-t", "tgt", "--char")
    with open(os.path.join(out, "tok/test.tgt")) as f:
        first = f.readline().rstrip("\n")
    assert VISIBLE_SPACE in first.split(" ")
    restored = plugins_cli("detok", out, "--input", os.path.join(out, "tok/test.tgt")).stdout
    with open(os.path.join(tiny_raw, "test_2016_flickr.tgt")) as f:
        assert restored == f.read()


def test_mismatched_line_counts_name_both_files_and_leave_nothing(tiny_raw, tmp_path):
    with open(os.path.join(tiny_raw, "val.tgt"), "a") as f:
        f.write("one line too many .\n")
    out = tmp_path / "prep"
    with pytest.raises(InputError, match=r"val\.src has 20 lines but .*val\.tgt has 21"):
        prepare(tiny_raw, str(out), "src", "tgt", vocab_size=60)
    assert not out.exists() and leftovers(tmp_path) == []


def test_empty_line_is_named_by_file_and_line(tiny_raw, tmp_path):
    path = os.path.join(tiny_raw, "train.src")
    lines = open(path).read().splitlines()
    lines[6] = "   "
    open(path, "w").write("\n".join(lines) + "\n")
    proc = plugins_cli("prepare", tiny_raw, tmp_path / "prep", "-s", "src", "-t", "tgt", check=False)
    assert proc.returncode == 2
    assert "train.src:7: empty line" in proc.stderr
    assert not (tmp_path / "prep").exists() and leftovers(tmp_path) == []


def test_bad_paths_and_flags_are_clear_errors(tiny_raw, tmp_path):
    with pytest.raises(InputError, match="no-such-dir: data directory not found"):
        prepare(str(tmp_path / "no-such-dir"), str(tmp_path / "p"), "src", "tgt")
    with pytest.raises(InputError, match=r"no test split found \(looked for nope\.\{src,tgt\}\)"):
        prepare(tiny_raw, str(tmp_path / "p"), "src", "tgt", split_stems={"test": "nope"})
    with pytest.raises(InputError, match="--vocab-size 100000"):
        prepare(tiny_raw, str(tmp_path / "p"), "src", "tgt", vocab_size=100000)
    assert leftovers(tmp_path) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="not empty.*--overwrite"):
        prepare(tiny_raw, str(tmp_path / "full"), "src", "tgt")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_parse_generate_output_orders_by_sentence_id():
    lines = ["S-2\ta", "H-2\t-0.1\tc d", "H-0\t-0.3\ta b", "D-0\t-0.3\tab", "H-1\t-0.2\t", "H-0\t-0.9\tworse"]
    assert parse_generate_output(lines) == ["a b", "", "c d"]


def test_detok_keep_pieces_writes_generate_hypotheses_in_corpus_order(tiny_raw, tmp_path):
    """What the blockwise recipe's distillation stage binarises: tokens as generated, sentence order."""
    out = str(tmp_path / "prep")
    plugins_cli("prepare", tiny_raw, out, "-s", "src", "-t", "tgt", "--char")
    generated = tmp_path / "generate.out"
    generated.write_text(f"H-1\t-0.2\tb {VISIBLE_SPACE} c\nH-0\t-0.1\ta\n")
    pieces = plugins_cli("detok", out, "--from-generate", "--keep-pieces", "--input", generated).stdout
    assert pieces == f"a\nb {VISIBLE_SPACE} c\n"
    assert plugins_cli("detok", out, "--from-generate", "--input", generated).stdout == "a\nb c\n"


def test_prepare_lm_keeps_blank_lines_and_escapes_other_whitespace(tmp_path):
    from fairseq_plugins.tools.prepared import prepare_lm

    (tmp_path / "train.txt").write_text("First Citizen:\n\nBefore we\u00a0proceed\n")
    (tmp_path / "valid.txt").write_text("All:\nSpeak.\n")
    out = str(tmp_path / "lm")
    manifest = prepare_lm(str(tmp_path / "train.txt"), str(tmp_path / "valid.txt"), out)
    assert manifest["kind"] == "lm" and manifest["splits"]["train"]["lines"] == 3
    for name in ("bin/dict.txt", "bin/train.bin", "bin/valid.idx", "tok/train.txt"):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, "tok/train.txt")) as f:
        lines = f.read().split("\n")
    assert lines[1] == "" and "<U+00A0>" in lines[2].split(" ")  # blank line kept; no-break space escaped
    assert CharTokenizer().decode(lines[2]) == "Before we\u00a0proceed"
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert os.stat(os.path.join(out, "prepare.json")).st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(InputError, match="missing.txt: no such file"):
        prepare_lm(str(tmp_path / "missing.txt"), str(tmp_path / "valid.txt"), str(tmp_path / "other"))
    assert not os.path.exists(tmp_path / "other") and leftovers(tmp_path) == []
