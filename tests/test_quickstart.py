"""examples/quickstart/run.sh (docs/quickstart.md): a user's own parallel text, in a language pair other than
en-de and with the split names train/valid/test, end to end through the quickstart, one method of each family:
the baseline transformer, a decoder for any trained transformer (the fast step), a method warm-started from the
baseline (seq-to-lattice, with its alignment and candidate tables) and one with a model and data of its own
(ByteNet, on characters)."""

import json
import os
import re
import subprocess
import sys

import pytest
import sacrebleu

from conftest import REPO, TRAIN_THREADS

QUICKSTART = os.path.join(REPO, "examples", "quickstart", "run.sh")
SIZES = {"train": 1000, "valid": 60, "test": 40}
METHODS = ("baseline", "fast_step", "lattice", "bytenet")
BLEU_LINE = re.compile(r"^(\S+): BLEU ([\d.]+) \((\d+) sentences\)$", re.M)


def quickstart(raw, work, timeout=1800, **env):
    """The quickstart on RAW_DIR ``raw`` into ``work``, languages xx -> yy, this interpreter's commands first."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "SRC": "xx", "TGT": "yy",
           "THREADS": TRAIN_THREADS, **env}
    return subprocess.run(["bash", QUICKSTART, str(raw), str(work)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


@pytest.mark.slow
def test_quickstart_runs_one_method_of_each_family_on_a_users_language_pair(tmp_path):
    from fairseq_plugins.tools.synthetic import write_corpus

    raw = write_corpus(str(tmp_path / "raw"), "xx", "yy", sizes=SIZES)
    work = tmp_path / "work"
    proc = quickstart(raw, work, METHODS=" ".join(METHODS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The synthetic text supports far fewer SentencePiece pieces than VOCAB's 1000: the most it supports instead.
    assert re.search(r"VOCAB=1000 is more pieces than the training text supports: \d+ instead", proc.stdout)

    manifest = json.loads((work / "data" / "prepare.json").read_text())
    assert (manifest["source_lang"], manifest["target_lang"]) == ("xx", "yy")
    assert {split: manifest["splits"][split]["lines"] for split in SIZES} == SIZES
    characters = json.loads((work / "bytenet-data" / "prepare.json").read_text())
    assert characters["tokenizer"]["yy"]["kind"] == "char"
    for path in ("baseline/checkpoint_best.pt", "lattice/checkpoint_best.pt", "lattice/table.pt",
                 "align/train.align", "bytenet/checkpoint_best.pt"):
        assert (work / path).is_file(), path

    rows = {name: (float(bleu), int(sentences)) for name, bleu, sentences in
            BLEU_LINE.findall((work / "bleu.txt").read_text())}
    assert set(rows) == set(METHODS), rows
    references = read_lines(os.path.join(raw, "test.yy"))
    for name, (bleu, sentences) in rows.items():
        data = work / ("bytenet-data" if name == "bytenet" else "data")
        hypotheses = read_lines(work / name / "hyp.yy")
        # One translation per test sentence, fairseq-generate's included, and the line's BLEU is sacreBLEU's.
        assert sentences == len(hypotheses) == len(references) == SIZES["test"], name
        assert read_lines(data / "raw" / "test.yy") == references
        generated = {line.split("\t")[0] for line in read_lines(work / name / "generate.out") if line.startswith("H-")}
        assert len(generated) == SIZES["test"], name
        assert bleu == round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2), name
        assert f"{name}: BLEU {rows[name][0]:.2f}" in proc.stdout
    # The tiny transformer learns the synthetic task in 300 updates; the fp32 fast step is token-identical to it.
    assert rows["baseline"][0] > 50, rows
    assert read_lines(work / "fast_step" / "hyp.yy") == read_lines(work / "baseline" / "hyp.yy")

    # A second run trains nothing again: it decodes and scores, and replaces the row in bleu.txt.
    log = work / "baseline" / "train.log"
    trained_at = log.stat().st_mtime_ns
    again = quickstart(raw, work, METHODS="baseline")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "baseline: train" not in again.stdout and f"prepare {raw} (" not in again.stdout
    assert "baseline: BLEU" in again.stdout
    assert log.stat().st_mtime_ns == trained_at
    rerun = {name: float(bleu) for name, bleu, _ in BLEU_LINE.findall((work / "bleu.txt").read_text())}
    assert set(rerun) == set(METHODS) and rerun["baseline"] == rows["baseline"][0]


def test_quickstart_refuses_an_unknown_method_a_missing_corpus_and_another_pairs_data(tmp_path):
    proc = quickstart(tmp_path, tmp_path / "work", METHODS="baseline transformer")
    assert proc.returncode == 2 and "METHODS: unknown method transformer" in proc.stderr
    proc = quickstart(tmp_path / "nowhere", tmp_path / "work", METHODS="baseline")
    assert proc.returncode == 2 and "no such directory" in proc.stderr
    # A work dir prepared for another pair: named, not silently mixed.
    data = tmp_path / "work" / "data"
    data.mkdir(parents=True)
    (data / "prepare.json").write_text(json.dumps({"source_lang": "en", "target_lang": "de"}))
    proc = quickstart(tmp_path, tmp_path / "work", METHODS="baseline")
    assert proc.returncode == 2 and "holds en->de data, not xx->yy" in proc.stderr
