"""Time a ByteNet translation model's decoder step, native (one bytenet_step.c call for the stack) against the torch
frame steps, at several numbers of rows (batch x beam): what ``DilatedStack.NATIVE_MAX_ROWS`` is set from.

Usage: python examples/bytenet/step_timing.py CHECKPOINT DATA_BIN [--rows 1 4 8 12 16 24 48] [--steps 200] [--runs 3]
       [--json OUT.json]

Random source characters (60) and greedy steps through ``model.decoder`` with an incremental state (no generator
around it), one thread, the two kinds alternated run by run in one process; prints and writes the median ms a step
with the min-max over runs, and whether both kinds chose the same characters.
"""

import argparse
import json
import statistics
import sys
import time

import torch

import fairseq_plugins  # noqa: F401 (registers the models; torch >= 2.6 checkpoint loading)
from fairseq_plugins.bench.report import device_name
from fairseq_plugins.common.textio import atomic_output


def decode(model, rows: int, steps: int, native: bool):
    """Seconds for ``steps`` greedy decoder steps of ``rows`` rows, and the characters chosen."""
    stack = model.decoder.stack
    stack.native_frame_steps, stack.NATIVE_MAX_ROWS = native, rows  # this probe decides, not the cap
    dictionary = model.decoder.dictionary
    source = torch.randint(dictionary.nspecial, len(dictionary), (rows, 60), generator=torch.Generator().manual_seed(0))
    encoder_out = model.encoder(source, torch.full((rows,), 60))
    state, tokens = {}, torch.full((rows, 1), dictionary.eos())
    start = time.perf_counter()
    for _ in range(steps):
        logits = model.decoder(tokens, encoder_out, incremental_state=state)[0]
        tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return time.perf_counter() - start, tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a ByteNet translation checkpoint (--arch bytenet*, ReLU decoder blocks)")
    parser.add_argument("data", help="its binarised data (the recipe's WORK/mt-data/bin): the dictionaries")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24, 48])
    parser.add_argument("--steps", type=int, default=200, help="decoder steps a run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the figures here as well")
    args = parser.parse_args(argv)
    from fairseq import checkpoint_utils

    from fairseq_plugins.kernels import native
    from fairseq_plugins.bytenet.model import ByteNetModel

    torch.set_num_threads(1)
    if not native.available():
        parser.error("the native kernels could not be built here: nothing to compare")
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([args.checkpoint], arg_overrides={"data": args.data})
    model = models[0].float().eval()
    if not isinstance(model, ByteNetModel):
        parser.error(f"{args.checkpoint}: not a ByteNet translation model ({type(model).__name__})")
    figures = []
    with torch.no_grad():
        for rows in args.rows:
            seconds, chosen = {True: [], False: []}, {}
            for _ in range(args.runs):
                for kind in (True, False):
                    elapsed, chosen[kind] = decode(model, rows, args.steps, kind)
                    seconds[kind].append(elapsed / args.steps * 1000)
            row = {"rows": rows, "same_characters": torch.equal(chosen[True], chosen[False])}
            for kind, name in ((True, "native"), (False, "torch")):
                row[f"{name}_ms"] = {"median": statistics.median(seconds[kind]), "min": min(seconds[kind]),
                                     "max": max(seconds[kind])}
            figures.append(row)
            print(f"rows {rows:3d}: native {row['native_ms']['median']:.2f} ms a step "
                  f"({row['native_ms']['min']:.2f}-{row['native_ms']['max']:.2f}), torch "
                  f"{row['torch_ms']['median']:.2f} ({row['torch_ms']['min']:.2f}-{row['torch_ms']['max']:.2f}), "
                  f"same characters: {row['same_characters']}", flush=True)
    if args.json:
        with atomic_output(args.json) as f:
            json.dump({"command": ["python", "examples/bytenet/step_timing.py", *(argv or sys.argv[1:])],
                       "checkpoint": args.checkpoint, "device": device_name(torch.device("cpu")), "steps": args.steps,
                       "runs": args.runs, "threads": 1, "figures": figures}, f, indent=1)


if __name__ == "__main__":
    main()
