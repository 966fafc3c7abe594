"""``StaticDecoderStep``: the fast step's decoder call with static shapes and no host synchronisation, so that one
call can be captured once (``torch.compile``, a CUDA graph) and replayed for every position.

``FastDecoderStep`` grows its caches and attends over the filled prefix only: every step has other shapes, and
its reordering asks the host whether the order is the identity. On a GPU at batch 1 a step of a small model is
then kernel launches and Python (issue 57). This step keeps one shape for a whole batch:

- caches preallocated to the length limit (rows, heads, max_len, head_dim), each row's prefix length a tensor
  (``lengths``), and self-attention over all max_len slots with the slots after a row's prefix masked out;
- the source's keys and values padded to a length bucket, its padding masked, so that batches of nearby
  lengths share a shape (``cuda_graphs.LENGTH_BUCKET``);
- finished sentences masked rather than removed: when the search drops rows, the step keeps its row count, the
  live rows first, and the dead ones ride along (computed, never returned);
- no ``.item()``, ``.tolist()``, ``.cpu()`` or Python branching on a tensor's value inside ``group_fn``.

One call feeds m positions a row (``group_fn``): one (``step``: fairseq's search, token by token), a causal
block (``block_step``: blockwise decoding's verification, each row then keeping its own number of them,
``keep_block``), or a pair that sees itself whole (``group_step(causal=False)``: a double-token step). A row's
prefix is always its first ``lengths[r]`` slots: a position a row did not keep is written over by its next call.

It runs on ``FastDecoderStep``'s prepared weights (the same ``_Layer`` code), as plain ``F.linear`` products (the
CPU's native and oneDNN-packed products are calls a graph cannot hold), in the model's dtype: a model cast to
float16 or bfloat16 decodes with float16 or bfloat16 weights, caches and logits. Its outputs are the fast step's,
hence fairseq's, to float rounding (tests/test_static_step.py). ``cuda_graphs``: each (shape, group, causal,
output) call is captured as a CUDA graph at its first use and replayed after (``--fast-step-cuda-graphs``).
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import attention
from .cuda_graphs import capture, length_bucket
from .decoder_step import FastDecoderStep

# The shapes whose buffers (and captured graphs) are kept; the least recently used beyond that is dropped.
MAX_SHAPES = 4


def plain_product(matrix, x: Tensor) -> Tensor:
    """One of the engine's float matrices (``PackedLinear``) as ``F.linear``: capturable on every device."""
    return F.linear(x, matrix.weight, matrix.bias)


class _Buffers:
    """The static tensors of one shape (rows, cache length, source length): what a captured call reads and
    writes, at fixed addresses; each batch of that shape copies its own values in."""

    def __init__(self, engine: FastDecoderStep, rows: int, max_len: int, source_len: int):
        device, dtype = engine.embed_tokens.device, engine.embed_tokens.dtype
        self.rows = rows
        self.keys = [torch.zeros(rows, layer.heads, max_len, layer.head_dim, device=device, dtype=dtype)
                     for layer in engine.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.cross_keys = [torch.zeros(rows, layer.heads, source_len, layer.head_dim, device=device, dtype=dtype)
                           for layer in engine.layers]
        self.cross_values = [torch.zeros_like(k) for k in self.cross_keys]
        self.source_attend = torch.zeros(rows, 1, 1, source_len, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # each row's prefix: its first slots
        self.block_start = torch.zeros_like(self.lengths)  # the prefixes before the last call
        self.slots = torch.arange(max_len, device=device)
        self.positions = self._position_table(engine, max_len)
        self.padding_idx = engine.padding_idx
        self.tokens: Dict[int, Tensor] = {}  # group size -> (rows, m): a call's input
        # (group size, causal, logits) -> (its CUDA graph, the output it writes)
        self.graphs: Dict[Tuple[int, bool, bool], Tuple["torch.cuda.CUDAGraph", Tensor]] = {}

    def tokens_of(self, group: int) -> Tensor:
        if group not in self.tokens:
            self.tokens[group] = torch.full((self.rows, group), self.padding_idx, dtype=torch.long,
                                            device=self.lengths.device)
        return self.tokens[group]

    @staticmethod
    def _position_table(engine: FastDecoderStep, max_len: int) -> Optional[Tensor]:
        """The decoder's position embeddings of slots 0 .. max_len - 1; slots past the decoder's last position
        (a bucket's rounding, or a block run past the length limit) get that last one, as the engine clamps."""
        table = engine._position_table(min(max_len, engine.max_positions))
        if table is None:
            return None
        table = table[:max_len]
        return table[torch.arange(max_len, device=table.device).clamp(max=table.size(0) - 1)].contiguous()


class StaticDecoderStep:
    """Some positions of every row a call, at shapes fixed for a batch, on ``engine``'s weights (fp32 engines:
    float matrices in the model's dtype); the engine's interface (``start``, ``group_step``, ``block_step``,
    ``keep_block``, ``truncate``, ``reorder``, ``logits``), but ``step`` returns the logits.

    ``start(encoder_out, max_steps)`` takes fairseq's encoder output (one row per hypothesis) and the positions a
    row may take; ``step(tokens)`` the previous token of each live row and returns the logits of the next
    position (live rows, V), valid until the next call; ``reorder(order)`` keeps the rows ``order`` names (fewer
    rows: the others are masked, not removed). ``group_fn(tokens, lengths, causal, logits)`` is the static call
    itself (every row): what ``torch.compile`` or a CUDA graph captures.
    """

    def __init__(self, engine: FastDecoderStep, cuda_graphs: bool = False):
        if engine.precision != "fp32":
            raise ValueError(f"the static decoder step runs float matrices (the model's float32, float16 or "
                             f"bfloat16), not {engine.precision} (the int8 kernels run on the CPU)")
        device = engine.embed_tokens.device
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {device}")
        self.engine = engine
        self.cuda_graphs = cuda_graphs
        self.shapes: Dict[Tuple[int, int, int], _Buffers] = {}
        self.buffers: Optional[_Buffers] = None
        self.live = 0  # rows the search still decodes: the first ``live`` rows of the buffers
        self.length = 0  # the longest row's prefix, as the host knows it
        self.call_start = 0  # ``length`` before the last call (what keep_block's ``start`` names)

    @property
    def rows(self) -> int:
        return self.live

    # ---- per batch ----------------------------------------------------------------------------------------
    def start(self, encoder_out: Dict[str, List[Tensor]], max_steps: int) -> None:
        """Cross-attention keys/values of every row's source in the shape's buffers, empty caches for
        ``max_steps`` positions."""
        memory = encoder_out["encoder_out"][0]  # (source length, rows, d)
        padding = encoder_out["encoder_padding_mask"][0] if encoder_out["encoder_padding_mask"] else None
        source_len, rows = memory.shape[:2]
        buffers = self._buffers((rows, length_bucket(max_steps), length_bucket(source_len)))
        for layer, cross_keys, cross_values in zip(self.engine.layers, buffers.cross_keys, buffers.cross_values):
            shape = (source_len, rows, layer.heads, layer.head_dim)
            # (rows, heads, source length, head_dim); the bucket's slots past the source are masked out (finite:
            # zeros, or what an earlier batch of the shape left there)
            cross_keys[:, :, :source_len].copy_(plain_product(layer.cross_k, memory).view(shape).permute(1, 2, 0, 3))
            cross_values[:, :, :source_len].copy_(plain_product(layer.cross_v, memory).view(shape).permute(1, 2, 0, 3))
        buffers.source_attend.zero_()
        if padding is None:
            buffers.source_attend[..., :source_len] = True
        else:
            buffers.source_attend[..., :source_len].copy_((~padding)[:, None, None, :])
        for cache in buffers.keys + buffers.values:
            cache.zero_()  # (zeros, not garbage: a masked slot's value still meets a zero weight, and 0 * NaN is NaN)
        buffers.lengths.zero_()
        buffers.block_start.zero_()
        self.buffers, self.live, self.length, self.call_start = buffers, rows, 0, 0

    def _buffers(self, shape: Tuple[int, int, int]) -> _Buffers:
        buffers = self.shapes.pop(shape, None)
        if buffers is None:
            buffers = _Buffers(self.engine, *shape)
        self.shapes[shape] = buffers  # the most recently used last
        while len(self.shapes) > MAX_SHAPES:
            del self.shapes[next(iter(self.shapes))]
        return buffers

    def reorder(self, order: Tensor) -> None:
        """Keep rows ``order`` (fairseq's reorder_incremental_state: beam reordering, or finished sentences
        leaving). The buffers keep their rows: the kept ones first, the rest copies of row 0 whose outputs are
        never returned. No identity check (that would ask the host): every call copies."""
        buffers, kept = self.buffers, order.numel()
        rows = buffers.rows
        if kept > rows:
            raise ValueError(f"reorder to {kept} rows: the static step holds {rows} (its search may not widen)")
        if kept < rows:
            order = torch.cat([order, order.new_zeros(rows - kept)])
        kept_tensors = buffers.keys + buffers.values + [buffers.lengths, buffers.block_start]
        if kept != self.live:  # the rows now belong to other sentences (a permutation keeps each one's source)
            kept_tensors = kept_tensors + buffers.cross_keys + buffers.cross_values + [buffers.source_attend]
        for tensor in kept_tensors:
            tensor.copy_(tensor.index_select(0, order))
        self.live = kept

    # ---- one call -----------------------------------------------------------------------------------------
    def step(self, tokens: Tensor) -> Tensor:
        """Logits (live rows, V) of the position after each live row's prefix, whose last token is ``tokens``."""
        return self.group_step(tokens.view(-1, 1), logits=True)

    def block_step(self, tokens: Tensor) -> Tensor:
        """As ``FastDecoderStep.block_step``: a causal block (rows, m) a row -> features (rows * m, d)."""
        return self.group_step(tokens.view(self.live, -1), causal=True)

    def group_step(self, tokens: Tensor, causal: bool = True, logits: bool = False) -> Tensor:
        """tokens (live rows, m): each row's next m tokens, after its own prefix, causal among themselves or each
        seeing all m; every row's prefix grows by m. Returns their features (rows * m, d) row-major, as
        ``FastDecoderStep.group_step``, or (``logits``) the output layer's logits (rows * m, V)."""
        buffers = self.buffers
        m = tokens.size(1)
        if tokens.size(0) != self.live:
            raise ValueError(f"{tokens.size(0)} rows of tokens for the static step's {self.live} live rows")
        if self.length + m > buffers.slots.numel():
            raise ValueError(f"the static step holds {buffers.slots.numel()} positions (start's max_steps)")
        buffers.tokens_of(m)[:self.live].copy_(tokens)
        buffers.block_start.copy_(buffers.lengths)
        if self.cuda_graphs:
            output = self._replay(buffers, m, causal, logits)
        else:
            output = self.group_fn(buffers.tokens_of(m), buffers.lengths, causal, logits)
        buffers.lengths.add_(m)  # (outside the captured call: its warm-up runs must not move the prefixes)
        self.call_start = self.length
        self.length += m
        return output.view(buffers.rows, m, -1)[:self.live].reshape(self.live * m, -1)

    def keep_block(self, start: int, accepted: Tensor) -> None:
        """Of the m positions the last call fed, live row r keeps the first ``accepted[r]`` (live rows,); ``start``
        is the host's ``length`` before that call. The host's ``length`` becomes the longest prefix (one read, as
        the engine's keep_block makes; the rows' rejected slots are written over, not kept, so the caches never
        need more than the longest prefix and a block)."""
        fed = self.length - self.call_start
        if start != self.call_start or accepted.numel() != self.live or not bool(
                ((accepted >= 0) & (accepted <= fed)).all()):
            raise ValueError(f"keep_block({start}, {accepted.tolist()}): the last call fed {fed} positions after "
                             f"{self.call_start}, to {self.live} live rows")
        buffers = self.buffers
        buffers.lengths[:self.live] = buffers.block_start[:self.live] + accepted
        self.length = int(buffers.lengths[:self.live].max())

    def truncate(self, length: int) -> None:
        """Every row's prefix becomes its first ``length`` positions (each row must hold them: a row's slots past
        its prefix are not its own)."""
        prefixes = self.buffers.lengths[:self.live]
        if not 0 <= length <= int(prefixes.min()):
            raise ValueError(f"truncate to {length}: the rows' prefixes hold {prefixes.tolist()} positions")
        self.buffers.lengths.fill_(length)
        self.length = self.call_start = length

    def logits(self, features: Tensor) -> Tensor:
        """The output layer (rows, d) -> (rows, V), as the static call's ``logits``."""
        return F.linear(features, self.engine.output.weight, self.engine.output.bias)

    def group_fn(self, tokens: Tensor, lengths: Tensor, causal: bool, logits: bool) -> Tensor:
        """The static call: every row's tokens (rows, m) after its prefix of ``lengths`` (rows,) slots ->
        features (rows * m, d), or logits (rows * m, V). Writes each row's slots lengths .. lengths + m - 1; a
        position attends over the slots before it (``causal``) or before the group's end."""
        engine, buffers = self.engine, self.buffers
        rows, m = tokens.shape
        max_len = buffers.slots.numel()
        # (rows, m): the slot, hence the position, of each new token (a masked row past the end writes the last)
        slots = (lengths.unsqueeze(1) + buffers.slots[:m]).clamp(max=max_len - 1)
        x = engine.embed_scale * F.embedding(tokens.reshape(-1), engine.embed_tokens)
        if engine.project_in is not None:
            x = plain_product(engine.project_in, x)
        if buffers.positions is not None:
            x = x + buffers.positions.index_select(0, slots.reshape(-1))
        if engine.embedding_norm is not None:
            x = engine.embedding_norm(x)
        # (rows, 1, m, max_len): a query sees its row's prefix and the group up to itself (or all of it)
        ends = slots + 1 if causal else (lengths + m).unsqueeze(1).expand(rows, m)
        attend = (buffers.slots.view(1, 1, 1, -1) < ends.view(rows, 1, m, 1))
        for index, layer in enumerate(engine.layers):
            where = slots.view(rows, 1, m, 1).expand(rows, layer.heads, m, layer.head_dim)

            def self_attention(q, k, v, keys=buffers.keys[index], values=buffers.values[index],
                               scaling=layer.scaling, where=where):
                keys.scatter_(2, where, k)
                values.scatter_(2, where, v)
                return attention(q, keys, values, attend, scaling)

            x = layer.forward(x, rows, m, self_attention, buffers.cross_keys[index], buffers.cross_values[index],
                              buffers.source_attend, product=plain_product)
        if engine.final_norm is not None:
            x = engine.final_norm(x)
        if engine.project_out is not None:
            x = plain_product(engine.project_out, x)
        return self.logits(x) if logits else x

    def _replay(self, buffers: _Buffers, m: int, causal: bool, logits: bool) -> Tensor:
        """The call as a CUDA graph: captured at its first use (after eager warm-up runs, which only rewrite the
        new slots with the same values), replayed on the buffers' current values after."""
        key = (m, causal, logits)
        if key not in buffers.graphs:
            buffers.graphs[key] = capture(self.group_fn, buffers.tokens_of(m), buffers.lengths, causal, logits)
        graph, output = buffers.graphs[key]
        graph.replay()
        return output
