"""Training figures from fairseq-train logs: one record per log (device, precision, validation curve with the
training wall time at each epoch, why it stopped), written as JSON and a Markdown table. The GPU kit and the
rnn_fc ablation (examples/rnn_fc/ablation.sh) use it.

Usage: python examples/results/training_curves.py --logs NAME=LOG... --json OUT.json [--markdown OUT.md]
"""

import argparse
import json
import os
import re
import sys

# (fairseq's cross_entropy criterion logs no nll_loss: a language model's log has none)
VALID = re.compile(r"epoch (\d+) \| valid on 'valid' subset \| loss ([\d.]+)(?: \| nll_loss ([\d.]+))?"
                   r"(?:.*?\| num_updates (\d+))?")
DEVICE = re.compile(r"rank +\d+: capabilities = +([\d.]+) +; total memory = ([\d.]+) GB ; name = (.+?)\s*$")
TRAIN_WALL = re.compile(r"\| train \| epoch (\d+) \|.*?\| wall (\d+)")
DONE = re.compile(r"done training in ([\d.]+) seconds")
FP16 = re.compile(r"'fp16': (True|False)")
BF16 = re.compile(r"'bf16': (True|False)")


# Where a fairseq-train process starts: its wall clock ("wall" in its "| train |" lines) starts at 0 there. A run
# from another model (--finetune-from-model: "loading pretrained model from", then that model's "Loaded checkpoint
# ... @ 0 updates", its optimiser left behind) is a start from scratch; a resume loads a checkpoint of >= 1 update.
PROCESS_START = re.compile(r"Loaded checkpoint .*\(epoch (\d+) @ [1-9]\d* updates\)|No existing checkpoint found"
                           r"|loading pretrained model from")
# A mid-epoch save of checkpoint_last.pt (FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES, fairseq_plugins/fairseq_fixes.py):
# how far into its process's clock the epoch had come when a resumed run can go on from it.
MID_EPOCH_SAVE = re.compile(r"saved checkpoint_last mid-epoch: epoch (\d+) @ \d+ updates \| wall (\d+)")


def wall_event(line: str):
    """A log line's part in the training clock: ("start", E) where a fairseq-train process starts (resuming at
    epoch E; None: from scratch), ("epoch", N, W) at the end of epoch N, or at a mid-epoch save in it, W seconds
    into its process; else None."""
    if m := TRAIN_WALL.search(line) or MID_EPOCH_SAVE.search(line):
        return "epoch", int(m.group(1)), int(m.group(2))
    if m := PROCESS_START.search(line):
        return "start", int(m.group(1)) if m.group(1) else None
    return None


def cumulative_walls(events):
    """fairseq's training wall seconds at the end of each epoch, counted across resumes, from a log's
    ``wall_event``s in order -> ({epoch: seconds}, whether more than one process trained them).
    fairseq's ``wall`` starts again from 0 in every process (it resets its time meters when it loads a
    checkpoint), so a process that resumes at epoch E counts on from the last epoch end logged at or before E:
    the end of epoch E - 1 after an end-of-epoch checkpoint (the part of an epoch that a killed process did not
    finish is not counted: it is trained again), or the part of epoch E trained before a mid-epoch checkpoint
    (a stop by --stop-time-hours or --max-update logs it, as does each FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES save, and
    the resumed run goes on from there). A log without
    the start lines (older logs) still counts on where ``wall`` falls."""
    walls, offset, previous, restarted = {}, 0, 0, False
    for event in events:
        if event[0] == "start":
            resumed_at = event[1]
            if resumed_at is None:  # from scratch: what an earlier run of this log trained is gone
                walls, offset, restarted = {}, 0, False
            else:
                offset = max((seconds for epoch, seconds in walls.items() if epoch <= resumed_at), default=0)
                restarted = True
            previous = 0
            continue
        _, epoch, wall = event
        if wall < previous:
            offset, restarted = offset + previous, True
        previous = wall
        walls[epoch] = offset + wall
    return walls, restarted


# What ended a fairseq-train run, by the line it logs.
STOP_LINES = (("early stop since valid performance", "patience (plateau of validation loss)"),
              ("Stopping training due to cumulative_training_time", "time budget (--stop-time-hours)"),
              ("Stopping training due to num_updates", "update budget (--max-update)"))


def stop_reason(lines) -> str:
    """Why the last fairseq-train process of a log (its lines; a resumed run's log appended) stopped: its stop
    line; without one, "max epoch" where it logged the end of training, else the log ends inside that run (still
    training, or killed). What an earlier process of the log logged does not count."""
    reason, finished = None, False
    for line in lines:
        if PROCESS_START.search(line):
            reason, finished = None, False
        elif DONE.search(line):
            finished = True
        else:
            reason = next((why for text, why in STOP_LINES if text in line), reason)
    if reason is None:
        reason = "max epoch" if finished else "not finished (no end of training in the log)"
    return reason


def read_log(path: str) -> dict:
    """A fairseq-train log's record (--log-format simple; a resumed run's log appended): the training since its
    last start from scratch (what an earlier run of the log trained is gone), the device from the whole log
    (fairseq names it before it looks for a checkpoint). ``validations`` lists every validation in order, an epoch
    validated twice (cut by a time cap, then finished by the resumed run) included; ``curve`` keeps an epoch's
    last."""
    curve, validations, device, seconds, fp16, bf16 = [], [], None, None, False, False
    wall_events = []  # process starts and epoch ends, in log order
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines:
        if m := VALID.search(line):
            epoch = int(m.group(1))
            curve = [point for point in curve if point["epoch"] < epoch]  # a resumed run repeats epochs
            curve.append({"epoch": epoch, "loss": float(m.group(2)),
                          "nll_loss": float(m.group(3)) if m.group(3) else None})
            validations.append({"epoch": epoch, "loss": float(m.group(2)),
                                "num_updates": int(m.group(4)) if m.group(4) else None})
        elif event := wall_event(line):
            wall_events.append(event)
            if event == ("start", None):  # from scratch
                curve, validations, seconds = [], [], None
        elif m := DEVICE.search(line):
            device = {"name": m.group(3), "capability": m.group(1), "memory_gb": float(m.group(2))}
        elif m := DONE.search(line):
            seconds = float(m.group(1))
        if "'common': {" in line:
            fp16 = fp16 or (m := FP16.search(line)) is not None and m.group(1) == "True"
            bf16 = bf16 or (m := BF16.search(line)) is not None and m.group(1) == "True"
    if not curve:
        raise SystemExit(f"{path}: no validation line (not a fairseq-train log, or it ended before epoch 1)")
    walls, restarted = cumulative_walls(wall_events)
    for point in curve:
        point["wall_seconds"] = walls.get(point["epoch"])
    stopped_by = stop_reason(lines)
    if restarted or seconds is None:  # "done training in" counts the last run only, once it ended
        seconds = max(walls.values(), default=None)
    best = min(curve, key=lambda point: point["loss"])
    return {"log": path, "device": device or {"name": "cpu"}, "precision": "fp16" if fp16 else "bf16" if bf16 else
            "fp32", "epochs": curve[-1]["epoch"], "best_epoch": best["epoch"], "best_valid_loss": best["loss"],
            "best_valid_nll_loss": best["nll_loss"], "train_seconds": seconds, "stopped_by": stopped_by,
            "updates": validations[-1]["num_updates"], "validations": validations, "curve": curve}


def _three(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(runs: dict) -> str:
    lines = ["| run | device | precision | epochs | best valid loss (nll) @ epoch | train s | stopped by |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['device']['name']} | {r['precision']} | {r['epochs']} | "
                     f"{r['best_valid_loss']:.3f} ({_three(r['best_valid_nll_loss'])}) @ {r['best_epoch']} | "
                     f"{r['train_seconds'] if r['train_seconds'] is not None else '-'} | {r['stopped_by']} |")
    return "\n".join(lines) + "\n"


def curve_markdown(runs: dict) -> str:
    """Validation loss / nll at every epoch, with the training wall seconds at its end."""
    epochs = max(point["epoch"] for r in runs.values() for point in r["curve"])
    lines = ["| run | " + " | ".join(f"epoch {e}" for e in range(1, epochs + 1)) + " |",
             "| --- |" + " --- |" * epochs]
    for name, r in runs.items():
        cells = {point["epoch"]: f"{point['loss']:.3f} / {_three(point['nll_loss'])}"
                 + (f" ({point['wall_seconds']} s)" if point.get("wall_seconds") is not None else "")
                 for point in r["curve"]}
        lines.append(f"| {name} | " + " | ".join(cells.get(e, "") for e in range(1, epochs + 1)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", nargs="+", required=True, metavar="NAME=LOG", help="fairseq-train logs, each named")
    p.add_argument("--json", required=True, help="write the records here (-: to standard output)")
    p.add_argument("--markdown", help="and two tables here: a run a line, then each epoch's validation loss")
    args = p.parse_args(argv)
    runs = {}
    for item in args.logs:
        name, sep, path = item.partition("=")
        if not sep or not os.path.isfile(path):
            sys.exit(f"--logs {item}: NAME=LOG with LOG an existing file")
        runs[name] = read_log(path)
    for path, text in ((args.json, json.dumps({"runs": runs}, indent=1) + "\n"),
                       (args.markdown, markdown(runs) + "\n" + curve_markdown(runs) if args.markdown else None)):
        if path == "-":
            sys.stdout.write(text)
        elif path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
