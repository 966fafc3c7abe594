"""A new user's mistakes (issue 20): each is an error naming the file, line or flag, found before any work."""

import json
import os
import subprocess
import sys

import pytest

from conftest import plugins_cli
from fairseq_plugins.cli import main
from fairseq_plugins.tools.prepared import _build_aside, _check_output_dir, prepare_lm
from fairseq_plugins.tools.synthetic import write_corpus
from fairseq_plugins.common.textio import InputError, read_lines
from fairseq_plugins.tools.tokenization import VISIBLE_SPACE, SentencePieceTokenizer, train_sentencepiece

BAD_LINE = b"caf\xe9 au lait\n"  # Latin-1, not UTF-8: the byte 0xe9 is at offset 3 of the line


def leftovers(parent):
    return [name for name in os.listdir(parent) if name.startswith(".")]


def write_bad_third_line(path):
    """Keep the first two lines of ``path`` and make its third one Latin-1; returns the bad byte's file offset."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    head = lines[0] + b"\n" + lines[1] + b"\n"
    with open(path, "wb") as f:
        f.write(head + BAD_LINE + b"\n".join(lines[3:]))
    return len(head) + 3


def fake_prepared(path, tokenizer):
    """The manifest of a prepared directory: all that detok reads besides the tokenizer's model."""
    os.makedirs(path)
    with open(os.path.join(path, "prepare.json"), "w") as f:
        json.dump({"version": 1, "source_lang": "src", "target_lang": "tgt",
                   "tokenizer": {"src": tokenizer, "tgt": tokenizer}, "splits": {}, "command": []}, f)
    return str(path)


# ---- non-UTF-8 input ----

def test_read_lines_names_the_line_and_byte_offset_of_a_non_utf8_byte(tmp_path):
    path = tmp_path / "text.en"
    path.write_bytes(b"ok\r\nfine\n" + BAD_LINE)
    with pytest.raises(InputError, match=r"text\.en:3: not UTF-8 text: byte 0xe9 at byte offset 12 of the file "
                                         r"\(byte 3 of the line\)"):
        read_lines(str(path))
    path.write_bytes(b"ok\r\nfine\n")
    assert read_lines(str(path)) == ["ok", "fine"]


def test_prepare_refuses_non_utf8_text_naming_file_line_and_offset(tmp_path):
    raw = write_corpus(str(tmp_path / "raw"), sizes={"train": 30, "val": 5, "test_2016_flickr": 5})
    offset = write_bad_third_line(os.path.join(raw, "val.tgt"))
    proc = plugins_cli("prepare", raw, tmp_path / "prep", "-s", "src", "-t", "tgt", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"val.tgt:3: not UTF-8 text: byte 0xe9 at byte offset {offset} of the file" in proc.stderr
    assert not (tmp_path / "prep").exists() and leftovers(tmp_path) == []


def test_align_refuses_non_utf8_text(tmp_path):
    (tmp_path / "s.txt").write_text("a b\nc d\ne f\n")
    (tmp_path / "t.txt").write_bytes(b"x y\nz w\n" + BAD_LINE)
    proc = plugins_cli("align", "--source", tmp_path / "s.txt", "--target", tmp_path / "t.txt",
                       "--output", tmp_path / "a.txt", check=False)
    assert proc.returncode == 2 and "t.txt:3: not UTF-8 text: byte 0xe9 at byte offset 11" in proc.stderr
    assert not (tmp_path / "a.txt").exists()


def test_detok_refuses_non_utf8_input_from_a_file_and_standard_input(tmp_path):
    data = fake_prepared(tmp_path / "prep", {"kind": "char"})
    (tmp_path / "tok.txt").write_bytes(b"a b\n" + BAD_LINE)
    proc = plugins_cli("detok", data, "--input", tmp_path / "tok.txt", check=False)
    assert proc.returncode == 2 and "tok.txt:2: not UTF-8 text: byte 0xe9 at byte offset 7" in proc.stderr
    assert proc.stdout == ""  # nothing written before the error
    proc = plugins_cli("detok", data, stdin="a b\n", check=False)  # text=True: stdin is encoded as UTF-8
    assert proc.returncode == 0 and proc.stdout == "ab\n"
    command = [sys.executable, "-m", "fairseq_plugins.cli", "detok", data]
    proc = subprocess.run(command, input=BAD_LINE, capture_output=True)
    assert proc.returncode == 2 and b"standard input:1: not UTF-8 text: byte 0xe9 at byte offset 3" in proc.stderr


# ---- language-model data where parallel data is needed ----

@pytest.fixture
def lm_data(tmp_path):
    (tmp_path / "train.txt").write_text("First Citizen:\nBefore we proceed\n")
    (tmp_path / "valid.txt").write_text("All:\nSpeak.\n")
    out = str(tmp_path / "lm")
    prepare_lm(str(tmp_path / "train.txt"), str(tmp_path / "valid.txt"), out)
    return out


def test_detok_and_bench_refuse_language_model_data(lm_data, tmp_path):
    proc = plugins_cli("detok", lm_data, stdin="a b\n", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{lm_data}: language-model data (made by `fairseq-plugins prepare-lm`)" in proc.stderr
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"")  # bench checks that it exists before it reads the data directory
    proc = plugins_cli("bench", "--method", "baseline", "--path", checkpoint, "--data", lm_data, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{lm_data}: language-model data" in proc.stderr


# ---- counts below 1, refused at argument parsing ----

@pytest.mark.parametrize("argv, message", [
    (["align", "--source", "s", "--target", "t", "--output", "o", "--iterations", "-3"],
     "argument --iterations: must be at least 1, got -3"),
    (["prepare", "raw", "out", "-s", "en", "-t", "de", "--workers", "0"],
     "argument --workers: must be at least 1, got 0"),
    (["prepare", "raw", "out", "-s", "en", "-t", "de", "--vocab-size", "0"],
     "argument --vocab-size: must be at least 1, got 0"),
    (["prepare", "raw", "out", "-s", "en", "-t", "de", "--train-limit", "-1"],
     "argument --train-limit: must not be negative, got -1"),
    (["prepare", "raw", "out", "-s", "en", "-t", "de", "--workers", "two"],
     "argument --workers: 'two' is not an integer"),
    (["shortlist", "--lexical-table", "l", "--data-bin", "d", "-s", "en", "-t", "de", "--output", "o", "--top", "0"],
     "argument --top: must be at least 1, got 0"),
    (["lattice-table", "--data-bin", "d", "-s", "en", "-t", "de", "--alignment", "a", "--output", "o", "--top-n", "0"],
     "argument --top-n: must be at least 1, got 0"),
    (["lattice-recall", "--table", "t", "--data-bin", "d", "-s", "en", "-t", "de", "--k", "4", "0"],
     "argument --k: must be at least 1, got 0"),
    (["average-checkpoints", "--inputs", "d", "--output", "o", "--num-epoch-checkpoints", "0"],
     "argument --num-epoch-checkpoints: must be at least 1, got 0"),
])
def test_non_positive_counts_are_refused_at_parsing(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


# ---- detok --from-generate ----

def test_detok_from_generate_names_missing_hypotheses(tmp_path):
    data = fake_prepared(tmp_path / "prep", {"kind": "char"})
    generated = tmp_path / "generate.out"
    generated.write_text("S-0\ta\nH-0\t-0.1\ta\nS-1\tb\nS-3\tc\nH-3\t-0.2\tc\n")  # H-1 missing, id 2 absent
    proc = plugins_cli("detok", data, "--from-generate", "--input", generated, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{generated}: 2 of 4 sentences have no H- line (ids 1, 2)" in proc.stderr
    generated.write_text("S-0\ta\nD-0\t-0.1\ta\n")
    proc = plugins_cli("detok", data, "--from-generate", "--input", generated, check=False)
    assert proc.returncode == 2 and f"{generated}: no H-<id> lines" in proc.stderr


def test_detok_from_generate_refuses_post_processed_output(tmp_path):
    (tmp_path / "train.txt").write_text("".join(f"the cat number {i} sat on the mat .\n" for i in range(50)))
    model = train_sentencepiece([str(tmp_path / "train.txt")], str(tmp_path / "spm"), vocab_size=30)
    data = fake_prepared(tmp_path / "prep", {"kind": "sentencepiece", "model": model})
    generated = tmp_path / "generate.out"
    # fairseq-generate --post-process sentencepiece: the pieces already joined into words
    generated.write_text("S-0\tthe cat\nH-0\t-0.1\tthe cat sat\nS-1\tmat\nH-1\t-0.2\ton the mat\n")
    proc = plugins_cli("detok", data, "--from-generate", "--input", generated, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{generated}: its H- lines hold no '{VISIBLE_SPACE}' word-boundary symbol" in proc.stderr
    assert "without them" in proc.stderr
    pieces = SentencePieceTokenizer(model).encode("the cat sat")  # what it writes without --post-process
    assert VISIBLE_SPACE in pieces
    generated.write_text(f"S-0\tthe cat\nH-0\t-0.1\t{pieces}\n")
    assert plugins_cli("detok", data, "--from-generate", "--input", generated).stdout == "the cat sat\n"

    chars = fake_prepared(tmp_path / "chars", {"kind": "char"})
    generated.write_text("H-0\t-0.1\tthe cat sat\n")
    proc = plugins_cli("detok", chars, "--from-generate", "--input", generated, check=False)
    assert proc.returncode == 2 and "word-boundary symbol" in proc.stderr
    generated.write_text("H-0\t-0.1\ta\nH-1\t-0.1\tb <U+00A0> c\n")  # one-word sentences: nothing to tell
    assert plugins_cli("detok", chars, "--from-generate", "--input", generated).stdout == "a\nb\u00a0c\n"


# ---- bench output paths, checked before any work ----

@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot", "--hypotheses"])
def test_bench_checks_output_paths_before_any_work(flag, tmp_path, caplog):
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    # --data does not exist: the output path is refused before the data directory is read
    bench = ["bench", "--method", "baseline", "--path", str(checkpoint), "--data", str(tmp_path / "no-data")]
    for path, message in ((tmp_path, f"{flag} {tmp_path}: is a directory"),
                          (a_file / "sub" / "out", f"{flag} {a_file / 'sub' / 'out'}: {a_file} is a file")):
        caplog.clear()
        with pytest.raises(SystemExit) as exit:
            main(bench + [flag, str(path)])
        assert exit.value.code == 2 and message in caplog.text


def test_an_output_in_a_missing_directory_is_accepted_and_the_directory_made(tmp_path):
    from fairseq_plugins.common.textio import atomic_output, check_output_path

    # Accepted, not refused: bench writes its outputs with atomic_output, which makes the missing directories,
    # so nothing fails after the decoding.
    path = tmp_path / "new" / "sub" / "r.json"
    check_output_path(str(path), "--json")
    with atomic_output(str(path)) as f:
        f.write("{}")
    assert path.read_text() == "{}" and leftovers(path.parent) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_an_output_in_a_read_only_directory_is_refused(tmp_path):
    from fairseq_plugins.common.textio import check_output_path

    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(InputError, match="--json .*: directory .*ro is not writable"):
        check_output_path(str(tmp_path / "ro" / "sub" / "r.json"), "--json")


# ---- rebuilding a prepared directory ----

def test_a_failed_rebuild_leaves_the_old_directory_whole(tmp_path, monkeypatch):
    out = tmp_path / "data"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real_replace = os.replace

    def replace(source, target):
        if os.path.abspath(target) == str(out) and not str(source).endswith(".old"):
            raise OSError("disk full")  # the new directory cannot be moved in
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk full"):
        with _build_aside(str(out)) as build_dir:
            with open(os.path.join(build_dir, "new.txt"), "w") as f:
                f.write("new")
    assert os.listdir(out) == ["old.txt"] and leftovers(tmp_path) == []
    monkeypatch.setattr(os, "replace", real_replace)
    with _build_aside(str(out)) as build_dir:
        with open(os.path.join(build_dir, "new.txt"), "w") as f:
            f.write("new")
    assert os.listdir(out) == ["new.txt"] and leftovers(tmp_path) == []


def test_a_prepare_that_fails_midway_leaves_the_old_directory_whole(tmp_path, monkeypatch):
    from fairseq_plugins.tools import prepared

    raw = write_corpus(str(tmp_path / "raw"), sizes={"train": 30, "val": 5, "test_2016_flickr": 5})
    out = tmp_path / "data"
    out.mkdir()
    (out / "old.txt").write_text("old")

    def crash(build_dir, *args, **kwargs):  # fairseq-preprocess dies with the raw text already written
        assert os.path.isdir(os.path.join(build_dir, "raw"))
        raise RuntimeError("preprocess crashed")

    monkeypatch.setattr(prepared, "_tokenize_and_binarize", crash)
    with pytest.raises(RuntimeError, match="preprocess crashed"):
        prepared.prepare(raw, str(out), "src", "tgt", tokenizer="char", overwrite=True)
    assert os.listdir(out) == ["old.txt"] and (out / "old.txt").read_text() == "old" and leftovers(tmp_path) == []


def test_an_output_directory_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "data").write_text("")
    with pytest.raises(InputError, match="data: output directory is a file"):
        _check_output_dir(str(tmp_path / "data"), overwrite=True)


# ---- installing ----

def test_version_flag_prints_the_package_version(capsys):
    import fairseq_plugins

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"fairseq-plugins {fairseq_plugins.__version__}\n"


def test_importing_without_fairseq_says_how_to_install_it():
    code = "import sys; sys.modules['fairseq'] = None; import fairseq_plugins"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fairseq-plugins needs fairseq")
    assert "pip install --no-deps ve-fairseq==0.12.3" in last
