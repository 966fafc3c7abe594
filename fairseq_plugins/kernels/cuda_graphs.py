"""CUDA graphs of a call whose inputs live at fixed addresses: captured once (after warm-up runs), replayed after.

At batch 1 a small model's call on a GPU is kernel launches and Python (issue 57); a graph replays all of its
kernels in one launch. What is captured must never wait on the host (no ``.item()``, no shape that depends on
a value) and must read its inputs from the same tensors at every replay: ``capture`` takes the function and its
static inputs; ``CapturedCalls`` keeps a graph per input shape and copies each call's inputs into that graph's own.
``capturable_encoder_out`` is fairseq's transformer encoder as such a call (fairseq's own asks the host whether
a batch has padding).
"""

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

# Eager runs before a capture (CUDA's lazy initialisations, cuBLAS workspaces, must happen outside the graph).
WARMUP_RUNS = 2
# Lengths a captured call pads its inputs to are rounded up to a multiple of this: calls of nearby lengths share
# one graph (a capture costs a synchronisation, a collection of the caches and two warm-up runs).
LENGTH_BUCKET = 16


def length_bucket(length: int) -> int:
    return -(-max(length, 1) // LENGTH_BUCKET) * LENGTH_BUCKET


def capture(fn: Callable, *inputs):
    """``fn(*inputs)`` as a CUDA graph: warm-up runs on a side stream, then the capture. Returns the graph and
    the output it writes at every replay. (Each graph its own memory pool: graphs then replay in any order,
    which a shared pool does not allow.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn(*inputs)
    return graph, output


class CapturedCalls:
    """``fn`` over tensors, a CUDA graph per input shapes (the least recently used beyond ``max_graphs`` dropped):
    a call copies its inputs into the graph's static ones, replays it and returns its output, valid until the
    next call of that shape."""

    def __init__(self, fn: Callable, max_graphs: int = 16):
        self.fn = fn
        self.max_graphs = max_graphs
        self.graphs: "OrderedDict[Tuple, Tuple[torch.cuda.CUDAGraph, Tuple[Tensor, ...], object]]" = OrderedDict()
        self.captures = 0

    def __call__(self, *inputs: Tensor):
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
        entry = self.graphs.pop(key, None)
        if entry is None:
            static_inputs = tuple(t.clone() for t in inputs)
            graph, output = capture(self.fn, *static_inputs)
            entry = (graph, static_inputs, output)
            self.captures += 1
        else:
            for static, given in zip(entry[1], inputs):
                static.copy_(given)
        self.graphs[key] = entry  # the most recently used last
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        graph, _inputs, output = entry
        graph.replay()
        return output


def encoder_unsupported_reason(encoder: nn.Module) -> Optional[str]:
    """Why ``capturable_encoder_out`` cannot run ``encoder``, or None: it runs fairseq's transformer encoder as
    it is."""
    from fairseq.models.transformer import TransformerEncoderBase
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

    if not isinstance(encoder, TransformerEncoderBase) or (
            type(encoder).forward_scriptable is not TransformerEncoderBase.forward_scriptable):
        return f"{type(encoder).__name__} is not fairseq's transformer encoder"
    for index, layer in enumerate(encoder.layers):
        if type(layer).forward is not TransformerEncoderLayerBase.forward or getattr(layer, "return_fc", False):
            return f"encoder layer {index} ({type(layer).__name__}) is not a plain fairseq transformer encoder layer"
    return None


def capturable_encoder_out(encoder: nn.Module, src_tokens: Tensor) -> Dict[str, List[Tensor]]:
    """fairseq's ``TransformerEncoderBase.forward_scriptable`` (in evaluation mode) without its host read: the
    padding mask goes to every layer whether or not the batch has padding (an all-False mask changes nothing but
    the code path), so no value decides what runs. The same dictionary, to float rounding."""
    padding = src_tokens.eq(encoder.padding_idx)
    x, embedding = encoder.forward_embedding(src_tokens)
    x = (x * (1 - padding.unsqueeze(-1).type_as(x))).transpose(0, 1)  # (source, batch, dim)
    for layer in encoder.layers:
        x = layer(x, encoder_padding_mask=padding)
    if encoder.layer_norm is not None:
        x = encoder.layer_norm(x)
    src_lengths = src_tokens.ne(encoder.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
    return {"encoder_out": [x], "encoder_padding_mask": [padding], "encoder_embedding": [embedding],
            "encoder_states": [], "fc_results": [], "src_tokens": [], "src_lengths": [src_lengths]}
