"""`make retrain`: train the pinned model set (docs/results/models.json) on this machine, the recipes' way.

Checkpoints never leave the machine that trained them, so a new machine trains the set again before `make results`
can re-measure the README's rows. models.json's "retrain" list is the plan: each job a recipe command (the
"recipe" of the models it trains), the cores it takes, and the jobs it needs first. A job starts once the jobs it
needs have finished and its cores are free, CORES (2) in all counted in the jobs' cores, each process with one
thread (OMP_NUM_THREADS=1), logging to LOGS/<job>.log; a free core goes to the first waiting job in the plan that
fits, so a job of two cores waits until both are free while later one-core jobs fill a single free one. Every
recipe resumes from checkpoint_last.pt and skips its finished stages, so running this again (the next working
period) goes on where the last run stopped. A job that fails skips the jobs that need it; the others go on.

One run at a time: a second refuses to start while the first (or a training it started) is alive. Each job's
state (running with its process group, finished, failed, skipped, stopped, with its times) is kept in
LOGS/state.json as it changes; a job recorded as running whose processes are gone reads as interrupted.
--status prints the states with each log's last line, starting nothing.

Usage: python examples/results/retrain.py [--models FILE] [--cores N] [--logs DIR] [--only JOB ...] [--dry-run]
                                          [--status]
  (make retrain; in the background: mkdir -p work && setsid nohup make retrain > work/retrain.log 2>&1 &)
"""

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_KEYS = ("name", "command", "cores", "after", "trains")
FINISHED = "finished"


class PlanError(Exception):
    pass


class Stopped(Exception):
    """A signal asked this run to stop: its trainings are stopped too, and resume when it runs again."""


def load_plan(path: str):
    """models.json's "retrain" jobs, checked: every key, cores >= 1, "after" naming earlier jobs (so the list
    order is an order that works), "trains" naming pinned models whose recipe is the job's command, and every
    model that is not superseded trained by exactly one job."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    jobs, models = data.get("retrain"), {m["name"]: m for m in data.get("models", [])}
    if not isinstance(jobs, list) or not jobs:
        raise PlanError(f"{path}: no 'retrain' list (the jobs that train the pinned set)")
    seen, trained = [], {}
    for number, job in enumerate(jobs):
        missing = [key for key in JOB_KEYS if key not in job]
        if missing:
            raise PlanError(f"{path}: retrain job {number} lacks {', '.join(missing)}")
        name = job["name"]
        if name in seen:
            raise PlanError(f"{path}: retrain job {name!r} is listed twice")
        if not isinstance(job["cores"], int) or job["cores"] < 1:
            raise PlanError(f"{path}: retrain job {name!r}: cores must be a whole number >= 1")
        for key in ("after", "trains"):
            if not isinstance(job[key], list):
                raise PlanError(f"{path}: retrain job {name!r}: {key} must be a list of names")
        for need in job["after"]:
            if need not in seen:
                raise PlanError(f"{path}: retrain job {name!r} comes after {need!r}, which is not a job listed "
                                "before it")
        for model in job["trains"]:
            if model not in models:
                raise PlanError(f"{path}: retrain job {name!r} trains {model!r}, which is not a pinned model")
            if models[model]["recipe"] != job["command"]:
                raise PlanError(f"{path}: retrain job {name!r}: its command is not the recipe of {model!r} "
                                f"({models[model]['recipe']!r})")
            if model in trained:
                raise PlanError(f"{path}: {model!r} is trained by two jobs, {trained[model]!r} and {name!r}")
            trained[model] = name
        seen.append(name)
    for model in models.values():
        if model.get("superseded_by") or model["name"] in trained:
            continue
        raise PlanError(f"{path}: pinned model {model['name']!r} is trained by no retrain job (add it to one's "
                        "'trains', or mark it superseded_by the model that replaced it)")
    return jobs


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _group_alive(pgid) -> bool:
    """Whether a process of group ``pgid`` still runs: on Linux from /proc, leaving out zombies (a killed
    training's children wait there until they are reaped, and signal 0 still reaches them)."""
    if not pgid:
        return False
    if os.path.isdir("/proc/self"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "(command name)": state, ppid, pgrp
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state(logs: str) -> dict:
    """state.json, with a job recorded as running whose process group is gone read as interrupted."""
    path = os.path.join(logs, "state.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        state = json.load(f)
    for entry in state.values():
        if entry.get("status") == "running" and not _group_alive(entry.get("pgid")):
            entry["status"] = "interrupted (resumes when run again)"
    return state


def _write_state(logs: str, state: dict) -> None:
    # Written aside and renamed, as fairseq_plugins.common.textio.atomic_output does; not imported from there:
    # importing the package loads fairseq and every method (~8 s and their memory for a run that lasts days).
    handle, aside = tempfile.mkstemp(prefix=".state-", suffix=".json", dir=logs)
    with os.fdopen(handle, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2)
        f.write("\n")
    os.replace(aside, os.path.join(logs, "state.json"))


def _last_line(path: str) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 4096))
        lines = [line for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def print_status(jobs, logs: str) -> None:
    """Each job's last recorded state and its log's last line."""
    state = read_state(logs)
    for job in jobs:
        entry = state.get(job["name"], {})
        when = entry.get("ended") or entry.get("started") or ""
        print(f"{job['name']}: {entry.get('status', 'not started')}{' ' + when if when else ''}")
        last = _last_line(os.path.join(logs, f"{job['name']}.log"))
        if last:
            print(f"  {last}")


def _stop(signum, _frame):
    raise Stopped(signum)


def run(jobs, cores: int, logs: str, dry_run: bool, poll_seconds: float = 2.0) -> int:
    """Run ``jobs`` as their needs finish and cores free up; returns how many failed or were skipped. A job wider
    than ``cores`` runs alone. A need that is not among ``jobs`` must have finished in an earlier run."""
    names = {job["name"] for job in jobs}
    state = {} if dry_run else read_state(logs)
    waiting, running, failed = list(jobs), {}, set()
    done = {name for name, entry in state.items() if entry.get("status") == FINISHED and name not in names}

    def record(name, **entry):
        if not dry_run:
            state[name] = {**state.get(name, {}), **entry}
            _write_state(logs, state)

    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        while waiting or running:
            for job in list(waiting):
                unmet = [n for n in job["after"] if n in failed or (n not in names and n not in done)]
                if unmet:
                    why = ", ".join(n if n in names else f"{n} (not run here; not finished in an earlier run)"
                                    for n in unmet)
                    print(f"retrain: {job['name']}: skipped, it needs {why}, which did not finish", flush=True)
                    record(job["name"], status="skipped", ended=_now())
                    failed.add(job["name"])
                    waiting.remove(job)
            busy = sum(job["cores"] for _, job in running.values())
            for job in list(waiting):
                if not all(need in done for need in job["after"]):
                    continue
                if busy and busy + job["cores"] > cores:
                    continue  # too wide for the free cores: a later job that fits them starts meanwhile
                waiting.remove(job)
                log = os.path.join(logs, f"{job['name']}.log")
                print(f"retrain: {job['name']}: {job['command']}  ({job['cores']} core(s), log {log})", flush=True)
                if dry_run:
                    done.add(job["name"])
                    continue
                with open(log, "a", encoding="utf-8") as out:
                    out.write(f"\n=== {_now()} retrain: {job['command']}\n")
                    out.flush()
                    proc = subprocess.Popen(["bash", "-c", job["command"]], cwd=REPO, env=environment, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                running[job["name"]] = (proc, job)
                record(job["name"], status="running", pgid=proc.pid, started=_now(), ended=None)
                busy += job["cores"]
            if dry_run:
                continue
            time.sleep(poll_seconds)
            for name, (proc, job) in list(running.items()):
                status = proc.poll()
                if status is None:
                    continue
                del running[name]
                if status == 0:
                    done.add(name)
                    record(name, status=FINISHED, ended=_now())
                    print(f"retrain: {name}: finished", flush=True)
                else:
                    failed.add(name)
                    record(name, status=f"failed (exit {status})", ended=_now())
                    print(f"retrain: {name}: failed (exit {status}; its log: {os.path.join(logs, name + '.log')})",
                          flush=True)
    finally:  # a signal, or any error here: no training outlives this run unseen
        for name, (proc, _) in running.items():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for name, (proc, _) in running.items():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            record(name, status="stopped (resumes when run again)", ended=_now())
    return len(failed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=os.path.join(REPO, "docs", "results", "models.json"),
                        help="the pinned model set with its 'retrain' plan")
    parser.add_argument("--cores", type=int, default=int(os.environ.get("CORES", 2)),
                        help="cores to fill with the jobs (CORES, default 2), one thread a process")
    parser.add_argument("--logs", default=os.path.join(REPO, "work", "retrain"),
                        help="where each job's log and state.json go")
    parser.add_argument("--only", nargs="+", metavar="JOB",
                        help="these jobs alone, each after those of them it needs; a need outside them must have "
                             "finished in an earlier run (state.json)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the jobs, each after the jobs it needs, and start none")
    parser.add_argument("--status", action="store_true",
                        help="print each job's state and its log's last line, and start none")
    args = parser.parse_args(argv)
    if args.cores < 1:
        parser.error(f"--cores must be at least 1, got {args.cores}")
    try:
        jobs = load_plan(args.models)
    except (PlanError, OSError, json.JSONDecodeError) as error:
        print(f"retrain: {error}", file=sys.stderr)
        return 2
    if args.status:
        print_status(jobs, args.logs)
        return 0
    if args.only:
        unknown = sorted(set(args.only) - {job["name"] for job in jobs})
        if unknown:
            print(f"retrain: --only {' '.join(unknown)}: no such job (the jobs: "
                  f"{', '.join(job['name'] for job in jobs)})", file=sys.stderr)
            return 2
        jobs = [job for job in jobs if job["name"] in args.only]
    if args.dry_run:
        return 1 if run(jobs, args.cores, args.logs, dry_run=True) else 0
    os.makedirs(args.logs, exist_ok=True)
    lock = open(os.path.join(args.logs, ".lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"retrain: another retrain runs on {args.logs} (its state: retrain.py --status)", file=sys.stderr)
        return 2
    alive = {name: entry["pgid"] for name, entry in read_state(args.logs).items() if entry.get("status") == "running"}
    if alive:  # started by a run that died without stopping them (SIGKILL): two of one training would collide
        print(f"retrain: {', '.join(alive)} still running from an earlier retrain (process groups "
              f"{', '.join(map(str, alive.values()))}): stop them first", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _stop)
    try:
        problems = run(jobs, args.cores, args.logs, dry_run=False)
    except Stopped as stop:
        print(f"retrain: stopped by signal {stop.args[0]}; the trainings resume when it runs again", file=sys.stderr)
        return 128 + stop.args[0]
    if problems:
        print(f"retrain: {problems} job(s) did not finish (above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
