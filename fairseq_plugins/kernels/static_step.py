"""``StaticDecoderStep``: the fast step's decoder call with static shapes and no host synchronisation, so that one
step can be captured once (``torch.compile``, a CUDA graph) and replayed for every position.

``FastDecoderStep`` grows its caches and attends over the filled prefix only: every step has other shapes, and
its reordering asks the host whether the order is the identity. On a GPU at batch 1 a step of a small model is
then kernel launches and Python (issue 57). This step keeps one shape for a whole batch:

- caches preallocated to the length limit (rows, heads, max_len, head_dim), the step's position a tensor, and
  self-attention over all max_len slots with the slots not yet written masked out;
- the source's keys and values padded to a length bucket, its padding masked, so that batches of nearby
  lengths share a shape (``LENGTH_BUCKET``);
- finished sentences masked rather than removed: when fairseq's search drops rows, the step keeps its row
  count, the live rows first, and the dead ones ride along (computed, never returned);
- no ``.item()``, ``.tolist()``, ``.cpu()`` or Python branching on a tensor's value inside ``step_fn``.

It runs on ``FastDecoderStep``'s prepared weights (the same ``_Layer`` code), as plain ``F.linear`` products (the
CPU's native and oneDNN-packed products are calls a graph cannot hold), in the model's dtype: a model cast to
float16 or bfloat16 decodes with float16 or bfloat16 weights, caches and logits. Its logits are the fast step's,
hence fairseq's, to float rounding (tests/test_static_step.py). ``cuda_graphs``: each shape's step is captured
as a CUDA graph at its first call and replayed after (``--fast-step-cuda-graphs``).
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import attention
from .decoder_step import FastDecoderStep

# Cache and source lengths are rounded up to a multiple of this: batches of nearby lengths share one captured step.
LENGTH_BUCKET = 16
# The shapes whose buffers (and captured graphs) are kept; the least recently used beyond that is dropped.
MAX_SHAPES = 4
# Eager runs before a capture (CUDA's lazy initialisations, cuBLAS workspaces, must happen outside the graph).
WARMUP_RUNS = 2


def length_bucket(length: int) -> int:
    return -(-max(length, 1) // LENGTH_BUCKET) * LENGTH_BUCKET


def plain_product(matrix, x: Tensor) -> Tensor:
    """One of the engine's float matrices (``PackedLinear``) as ``F.linear``: capturable on every device."""
    return F.linear(x, matrix.weight, matrix.bias)


class _Buffers:
    """The static tensors of one shape (rows, cache length, source length): what a captured step reads and
    writes, at fixed addresses; each batch of that shape copies its own values in."""

    def __init__(self, engine: FastDecoderStep, rows: int, max_len: int, source_len: int):
        device, dtype = engine.embed_tokens.device, engine.embed_tokens.dtype
        self.keys = [torch.zeros(rows, layer.heads, max_len, layer.head_dim, device=device, dtype=dtype)
                     for layer in engine.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.cross_keys = [torch.zeros(rows, layer.heads, source_len, layer.head_dim, device=device, dtype=dtype)
                           for layer in engine.layers]
        self.cross_values = [torch.zeros_like(k) for k in self.cross_keys]
        self.source_attend = torch.zeros(rows, 1, 1, source_len, dtype=torch.bool, device=device)
        self.tokens = torch.full((rows,), engine.padding_idx, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        self.positions = self._position_table(engine, max_len)
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.logits: Optional[Tensor] = None  # the captured step's output

    @staticmethod
    def _position_table(engine: FastDecoderStep, max_len: int) -> Optional[Tensor]:
        """The decoder's position embeddings of slots 0 .. max_len - 1; slots past the decoder's last position
        (a bucket's rounding, never reached: fairseq's length limit is below it) are zeros."""
        table = engine._position_table(max_len)
        if table is None:
            return None
        table = table[:max_len]
        return F.pad(table, (0, 0, 0, max_len - table.size(0))).contiguous()


class StaticDecoderStep:
    """One position of every row a call, at shapes fixed for a batch, on ``engine``'s weights (fp32 engines:
    float matrices in the model's dtype).

    ``start(encoder_out, max_steps)`` takes fairseq's encoder output (one row per hypothesis) and the positions a
    row may take; ``step(tokens)`` the previous token of each live row and returns the logits of the next
    position (live rows, V), valid until the next step; ``reorder(order)`` keeps the rows ``order`` names (fewer
    rows: the others are masked, not removed). ``step_fn(tokens, position)`` is the static step itself (every
    row, the position a 0-d tensor): what ``torch.compile`` or a CUDA graph captures.
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
        self.live = 0  # rows fairseq still decodes: the first ``live`` rows of the buffers
        self.length = 0  # positions fed since start

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
        self.buffers, self.live, self.length = buffers, rows, 0

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
        rows = buffers.tokens.size(0)
        if kept > rows:
            raise ValueError(f"reorder to {kept} rows: the static step holds {rows} (its search may not widen)")
        if kept < rows:
            order = torch.cat([order, order.new_zeros(rows - kept)])
        caches = buffers.keys + buffers.values
        if kept != self.live:  # the rows now belong to other sentences (a permutation keeps each one's source)
            caches = caches + buffers.cross_keys + buffers.cross_values + [buffers.source_attend]
        for cache in caches:
            cache.copy_(cache.index_select(0, order))
        self.live = kept

    # ---- one step -----------------------------------------------------------------------------------------
    def step(self, tokens: Tensor) -> Tensor:
        """Logits (live rows, V) of the position after each live row's prefix, whose last token is ``tokens``."""
        buffers = self.buffers
        if self.length >= buffers.slots.numel():
            raise ValueError(f"the static step holds {buffers.slots.numel()} positions (start's max_steps)")
        buffers.tokens[:self.live].copy_(tokens)
        buffers.position.fill_(self.length)  # (a kernel, not a host read)
        if self.cuda_graphs:
            logits = self._replay(buffers)
        else:
            logits = self.step_fn(buffers.tokens, buffers.position)
        self.length += 1
        return logits[:self.live]

    def step_fn(self, tokens: Tensor, position: Tensor) -> Tensor:
        """The static step: every row's token (rows,) at ``position`` (a 0-d long tensor) -> logits (rows, V).
        Writes the caches' slot ``position``; attends over all slots, those after ``position`` masked."""
        engine, buffers = self.engine, self.buffers
        rows = tokens.size(0)
        x = engine.embed_scale * F.embedding(tokens, engine.embed_tokens)
        if engine.project_in is not None:
            x = plain_product(engine.project_in, x)
        slot = position.view(1)
        if buffers.positions is not None:
            x = x + buffers.positions.index_select(0, slot)
        if engine.embedding_norm is not None:
            x = engine.embedding_norm(x)
        written = (buffers.slots <= position).view(1, 1, 1, -1)
        for index, layer in enumerate(engine.layers):
            def self_attention(q, k, v, keys=buffers.keys[index], values=buffers.values[index],
                               scaling=layer.scaling):
                keys.index_copy_(2, slot, k)
                values.index_copy_(2, slot, v)
                return attention(q, keys, values, written, scaling)

            x = layer.forward(x, rows, 1, self_attention, buffers.cross_keys[index], buffers.cross_values[index],
                              buffers.source_attend, product=plain_product)
        if engine.final_norm is not None:
            x = engine.final_norm(x)
        if engine.project_out is not None:
            x = plain_product(engine.project_out, x)
        return F.linear(x, engine.output.weight, engine.output.bias)

    def _replay(self, buffers: _Buffers) -> Tensor:
        """The shape's step as a CUDA graph: captured at its first call (after eager warm-up runs, which only
        rewrite the current slot with the same values), replayed on the buffers' current values after."""
        if buffers.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.step_fn(buffers.tokens, buffers.position)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # (each graph its own memory pool: shapes replay in any order, which a shared pool does not allow)
            with torch.cuda.graph(graph):
                buffers.logits = self.step_fn(buffers.tokens, buffers.position)
            buffers.graph = graph
        buffers.graph.replay()
        return buffers.logits
