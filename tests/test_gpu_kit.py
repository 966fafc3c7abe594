"""The GPU kit (examples/gpu): its CPU dry run end to end, its refusals, and the pieces it relies on (packing a
checkpoint in float16 with tied tensors kept once, the training summary)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

KIT = os.path.join(REPO, "examples", "gpu", "run.sh")


def kit_env(**extra):
    """The environment of a kit command: this interpreter's commands (fairseq-train, fairseq-plugins) first."""
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1",
            **extra}


def run_kit(*args, env=None, cwd=REPO, timeout=120):
    return subprocess.run(["bash", KIT, *args], capture_output=True, text=True, env=env or kit_env(), cwd=cwd,
                          timeout=timeout)


@pytest.mark.slow
def test_the_dry_run_runs_every_stage_on_the_cpu(tmp_path):
    """examples/gpu/dry_run.sh: env, baseline, train, bench, profile, pack and unpack on tiny data, as CI must keep
    them."""
    work = tmp_path / "dry"
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "gpu", "dry_run.sh"), str(work)],
                          capture_output=True, text=True, env=kit_env(), cwd=REPO, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run: every stage ran" in proc.stdout
    from fairseq_plugins.bench.report import load_results

    for method in ("baseline", "fast_step", "double_token", "rnn_fc"):
        rows = load_results(str(work / "results" / f"{method}.json"))
        labels = {row["label"] for row in rows}
        assert labels == {f"{method} batch 1 fp32", f"{method} batch 4 fp32"}, labels
        assert all(row["device_type"] == "cpu" for row in rows)
    for method in ("fast_step", "double_token"):  # the dry run's PROFILE_METHODS
        [profiled] = load_results(str(work / "results" / "profile" / f"{method}.json"))
        assert profiled["label"] == f"{method} batch 1 fp32" and profiled["sentences"] == 2
        assert {"method", "stock"} <= set(profiled["profile"]) and profiled["profile"]["method"]["tokens"] > 0
    # The averaged double-token systems came back through pack/unpack as loadable float16 checkpoints.
    import torch

    packed = work / "unpacked" / str(work).lstrip("/") / "double_token" / "bidir-2" / "checkpoints" / "checkpoint_avg.pt"
    state = torch.load(packed, map_location="cpu", weights_only=False)
    assert {t.dtype for t in state["model"].values() if t.is_floating_point()} == {torch.float16}
    assert state["last_optimizer_state"] is None


def test_no_cuda_device_stops_every_stage_with_exit_code_2():
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a CUDA device is visible")
    except ImportError:
        pass
    for stage in ("env", "baseline", "train", "bytenet", "bench"):
        proc = run_kit(stage, env=kit_env(DEVICE="cuda"))
        assert proc.returncode == 2, (stage, proc.stderr)
        assert "no CUDA device visible" in proc.stderr


def test_missing_wheels_are_named_with_the_command_that_fetches_them(tmp_path):
    # fairseq made unimportable for the kit's python3, as on a bare GPU machine
    hidden = tmp_path / "hide" / "fairseq"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed on this machine')\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    proc = run_kit("env", env=kit_env(DEVICE="cpu", WHEELS=str(wheels), PYTHONPATH=str(tmp_path / "hide")))
    assert proc.returncode == 2, proc.stderr
    assert f"{wheels}/ve_fairseq-0.12.3*.whl" in proc.stderr
    assert "fetch-wheels.sh" in proc.stderr


def test_unknown_stage_and_unpack_without_parts_are_refused(tmp_path):
    proc = run_kit("unpack", str(tmp_path))
    assert proc.returncode == 2 and "no kit.tar.gz.part* files" in proc.stderr
    proc = run_kit("frobnicate", env=kit_env(DEVICE="cpu"))
    assert proc.returncode == 2 and "unknown stage" in proc.stderr


def test_the_graphs_stage_needs_a_cuda_device():
    proc = run_kit("graphs", env=kit_env(DEVICE="cpu"))
    assert proc.returncode == 2 and "graphs: CUDA graphs need DEVICE=cuda" in proc.stderr, proc.stderr


def test_the_bytenet_stage_without_prepared_data_names_the_directory(tmp_path):
    work = tmp_path / "bytenet-gpu"
    proc = run_kit("bytenet", env=kit_env(DEVICE="cpu", BYTENET_WORK=str(work)))
    assert proc.returncode == 2, proc.stderr
    assert f"{work}/mt-data: no prepared data" in proc.stderr and "STAGES=prepare" in proc.stderr


def test_pack_splits_into_parts_and_unpack_restores_them(tmp_path):
    """Parts of 15 MiB, at most 4 a command (pack-rest sends the others), put back byte for byte."""
    src = tmp_path / "repo"
    (src / "work" / "big").mkdir(parents=True)
    payload = os.urandom(40 * 2**20)  # incompressible: 3 parts
    (src / "work" / "big" / "blob.bin").write_bytes(payload)
    (src / "work" / "note.txt").write_text("kept\n")
    out = tmp_path / "out"
    out.mkdir()
    proc = run_kit("pack", "work/big", "work/note.txt", "work/missing", cwd=src,
                   env=kit_env(DEVICE="cpu", OUT=str(out), WORK="work"))
    assert proc.returncode == 0, proc.stderr
    assert "work/missing: not there, skipped" in proc.stderr
    parts = sorted(os.listdir(out))
    assert parts == ["kit.tar.gz.part00", "kit.tar.gz.part01", "kit.tar.gz.part02"]
    assert all(os.path.getsize(out / p) <= 15 * 2**20 for p in parts)
    back = tmp_path / "back"
    back.mkdir()
    proc = run_kit("unpack", str(out), cwd=back)
    assert proc.returncode == 0, proc.stderr
    assert (back / "work" / "big" / "blob.bin").read_bytes() == payload
    assert (back / "work" / "note.txt").read_text() == "kept\n"


def test_summary_reads_curves_device_precision_and_stop_reason(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "2026-11-25 | INFO | fairseq_cli.train | {'_name': None, 'common': {'_name': None, 'fp16': True, "
        "'bf16': False}}\n"
        "2026-11-25 | INFO | fairseq.utils | rank   0: capabilities =  9.0  ; total memory = 79.179 GB ; "
        "name = NVIDIA H100 80GB HBM3                   \n"
        "x | valid | epoch 001 | valid on 'valid' subset | loss 5.5 | nll_loss 4.1 | ppl 17\n"
        "x | train | epoch 001 | loss 6.1 | nll_loss 5.0 | ppl 32 | wall 20\n"
        "x | valid | epoch 002 | valid on 'valid' subset | loss 4.9 | nll_loss 3.6 | ppl 12\n"
        "x | valid | epoch 003 | valid on 'valid' subset | loss 5.0 | nll_loss 3.7 | ppl 13\n"
        "x | valid | epoch 003 | valid on 'valid' subset | loss 4.95 | nll_loss 3.65 | ppl 13\n"  # resumed epoch
        "x | fairseq_cli.train | early stop since valid performance hasn't improved for last 3 runs\n"
        "x | fairseq_cli.train | done training in 61.5 seconds\n")
    out = tmp_path / "training.json"
    subprocess.run([sys.executable, os.path.join(REPO, "examples", "results", "training_curves.py"), "--logs",
                    f"run={log}", "--json", str(out), "--markdown", str(tmp_path / "training.md")], check=True)
    run = json.load(open(out))["runs"]["run"]
    assert run["device"]["name"] == "NVIDIA H100 80GB HBM3" and run["precision"] == "fp16"
    assert [p["epoch"] for p in run["curve"]] == [1, 2, 3] and run["curve"][-1]["loss"] == 4.95
    assert [p["wall_seconds"] for p in run["curve"]] == [20, None, None]  # from each epoch's "| train |" line
    assert (run["best_epoch"], run["best_valid_loss"], run["epochs"]) == (2, 4.9, 3)
    assert run["train_seconds"] == 61.5 and run["stopped_by"].startswith("patience")
    table = (tmp_path / "training.md").read_text()
    assert "| run | NVIDIA H100 80GB HBM3 | fp16 | 3 | 4.900 (3.600) @ 2 | 61.5 |" in table
    # A resumed run whose wall clock started again from 0: the curve keeps counting, and the total is no longer
    # the last run's "done training in".
    log.write_text("".join(f"x | valid | epoch {n:03d} | valid on 'valid' subset | loss 5.{n} | nll_loss 4.{n} | "
                           f"ppl 17\nx | train | epoch {n:03d} | loss 6.1 | nll_loss 5.0 | ppl 32 | wall {wall}\n"
                           for n, wall in [(1, 600), (2, 1200), (3, 500), (4, 1000)])
                   + "x | fairseq_cli.train | done training in 1001.0 seconds\n")
    subprocess.run([sys.executable, os.path.join(REPO, "examples", "results", "training_curves.py"), "--logs",
                    f"run={log}", "--json", str(out)], check=True)
    run = json.load(open(out))["runs"]["run"]
    assert [p["wall_seconds"] for p in run["curve"]] == [600, 1200, 1700, 2200] and run["train_seconds"] == 2200
    # A language model's log (no nll_loss) cut by --max-update, and one killed inside its first run.
    log.write_text("x | valid | epoch 001 | valid on 'valid' subset | loss 2.7 | ppl 6.5 | wps 900\n"
                   "x | train | epoch 001 | loss 3.0 | ppl 8 | wall 30\n"
                   "x | fairseq_cli.train | Stopping training due to num_updates: 100 >= max_update: 100\n"
                   "x | fairseq_cli.train | done training in 30.2 seconds\n")
    subprocess.run([sys.executable, os.path.join(REPO, "examples", "results", "training_curves.py"), "--logs",
                    f"run={log}", "--json", str(out), "--markdown", str(tmp_path / "training.md")], check=True)
    run = json.load(open(out))["runs"]["run"]
    assert run["curve"] == [{"epoch": 1, "loss": 2.7, "nll_loss": None, "wall_seconds": 30}]
    assert run["stopped_by"] == "update budget (--max-update)"
    assert "| run | cpu | fp32 | 1 | 2.700 (-) @ 1 | 30.2 | update budget (--max-update) |" in (
        tmp_path / "training.md").read_text()
    log.write_text("x | valid | epoch 001 | valid on 'valid' subset | loss 2.7 | ppl 6.5\n")
    subprocess.run([sys.executable, os.path.join(REPO, "examples", "results", "training_curves.py"), "--logs",
                    f"run={log}", "--json", str(out)], check=True)
    assert json.load(open(out))["runs"]["run"]["stopped_by"].startswith("not finished")
    assert "| run | 5.500 / 4.100 (20 s) | 4.900 / 3.600 | 4.950 / 3.650 |" in table  # every epoch
