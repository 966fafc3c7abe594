"""``fairseq-plugins average-checkpoints``: the mean of the last N epoch (or update) checkpoints of a run.

fairseq's ``scripts/average_checkpoints.py`` is not in the installed wheel; this is the same operation with the
same flags (``--inputs``, ``--num-epoch-checkpoints``, ``--num-update-checkpoints``, ``--output``). The result is
the newest input checkpoint with its model replaced by the element-wise mean of the inputs' models (floating
tensors averaged in float64, then cast back), so ``fairseq-generate --path`` and ``bench`` load it as they load
any checkpoint. Its optimizer state is dropped: an average is for decoding, not for resuming training.
"""

import collections
import os
import re
from typing import Dict, List, Optional

import torch

from ..common.textio import InputError, positive_int

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_EPOCH_CHECKPOINT = re.compile(r"^checkpoint(\d+)\.pt$")
_UPDATE_CHECKPOINT = re.compile(r"^checkpoint_\d+_(\d+)\.pt$")


def last_checkpoints(directory: str, count: int, by_update: bool = False) -> List[str]:
    """The ``count`` newest ``checkpointEPOCH.pt`` (or ``checkpoint_EPOCH_UPDATE.pt``) files of ``directory``,
    oldest first."""
    if not os.path.isdir(directory):
        raise InputError(f"--inputs {directory}: no such directory")
    pattern = _UPDATE_CHECKPOINT if by_update else _EPOCH_CHECKPOINT
    numbered = sorted((int(m.group(1)), name) for name in os.listdir(directory) if (m := pattern.match(name)))
    kind = "update (checkpoint_E_U.pt)" if by_update else "epoch (checkpointN.pt)"
    if len(numbered) < count:
        raise InputError(f"--inputs {directory}: {len(numbered)} {kind} checkpoint(s), {count} asked for "
                         "(train with --keep-last-epochs N rather than --no-epoch-checkpoints)")
    return [os.path.join(directory, name) for _, name in numbered[-count:]]


def average_models(paths: List[str], dtype: Optional[torch.dtype] = None) -> Dict:
    """The newest of ``paths`` (a fairseq checkpoint dict) with ``model`` the mean of all their models, its floating
    tensors in ``dtype`` (default: the newest input's)."""
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    if not paths:
        raise InputError("average-checkpoints: no checkpoints given")
    sums: Optional[collections.OrderedDict] = None
    newest = None
    for path in paths:
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such checkpoint")
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        model = state["model"]
        if sums is None:
            sums = collections.OrderedDict(
                (key, tensor.double() if tensor.is_floating_point() else tensor.clone()) for key, tensor in model.items()
            )
            first = path
        else:
            if list(model) != list(sums):
                raise InputError(f"{path}: not the same model as {first} (parameter names differ)")
            for key, tensor in model.items():
                if tensor.shape != sums[key].shape:
                    raise InputError(f"{path}: {key} is {tuple(tensor.shape)}, {tuple(sums[key].shape)} in {first}")
                if tensor.is_floating_point():
                    sums[key] += tensor.double()
                elif not torch.equal(tensor, sums[key]):  # e.g. a step counter: averaging it means nothing
                    raise InputError(f"{path}: integer tensor {key} differs from {first}'s; cannot average it")
        newest = state
    reference = newest["model"]
    # Tied parameters (one embedding saved under three names) are saved once, as fairseq saves them: the inputs'
    # equal tensors stay one tensor, so the file keeps fairseq's size.
    averaged: collections.OrderedDict = collections.OrderedDict()
    for key, total in sums.items():
        mean = (total / len(paths)).to(dtype or reference[key].dtype) if reference[key].is_floating_point() else total
        averaged[key] = next((kept for kept in averaged.values()
                              if kept.shape == mean.shape and kept.dtype == mean.dtype and torch.equal(kept, mean)),
                             mean)
    newest["model"] = averaged
    newest["last_optimizer_state"] = None
    if OmegaConf.is_config(newest.get("cfg")):  # saved as fairseq saves it: plain containers, not OmegaConf
        newest["cfg"] = OmegaConf.to_container(newest["cfg"])
    newest.setdefault("extra_state", {})
    newest["extra_state"]["averaged_checkpoints"] = [os.path.basename(p) for p in paths]
    return newest


def add_average_parser(subparsers):
    p = subparsers.add_parser(
        "average-checkpoints", help="average the models of a run's last checkpoints (fairseq's "
                                    "scripts/average_checkpoints.py, which the fairseq wheel lacks)")
    # --input: detok's spelling, so either works for both
    p.add_argument("--inputs", "--input", dest="inputs", nargs="+", required=True,
                   help="checkpoint files, or one save directory with --num-epoch-checkpoints/--num-update-checkpoints")
    p.add_argument("--output", required=True, help="the averaged checkpoint to write")
    count = p.add_mutually_exclusive_group()
    count.add_argument("--num-epoch-checkpoints", type=positive_int,
                       help="average the last N checkpointEPOCH.pt of --inputs DIR")
    count.add_argument("--num-update-checkpoints", type=positive_int,
                       help="average the last N checkpoint_EPOCH_UPDATE.pt of --inputs DIR")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="save the floating tensors in this type (float16 halves the file, e.g. to ship a model "
                        "trained on a GPU; fairseq loads it into a float32 model); default: as the inputs")
    p.set_defaults(run=_run_average)


def _run_average(args, argv):
    count = args.num_epoch_checkpoints or args.num_update_checkpoints
    if count is not None:
        if len(args.inputs) != 1:
            raise InputError("--num-epoch-checkpoints/--num-update-checkpoints take one directory as --inputs")
        if count < 1:
            raise InputError(f"--num-{'epoch' if args.num_epoch_checkpoints else 'update'}-checkpoints {count}: "
                             "must be at least 1")
        paths = last_checkpoints(args.inputs[0], count, by_update=args.num_update_checkpoints is not None)
    else:
        paths = args.inputs
        if any(os.path.isdir(p) for p in paths):
            raise InputError("--inputs: a directory needs --num-epoch-checkpoints or --num-update-checkpoints")
    state = average_models(paths, DTYPES[args.dtype] if args.dtype else None)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    partial = args.output + ".tmp"
    torch.save(state, partial)
    os.replace(partial, args.output)  # never a half-written checkpoint under the final name
    print(f"averaged {len(paths)} checkpoints ({', '.join(os.path.basename(p) for p in paths)}) into {args.output}")
