"""x W^T + b in float32 with W pre-packed once for oneDNN, for the few-row products of beam search on CPU.

Measured here (one thread, AVX2, torch 2.13): the baseline's 8008 x 256 output projection at 5 rows (beam 5,
batch 1) takes 2.2 ms through ``F.linear`` (MKL repacks W on every call) and 0.65 ms with a pre-packed
weight, while at one row ``F.linear`` is as fast; the 1024 x 256 feed-forward matrices gain 10-35% at
5 rows. So a single row keeps ``F.linear`` and more rows use the packed weight. Results differ from
``F.linear``'s in the last bits only (another summation order). Where oneDNN is missing, or the weight is
not on the CPU, every call is ``F.linear``.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# The row count oneDNN is told to expect; measured to serve 2-80 rows well (5: beam 5, batch 1).
PACKING_ROWS_HINT = 16


def _pack(weight: Tensor) -> Optional[Tensor]:
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS_HINT)
        probe = torch.ones(2, weight.size(1))
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # a build without these kernels: F.linear everywhere
        return None
    return packed


class PackedLinear:
    """x (..., d) -> x W^T (+ b) (..., rows); W (rows, d) float32."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor] = None):
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = _pack(self.weight)

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None or x.numel() == x.size(-1) or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
