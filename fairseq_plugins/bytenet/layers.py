"""ByteNet's building blocks: dilated 1-D convolutions (masked or not) and the paper's two residual blocks.

Tensors are (batch, time, channels) throughout; convolutions transpose around ``F.conv1d``. A masked
(causal) convolution of kernel k and dilation r reads the frames t - (k-1)r, ..., t - r, t. In
incremental decoding it keeps exactly the (k-1)r most recent input frames (in fairseq's ``incremental_state``,
one entry per stack), so a new token costs one k-tap product per layer whatever the length so far.
Layer normalisation is over channels only (per time step), so no statistic ever sees the future.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules import FairseqDropout
from torch import Tensor, nn

from ..common.textio import InputError
from ..kernels import native

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


class DilatedConv1d(nn.Module):
    """A k-tap convolution with dilation r: centred ("same" length) when unmasked, causal when masked."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int, masked: bool):
        super().__init__()
        if not masked and kernel_size % 2 == 0:
            raise ValueError(f"an unmasked (source) convolution needs an odd kernel size, got {kernel_size}")
        self.kernel_size, self.dilation, self.masked = kernel_size, dilation, masked
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation)

    @property
    def history(self) -> int:
        """Past frames a masked convolution reads besides the current one."""
        return (self.kernel_size - 1) * self.dilation

    def forward(self, x: Tensor) -> Tensor:
        span = self.history
        padding = (span, 0) if self.masked else (span // 2, span // 2)
        return self.conv(F.pad(x.transpose(1, 2), padding)).transpose(1, 2)

    def step(self, x: Tensor, past: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """New frames x (batch, n, C) after the ``past`` ones (the last ``history``, None before the first
        step): their outputs, and the frames to keep for the next step."""
        assert self.masked, "only a masked convolution decodes incrementally"
        if past is None:
            past = x.new_zeros(x.size(0), self.history, x.size(2))
        frames = torch.cat([past, x], dim=1)
        # Valid (unpadded) convolution over history + n frames gives exactly the n new outputs.
        return self.conv(frames.transpose(1, 2)).transpose(1, 2), frames[:, frames.size(1) - self.history:]


def _conv_frame(x: Tensor, past: Optional[Tensor], dilation: int, history: int, weight_t: Tensor,
                bias: Tensor) -> Tuple[Tensor, Tensor]:
    """A masked convolution on one new frame a row, x (batch, C), after ``past`` (batch, history, C; None before
    the first step): its k taps times the kernel as one matrix product (a conv1d call for a single output costs
    far more on CPU), and the frames to keep. ``weight_t`` is the kernel viewed as (in * k, out), so the taps
    are gathered channel-major, tap-minor, as the kernel lies in memory."""
    if past is None:
        past = x.new_zeros(x.size(0), history, x.size(1))
    frames = torch.cat([past, x.unsqueeze(1)], dim=1)
    taps = frames[:, ::dilation].transpose(1, 2).reshape(x.size(0), -1)
    return torch.addmm(bias, taps, weight_t), frames[:, 1:]


def _norm(module: nn.LayerNorm, x: Tensor) -> Tensor:
    """``module(x)`` without the module call (the multi-frame steps' layer norms; the one-frame step takes its
    arguments from ``frame_arguments``)."""
    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


def _linear(module: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, module.weight, module.bias)


# The frame steps (one new frame a row, the decoding step) take their parameters as built once per decode
# by these, so that a step makes the arithmetic's calls and little else: no module calls, no attribute
# lookups, no transposes. Views, not copies: they follow the parameters' in-place updates.
def _norm_arguments(module: nn.LayerNorm) -> tuple:
    """``torch.layer_norm(x, *arguments)`` == ``module(x)``."""
    return module.normalized_shape, module.weight, module.bias, module.eps


def _linear_arguments(module: nn.Linear) -> tuple:
    """``torch.addmm(*arguments[:1], x, *arguments[1:])``, i.e. ``addmm(bias, x, weight_t)`` == ``module(x)``
    on rows x (batch, in)."""
    return module.bias, module.weight.t()


def _conv_arguments(conv: DilatedConv1d) -> tuple:
    """``_conv_frame(x, past, *arguments)``."""
    weight = conv.conv.weight
    return conv.dilation, conv.history, weight.view(weight.size(0), -1).t(), conv.conv.bias


def _step_dropout(dropout: FairseqDropout, x: Tensor) -> Tensor:
    return dropout(x) if dropout.p > 0 and (dropout.training or dropout.apply_during_inference) else x


class ReLUBlock(nn.Module):
    """Fig. 3 (left): LN, ReLU, 1x1 (C -> h), LN, ReLU, dilated 1xk (h -> h), LN, ReLU, 1x1 (h -> C), residual."""

    convolutions_per_block = 1

    def __init__(self, channels, hidden, kernel_size, dilation, masked, dropout):
        super().__init__()
        self.norm_in, self.norm_mid, self.norm_out = nn.LayerNorm(channels), nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.reduce = nn.Linear(channels, hidden)  # a 1x1 convolution
        self.conv = DilatedConv1d(hidden, hidden, kernel_size, dilation, masked)
        self.expand = nn.Linear(hidden, channels)
        self.dropout = FairseqDropout(dropout, module_name=self.__class__.__name__)

    def forward(self, x, keep: Optional[Tensor] = None):
        h = self.reduce(F.relu(self.norm_in(x)))
        h = _zero_outside(F.relu(self.norm_mid(h)), keep)
        h = self.conv(h)
        h = self.expand(F.relu(self.norm_out(h)))
        return x + self.dropout(h)

    def step(self, x: Tensor, pasts: List[Optional[Tensor]]) -> Tuple[Tensor, List[Tensor]]:
        """``forward`` on new frames after the cached ones, operation for operation (so it gives the same
        numbers); ``pasts`` holds the convolution's kept frames."""
        h = _linear(self.reduce, F.relu(_norm(self.norm_in, x)))
        h, kept = self.conv.step(F.relu(_norm(self.norm_mid, h)), pasts[0])
        h = _linear(self.expand, F.relu(_norm(self.norm_out, h)))
        return x + _step_dropout(self.dropout, h), [kept]

    def frame_arguments(self) -> tuple:
        return (_norm_arguments(self.norm_in), _linear_arguments(self.reduce), _norm_arguments(self.norm_mid),
                _conv_arguments(self.conv), _norm_arguments(self.norm_out), _linear_arguments(self.expand))

    def frame_step(self, x: Tensor, pasts: List[Optional[Tensor]], arguments: tuple) -> Tuple[Tensor, List[Tensor]]:
        """``step`` on one new frame a row, x (batch, C), with ``frame_arguments()``: the same arithmetic in
        a dozen calls."""
        norm_in, reduce, norm_mid, conv, norm_out, expand = arguments
        h = torch.addmm(reduce[0], torch.layer_norm(x, *norm_in).relu_(), reduce[1])
        h, kept = _conv_frame(torch.layer_norm(h, *norm_mid).relu_(), pasts[0], *conv)
        h = torch.addmm(expand[0], torch.layer_norm(h, *norm_out).relu_(), expand[1])
        return _step_dropout(self.dropout, h).add_(x), [kept]


class MultiplicativeUnit(nn.Module):
    """MU(h) = g1 * tanh(g2 * h + g3 * u), gates g = sigmoid(conv h), u = tanh(conv h): four dilated 1xk convs."""

    def __init__(self, channels, kernel_size, dilation, masked):
        super().__init__()
        self.conv = DilatedConv1d(channels, 4 * channels, kernel_size, dilation, masked)

    def forward(self, h):
        return self._gate(h, self.conv(h))

    def step(self, h: Tensor, past: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        out, kept = self.conv.step(h, past)
        return self._gate(h, out), kept

    @staticmethod
    def _gate(h: Tensor, out: Tensor) -> Tensor:
        """The three gates' sigmoids in one call (elementwise: the same numbers as three)."""
        gates, u = out.split([3 * h.size(-1), h.size(-1)], dim=-1)
        g1, g2, g3 = torch.sigmoid(gates).chunk(3, dim=-1)
        return g1 * torch.tanh(g2 * h + g3 * torch.tanh(u))

    @staticmethod
    def frame_step(h: Tensor, past: Optional[Tensor], conv: tuple) -> Tuple[Tensor, Tensor]:
        """``step`` on one new frame a row, h (batch, C), with the convolution's ``_conv_arguments``."""
        out, kept = _conv_frame(h, past, *conv)
        return MultiplicativeUnit._gate(h, out), kept


class MultiplicativeBlock(nn.Module):
    """Fig. 3 (right): LN, 1x1 (C -> h), LN, MU, LN, MU, LN, 1x1 (h -> C), residual."""

    convolutions_per_block = 2

    def __init__(self, channels, hidden, kernel_size, dilation, masked, dropout):
        super().__init__()
        self.norm_in = nn.LayerNorm(channels)
        self.reduce = nn.Linear(channels, hidden)
        self.norm_mu1, self.norm_mu2, self.norm_out = nn.LayerNorm(hidden), nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.mu1 = MultiplicativeUnit(hidden, kernel_size, dilation, masked)
        self.mu2 = MultiplicativeUnit(hidden, kernel_size, dilation, masked)
        self.expand = nn.Linear(hidden, channels)
        self.dropout = FairseqDropout(dropout, module_name=self.__class__.__name__)

    def forward(self, x, keep: Optional[Tensor] = None):
        h = self.reduce(self.norm_in(x))
        h = self.mu1(_zero_outside(self.norm_mu1(h), keep))
        h = self.mu2(_zero_outside(self.norm_mu2(h), keep))
        h = self.expand(self.norm_out(h))
        return x + self.dropout(h)

    def step(self, x: Tensor, pasts: List[Optional[Tensor]]) -> Tuple[Tensor, List[Tensor]]:
        """``forward`` on new frames after the cached ones (see ReLUBlock.step)."""
        h = _linear(self.reduce, _norm(self.norm_in, x))
        h, kept1 = self.mu1.step(_norm(self.norm_mu1, h), pasts[0])
        h, kept2 = self.mu2.step(_norm(self.norm_mu2, h), pasts[1])
        h = _linear(self.expand, _norm(self.norm_out, h))
        return x + _step_dropout(self.dropout, h), [kept1, kept2]

    def frame_arguments(self) -> tuple:
        return (_norm_arguments(self.norm_in), _linear_arguments(self.reduce),
                _norm_arguments(self.norm_mu1), _conv_arguments(self.mu1.conv),
                _norm_arguments(self.norm_mu2), _conv_arguments(self.mu2.conv),
                _norm_arguments(self.norm_out), _linear_arguments(self.expand))

    def frame_step(self, x: Tensor, pasts: List[Optional[Tensor]], arguments: tuple) -> Tuple[Tensor, List[Tensor]]:
        """``step`` on one new frame a row, x (batch, C), with ``frame_arguments()`` (see ReLUBlock.frame_step)."""
        norm_in, reduce, norm_mu1, mu1, norm_mu2, mu2, norm_out, expand = arguments
        h = torch.addmm(reduce[0], torch.layer_norm(x, *norm_in), reduce[1])
        h, kept1 = MultiplicativeUnit.frame_step(torch.layer_norm(h, *norm_mu1), pasts[0], mu1)
        h, kept2 = MultiplicativeUnit.frame_step(torch.layer_norm(h, *norm_mu2), pasts[1], mu2)
        h = torch.addmm(expand[0], torch.layer_norm(h, *norm_out), expand[1])
        return _step_dropout(self.dropout, h).add_(x), [kept1, kept2]


BLOCK_TYPES = {"relu": ReLUBlock, "multiplicative": MultiplicativeBlock}


def keeps_every_row(order: Tensor, rows: int) -> bool:
    """Whether a generator's reordering of ``rows`` rows keeps each in place (greedy decoding of one sentence,
    a beam that kept its hypotheses where they were). Checked on the CPU only: on a device the check would
    cost a synchronisation, more than the reordering it saves."""
    return (
        order.device.type == "cpu" and order.numel() == rows
        and bool(torch.equal(order, torch.arange(rows, dtype=order.dtype)))
    )


def _zero_outside(h: Tensor, keep: Optional[Tensor]) -> Tensor:
    """Zero the frames past each sequence's end, so a convolution sees exactly what it would unbatched."""
    return h if keep is None else h * keep.unsqueeze(-1).type_as(h)


def parse_dilations(text: str, flag: str) -> List[int]:
    try:
        dilations = [int(value) for value in str(text).split(",") if value.strip()]
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,2,4,8,16") from None
    if not dilations or min(dilations) < 1:
        raise InputError(f"{flag} {text!r}: expected one or more positive integers")
    return dilations


@with_incremental_state
class DilatedStack(nn.Module):
    """``blocks`` residual blocks whose dilations cycle through ``dilations`` (the paper's sets of five)."""

    # The one-frame decoding step of a stack of ReLU blocks runs as one native call (kernels/native/bytenet_step.c) where it
    # can: float32 parameters on the CPU, no gradient, no dropout, the kernels built, at most NATIVE_MAX_ROWS
    # rows. False: the torch frame steps always (``--bytenet-decoding cached-torch``, to time one against the
    # other).
    native_frame_steps = True
    # The native products read each weight once per 4 rows; above this many rows (a batch of beams) torch's
    # blocked ones read it fewer times and win.
    NATIVE_MAX_ROWS = 12

    def __init__(self, channels, hidden, blocks, dilations, kernel_size, block_type, masked, dropout, layerdrop=0.0):
        super().__init__()
        self.layerdrop = layerdrop
        if block_type not in BLOCK_TYPES:
            raise InputError(f"block type {block_type!r}: expected one of {sorted(BLOCK_TYPES)}")
        block_class = BLOCK_TYPES[block_type]
        self.block_dilations = [dilations[i % len(dilations)] for i in range(blocks)]
        self.kernel_size = kernel_size
        self.convolutions_per_block = block_class.convolutions_per_block
        self.blocks = nn.ModuleList(
            block_class(channels, hidden, kernel_size, dilation, masked, dropout) for dilation in self.block_dilations
        )
        self.final_norm = nn.LayerNorm(channels)
        # incremental_state keys of each block's convolutions' kept frames
        self.state_names = [[str(i * self.convolutions_per_block + j) for j in range(self.convolutions_per_block)]
                            for i in range(blocks)]

    def receptive_field(self) -> int:
        """Input frames one output frame depends on, itself included (all past ones when masked, centred if not)."""
        return 1 + (self.kernel_size - 1) * self.convolutions_per_block * sum(self.block_dilations)

    def forward(self, x, keep=None, incremental_state: Optional[IncrementalState] = None):
        """The whole sequence, or (with ``incremental_state``, masked stacks only) new frames after the cached
        ones. The cache is one entry for the whole stack, each convolution's last (k-1)r input frames."""
        if incremental_state is None:
            # LayerDrop (Fan et al. 2019): in training each residual block is skipped (left the identity) with
            # probability layerdrop; at inference every block runs.
            skipped = torch.rand(len(self.blocks)) < self.layerdrop if self.training and self.layerdrop > 0 else None
            for i, block in enumerate(self.blocks):
                if skipped is None or not skipped[i]:
                    x = block(x, keep)
            return self.final_norm(x)
        saved = self.get_incremental_state(incremental_state, "frames")
        if saved is None or not hasattr(self, "_frame_arguments"):
            # A new decode: the blocks' parameters as their frame steps take them (views, built once a decode
            # so that a changed model, e.g. converted to half precision, is always read afresh).
            self._frame_arguments = [block.frame_arguments() for block in self.blocks]
            self._native_stepper = self._native_stepper_for_this_decode()
        kept: Dict[str, Optional[Tensor]] = {}
        one_frame = x.size(1) == 1  # the decoding step: rows (batch, C), a dozen calls a block
        if (one_frame and self._native_stepper is not None and x.size(0) <= self.NATIVE_MAX_ROWS
                and not torch.is_grad_enabled()):
            # The whole stack in one call, on a copy of x (updated in place) and the kept frames (moved on by one
            # frame in place: they are this decode's own, a reorder makes new ones).
            x = x.squeeze(1).clone(memory_format=torch.contiguous_format)
            pasts = [saved[names[0]].contiguous() if saved is not None
                     else x.new_zeros(x.size(0), block.conv.history, block.conv.conv.in_channels)
                     for names, block in zip(self.state_names, self.blocks)]
            self._native_stepper(x, pasts)
            kept = {names[0]: past for names, past in zip(self.state_names, pasts)}
        else:
            if one_frame:
                x = x.squeeze(1)
            for names, block, arguments in zip(self.state_names, self.blocks, self._frame_arguments):
                pasts = [saved[name] for name in names] if saved is not None else [None] * len(names)
                x, frames = block.frame_step(x, pasts, arguments) if one_frame else block.step(x, pasts)
                kept.update(zip(names, frames))
        self.set_incremental_state(incremental_state, "frames", kept)
        x = torch.layer_norm(x, *_norm_arguments(self.final_norm))
        return x.unsqueeze(1) if one_frame else x

    def _native_stepper_for_this_decode(self) -> Optional["native.ReLUBlocksStepper"]:
        """The native one-frame step of this stack, where it can run (see ``native_frame_steps``), else None."""
        if not (self.native_frame_steps and all(type(block) is ReLUBlock for block in self.blocks)):
            return None
        if any(p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous()
               for p in self.blocks.parameters()):
            return None
        if any(block.dropout.p > 0 and (block.dropout.training or block.dropout.apply_during_inference)
               for block in self.blocks):
            return None
        return native.ReLUBlocksStepper(list(self.blocks)) if native.available() else None

    def _apply(self, fn, *args, **kwargs):
        # .half(), .to() or .cuda() give the parameters new tensors: drop the frame steps' views of the old ones,
        # which would keep the old copies alive until the next decode rebuilds them.
        self.__dict__.pop("_frame_arguments", None)
        self.__dict__.pop("_native_stepper", None)
        return super()._apply(fn, *args, **kwargs)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor) -> None:
        saved = self.get_incremental_state(incremental_state, "frames")
        if saved is not None and not keeps_every_row(new_order, next(iter(saved.values())).size(0)):
            self.set_incremental_state(
                incremental_state, "frames", {name: frames.index_select(0, new_order) for name, frames in saved.items()}
            )
