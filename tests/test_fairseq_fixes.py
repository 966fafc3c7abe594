"""The fixes the package installs on import (fairseq_plugins/fairseq_fixes.py)."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import TRAIN_THREADS, USER_DIR, run, train_flags

DROP_ENV = "FAIRSEQ_PLUGINS_DROP_LAST_PARTIAL_BATCH"

SAVE_AND_LOAD = textwrap.dedent("""
    import argparse, sys, torch
    if sys.argv[2] == "with-plugins":
        import fairseq_plugins  # noqa: F401  (installs the fix)
    torch.save({"args": argparse.Namespace(arch="transformer"), "model": {"w": torch.ones(2)}}, sys.argv[1])
    state = torch.load(sys.argv[1])  # default weights_only=True since torch 2.6
    assert state["args"].arch == "transformer" and state["model"]["w"].sum().item() == 2
    print("loaded")
""")


def test_checkpoint_with_namespace_loads_only_with_the_fix(tmp_path):
    script = tmp_path / "save_and_load.py"
    script.write_text(SAVE_AND_LOAD)

    def attempt(mode):
        return subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt.pt"), mode],
                              capture_output=True, text=True)

    without = attempt("without-plugins")
    assert without.returncode != 0 and "argparse.Namespace" in without.stderr
    with_fix = attempt("with-plugins")
    assert with_fix.returncode == 0, with_fix.stderr[-2000:]
    assert with_fix.stdout.strip() == "loaded"


def test_batch_by_size_keeps_every_sentence_in_order():
    from fairseq.data import data_utils

    import fairseq_plugins  # noqa: F401  (installs the fix)

    indices = np.arange(300, dtype=np.int64)[::-1]
    for max_sentences, multiple in ((1, 8), (2, 8), (7, 8), (64, 8), (64, 1)):
        batches = data_utils.batch_by_size(indices, num_tokens_fn=lambda i: 10, max_sentences=max_sentences,
                                           required_batch_size_multiple=multiple)
        assert np.array_equal(np.concatenate(batches), indices), (max_sentences, multiple)
        assert all(len(batch) <= max_sentences for batch in batches)
    fairseq_plugins.fairseq_fixes.keep_last_partial_batch()  # idempotent: wraps once
    assert not hasattr(data_utils.batch_by_size.__wrapped__, "__wrapped__")


def _batch(indices, **kwargs):
    from fairseq.data import data_utils

    import fairseq_plugins  # noqa: F401  (installs the fix)

    return data_utils.batch_by_size(indices, num_tokens_fn=lambda i: 10, **kwargs)


@pytest.mark.parametrize("multiple", [1, 8])
def test_an_empty_index_list_gives_no_batches(multiple, monkeypatch):
    # fairseq itself raises IndexError here when --required-batch-size-multiple > 1
    for drop in ("0", "1"):
        monkeypatch.setenv(DROP_ENV, drop)
        assert _batch(np.array([], dtype=np.int64), max_sentences=4, required_batch_size_multiple=multiple) == []
        assert _batch([], max_tokens=100, required_batch_size_multiple=multiple) == []


def test_max_tokens_batching_keeps_the_tail_that_fairseq_drops(monkeypatch):
    indices = np.arange(13, dtype=np.int64)
    monkeypatch.delenv(DROP_ENV, raising=False)
    # 10 tokens a sentence, 45 tokens a batch, multiple 8: fairseq makes batches of 4 and drops the 13th;
    # with room for all 13, it splits 8 + 5 and drops 5.
    for max_tokens, sizes in ((45, [4, 4, 4, 1]), (200, [8, 5])):
        batches = _batch(indices, max_tokens=max_tokens, required_batch_size_multiple=8)
        assert [len(b) for b in batches] == sizes
        assert np.array_equal(np.concatenate(batches), indices)


def test_the_opt_out_restores_fairseqs_batches(monkeypatch):
    from fairseq.data import data_utils

    import fairseq_plugins  # noqa: F401  (installs the fix)

    fairseqs_own = data_utils.batch_by_size.__wrapped__
    indices = np.arange(13, dtype=np.int64)
    monkeypatch.setenv(DROP_ENV, "1")
    for kwargs in ({"max_tokens": 45}, {"max_tokens": 200}, {"max_sentences": 1}, {"max_sentences": 3}):
        ours = _batch(indices, required_batch_size_multiple=8, **kwargs)
        theirs = fairseqs_own(indices, num_tokens_fn=lambda i: 10, required_batch_size_multiple=8, **kwargs)
        assert [b.tolist() for b in ours] == [b.tolist() for b in theirs], kwargs
        assert sum(map(len, ours)) < len(indices), kwargs  # fairseq does drop a tail in each of these


def test_fairseq_generate_decodes_every_sentence_of_a_13_sentence_test_set(trained, tmp_path):
    """13 is no multiple of fairseq's default --required-batch-size-multiple (8): stock fairseq decodes 12."""
    data = trained["data"]
    (tmp_path / "tok").mkdir()
    for lang in ("src", "tgt"):
        with open(os.path.join(data, "tok", f"test.{lang}")) as f:
            lines = f.readlines()[:13]
        (tmp_path / "tok" / f"test.{lang}").write_text("".join(lines))
    bin_dir = tmp_path / "bin"
    run("fairseq_cli.preprocess", "-s", "src", "-t", "tgt", "--testpref", tmp_path / "tok" / "test",
        "--srcdict", os.path.join(data, "bin", "dict.src.txt"), "--tgtdict", os.path.join(data, "bin", "dict.tgt.txt"),
        "--destdir", bin_dir, "--workers", "1")

    def decoded(batch_size, drop):
        proc = run("fairseq_cli.generate", bin_dir, "--user-dir", USER_DIR,
                   "--path", trained["checkpoint"], "--gen-subset", "test", "--beam", "1",
                   "--batch-size", batch_size, env={DROP_ENV: drop})
        return sorted(int(line.split("\t")[0][2:]) for line in proc.stdout.splitlines() if line.startswith("S-"))

    for batch_size in (1, 4):
        assert decoded(batch_size, "0") == list(range(13)), batch_size
    assert len(decoded(1, "1")) == 12  # the opt-out: fairseq's own batching drops the 13th



def test_patience_counts_on_across_a_resume_and_a_rerun_of_a_stopped_training(prepared, tmp_path):
    """At learning rate 0 every validation loss equals the first, so with --patience 3 a training stops after
    epoch 4 however it is cut: two epochs, then a resume that stops after two more (fairseq alone would compare
    against the resumed run's first validation and count from 0: it would stop after epoch 6), then a re-run of
    the stopped training, which stops after one epoch."""
    flags = [*train_flags(lr="0", warmup_updates="1"), "--patience", 3, "--save-dir", tmp_path]

    def train(epochs):
        proc = run("fairseq_cli.train", os.path.join(prepared, "bin"), *flags, "--max-epoch", epochs,
                   env={"OMP_NUM_THREADS": TRAIN_THREADS})
        log = proc.stdout + proc.stderr
        return [int(epoch) for epoch in re.findall(r"epoch (\d+) \| valid on 'valid' subset", log)], log

    first, _ = train(2)
    resumed, log = train(10)
    assert first == [1, 2] and resumed == [3, 4]
    assert "early stopping resumes at 1 validation(s) without improvement" in log
    assert "early stop since valid performance hasn't improved for last 3 runs" in log
    rerun, log = train(10)
    assert rerun == [5] and "early stopping resumes at 3 validation(s)" in log


# fairseq-train (as `python -m fairseq_cli.train` runs it) that dies like a killed process, without a save, when
# its update DIE_AT_UPDATE is about to start.
TRAIN_THEN_DIE = textwrap.dedent("""
    import os, runpy, sys
    from fairseq.trainer import Trainer

    die_at = int(os.environ.get("DIE_AT_UPDATE") or 0)
    original = Trainer.train_step

    def train_step(self, samples, raise_oom=False):
        if die_at and self.get_num_updates() == die_at:
            os._exit(3)
        return original(self, samples, raise_oom)

    Trainer.train_step = train_step
    sys.argv[0] = "fairseq-train"
    runpy.run_module("fairseq_cli.train", run_name="__main__", alter_sys=True)
""")


def test_a_training_killed_mid_epoch_resumes_from_its_last_mid_epoch_save_on_the_same_path(prepared, tmp_path):
    """With FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES=2, checkpoint_last.pt is written every 2 updates inside an epoch
    without a validation; a training killed in its first epoch resumes from there and ends with exactly the
    weights of the same training never interrupted. Without it, the killed training has nothing to resume."""
    import torch

    flags = [*train_flags(max_tokens="300"), "--max-epoch", 2, "--patience", 3]

    def train(save_dir, **env):
        proc = subprocess.run([sys.executable, "-c", TRAIN_THEN_DIE, os.path.join(prepared, "bin"), *map(str, flags),
                               "--save-dir", str(save_dir)], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **env})
        return proc, proc.stdout + proc.stderr

    proc, log = train(tmp_path / "whole")
    assert proc.returncode == 0, log[-3000:]
    updates_per_epoch = int(re.search(r"epoch 001 \| .*num_updates (\d+)", log).group(1))
    assert updates_per_epoch >= 6, log[-2000:]  # room to die after a mid-epoch save

    cut = tmp_path / "cut"
    proc, log = train(cut, FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES="2", DIE_AT_UPDATE="5")
    assert proc.returncode == 3
    assert "saved checkpoint_last mid-epoch: epoch 1 @ 4 updates | wall " in log
    assert "valid on 'valid' subset" not in log  # no validation at those saves
    assert sorted(os.listdir(cut)) == ["checkpoint_last.pt"]  # no epoch checkpoint, no best
    proc, log = train(cut, FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES="100")
    assert proc.returncode == 0, log[-3000:]
    assert re.search(r"Loaded checkpoint \S+checkpoint_last\.pt \(epoch 1 @ 4 updates\)", log)
    assert re.findall(r"epoch (\d+) \| valid on 'valid' subset", log) == ["001", "002"]
    # the resumed process's wall clock runs (fairseq alone loads it stopped and logs "wall 0" from then on)
    walls = [int(wall) for wall in re.findall(r"\btrain\b\W+epoch \d+ \|.*\| wall (\d+)", log)]
    assert len(walls) == 2 and 0 < walls[0] < walls[1], walls

    whole = torch.load(tmp_path / "whole" / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    resumed = torch.load(cut / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert whole["optimizer_history"][-1]["num_updates"] == resumed["optimizer_history"][-1]["num_updates"]
    assert whole["model"].keys() == resumed["model"].keys()
    assert all(torch.equal(whole["model"][name], resumed["model"][name]) for name in whole["model"])

    proc, _ = train(tmp_path / "unsaved", DIE_AT_UPDATE="5")
    assert proc.returncode == 3 and not (tmp_path / "unsaved" / "checkpoint_last.pt").exists()
    proc, log = train(tmp_path / "bad", FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES="often")
    assert proc.returncode != 0
    assert "InputError: FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES='often': expected a whole number of updates" in log
    assert not (tmp_path / "bad" / "checkpoint_last.pt").exists()
