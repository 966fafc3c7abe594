"""The fixes the package installs on import (fairseq_plugins/common/fairseq_fixes.py)."""

import subprocess
import sys
import textwrap

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
    import numpy as np
    from fairseq.data import data_utils

    import fairseq_plugins  # noqa: F401  (installs the fix)

    indices = np.arange(300, dtype=np.int64)[::-1]
    for max_sentences, multiple in ((1, 8), (2, 8), (7, 8), (64, 8), (64, 1)):
        batches = data_utils.batch_by_size(indices, num_tokens_fn=lambda i: 10, max_sentences=max_sentences,
                                           required_batch_size_multiple=multiple)
        assert np.array_equal(np.concatenate(batches), indices), (max_sentences, multiple)
        assert all(len(batch) <= max_sentences for batch in batches)
    fairseq_plugins.common.fairseq_fixes.keep_last_partial_batch()  # idempotent: wraps once
    assert not hasattr(data_utils.batch_by_size.__wrapped__, "__wrapped__")
