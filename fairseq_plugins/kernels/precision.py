"""The precisions of the decoding matrices (``--fast-step-precision``, ``--rnn-fc-precision``, the lattice's
``--lattice-*-precision``) and the product each one selects; the one place a precision name is checked."""

from typing import Callable, Optional

from torch import Tensor

from ..common.textio import InputError
from .int8 import Int8Matrix
from .packed_linear import PackedLinear

PRECISIONS = ("fp32", "int8")


def check_precision(precision: str, flag: str = "precision") -> str:
    """``precision`` if it is one of PRECISIONS, else an InputError naming ``flag`` and the choices."""
    if precision not in PRECISIONS:
        raise InputError(f"{flag} {precision}: choose one of {', '.join(PRECISIONS)}")
    return precision


def linear_of(weight: Tensor, bias: Optional[Tensor], precision: str) -> Callable[[Tensor], Tensor]:
    """x (rows, in) -> x W^T + b at ``precision``: float32 (packed for few rows) or int8 with per-row scales."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if check_precision(precision) == "fp32":
        return PackedLinear(weight, bias)
    return Int8Matrix(weight, bias=bias)
