"""fairseq's own distributed training, 2 CPU processes over gloo, on a plugin architecture.

fairseq's auto-spawn and torchrun paths assume GPUs, so each rank is its own `fairseq-train` process
(--distributed-no-spawn). The architecture exists only through --user-dir: a worker that did not import the
plugins would reject `--arch baseline_transformer_tiny` before joining the group.
"""

import os
import socket
import subprocess
import sys

from conftest import TRAIN_FLAGS

WORLD_SIZE = 2
UPDATES = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_workers(prepared, tmp_path, max_update: int, tag: str):
    """Both ranks of one `fairseq-train` run to ``max_update``; returns their exit codes and logs."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    workers = []
    for rank in range(WORLD_SIZE):
        command = [
            sys.executable, "-m", "fairseq_cli.train", os.path.join(prepared, "bin"), *TRAIN_FLAGS,
            "--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
            "--distributed-world-size", str(WORLD_SIZE), "--distributed-rank", str(rank),
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn",
            "--max-update", str(max_update), "--log-interval", "1", "--save-dir", str(tmp_path / "ckpt"),
        ]
        log = open(tmp_path / f"{tag}.rank{rank}.log", "w")
        workers.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    try:
        codes = [proc.wait(timeout=600) for proc, _ in workers]
    finally:
        for proc, log in workers:
            proc.kill() if proc.poll() is None else None
            log.close()
    return codes, [(tmp_path / f"{tag}.rank{rank}.log").read_text() for rank in range(WORLD_SIZE)]


def test_two_gloo_workers_train_a_plugin_model_and_resume(prepared, tmp_path):
    codes, logs = train_workers(prepared, tmp_path, UPDATES, "first")
    assert codes == [0, 0], "\n\n".join(text[-3000:] for text in logs)
    for rank, text in enumerate(logs):
        assert f"distributed init (rank {rank})" in text
    assert "training on 2 devices" in logs[0]
    assert f"num_updates={UPDATES}" in logs[0].replace(" ", "") or f"num_updates {UPDATES}" in logs[0]
    assert os.path.isfile(tmp_path / "ckpt" / "checkpoint_last.pt")
    # Resuming: rank 0 loads checkpoint_last.pt and broadcasts it (its omegaconf config included) to rank 1,
    # which unpickles it under torch's weights-only loader.
    codes, logs = train_workers(prepared, tmp_path, UPDATES + 4, "resumed")
    assert codes == [0, 0], "\n\n".join(text[-3000:] for text in logs)
    assert f"num_updates={UPDATES + 4}" in logs[0].replace(" ", "") or f"num_updates {UPDATES + 4}" in logs[0]
    assert f"num_updates={UPDATES + 1}," in logs[0].replace(" ", "")  # continued, not started over
    assert "num_updates=1," not in logs[0].replace(" ", "")
