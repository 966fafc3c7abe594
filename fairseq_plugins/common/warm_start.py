"""Warm starts: copy a trained fairseq model's tensors into a method's model of the same sizes (registers nothing).

Each method says which of the base's tensors it takes (``take``; by name), which of its own must come from the
base (``required``), and how to fit a base tensor of another shape (``adapt``, e.g. an embedding matrix one row
short because the method adds a symbol). Anything else that does not fit is an error naming the flag, checked
before training starts.
"""

import logging
import os
import re
from typing import Callable, Optional, Set

from torch import Tensor

from .textio import InputError

logger = logging.getLogger(__name__)


def resumes_training(cfg) -> bool:
    """Whether fairseq-train will restore a checkpoint over the model it is building (``--restore-file``, by
    default the save dir's checkpoint_last.pt, exists). A warm start is then not applied, as fairseq does not
    apply --finetune-from-model: the checkpoint holds the weights, and the base may have changed or gone since."""
    save_dir = getattr(cfg, "save_dir", None)
    restore = getattr(cfg, "restore_file", None) or "checkpoint_last.pt"
    if save_dir is None:  # not a training (a model built for inference, a test)
        return False
    path = os.path.join(save_dir, "checkpoint_last.pt") if restore == "checkpoint_last.pt" else restore
    return os.path.isfile(path)


def warm_start_unless_resuming(cfg, path: str, flag: str, load: Callable[[str], None]) -> None:
    """``load(path)`` (a method's warm start from ``path``), or, when the training resumes, a log line saying why
    not."""
    if resumes_training(cfg):
        logger.info("%s %s: not applied, the training resumes from its own checkpoint", flag, path)
        return
    load(path)


def warm_start_built_model(model, cfg, from_checkpoint: bool, path: Optional[str], flag: str, model_class,
                           arch: str) -> None:
    """A task's ``build_model`` warm start: ``model.load_base_checkpoint(path, flag)`` for a model built fresh
    (not one built to receive a checkpoint, ``from_checkpoint``) of ``model_class`` when ``path`` (the value of
    ``flag``) is given and the training does not resume; an InputError when the model is of another class
    (``arch``: the --arch presets that build one)."""
    if not path or from_checkpoint:
        return
    if not isinstance(model, model_class):
        raise InputError(f"{flag} needs --arch {arch} (the model built is a {type(model).__name__})")
    warm_start_unless_resuming(cfg, path, flag, lambda path: model.load_base_checkpoint(path, flag))


def load_base_state(path: str, flag: str) -> dict:
    """The model tensors of checkpoint ``path``, or an error naming ``flag`` when there is no such file."""
    from fairseq import checkpoint_utils

    try:
        return checkpoint_utils.load_checkpoint_to_cpu(path)["model"]
    except FileNotFoundError:
        raise InputError(f"{flag} {path}: no such file")


def layer_count(state: dict, prefix: str) -> int:
    """How many layers ``prefix``.layers.N. a state dict has (e.g. prefix "encoder")."""
    pattern = re.compile(rf"{re.escape(prefix)}\.layers\.(\d+)\.")
    indices = [int(match.group(1)) for match in map(pattern.match, state) if match]
    return max(indices) + 1 if indices else 0


def warm_start(model, path: str, flag: str, required: Callable[[str], bool],
               take: Callable[[str], bool] = lambda key: True,
               adapt: Optional[Callable[[str, Tensor, Tensor], Optional[Tensor]]] = None,
               base_state: Optional[dict] = None) -> Set[str]:
    """Load the tensors of checkpoint ``path`` into ``model`` by name; returns the names of those copied.

    ``take(key)``: the base's tensor ``key`` is copied (it must then exist in ``model``); the others are left.
    ``required(key)``: ``model``'s tensor ``key`` must be in the base. ``adapt(key, base, own)``: the tensor to
    load where shapes differ, or None if it cannot fit. ``base_state``: the checkpoint's model tensors when the
    caller has read them already (``load_base_state``).
    """
    base = load_base_state(path, flag) if base_state is None else base_state
    base = {key: tensor for key, tensor in base.items() if take(key)}
    own = model.state_dict()
    unexpected = sorted(key for key in base if key not in own)
    missing = sorted(key for key in own if key not in base and required(key) and not key.endswith("_float_tensor"))
    mismatched, fitted = [], {}
    for key, tensor in base.items():
        if key not in own:
            continue  # listed in unexpected
        if tensor.shape == own[key].shape:
            fitted[key] = tensor
            continue
        adapted = adapt(key, tensor, own[key]) if adapt is not None else None
        if adapted is None or adapted.shape != own[key].shape:
            mismatched.append(f"{key} {tuple(tensor.shape)} vs {tuple(own[key].shape)}")
        else:
            fitted[key] = adapted
    if unexpected or mismatched or missing:
        raise InputError(
            f"{flag} {path}: not a model this one can start from (parameters it has and this model lacks "
            f"{unexpected[:3]}, shape mismatches {mismatched[:3]}, parameters it lacks {missing[:3]}); pass the "
            "--arch sizes the base was trained with and the same data (dictionaries)")
    own.update(fitted)
    model.load_state_dict(own, strict=True)
    logger.info("warm start from %s: %d of %d tensors copied", path, len(fitted), len(own))
    return set(fitted)
