"""The pinned model set (docs/results/models.json): a changed checkpoint under a pinned name is caught, a result
whose checkpoints are pinned nowhere goes into no generated block, and a flagged ratio never meets a target."""

import hashlib
import json
import os

import pytest

from conftest import REPO, TRAIN_FLAGS, plugins_cli, train_tiny
from fairseq_plugins.bench import pinned
from fairseq_plugins.bench.overview import PAGE_BEGIN, PAGE_END, readme_block
from fairseq_plugins.bench.targets import FLAGGED, MET, NOT_MET, judge


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model(name, path, digest, **extra):
    return {"name": name, "what": "a test model", "path": path, "recipe": "examples/x/run.sh", "data": "tiny",
            "date": "2026-11-28", "sha256": digest, **extra}


def bench_row(label, ratio, runs=None, hashes=None, **extra):
    runs = runs or [ratio] * 3
    row = {"method": "fast", "label": label, "bleu": 30.0, "baseline": {"bleu": 30.5}, "bleu_delta": -0.5,
           "speed_ratio": ratio, "speed_ratio_runs": runs, "speed_ratio_min": min(runs),
           "speed_ratio_max": max(runs), "speed_ratio_spread": (max(runs) - min(runs)) / ratio, "batch_size": 1,
           "device": "test CPU", "device_type": "cpu", "sentences": 10, "generator": {"description": "greedy"},
           "timing": {"alternation": "per batch", "runnable_threads_median": 1.0}, "threads": 1,
           "checkpoint": "/m/work/a/checkpoint.pt", "baseline_checkpoint": "/m/work/a/checkpoint.pt", **extra}
    if hashes:
        row["hashes"] = hashes
    return row


@pytest.fixture
def pinned_tree(tmp_path):
    """A checkout with two pinned checkpoints on disk, their models.json, and a README with a results block."""
    (tmp_path / "work" / "a").mkdir(parents=True)
    (tmp_path / "work" / "b").mkdir(parents=True)
    (tmp_path / "work" / "a" / "checkpoint.pt").write_bytes(b"model a")
    (tmp_path / "work" / "b" / "checkpoint.pt").write_bytes(b"model b")
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "models.json").write_text(json.dumps({"test_set": {"sentences": 10}, "models": [
        model("model-a", "work/a/checkpoint.pt", sha256(b"model a")),
        model("model-b", "work/b/checkpoint.pt", sha256(b"model b")),
        model("model-c", "work/c/checkpoint.pt", None, sha256_note="not recorded: trained elsewhere"),
    ]}))
    return tmp_path


def test_a_changed_checkpoint_under_a_pinned_name_is_caught(pinned_tree):
    models = str(pinned_tree / "docs" / "results" / "models.json")
    proc = plugins_cli("report", "--check-models", "--models", models, cwd=pinned_tree)
    assert proc.returncode == 0 and "model-a: work/a/checkpoint.pt matches its pin" in proc.stdout
    assert "model-c: work/c/checkpoint.pt is not on this machine" in proc.stdout
    # the file under model-b's pinned path is retrained: another model under the same name
    (pinned_tree / "work" / "b" / "checkpoint.pt").write_bytes(b"model b, retrained")
    proc = plugins_cli("report", "--check-models", "--models", models, cwd=pinned_tree, check=False)
    assert proc.returncode == 1
    assert f"model-b: work/b/checkpoint.pt changed: sha256 {sha256(b'model b, retrained')}" in proc.stdout
    assert "model-a" not in proc.stdout.split("do not match:")[1]


def test_make_results_refuses_a_missing_or_unrecorded_model(pinned_tree):
    models = str(pinned_tree / "docs" / "results" / "models.json")
    proc = plugins_cli("report", "--check-models", "--require-all-models", "--models", models, cwd=pinned_tree,
                       check=False)
    assert proc.returncode == 1 and "model-c: work/c/checkpoint.pt is not on this machine (train it:" in proc.stdout


def test_a_superseded_model_is_neither_hashed_nor_required(pinned_tree):
    """An earlier model whose path now holds a retrained, pinned one (the baseline retrained on a new machine):
    its figures keep their name, and make results does not ask to train it again."""
    path = pinned_tree / "docs" / "results" / "models.json"
    models = json.loads(path.read_text())
    models["models"] = models["models"][:2] + [model("model-a-earlier", "work/a/checkpoint.pt", None,
                                                     sha256_note="not recorded: trained elsewhere",
                                                     superseded_by="model-a")]
    path.write_text(json.dumps(models))
    proc = plugins_cli("report", "--check-models", "--require-all-models", "--models", path, cwd=pinned_tree)
    assert "model-a-earlier: superseded by model-a" in proc.stdout and "model-a: work/a/checkpoint.pt matches" \
        in proc.stdout


def test_the_repository_pins_every_model_its_readme_rows_use():
    """models.json names each checkpoint behind a README row: by path for the unpinned rows of today."""
    models = pinned.load_models(os.path.join(REPO, pinned.MODELS_FILE))
    from fairseq_plugins.bench.overview import DEFAULT_RESULTS, best_per_method, bench_results

    results = bench_results([os.path.join(REPO, p) for p in DEFAULT_RESULTS])
    for path, result, _ in best_per_method(results, models["test_set"]["sentences"]):
        for role in ("checkpoint", "baseline_checkpoint"):
            name = pinned.model_name(result, role, models, path)
            assert name in {m["name"] for m in models["models"]}, (path, result.get("label"), role, name)
    assert all(m["sha256"] or "not recorded" in m["sha256_note"] for m in models["models"])


def test_a_result_with_hashes_outside_the_set_is_refused_and_pinned_rows_are_grouped_by_stock_side(pinned_tree):
    results = pinned_tree / "docs" / "results"
    a, b = sha256(b"model a"), sha256(b"model b")
    readme = pinned_tree / "README.md"
    readme.write_text("<!-- results:begin (generated by `fairseq-plugins report --readme README.md`; do not edit "
                      "by hand) -->\n<!-- results:end -->\n")
    (results / "fast.json").write_text(json.dumps([
        bench_row("on a", 2.0, hashes={"checkpoint": a, "baseline_checkpoint": a}),
        bench_row("older", 1.5),  # no hashes: from the unpinned set
    ]))
    plugins_cli("report", results, "--readme", readme, cwd=pinned_tree)
    text = readme.read_text()
    assert f"From the pinned model set ([models.json](docs/results/models.json)), against model-a (sha256 {a[:12]}" in text
    # the pinned row is the faster and is chosen; the older one would be listed under the unpinned set
    assert "| fast | on a (greedy) |" in text and "From an unpinned model set" not in text
    (results / "fast.json").write_text(json.dumps([
        bench_row("on an unpinned model", 3.0, hashes={"checkpoint": sha256(b"other"), "baseline_checkpoint": b})]))
    proc = plugins_cli("report", results, "--readme", readme, cwd=pinned_tree, check=False)
    assert proc.returncode == 2
    assert "on an unpinned model: its checkpoint (sha256" in proc.stderr and "is not in the pinned model set" in proc.stderr


def test_a_delta_against_another_model_names_it():
    models = {"models": [model("single-token", "work/l2r/checkpoint.pt", None, sha256_note="not recorded",
                               figures=["pair.json"])]}
    row = bench_row("pair", 2.0, baseline_checkpoint="/m/work/l2r/checkpoint.pt")
    row["baseline"]["generator"] = {"description": "beam 10"}
    assert "| -0.50 | single-token, stock beam 10 | 2.00x" in readme_block([("docs/results/pair.json", row)],
                                                                          models=models)


def test_a_flagged_ratio_never_meets_a_target(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps([
        bench_row("steady", 5.0),
        bench_row("two runs", 5.0, runs=[4.0, 6.0]),  # fewer than 3 runs, spread 40%
        bench_row("slow", 2.0),
    ]))

    def status(label, **condition):
        target = {"method": "fast", "target": "t", "row": {"file": "r.json", "label": label}, **condition}
        return judge(target, str(tmp_path), lambda r: r)["status"]

    assert status("steady", min_speed_ratio=4.4, max_bleu_loss=1.0) == MET
    assert status("two runs", min_speed_ratio=4.4) == FLAGGED
    assert status("two runs", max_bleu_loss=1.0) == MET  # a BLEU target does not rest on the ratio
    assert status("slow", min_speed_ratio=4.4) == NOT_MET
    assert status("steady", min_speed_ratio=4.4, max_bleu_loss=0.1) == NOT_MET
    relative = {"relative_to": {"file": "r.json", "label": "slow"}}
    assert status("steady", min_speed_ratio=2.5, **relative) == MET
    assert status("two runs", min_speed_ratio=2.5, **relative) == FLAGGED


def test_targets_against_the_same_runs_ctranslate2(tmp_path):
    """Issue 53's targets: the ratio to CTranslate2 (flagged by its own spread or the run's), BLEU against it on
    the whole split, and outputs identical to stock."""
    def reference(ratio, runs, bleu_delta=-0.1):
        return {"speed_ratio": ratio, "speed_ratio_runs": runs, "speed_ratio_min": min(runs),
                "speed_ratio_max": max(runs), "speed_ratio_spread": (max(runs) - min(runs)) / ratio,
                "compute_type": "int8", "bleu_delta": bleu_delta, "sentences": 10}
    (tmp_path / "r.json").write_text(json.dumps([
        bench_row("fast", 5.0, ctranslate2=reference(1.3, [1.28, 1.3, 1.31]), stats={
            "outputs_identical_to_baseline": 1.0}, split_bleu={"sentences": 1000, "ctranslate2_bleu_delta": -0.4}),
        bench_row("noisy", 5.0, ctranslate2=reference(1.3, [1.1, 1.3, 1.5]),
                  stats={"outputs_identical_to_baseline": 0.99}),
        bench_row("no reference", 5.0),
    ]))

    def status(label, **condition):
        target = {"method": "fast", "target": "t", "row": {"file": "r.json", "label": label}, **condition}
        return judge(target, str(tmp_path), lambda r: r)

    assert status("fast", min_ctranslate2_ratio=1.2)["status"] == MET
    assert "1.30x (1.28-1.31) CTranslate2 int8" in status("fast", min_ctranslate2_ratio=1.2)["measured"]
    assert status("fast", min_ctranslate2_ratio=1.4)["status"] == NOT_MET
    assert status("noisy", min_ctranslate2_ratio=1.2)["status"] == FLAGGED  # its own spread: 31%
    # BLEU against CTranslate2 on the whole split (-0.4) where the bench scored it, else on the timed sentences
    assert status("fast", max_bleu_loss_vs_ctranslate2=0.3)["status"] == NOT_MET
    assert status("noisy", max_bleu_loss_vs_ctranslate2=0.3)["status"] == MET
    assert status("fast", identical_outputs=True)["status"] == MET
    assert status("noisy", identical_outputs=True)["status"] == NOT_MET
    with pytest.raises(Exception, match="no CTranslate2 reference"):
        status("no reference", min_ctranslate2_ratio=1.0)


def test_a_summary_figure_whose_own_ratio_is_flagged_never_meets_its_target(tmp_path):
    (tmp_path / "hub.json").write_text(json.dumps([{"hub_over_prebuilt": 1.04, "flagged": False},
                                                   {"hub_over_prebuilt": 1.04, "flagged": True},
                                                   {"hub_over_prebuilt": 1.2, "flagged": False}]))

    def status(index):
        target = {"method": "fast", "target": "t", "at_most": 1.1,
                  "value": {"file": "hub.json", "key": f"{index}.hub_over_prebuilt", "flag_key": f"{index}.flagged"}}
        return judge(target, str(tmp_path), lambda r: r)["status"]

    assert [status(i) for i in range(3)] == [MET, FLAGGED, NOT_MET]
    (tmp_path / "hub.json").unlink()
    assert status(0) == "not measured"


def test_every_generated_block_of_the_repository_is_current():
    """What CI checks: the README's blocks and every method page's block under docs/ regenerate from the JSONs."""
    proc = plugins_cli("report", "--readme", "README.md", "--check", cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    pages = [name for name in os.listdir(os.path.join(REPO, "docs")) if name.endswith(".md")]
    for method, page in (("bytenet", "bytenet.md"), ("lattice", "lattice.md"), ("blockwise", "blockwise.md"),
                         ("double_token", "double_token.md"), ("rnn_fc", "rnn_fc.md"), ("fast_step", "fast-step.md"),
                         ("baseline", "baseline.md")):
        assert page in pages
        with open(os.path.join(REPO, "docs", page), encoding="utf-8") as f:
            text = f.read()
        assert PAGE_BEGIN.format(method=method) in text and PAGE_END.format(method=method) in text, page


def _checkpoint(path, weights, wall_seconds):
    """A fairseq-shaped checkpoint: its weights, and training meters that differ from one training to the next."""
    import torch

    torch.save({"model": weights, "extra_state": {"metrics": {"wall": wall_seconds}}, "last_optimizer_state": {}},
               path)


def test_a_retrained_checkpoint_with_the_pinned_weights_is_the_same_model(pinned_tree):
    """A recipe retrained on a new machine writes the same weights in another file (its wall-clock meters
    differ): check-models tells it from a changed model by the weights' hash, asks for its file hash to be
    recorded, then counts it as the pinned model, whose figures results measured on it are."""
    import torch

    from fairseq_plugins.bench.provenance import file_sha256, weights_sha256

    weights = {"encoder.weight": torch.arange(6, dtype=torch.float32).view(2, 3), "version": torch.tensor([3])}
    first, second = pinned_tree / "first.pt", pinned_tree / "work" / "a" / "checkpoint.pt"
    _checkpoint(first, weights, 100.0)
    _checkpoint(second, {name: tensor.clone() for name, tensor in reversed(weights.items())}, 250.5)
    assert file_sha256(str(first)) != file_sha256(str(second))
    assert weights_sha256(str(first)) == weights_sha256(str(second))
    path = pinned_tree / "docs" / "results" / "models.json"
    models = json.loads(path.read_text())
    models["models"][0].update(sha256=file_sha256(str(first)), weights_sha256=weights_sha256(str(first)))
    path.write_text(json.dumps(models))

    proc = plugins_cli("report", "--check-models", "--models", path, cwd=pinned_tree, check=False)
    assert proc.returncode == 1
    assert (f"model-a: work/a/checkpoint.pt is retrained with its pin's weights (weights sha256 "
            f"{weights_sha256(str(first))[:12]}...) in another file (sha256 {file_sha256(str(second))})") in proc.stdout
    models["models"][0]["retrained"] = [{"sha256": file_sha256(str(second)), "date": "2026-12-01",
                                         "evidence": "the same weights_sha256"}]
    path.write_text(json.dumps(models))
    proc = plugins_cli("report", "--check-models", "--models", path, cwd=pinned_tree)
    assert "model-a: work/a/checkpoint.pt matches its pin's copy retrained 2026-12-01" in proc.stdout
    loaded = pinned.load_models(str(path))
    assert pinned.pinned_hashes(loaded)[file_sha256(str(second))] == "model-a"
    result = bench_row("a", 2.0, hashes={"checkpoint": file_sha256(str(second)),
                                         "baseline_checkpoint": file_sha256(str(first))})
    assert pinned.model_set(result, loaded) == pinned.PINNED
    assert pinned.model_name(result, "checkpoint", loaded) == "model-a"

    # One weight changed: another model, whatever its meters; the line gives its weights' hash to pin.
    weights["encoder.weight"][0, 0] = 0.5
    _checkpoint(second, weights, 250.5)
    proc = plugins_cli("report", "--check-models", "--models", path, cwd=pinned_tree, check=False)
    assert proc.returncode == 1 and (f"model-a: work/a/checkpoint.pt changed: sha256 {file_sha256(str(second))} "
                                     f"(weights sha256 {weights_sha256(str(second))}), models.json pins") in proc.stdout


def test_a_retrained_copy_without_its_evidence_is_refused(pinned_tree):
    path = pinned_tree / "docs" / "results" / "models.json"
    models = json.loads(path.read_text())
    models["models"][0]["retrained"] = [{"sha256": sha256(b"copy"), "date": "2026-12-01"}]
    path.write_text(json.dumps(models))
    with pytest.raises(pinned.InputError, match="'retrained' must list files of the same weights"):
        pinned.load_models(str(path))


def test_the_same_training_twice_writes_other_files_of_the_same_weights(prepared, tmp_path):
    """What weights_sha256 is for: fairseq-train run twice with the same flags and seed (one thread) writes two
    checkpoint files that differ (their wall-clock meters) holding the same weights."""
    from fairseq_plugins.bench.provenance import file_sha256, weights_sha256

    checkpoints = [os.path.join(train_tiny(os.path.join(prepared, "bin"), str(tmp_path / name), TRAIN_FLAGS,
                                           "--max-update", 12), "checkpoint_last.pt") for name in ("one", "two")]
    assert file_sha256(checkpoints[0]) != file_sha256(checkpoints[1])
    assert weights_sha256(checkpoints[0]) == weights_sha256(checkpoints[1])


RETRAIN = os.path.join(REPO, "examples", "results", "retrain.py")


def runpy_retrain():
    import runpy

    return runpy.run_path(RETRAIN)


def retrain(models, *flags, check=True):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, RETRAIN, "--models", str(models), *map(str, flags)], capture_output=True,
                          text=True, timeout=120)
    assert not check or proc.returncode == 0, proc.stderr
    return proc


def retrain_plan(tmp_path, jobs, models):
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"test_set": {"sentences": 10}, "retrain": jobs, "models": models}))
    return path


def test_the_repositorys_retrain_plan_trains_every_pinned_model_with_its_recipe():
    """make retrain's plan: every pinned model that is not superseded is trained by one job whose command is its
    recipe, each job after the jobs it needs, each command a recipe of examples/."""
    import runpy

    plan = runpy.run_path(RETRAIN)["load_plan"](os.path.join(REPO, pinned.MODELS_FILE))
    models = {m["name"]: m for m in pinned.load_models(os.path.join(REPO, pinned.MODELS_FILE))["models"]}
    assert plan[0]["name"] == "baseline" and plan[0]["cores"] == 2
    for job in plan:
        script = next(word for word in job["command"].split() if word.startswith("examples/"))
        assert os.path.isfile(os.path.join(REPO, script)), job["name"]
        work = job["command"].split()[-1]  # every recipe's last argument is its work dir
        assert all(models[name]["path"].startswith(work + "/") for name in job["trains"]), job["name"]
        # one thread a process, or as many cores as the job takes (RANKS, TOGETHER)
        assert job["cores"] == 2 or "THREADS=" not in job["command"] or "THREADS=1 " in job["command"], job["name"]
        assert "bench" not in job["command"].split("STAGES=")[-1].split(" examples/")[0], job["name"]


def test_retrain_runs_each_job_after_its_needs_within_the_cores(tmp_path):
    """Jobs start as cores free up (counted in each job's cores) and only once the jobs they need have finished;
    a failed job skips the jobs that need it while the others go on, and the run says so."""
    events = tmp_path / "events"

    def job(name, cores=1, after=(), fail=False):
        command = (f'echo "start {name}" >> {events}; sleep 0.3; echo "end {name}" >> {events}; echo "{name} said"'
                   + ("; exit 3" if fail else ""))
        return {"name": name, "command": command, "cores": cores, "after": list(after), "trains": [name]}

    jobs = [job("root", cores=2), job("left", after=["root"]), job("right", after=["root"]),
            job("broken", after=["root"], fail=True), job("after-broken", after=["broken"]),
            job("last", after=["left", "right"])]
    models = [model(j["name"], f"work/{j['name']}.pt", None, sha256_note="not recorded: a test",
                    recipe=j["command"]) for j in jobs]
    proc = retrain(retrain_plan(tmp_path, jobs, models), "--cores", 2, "--logs", tmp_path / "logs", check=False)
    assert proc.returncode == 1 and "retrain: 2 job(s) did not finish" in proc.stderr
    assert "broken: failed (exit 3" in proc.stdout
    assert "after-broken: skipped, it needs broken, which did not finish" in proc.stdout
    lines = events.read_text().split("\n")[:-1]
    assert "start after-broken" not in lines
    running, widest = {}, 0
    width = {j["name"]: j["cores"] for j in jobs}
    for line in lines:
        what, name = line.split()
        if what == "start":
            assert all(f"end {need}" in lines[:lines.index(line)] for need in next(
                j["after"] for j in jobs if j["name"] == name)), (name, lines)
            running[name] = width[name]
            widest = max(widest, sum(running.values()))
        else:
            del running[name]
    assert widest == 2 and lines[:2] == ["start root", "end root"]
    assert (tmp_path / "logs" / "left.log").read_text().startswith("\n=== ")
    status = retrain(retrain_plan(tmp_path, jobs, models), "--status", "--logs", tmp_path / "logs").stdout
    assert "root: finished 20" in status and "broken: failed (exit 3) 20" in status
    assert "after-broken: skipped 20" in status and "left: finished 20" in status and "  left said" in status
    # Run again, as the next working period does: every job runs again (the recipes skip their finished stages).
    events.unlink()
    retrain(retrain_plan(tmp_path, jobs[:3], models[:3]), "--logs", tmp_path / "logs")
    assert sorted(events.read_text().split("\n")[:-1]) == sorted(f"{w} {n}" for w in ("start", "end")
                                                                  for n in ("root", "left", "right"))


@pytest.mark.parametrize("change, message", [
    (lambda jobs, models: jobs[1].update(after=["missing"]), "comes after 'missing', which is not a job listed"),
    (lambda jobs, models: jobs.reverse(), "comes after 'a', which is not a job listed before it"),
    (lambda jobs, models: jobs[1].update(trains=[]), "pinned model 'b' is trained by no retrain job"),
    (lambda jobs, models: models[1].update(recipe="other"), "its command is not the recipe of 'b'"),
    (lambda jobs, models: jobs[0].update(cores=0), "cores must be a whole number >= 1"),
    (lambda jobs, models: jobs[1].update(trains=["a"], command=jobs[0]["command"]), "'a' is trained by two jobs"),
])
def test_a_retrain_plan_that_cannot_train_the_set_is_refused_before_any_job(tmp_path, change, message):
    jobs = [{"name": name, "command": f"touch {tmp_path}/{name}", "cores": 1, "after": after, "trains": [name]}
            for name, after in (("a", []), ("b", ["a"]))]
    models = [model(name, f"work/{name}.pt", None, sha256_note="not recorded: a test", recipe=f"touch {tmp_path}/{name}")
              for name in ("a", "b")]
    change(jobs, models)
    proc = retrain(retrain_plan(tmp_path, jobs, models), "--logs", tmp_path / "logs", check=False)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "logs").exists()


def _chain(tmp_path):
    """Jobs a -> b (b needs a), each writing its start and end to tmp_path/events."""
    events = tmp_path / "events"
    jobs = [{"name": name, "command": f'echo "start {name}" >> {events}; sleep 0.3; echo "end {name}" >> {events}',
             "cores": 1, "after": after, "trains": [name]} for name, after in (("a", []), ("b", ["a"]))]
    models = [model(j["name"], f"work/{j['name']}.pt", None, sha256_note="not recorded: a test",
                    recipe=j["command"]) for j in jobs]
    return retrain_plan(tmp_path, jobs, models), events


def test_retrain_only_keeps_the_order_among_its_jobs_and_needs_the_others_finished(tmp_path):
    plan, events = _chain(tmp_path)
    retrain(plan, "--only", "a", "b", "--logs", tmp_path / "logs")
    assert events.read_text().split("\n")[:-1] == ["start a", "end a", "start b", "end b"]
    events.unlink()
    retrain(plan, "--only", "b", "--logs", tmp_path / "logs")  # a finished in the run before
    assert events.read_text() == "start b\nend b\n"
    proc = retrain(plan, "--only", "b", "--logs", tmp_path / "other-logs", check=False)
    assert proc.returncode == 1 and "b: skipped, it needs a (not run here; not finished in an earlier run)" in proc.stdout


def test_retrain_refuses_to_start_beside_trainings_an_earlier_run_left_running(tmp_path):
    """A retrain killed outright (SIGKILL) leaves its trainings running: the next run refuses to start a second
    copy of them, and once they are gone reads them as interrupted."""
    import subprocess

    plan, events = _chain(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    left = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        (logs / "state.json").write_text(json.dumps({"a": {"status": "running", "pgid": left.pid,
                                                           "started": "2026-12-01 10:00:00"}}))
        proc = retrain(plan, "--logs", logs, check=False)
        assert proc.returncode == 2 and f"a still running from an earlier retrain (process groups {left.pid})" \
            in proc.stderr and not events.exists()
        assert "a: running 2026-12-01 10:00:00" in retrain(plan, "--status", "--logs", logs).stdout
    finally:
        left.kill()
        left.wait()
    assert "a: interrupted (resumes when run again)" in retrain(plan, "--status", "--logs", logs).stdout
    retrain(plan, "--logs", logs)
    assert events.read_text().split("\n")[:-1] == ["start a", "end a", "start b", "end b"]


def test_a_stopped_retrain_stops_its_trainings_and_records_them(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    events = tmp_path / "events"
    jobs = [{"name": "long", "command": f'echo start >> {events}; sleep 60; echo end >> {events}', "cores": 1,
             "after": [], "trains": ["long"]}]
    plan = retrain_plan(tmp_path, jobs, [model("long", "work/long.pt", None, sha256_note="not recorded: a test",
                                               recipe=jobs[0]["command"])])
    proc = subprocess.Popen([sys.executable, RETRAIN, "--models", str(plan), "--logs", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(100):
        if events.exists():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by signal" in stderr
    state = json.loads((tmp_path / "logs" / "state.json").read_text())["long"]
    assert state["status"] == "stopped (resumes when run again)"
    assert not runpy_retrain()["_group_alive"](state["pgid"])  # (zombies awaiting their reaper left out)
    assert events.read_text() == "start\n"


def test_pin_records_a_new_model_a_retrained_copy_or_another_model_that_supersedes_the_last(pinned_tree):
    """report --pin NAME after a training: hashes and curve where none were recorded; the same weights in
    another file as a retrained copy; other weights as a new model under NAME, the entry so far kept, superseded
    by it, with its figures and sha256."""
    import torch

    from fairseq_plugins.bench.provenance import file_sha256, weights_sha256

    path = pinned_tree / "docs" / "results" / "models.json"
    checkpoint = pinned_tree / "work" / "c" / "checkpoint.pt"
    checkpoint.parent.mkdir(parents=True)
    weights = {"w": torch.ones(3)}
    _checkpoint(checkpoint, weights, 1.0)
    log = pinned_tree / "train.log"
    log.write_text("epoch 001 | valid on 'valid' subset | loss 5.5 | nll_loss 4\n"
                   "epoch 002 | valid on 'valid' subset | loss 4.25 | nll_loss 3\n"
                   "epoch 002 | valid on 'valid' subset | loss 4.2 | nll_loss 3\n")  # validated again on a resume

    def pin(*flags, check=True):
        return plugins_cli("report", "--models", path, "--pin", "model-c", *flags, cwd=pinned_tree, check=check)

    assert "model-c: pinned work/c/checkpoint.pt" in pin("--pin-log", log).stdout
    entry = {m["name"]: m for m in json.loads(path.read_text())["models"]}["model-c"]
    assert entry["sha256"] == file_sha256(str(checkpoint)) and entry["weights_sha256"] == weights_sha256(str(checkpoint))
    assert entry["validation_curve"]["curve"] == [5.5, 4.2] and "sha256_note" not in entry
    assert "already pinned" in pin().stdout

    _checkpoint(checkpoint, weights, 2.0)  # retrained: the same weights, other meters
    assert "a retrained copy of the pinned weights" in pin().stdout
    entry = {m["name"]: m for m in json.loads(path.read_text())["models"]}["model-c"]
    assert [copy["sha256"] for copy in entry["retrained"]] == [file_sha256(str(checkpoint))]

    first, earlier = entry["sha256"], f"model-c-{entry['date'][:10]}"  # the date it was pinned on
    _checkpoint(checkpoint, {"w": torch.zeros(3)}, 3.0)  # another model under the same name
    assert f"the earlier one is now {earlier}, superseded by it" in pin().stdout
    models = {m["name"]: m for m in json.loads(path.read_text())["models"]}
    assert models[earlier]["superseded_by"] == "model-c" and models[earlier]["sha256"] == first
    assert models["model-c"]["sha256"] == file_sha256(str(checkpoint)) and models["model-c"]["figures"] == []
    assert "retrained" not in models["model-c"] and models["model-c"]["date"].endswith("(trained on this machine)")
    assert pinned.pinned_hashes(pinned.load_models(str(path)))[first] == earlier

    # An entry without a hash that names figures describes a model trained elsewhere: a file now under its path is
    # another model, not that one.
    models = json.loads(path.read_text())
    (unrecorded,) = [m for m in models["models"] if m["name"] == "model-b"]
    unrecorded.update(sha256=None, sha256_note="not recorded: trained elsewhere", figures=["b.json"],
                      evaluate={"beam 5": 30.0})
    path.write_text(json.dumps(models))
    _checkpoint(pinned_tree / "work" / "b" / "checkpoint.pt", weights, 1.0)
    assert "the earlier one is now model-b-2026-11-28" in plugins_cli(
        "report", "--models", path, "--pin", "model-b", cwd=pinned_tree).stdout
    models = {m["name"]: m for m in json.loads(path.read_text())["models"]}
    assert models["model-b-2026-11-28"]["figures"] == ["b.json"] and models["model-b-2026-11-28"]["sha256"] is None
    assert "evaluate" not in models["model-b"]
    assert models["model-b"]["sha256"] == file_sha256(str(pinned_tree / "work" / "b" / "checkpoint.pt"))

    proc = plugins_cli("report", "--models", path, "--pin", earlier, cwd=pinned_tree, check=False)
    assert proc.returncode != 0 and "superseded by model-c; pin that one" in proc.stderr
    proc = plugins_cli("report", "--models", path, "--pin", "model-b", "--pin-log", pinned_tree / "missing.log",
                       cwd=pinned_tree, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr


def test_some_rows_need_their_own_pinned_models_only(pinned_tree):
    """make results ROWS=...: --require-models fails only for the named models that are missing or unhashed."""
    models = str(pinned_tree / "docs" / "results" / "models.json")
    proc = plugins_cli("report", "--check-models", "--require-models", "model-a,model-b", "--models", models,
                       cwd=pinned_tree)
    assert "model-c: work/c/checkpoint.pt is not on this machine" in proc.stdout
    proc = plugins_cli("report", "--check-models", "--require-models", "model-a,model-c", "--models", models,
                       cwd=pinned_tree, check=False)
    assert proc.returncode == 1 and "model-c: work/c/checkpoint.pt is not on this machine (train it:" in proc.stdout
    proc = plugins_cli("report", "--check-models", "--require-models", "model-z", "--models", models,
                       cwd=pinned_tree, check=False)
    assert proc.returncode == 2 and "--require-models model-z: not in the pinned model set" in proc.stderr
    # model-b is being retrained under its path (make retrain): the rows that need model-a alone go on, those that
    # need model-b are refused
    (pinned_tree / "work" / "b" / "checkpoint.pt").write_bytes(b"model b, halfway through its retraining")
    proc = plugins_cli("report", "--check-models", "--require-models", "model-a", "--models", models,
                       cwd=pinned_tree)
    assert "model-b: work/b/checkpoint.pt changed: sha256" in proc.stdout
    assert "(not needed by the models required)" in proc.stdout
    proc = plugins_cli("report", "--check-models", "--require-models", "model-a,model-b", "--models", models,
                       cwd=pinned_tree, check=False)
    assert proc.returncode == 1 and "model-b: work/b/checkpoint.pt changed" in proc.stdout.split("do not match:")[1]


def test_make_results_refuses_a_group_of_rows_it_does_not_know_before_anything():
    import subprocess

    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "results", "remeasure.sh")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "ROWS": "baseline fast-step", "DRY_RUN": "1"})
    assert proc.returncode == 2
    assert "ROWS names fast-step; the groups: baseline fast_step blockwise" in proc.stderr and "+ " not in proc.stdout
