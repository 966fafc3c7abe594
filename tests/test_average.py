"""fairseq-plugins average-checkpoints: the mean of real fairseq checkpoints, loadable as one."""

import os
import subprocess

import pytest
import torch

from conftest import REPO, plugins_cli, recipe_bin


def _shifted_copy(source: str, target: str, shift: float) -> None:
    """``source`` with every floating parameter plus ``shift`` (the rest of the checkpoint as it is)."""
    state = torch.load(source, map_location="cpu", weights_only=False)
    state["model"] = {k: v + shift if v.is_floating_point() else v for k, v in state["model"].items()}
    torch.save(state, target)


@pytest.fixture(scope="module")
def epoch_checkpoints(trained, tmp_path_factory):
    """checkpoint1..3.pt: the trained tiny model shifted by 0, 0.3 and 0.6."""
    directory = tmp_path_factory.mktemp("epochs")
    for epoch, shift in ((1, 0.0), (2, 0.3), (3, 0.6)):
        _shifted_copy(trained["checkpoint"], str(directory / f"checkpoint{epoch}.pt"), shift)
    return directory


def test_the_average_of_the_last_epochs_is_their_mean_and_loads_as_a_checkpoint(trained, epoch_checkpoints, tmp_path):
    from fairseq import checkpoint_utils

    out = str(tmp_path / "averaged.pt")
    plugins_cli("average-checkpoints", "--inputs", epoch_checkpoints, "--num-epoch-checkpoints", "2", "--output", out)
    base = torch.load(trained["checkpoint"], map_location="cpu", weights_only=False)["model"]
    averaged = torch.load(out, map_location="cpu", weights_only=False)
    assert averaged["extra_state"]["averaged_checkpoints"] == ["checkpoint2.pt", "checkpoint3.pt"]
    assert averaged["last_optimizer_state"] is None
    for key, tensor in base.items():
        expected = tensor + 0.45 if tensor.is_floating_point() else tensor  # mean of +0.3 and +0.6
        assert averaged["model"][key].dtype == tensor.dtype
        torch.testing.assert_close(averaged["model"][key], expected, rtol=0, atol=1e-6)
    # fairseq loads it as any checkpoint, with the training's task and sizes
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [out], arg_overrides={"data": os.path.join(trained["data"], "bin")})
    state = models[0].state_dict()
    torch.testing.assert_close(state["encoder.layers.0.fc1.weight"], base["encoder.layers.0.fc1.weight"] + 0.45,
                               rtol=0, atol=1e-6)


def test_listed_files_are_averaged_as_given(trained, epoch_checkpoints, tmp_path):
    out = str(tmp_path / "averaged.pt")
    plugins_cli("average-checkpoints", "--inputs", epoch_checkpoints / "checkpoint1.pt",
                epoch_checkpoints / "checkpoint3.pt", "--output", out)
    base = torch.load(trained["checkpoint"], map_location="cpu", weights_only=False)["model"]
    averaged = torch.load(out, map_location="cpu", weights_only=False)["model"]
    key = "decoder.layers.0.fc2.bias"
    torch.testing.assert_close(averaged[key], base[key] + 0.3, rtol=0, atol=1e-6)


def test_too_few_checkpoints_or_different_models_are_clear_errors(trained, epoch_checkpoints, tmp_path):
    out = tmp_path / "averaged.pt"
    result = plugins_cli("average-checkpoints", "--inputs", epoch_checkpoints, "--num-epoch-checkpoints", "5",
                         "--output", out, check=False)
    assert result.returncode == 2
    assert "3 epoch (checkpointN.pt) checkpoint(s), 5 asked for" in result.stderr
    other = tmp_path / "other.pt"
    state = torch.load(trained["checkpoint"], map_location="cpu", weights_only=False)
    state["model"]["decoder.output_projection.weight"] = torch.zeros(3, 3)
    torch.save(state, other)
    result = plugins_cli("average-checkpoints", "--inputs", epoch_checkpoints / "checkpoint1.pt", other,
                         "--output", out, check=False)
    assert result.returncode == 2
    assert "decoder.output_projection.weight is (3, 3)" in result.stderr
    assert not out.exists() and not os.path.exists(f"{out}.tmp")


def test_tied_embeddings_are_saved_once_and_float16_halves_the_file(trained, tmp_path):
    """The tiny baseline shares all embeddings (three names, one tensor): an average keeps them one tensor, so the
    file is no larger than fairseq's own; --dtype float16 stores the floats in half precision, loadable as ever."""
    from fairseq import checkpoint_utils

    base = torch.load(trained["checkpoint"], map_location="cpu", weights_only=False)["model"]
    tied = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.output_projection.weight"]
    assert all(torch.equal(base[tied[0]], base[name]) for name in tied[1:])
    full, half = str(tmp_path / "full.pt"), str(tmp_path / "half.pt")
    plugins_cli("average-checkpoints", "--inputs", trained["checkpoint"], "--output", full)
    plugins_cli("average-checkpoints", "--inputs", trained["checkpoint"], "--output", half, "--dtype", "float16")
    model = torch.load(full, map_location="cpu", weights_only=False)["model"]
    assert len({model[name].untyped_storage().data_ptr() for name in tied}) == 1
    untied = torch.load(full, map_location="cpu", weights_only=False)
    untied["model"] = {name: tensor.clone() for name, tensor in untied["model"].items()}  # three copies
    torch.save(untied, tmp_path / "untied.pt")
    embedding_bytes = model[tied[0]].numel() * 4
    assert os.path.getsize(full) < os.path.getsize(tmp_path / "untied.pt") - 1.5 * embedding_bytes  # two fewer
    halved = torch.load(half, map_location="cpu", weights_only=False)["model"]
    assert {t.dtype for t in halved.values() if t.is_floating_point()} == {torch.float16}
    for key, tensor in base.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(halved[key].float(), tensor, rtol=1e-3, atol=1e-4)
    assert os.path.getsize(half) < 0.6 * os.path.getsize(full)
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [half], arg_overrides={"data": os.path.join(trained["data"], "bin")})
    assert next(models[0].parameters()).dtype == torch.float32  # fairseq casts into its float32 model


def _average_around_best(directory, log, count, out):
    """examples/common.sh's average_epochs_around_best, as a recipe calls it."""
    script = (f'source examples/tools.sh; COMMANDS={directory}/commands.txt; source examples/common.sh; '
              f'average_epochs_around_best {directory} {log} {count} {out}')
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)


def _validation_log(path, losses):
    path.write_text("".join(f"| INFO | valid | epoch {epoch:03d} | valid on 'valid' subset | loss {loss} | ppl 4.1 | "
                            f"num_updates {10 * epoch}\n" for epoch, loss in losses))
    return path


def _averaged(out):
    return torch.load(out, map_location="cpu", weights_only=False)["extra_state"]["averaged_checkpoints"]


def test_the_recipes_average_is_centred_on_the_best_validation_loss(trained, tmp_path):
    """Patience stops a training epochs past its best: the average takes the N epochs centred on the best (a
    resumed log's repeated validation counted once), the ones there when the training has not gone N/2 past it
    yet, the last N where the best epoch's checkpoint is gone, and writes nothing where no epoch ended."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    for epoch in range(1, 6):
        _shifted_copy(trained["checkpoint"], str(directory / f"checkpoint{epoch}.pt"), 0.1 * epoch)
    log = _validation_log(tmp_path / "train.log", ((1, 2.5), (2, 2.31), (3, 2.204), (3, 2.204), (4, 2.21), (5, 2.3)))
    out = tmp_path / "avg.pt"
    proc = _average_around_best(directory, log, 3, out)
    assert proc.returncode == 0, proc.stderr
    assert "epochs 2-4" in proc.stderr and "best validation loss at epoch 3" in proc.stderr
    assert "only" not in proc.stderr
    assert _averaged(out) == ["checkpoint2.pt", "checkpoint3.pt", "checkpoint4.pt"]
    # an even N reaches one epoch further after the best than before it
    proc = _average_around_best(directory, log, 4, out)
    assert proc.returncode == 0 and "epochs 2-5" in proc.stderr, proc.stderr
    # the best is the last epoch so far: the epochs there, said so
    rising = _validation_log(tmp_path / "rising.log", ((1, 2.5), (2, 2.31), (3, 2.25), (4, 2.21), (5, 2.2)))
    proc = _average_around_best(directory, rising, 3, out)
    assert proc.returncode == 0 and "only 2 of the 3 epochs" in proc.stderr, proc.stderr
    assert _averaged(out) == ["checkpoint4.pt", "checkpoint5.pt"]
    # the best epoch's checkpoint no longer kept: the last N, as before
    os.remove(directory / "checkpoint3.pt")
    proc = _average_around_best(directory, log, 2, out)
    assert proc.returncode == 0, proc.stderr
    assert _averaged(out) == ["checkpoint4.pt", "checkpoint5.pt"]
    # no epoch checkpoint at all (stopped by its time cap inside epoch 1): nothing written, said so
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _average_around_best(empty, log, 2, tmp_path / "none.pt")
    assert proc.returncode == 0 and "holds no epoch checkpoint yet" in proc.stderr
    assert not (tmp_path / "none.pt").exists()


def test_the_recipes_know_a_training_that_patience_stopped(tmp_path):
    """examples/common.sh's stopped_by_patience: a log whose last start ended in a stop by --patience of at least
    the recipe's PATIENCE (a re-run would train past the plateau), also where a re-run was cut short after it; not
    one restarted from scratch since, nor one stopped with a smaller patience than asked for now, nor a missing
    log."""
    start = "| INFO | fairseq.trainer | No existing checkpoint found ckpt/checkpoint_last.pt\n"
    resume = "| INFO | fairseq.trainer | Loaded checkpoint ckpt/checkpoint_last.pt (epoch 9 @ 80 updates)\n"
    stop = "| INFO | fairseq_cli.train | early stop since valid performance hasn't improved for last {} runs\n"

    def stopped(text, patience=5):
        log = tmp_path / "train.log"
        if text is not None:
            log.write_text(text)
        script = f"source examples/tools.sh; source examples/common.sh; stopped_by_patience {log} {patience}"
        return subprocess.run(["bash", "-c", script], cwd=REPO, timeout=60).returncode == 0

    assert stopped(start + stop.format(5)) and stopped(start + stop.format(5) + resume + stop.format(5))
    assert stopped(start + stop.format(5), patience=3)
    assert not stopped(start + stop.format(3)) and not stopped(start) and not stopped(start + stop.format(5) + start)
    assert stopped(start + stop.format(5) + resume)  # a re-run cut short: the plateau stands
    # started again from another model (--finetune-from-model, its checkpoints deleted): a new training
    finetune = "| INFO | fairseq.checkpoint_utils | loading pretrained model from base.pt: optimizer, lr scheduler ...\n"
    assert not stopped(start + stop.format(5) + finetune + resume)
    (tmp_path / "train.log").unlink()
    assert not stopped(None)


def test_the_recipes_read_the_last_value_of_a_flag():
    """examples/common.sh's last_flag_value: as argparse reads it, the last of `FLAG VALUE` and `FLAG=VALUE`;
    empty where the flag is absent or ends the list without a value; other flags and prefixes not taken for it."""
    def value(*words):
        proc = subprocess.run(["bash", "-c", "set -euo pipefail; source examples/tools.sh; source examples/common.sh; "
                               "last_flag_value \"$@\"", "-", *words], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert value("--max-update", "--lr", "1e-3", "--max-update", "10", "--max-update=20") == "20"
    assert value("--max-update", "--max-update=20", "--max-update", "30", "--lr", "1") == "30"
    assert value("--finetune-from-model", "--finetune-from-model", "a b/c.pt") == "a b/c.pt"
    assert value("--max-update", "--max-update-x", "5", "--lr", "1") == ""
    assert value("--max-update", "--lr", "1", "--max-update") == ""
    assert value("--max-update") == ""


def test_the_recipes_turn_a_budget_in_minutes_into_stop_time_hours():
    """examples/common.sh's minutes_as_hours: minutes / 60 as --stop-time-hours reads it; anything but a number
    of minutes stops the recipe (exit 2) with the setting it came from named, before a training starts."""
    def hours(minutes, name="MT_MINUTES"):
        return subprocess.run(["bash", "-c", "set -euo pipefail; source examples/tools.sh; source examples/common.sh; "
                               "HOURS=(--stop-time-hours \"$(minutes_as_hours \"$1\" \"$2\")\"); echo \"${HOURS[1]}\"",
                               "-", minutes, name], cwd=REPO, capture_output=True, text=True, timeout=60)

    for minutes, expected in [("600", 10.0), ("90", 1.5), ("2.5", 2.5 / 60), (".5", 0.5 / 60), ("5.", 5 / 60), ("0", 0.0)]:
        proc = hours(minutes)
        assert proc.returncode == 0, proc.stderr
        assert float(proc.stdout) == expected
    for bad in ["", ".", "ten", "-5", "1e3", "1.2.3", "10 min", "$(echo 1)"]:
        proc = hours(bad, "GPU_MINUTES")
        assert proc.returncode == 2 and proc.stdout == ""
        assert f"GPU_MINUTES={bad}: not a number of minutes" in proc.stderr


def test_the_recipes_know_a_training_that_stopped_at_its_budget(tmp_path):
    """examples/common.sh's stopped_by_budget: a log whose last stop was by the time or update budget that the
    flags still set (a re-run would train one more update, validate and save again), also where a re-run was cut
    short after it; not where the flags raise the budget or set none, nor after a start from scratch or from
    another model, nor a missing log."""
    start = "| INFO | fairseq.trainer | No existing checkpoint found ckpt/checkpoint_last.pt\n"
    resume = "| INFO | fairseq.trainer | Loaded checkpoint ckpt/checkpoint_last.pt (epoch 9 @ 80 updates)\n"
    finetune = "| INFO | fairseq.checkpoint_utils | loading pretrained model from base.pt: optimizer, lr scheduler ...\n"
    time_stop = ("| INFO | fairseq_cli.train | Stopping training due to cumulative_training_time: 10.000213 > "
                 "stop_time_hours: 10.0 hour(s)\n")
    update_stop = "| INFO | fairseq_cli.train | Stopping training due to num_updates: 1228 >= max_update: 1228\n"

    def stopped(text, *flags):
        log = tmp_path / "system" / "train.log"
        log.parent.mkdir(exist_ok=True)
        if text is not None:
            log.write_text(text)
        script = ("source examples/tools.sh; source examples/common.sh; stopped_by_budget \"$@\"")
        proc = subprocess.run(["bash", "-c", script, "-", str(log), *flags], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        return proc.returncode == 0 and "system: stopped at its" in proc.stderr

    hours = ("--lr", "1e-3", "--stop-time-hours", "10.0", "--max-epoch", "100")
    assert stopped(start + time_stop, *hours) and stopped(start + time_stop + resume, *hours)
    assert stopped(start + time_stop, "--stop-time-hours", "12", "--stop-time-hours=9.5")  # the last one counts
    assert not stopped(start + time_stop, "--stop-time-hours", "12")  # a larger budget trains it on
    assert not stopped(start + time_stop, "--max-update", "5000") and not stopped(start + time_stop)
    assert not stopped(start + time_stop + start, *hours) and not stopped(start, *hours)
    assert stopped(finetune + resume + update_stop, "--max-update", "1228", "--stop-time-hours", "0")
    assert not stopped(finetune + resume + update_stop, "--max-update", "2000")
    assert not stopped(start + update_stop + finetune + resume, "--max-update", "1228")
    # the last stop line counts: trained past the time cap with a larger one, then stopped by its update budget
    assert stopped(start + time_stop + resume + update_stop, "--max-update", "1228", "--stop-time-hours", "10.0")
    assert not stopped(start + update_stop + resume + time_stop, "--max-update", "1228", "--stop-time-hours", "11")
    (tmp_path / "system" / "train.log").unlink()
    assert not stopped(None, *hours)


# Each recipe's train stage, its arguments and environment, and two of its systems: the first stopped by patience.
RECIPE_TRAININGS = {
    "bytenet": (["MULTI30K", "SHAKESPEARE", "WORK"],
                {"STAGES": "train-mt", "MT_SYSTEMS": "bytenet-mt transformer-mt", "LM_SYSTEMS": ""},
                ("bytenet-mt", "transformer-mt"), 5),
    "double_token": (["BASE", "WORK"], {"STAGES": "train", "SYSTEMS": "l2r-1 r2l-1"}, ("l2r-1", "r2l-1"), 3),
    "lattice": (["BASE", "WORK"], {"STAGES": "train", "SYSTEMS": "raw-1 distill-1"}, ("raw-1", "distill-1"), 3),
    "rnn_fc": (["BASE", "WORK"], {"STAGES": "train", "SYSTEMS": "fc4-tanh fc0-tanh", "TRAIN_ON": "raw"},
               ("fc4-tanh", "fc0-tanh"), 3),
    "blockwise": (["BASE", "WORK"], {"STAGES": "train", "VARIANTS": "self regular"}, ("self", "regular"), 3),
}


def _train_stage_with_a_stopped_system(recipe, tmp_path, env, stopped, other, stop_line):
    """The recipe's train stage with a stand-in fairseq-train that records its --save-dir, ``stopped``'s log a
    training from scratch that ended with ``stop_line``: checks that only ``other`` was trained, and returns the
    recipe's stderr."""
    args = RECIPE_TRAININGS[recipe][0]
    base, work = tmp_path / "base", tmp_path / "work"
    os.makedirs(base / "data")
    (base / "data" / "prepare.json").write_text('{"source_lang": "en", "target_lang": "de"}')
    os.makedirs(base / "checkpoints")
    (base / "checkpoints" / "checkpoint_best.pt").write_bytes(b"")
    os.makedirs(work / stopped)
    (work / stopped / "train.log").write_text(
        "| INFO | fairseq.trainer | No existing checkpoint found checkpoints/checkpoint_last.pt\n"
        f"| INFO | fairseq_cli.train | {stop_line}\n")
    stand_ins, calls = tmp_path / "bin", tmp_path / "calls"
    os.makedirs(stand_ins)
    (stand_ins / "fairseq-train").write_text(
        f'#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --save-dir ] && echo "$2" >> {calls}; shift; done\n')
    os.chmod(stand_ins / "fairseq-train", 0o755)
    paths = {"BASE": base, "WORK": work, "MULTI30K": tmp_path / "m", "SHAKESPEARE": tmp_path / "s"}
    venv_bin = recipe_bin()
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", recipe, "run.sh")] + [str(paths[a]) for a in args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PATH=f"{stand_ins}:{venv_bin}:{os.environ['PATH']}", **env))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (calls.read_text().split() if calls.exists() else []) == [str(work / other / "checkpoints")]
    return proc.stderr


@pytest.mark.parametrize("recipe", sorted(RECIPE_TRAININGS))
def test_no_recipe_trains_again_a_system_that_patience_stopped(recipe, tmp_path):
    """Re-run, a recipe's train stage skips a system whose log ends in a stop by its --patience (fairseq would
    resume and train past the plateau, moving the epochs averaged) and trains the others: checked with a stand-in
    fairseq-train that records its --save-dir."""
    _, env, (stopped, other), patience = RECIPE_TRAININGS[recipe]
    stderr = _train_stage_with_a_stopped_system(
        recipe, tmp_path, env, stopped, other,
        f"early stop since valid performance hasn't improved for last {patience} runs")
    assert (f"{stopped}: stopped at its plateau ({patience} validations without a new best; "
            f"{tmp_path / 'work' / stopped / 'train.log'}): not trained again" in stderr)


# The recipes whose trainings have a time or update budget: a system that reached it, the other, and the stop line.
RECIPE_BUDGETS = {
    "bytenet": ({"STAGES": "train-mt", "MT_SYSTEMS": "transformer-mt bytenet-mt", "LM_SYSTEMS": ""},
                "transformer-mt", "bytenet-mt",
                "cumulative_training_time: 10.0002 > stop_time_hours: 10.0 hour(s)"),
    "blockwise": ({"STAGES": "train", "VARIANTS": "finetuned regular"}, "finetuned", "regular",
                  "num_updates: 200 >= max_update: 200"),
}


@pytest.mark.parametrize("recipe", sorted(RECIPE_BUDGETS))
def test_no_recipe_trains_again_a_system_that_reached_its_budget(recipe, tmp_path):
    """Re-run, a recipe's train stage skips a system whose log ends in a stop by the time or update budget it
    would still run with (fairseq would train one more update, then validate and save again)."""
    env, stopped, other, stop = RECIPE_BUDGETS[recipe]
    stderr = _train_stage_with_a_stopped_system(recipe, tmp_path, env, stopped, other, f"Stopping training due to {stop}")
    assert f"{stopped}: stopped at its" in stderr and "not trained again (a larger budget trains it on)" in stderr
