"""``--fast-step``, ``--fast-step-precision`` and ``--fast-step-cuda-graphs`` for any task whose generator can run
on the fast decoder step (``fast_step_translation``, ``blockwise_translation``, ``double_token_translation``): the
flags as a config dataclass to extend, and the checks that turn a flag the model cannot take into an error naming
it."""

import weakref
from dataclasses import dataclass, field
from typing import Optional, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..common.textio import InputError
from .decoder_step import parameters_fingerprint, unsupported_reason
from .int8 import int8_encoder_unsupported_reason, int8_model_unsupported_reason
from .precision import PRECISIONS, check_precision


@dataclass
class FastStepConfig(FairseqDataclass):
    """The fast step's flags, for any task whose generator can run on it."""

    fast_step: bool = field(
        default=False, metadata={"help": "decode with the fast decoder step (static caches, fused projections, "
                                         "a decoder layer a kernel call; the task's search around it)"},
    )
    fast_step_precision: ChoiceEnum(list(PRECISIONS)) = field(
        default="fp32", metadata={"help": "with --fast-step: fp32 (fairseq's outputs), or int8 weights with "
                                          "per-row activation scales (CPU)"},
    )
    fast_step_cuda_graphs: bool = field(
        default=False, metadata={"help": "with --fast-step on a CUDA device: the decoder calls run on the static "
                                         "decoder step (caches of the whole length, finished rows masked), each "
                                         "shape's call captured as a CUDA graph at its first use and replayed "
                                         "after; the same outputs. Off by default: its speed is not measured yet"},
    )


# model -> {(precision, features_only): its parameters' fingerprint when it last passed the checks}
_PASSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_fast_step_model(model, precision: str, features_only: bool = False) -> Tuple:
    """InputError naming the flag where --fast-step (at ``precision``) cannot run ``model``. A model that passed
    is not walked again while its parameters are unchanged (``hub.translate`` asks for a generator every call).
    Returns the parameters' fingerprint (``decoder_step.parameters_fingerprint``)."""
    key, fingerprint = (precision, features_only), parameters_fingerprint(model)
    if _PASSED.get(model, {}).get(key) == fingerprint:
        return fingerprint
    reason = unsupported_reason(model.decoder, features_only)
    if reason is not None:
        raise InputError(f"--fast-step: this model is not supported ({reason}); drop --fast-step")
    reason = int8_model_unsupported_reason(model) if precision == "int8" else None
    if reason is not None:
        raise InputError(f"--fast-step-precision int8: {reason}")
    reason = int8_encoder_unsupported_reason(model.encoder) if precision == "int8" else None
    if reason is not None:
        raise InputError(f"--fast-step-precision int8: this model's encoder is not supported ({reason}); use fp32")
    _PASSED.setdefault(model, {})[key] = fingerprint
    return fingerprint


def fast_step_precision(cfg: FastStepConfig) -> Optional[str]:
    """--fast-step-precision of a task's config with --fast-step, None without it (an InputError where the
    precision is given without --fast-step)."""
    precision = check_precision(str(cfg.fast_step_precision), "--fast-step-precision")
    if cfg.fast_step:
        return precision
    if precision != "fp32":
        raise InputError("--fast-step-precision: only used with --fast-step (add it, or drop --fast-step-precision)")
    return None


def fast_step_cuda_graphs(cfg: FastStepConfig, precision: Optional[str], models) -> bool:
    """--fast-step-cuda-graphs of a task's config (``precision``: ``fast_step_precision``'s), an InputError where
    it cannot apply: without --fast-step, with int8 (CPU kernels), a model that is not on a CUDA device."""
    if not cfg.fast_step_cuda_graphs:
        return False
    if precision is None:
        raise InputError("--fast-step-cuda-graphs: only used with --fast-step (add it, or drop "
                         "--fast-step-cuda-graphs)")
    if precision == "int8":
        raise InputError("--fast-step-cuda-graphs: not with --fast-step-precision int8")
    device = next(models[0].parameters()).device
    if device.type != "cuda":
        raise InputError(f"--fast-step-cuda-graphs: CUDA graphs need the model on a CUDA device, it is on "
                         f"{device} (drop the flag, or decode on a GPU)")
    return True


def check_fast_step_models(models, precision: str) -> Tuple:
    """``check_fast_step_model`` for a task's --path models, of which --fast-step runs one."""
    if len(models) != 1:
        raise InputError("--fast-step: runs one model, not an ensemble (give one --path)")
    return check_fast_step_model(models[0], precision)
