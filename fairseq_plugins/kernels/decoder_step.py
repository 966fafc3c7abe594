"""``FastDecoderStep``: one incremental step of a fairseq ``TransformerDecoder`` without fairseq's per-step work.

fairseq's incremental decoder re-derives at every step what does not change: positions from the token
history, the cross-attention keys and values of the source (looked up from a dictionary of dictionaries), the
q, k and v projections as three matmuls, the caches grown by ``torch.cat`` and reordered in full. At batch 1 a
step is bound by reading the weights, so the engine reads each weight once a step and does nothing else:

- a static position table, computed once from the decoder's own positional embedding module;
- self-attention keys and values in preallocated caches (rows, heads, length, head_dim), written in place and
  reordered by index over the filled positions only;
- the fused q/k/v projection of self-attention (one weight pass instead of three), and attention as two
  matmuls and a softmax over the filled positions (``kernels.attention``: faster than
  ``scaled_dot_product_attention`` on a beam's many small problems, and fairseq's own arithmetic);
- the cross-attention keys and values projected once a sentence; reordered only when the rows change
  sentences (a beam's hypotheses share their sentence's source);
- optionally int8 weights with per-row activation scales (``kernels.int8``: a row's result does not
  depend on the batch); on the native kernels each layer runs as one call (``fp_decoder_layer_step``,
  native/layer_step.c: the ~30 small torch operations of a layer cost more than its int8 arithmetic).

The arithmetic of a row is fairseq's (the same operations; the fused projection, the attention kernel and
the preallocated caches change the memory layout and the summation order only), so float32 logits agree
with fairseq's to float rounding (1e-5 on the baseline); ``unsupported_reason`` names every decoder feature the engine does not implement, and the engine
refuses such a decoder rather than compute something else.
"""

import copy
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native
from .attention import attention
from .int8 import Int8Matrix, int8_encoder
from .output_layer import OutputLayer
from .packed_linear import PackedLinear
from .precision import linear_of


# The native layer's float32 products are the faster ones at a few rows; from about a dozen rows on (a beam of
# pairs, a batch), oneDNN's pre-packed products in the torch operations are (measured here, one thread:
# 20 rows x the 768 x 256 q/k/v matrix 170 us native, 53 us packed; 4 rows 19 us and 22 us).
NATIVE_FLOAT_MAX_ROWS = 12


def unsupported_reason(decoder: nn.Module, features_only: bool = False) -> Optional[str]:
    """Why the engine cannot run ``decoder`` exactly, or None when it can. ``features_only``: the caller makes
    the outputs from the decoder features itself (a method's own heads), so the decoder may override
    ``forward`` and ``output_layer``."""
    from fairseq.models.transformer import TransformerDecoderBase
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    name = type(decoder).__name__
    if not isinstance(decoder, TransformerDecoderBase):
        return f"{name} is not a fairseq TransformerDecoder"
    for method in ("extract_features_scriptable",) + (() if features_only else ("forward", "output_layer")):
        if getattr(type(decoder), method) is not getattr(TransformerDecoderBase, method):
            return f"{name} overrides TransformerDecoder.{method} (a decoder layout the engine does not know)"
    if decoder.adaptive_softmax is not None:
        return "an adaptive softmax output layer"
    if not isinstance(decoder.output_projection, nn.Linear):
        return "an output projection that is not a Linear layer"
    if decoder.cross_self_attention:
        return "--cross-self-attention"
    for index, layer in enumerate(decoder.layers):
        where = f"decoder layer {index}"
        if type(layer).forward is not TransformerDecoderLayerBase.forward:
            return f"{where}: {type(layer).__name__} overrides the transformer decoder layer's forward"
        if layer.encoder_attn is None:
            return f"{where}: no encoder attention (--no-encoder-attn)"
        if any(getattr(layer, part, None) is not None for part in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid")):
            return f"{where}: NormFormer scaling (--scale-attn/--scale-heads/--scale-fc/--scale-resids)"
        for attention_name in ("self_attn", "encoder_attn"):
            attention = getattr(layer, attention_name)
            if attention.bias_k is not None or attention.add_zero_attn:
                return f"{where}: {attention_name} with --add-bias-kv or --add-zero-attn"
            if not attention.qkv_same_dim:
                return f"{where}: {attention_name} with key/value dimensions other than the model's"
            if getattr(attention, "rotary_pos_embed", False) or getattr(attention, "xformers_att_config", None):
                return f"{where}: {attention_name} with rotary embeddings or xformers attention"
        if not isinstance(layer.fc1, nn.Linear) or not isinstance(layer.fc2, nn.Linear):
            return f"{where}: a feed-forward block that is not two Linear layers (quantization noise?)"
    return None


def native_matrix(matrix) -> Optional["native.Matrix"]:
    """The native kernels' struct of a ``linear_of`` product (its tensors stay the product's), or None where they
    cannot run it: float32 CPU weights only (a bfloat16/float16 model, or one on a GPU, runs as torch operations),
    int8 on the native backend."""
    if isinstance(matrix, PackedLinear) and matrix.weight.dtype == torch.float32 and matrix.weight.device.type == "cpu":
        return native.float_matrix(matrix.weight, matrix.bias)
    if isinstance(matrix, Int8Matrix) and matrix.backend == "native":
        return native.int8_matrix(matrix.values, matrix.scales, matrix.bias, matrix.dim, matrix.vnni)
    return None


def _layer_norm(module: Optional[nn.Module]) -> Optional[Callable[[Tensor], Tensor]]:
    if module is None:
        return None
    shape, weight, bias, eps = module.normalized_shape, module.weight.detach(), module.bias.detach(), module.eps
    return lambda x: F.layer_norm(x, shape, weight, bias, eps)


def _cat_linear(modules: List[nn.Linear]):
    weight = torch.cat([m.weight.detach() for m in modules])
    if all(m.bias is None for m in modules):
        return weight, None
    return weight, torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                              for m in modules])


class _Layer:
    """One decoder layer's weights as plain callables."""

    def __init__(self, layer, precision: str):
        attention = layer.self_attn
        self.heads, self.head_dim = attention.num_heads, attention.head_dim
        self.scaling = attention.scaling
        self.normalize_before = layer.normalize_before
        self.qkv = linear_of(*_cat_linear([attention.q_proj, attention.k_proj, attention.v_proj]), precision)
        self.self_out = linear_of(attention.out_proj.weight, attention.out_proj.bias, precision)
        self.self_norm = _layer_norm(layer.self_attn_layer_norm)
        cross = layer.encoder_attn
        self.cross_q = linear_of(cross.q_proj.weight, cross.q_proj.bias, precision)
        # Once a sentence over all source positions (at batch 1, 6 of the 18 products a sentence makes on
        # its source: int8 with int8, as the encoder's feed-forward matrices)
        self.cross_k = linear_of(cross.k_proj.weight, cross.k_proj.bias, precision)
        self.cross_v = linear_of(cross.v_proj.weight, cross.v_proj.bias, precision)
        self.cross_out = linear_of(cross.out_proj.weight, cross.out_proj.bias, precision)
        self.cross_norm = _layer_norm(layer.encoder_attn_layer_norm)
        self.fc1 = linear_of(layer.fc1.weight, layer.fc1.bias, precision)
        self.fc2 = linear_of(layer.fc2.weight, layer.fc2.bias, precision)
        self.activation = layer.activation_fn
        self.final_norm = _layer_norm(layer.final_layer_norm)
        self.native = self._native_layer(layer)

    def forward(self, x: Tensor, rows: int, group: int, self_attention: Callable[[Tensor, Tensor, Tensor], Tensor],
                cross_keys: Tensor, cross_values: Tensor, source_attend: Optional[Tensor],
                product: Callable[[Callable, Tensor], Tensor] = lambda matrix, x: matrix(x)) -> Tensor:
        """The layer as torch operations on x (rows * group, d). ``self_attention(q, k, v)`` (rows, heads, group,
        head_dim each) writes k and v to the caches and returns the context over them (the caller's cache
        layout: ``FastDecoderStep``'s filled prefix, ``StaticDecoderStep``'s whole length masked);
        ``product(matrix, x)`` runs one of the layer's matrices (a static step's plain ``F.linear``)."""
        heads, head_dim = self.heads, self.head_dim
        # self-attention over the prefix
        residual = x
        if self.normalize_before:
            x = self.self_norm(x)
        # (rows, heads, group, head_dim) each
        q, k, v = product(self.qkv, x).view(rows, group, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        context = self_attention(q, k, v)
        x = residual + product(self.self_out, context.transpose(1, 2).reshape(rows * group, heads * head_dim))
        if not self.normalize_before:
            x = self.self_norm(x)
        # attention over the source
        residual = x
        if self.normalize_before:
            x = self.cross_norm(x)
        q = product(self.cross_q, x).view(rows, group, heads, head_dim).transpose(1, 2)
        context = attention(q, cross_keys, cross_values, source_attend, self.scaling)
        x = residual + product(self.cross_out, context.transpose(1, 2).reshape(rows * group, heads * head_dim))
        if not self.normalize_before:
            x = self.cross_norm(x)
        # feed-forward
        residual = x
        if self.normalize_before:
            x = self.final_norm(x)
        x = residual + product(self.fc2, self.activation(product(self.fc1, x)))
        if not self.normalize_before:
            x = self.final_norm(x)
        return x

    def _native_layer(self, layer) -> Optional["native.DecoderLayer"]:
        """The whole layer as one call of the native kernels (``kernels/native``), where they implement it:
        float32 matrices, or int8 ones on the native backend; relu or gelu; affine layer norms."""
        from fairseq.modules import gelu

        matrices = {"qkv": self.qkv, "self_out": self.self_out, "cross_q": self.cross_q,
                    "cross_out": self.cross_out, "fc1": self.fc1, "fc2": self.fc2}
        norms = {"self_norm": layer.self_attn_layer_norm, "cross_norm": layer.encoder_attn_layer_norm,
                 "final_norm": layer.final_layer_norm}
        if not native.available() or self.activation not in (F.relu, gelu) or not all(
                isinstance(n, nn.LayerNorm) and n.weight is not None and n.bias is not None for n in norms.values()):
            return None
        structs = {name: native_matrix(matrix) for name, matrix in matrices.items()}
        if any(struct is None for struct in structs.values()):
            return None
        # The kernel reads raw pointers: float32 copies of the norms, which a later model.to()/half() leaves alone
        self.native_norms = {name: nn.LayerNorm(norm.normalized_shape, eps=norm.eps) for name, norm in norms.items()}
        for name, norm in norms.items():
            self.native_norms[name].load_state_dict({key: value.detach().float().clone()
                                                     for key, value in norm.state_dict().items()})
        return native.decoder_layer(structs, self.native_norms, self.heads, self.head_dim, self.scaling,
                                    self.normalize_before, gelu=self.activation is gelu)


class FastDecoderStep:
    """Incremental decoding of ``decoder`` one position at a time for ``rows`` hypotheses.

    ``start(encoder_out)`` takes fairseq's encoder output (one row per hypothesis), ``step(tokens)`` the
    previous token of each row and returns the decoder features of the next position (rows, embed_dim),
    ``logits(features)`` the output layer, ``reorder(order)`` keeps the rows ``order`` names. ``group_step``
    feeds several positions a row at once (a double-token pair); ``block_step(tokens)`` feeds a causal block a
    row, ``keep_block(start, accepted)`` keeps a different number of each row's block (blockwise decoding's
    acceptance) and ``truncate(length)`` takes positions back from all rows alike.

    The prefix of every row is ``length`` cache slots. Once ``keep_block`` keeps different numbers per row, the
    rows' prefixes differ: the slots a row rejected stay in the cache, masked out of its attention
    (``key_valid``), and each row's positions count only the slots it kept (``row_lengths``), so a row sees
    exactly what it would see alone.
    ``features_only``: a decoder whose ``forward``/``output_layer`` add a method's own outputs (blockwise's
    proposal heads) is accepted; the caller builds those outputs from ``step``'s features.
    """

    def __init__(self, decoder: nn.Module, precision: str = "fp32", fused: bool = True, features_only: bool = False):
        reason = unsupported_reason(decoder, features_only)
        if reason is not None:
            raise ValueError(f"the fast decoder step does not support this model: {reason}")
        self.precision = precision
        self.padding_idx = decoder.padding_idx
        self.embed_tokens = decoder.embed_tokens.weight.detach()
        self.embed_scale = decoder.embed_scale
        self.project_in = None if decoder.project_in_dim is None else linear_of(
            decoder.project_in_dim.weight, decoder.project_in_dim.bias, precision)
        self.embed_positions = decoder.embed_positions
        self.positions = None
        self.embedding_norm = _layer_norm(decoder.layernorm_embedding)
        self.layers = [_Layer(layer, precision) for layer in decoder.layers]
        # Each layer in one call of the native kernels (``fused``; else the same layer as torch operations)
        self.native_layers = [layer.native for layer in self.layers] if fused else None
        if self.native_layers is not None and any(layer is None for layer in self.native_layers):
            self.native_layers = None
        self.layer_step = native.LayerStepper() if self.native_layers is not None else None
        self.final_norm = _layer_norm(decoder.layer_norm)
        self.project_out = None if decoder.project_out_dim is None else linear_of(
            decoder.project_out_dim.weight, decoder.project_out_dim.bias, precision)
        self.output = OutputLayer(decoder.output_projection.weight, decoder.output_projection.bias, precision)
        self.embed_dim = self.layers[0].heads * self.layers[0].head_dim
        self.max_positions = decoder.max_positions()
        self.rows = 0
        self.native_decoder = self._native_decoder(decoder)
        self.greedy_searcher = native.GreedySearcher() if self.native_decoder is not None else None
        self.beam_searcher = native.BeamSearcher() if self.native_decoder is not None else None
        self.blockwise_searcher = None  # (made on the first blockwise_search)

    def _native_decoder(self, decoder) -> Optional["native.Decoder"]:
        """The whole decoder for the one-call searches (native/search.c: ``greedy_search``, ``beam_search``), where
        its parts are native: every layer, float32 CPU embeddings, no projections around the layers, no embedding norm, and an output
        matrix of the native kernels (float32 CPU, or int8 on the native backend)."""
        if (self.native_layers is None or self.project_in is not None or self.project_out is not None
                or self.embedding_norm is not None or self.embed_tokens.dtype != torch.float32
                or self.embed_tokens.device.type != "cpu"):
            return None
        output = self.output
        if output.full_int8 is not None and output.full_int8.backend == "native":
            matrix = native.int8_matrix(output.full_int8.values, output.full_int8.scales, output.full_int8.bias,
                                        output.full_int8.dim, output.full_int8.vnni)
        elif output.full_fp32 is not None and output.weight.dtype == torch.float32:
            self.output_weight = output.weight.contiguous()
            self.output_bias = None if output.bias is None else output.bias.float().contiguous()
            matrix = native.float_matrix(self.output_weight, self.output_bias)
        else:
            return None
        self.embed_table = self.embed_tokens.contiguous()
        self.native_final_norm = None
        if decoder.layer_norm is not None:  # (a float32 copy, as the layers' norms)
            norm = decoder.layer_norm
            self.native_final_norm = nn.LayerNorm(norm.normalized_shape, eps=norm.eps)
            self.native_final_norm.load_state_dict({key: value.detach().float().clone()
                                                    for key, value in norm.state_dict().items()})
        return native.decoder(self.native_layers, self.embed_table, self.embed_scale, self.native_final_norm, matrix)

    def _native_positions(self, max_len: int):
        """The position table for a native search to max_len (None: the decoder has no positions), or False
        where the kernels cannot read it (not float32, not contiguous)."""
        table = self._position_table(max_len + 1)
        if table is not None and (table.dtype != torch.float32 or not table.is_contiguous()):
            return False
        return table

    def beam_search(self, beam: int, bos: int, eos: int, pad: int, unk: int, unk_penalty: float, min_len: int,
                    max_len: int):
        """The whole beam search (fairseq's) of the sentences ``start`` took (one row each), in one native call:
        each sentence's finished hypotheses [[(tokens, cumulative scores)]] in the order fairseq finalises them;
        None where the decoder is not all native or the beam is wider than the kernel's."""
        if (self.beam_searcher is None or self.rows < 1 or self.length != 0
                or not 1 <= beam <= native.MAX_NATIVE_BEAM):
            return None
        table = self._native_positions(max_len)
        if table is False:
            return None
        capacity = max_len + 2
        keys = [torch.empty(self.rows * beam, layer.heads, capacity, layer.head_dim) for layer in self.layers]
        values = [torch.empty_like(k) for k in keys]
        source_attend = None if self.source_attend is None else self.source_attend[:, 0, 0, :]
        return self.beam_searcher(self.native_decoder, table, keys, values, self.cross_keys, self.cross_values,
                                  source_attend, beam, bos, eos, pad, unk, unk_penalty, min_len, max_len)

    def greedy_search(self, bos: int, eos: int, pad: int, unk: int, unk_penalty: float, min_len: int,
                      max_len: int):
        """One sentence's whole greedy search in one native call, after ``start`` (one row, caches for more than
        max_len positions), with fairseq's rules at beam 1: (tokens, cumulative scores), the end token included;
        None where the decoder is not all native (``_native_decoder``: then step by step), or where the source has
        padding (a sentence padded alone: the kernel attends over every source position)."""
        if self.greedy_searcher is None or self.rows != 1 or self.length != 0 or self.capacity <= max_len \
                or self.source_attend is not None:
            return None
        table = self._native_positions(max_len)
        if table is False:
            return None
        return self.greedy_searcher(self.native_decoder, table, self.keys, self.values, self.cross_keys,
                                    self.cross_values, bos, eos, pad, unk, unk_penalty, min_len, max_len)

    def blockwise_search(self, heads: "native.ProposalHeads", bos: int, eos: int, pad: int, unk: int,
                         unk_penalty: float, min_len: int, max_len: int):
        """One sentence's whole blockwise decoding (exact acceptance, ``heads``: the proposal heads 2..k as
        ``native.proposal_heads``) in one native call, after ``start`` (one row, caches for more than max_len + k
        positions): (tokens, scores, (iterations, decoder passes)); None where the decoder is not all native."""
        block = 1 + heads.n_heads
        if (self.native_decoder is None or self.rows != 1 or self.length != 0
                or self.capacity <= max_len + block):
            return None
        table = self._native_positions(max_len + block)
        if table is False:
            return None
        if self.blockwise_searcher is None:
            self.blockwise_searcher = native.BlockwiseSearcher()
        source_attend = None if self.source_attend is None else self.source_attend.reshape(-1)
        return self.blockwise_searcher(self.native_decoder, heads, table, self.keys, self.values, self.cross_keys,
                                       self.cross_values, source_attend, bos, eos, pad, unk, unk_penalty, min_len,
                                       max_len)

    def sharing_weights(self) -> "FastDecoderStep":
        """A new engine on this one's prepared weights (packed, quantised, native structs: nothing is built
        again) with state of its own (caches, rows, candidate lists, kernel scratch), for another generator."""
        twin = copy.copy(self)
        twin.output = copy.copy(self.output)
        twin.output.prepare(None)
        twin.layer_step = native.LayerStepper() if self.native_layers is not None else None
        twin.greedy_searcher = native.GreedySearcher() if self.native_decoder is not None else None
        twin.beam_searcher = native.BeamSearcher() if self.native_decoder is not None else None
        twin.blockwise_searcher = None
        twin.rows = 0
        return twin

    # ---- positions ------------------------------------------------------------------------------------
    def _position_table(self, length: int) -> Optional[Tensor]:
        """Position embeddings of steps 0..length-1, from the decoder's own module (learned or sinusoidal):
        step t of an unpadded prefix has position padding_idx + 1 + t in both."""
        if self.embed_positions is None:
            return None
        if self.positions is None or self.positions.size(0) < length:
            length = min(max(length, 2 * (0 if self.positions is None else self.positions.size(0))),
                         self.max_positions)
            dummy = torch.full((1, length), self.padding_idx + 1, dtype=torch.long,
                               device=self.embed_tokens.device)
            with torch.no_grad():
                self.positions = self.embed_positions(dummy)[0].detach()
        return self.positions

    # ---- per batch --------------------------------------------------------------------------------------
    def start(self, encoder_out: Dict[str, List[Tensor]], max_steps: int = 64) -> None:
        """Cross-attention keys/values of every row's source, and empty self-attention caches."""
        memory = encoder_out["encoder_out"][0]  # (source length, rows, d)
        padding = encoder_out["encoder_padding_mask"][0] if encoder_out["encoder_padding_mask"] else None
        rows = memory.size(1)
        self.rows, self.length = rows, 0
        # None while every row's prefix is all ``length`` slots; else per row: the slots it kept (rows, capacity)
        # and their number (rows,)
        self.key_valid: Optional[Tensor] = None
        self.row_lengths: Optional[Tensor] = None
        # (rows, 1, 1, source length): True where the source is a token (fairseq masks out the padding)
        self.source_attend = None if padding is None or not bool(padding.any()) else (~padding)[:, None, None, :]
        self.cross_keys, self.cross_values = [], []
        for layer in self.layers:
            shape = (memory.size(0), rows, layer.heads, layer.head_dim)
            # (rows, heads, source length, head_dim)
            self.cross_keys.append(layer.cross_k(memory).view(shape).permute(1, 2, 0, 3).contiguous())
            self.cross_values.append(layer.cross_v(memory).view(shape).permute(1, 2, 0, 3).contiguous())
        self._allocate(rows, max_steps)
        self._position_table(max_steps)

    def _allocate(self, rows: int, steps: int) -> None:
        device, dtype = self.embed_tokens.device, self.embed_tokens.dtype  # the model's (bfloat16 caches for one)
        self.capacity = steps
        self.keys = [torch.empty(rows, layer.heads, steps, layer.head_dim, device=device, dtype=dtype)
                     for layer in self.layers]
        self.values = [torch.empty_like(k) for k in self.keys]

    def _grow(self) -> None:
        """Double the caches' length (a sentence longer than start's max_steps)."""
        old_keys, old_values, length = self.keys, self.values, self.length
        self._allocate(old_keys[0].size(0), 2 * self.capacity)
        for new, old in zip(self.keys + self.values, old_keys + old_values):
            new[:, :, :length] = old[:, :, :length]
        if self.key_valid is not None:
            self.key_valid = F.pad(self.key_valid, (0, self.capacity - self.key_valid.size(1)), value=True)

    def reorder(self, order: Tensor) -> None:
        """Keep rows ``order`` (fairseq's reorder_incremental_state): beam reordering or finished sentences."""
        rows, length = order.numel(), self.length
        if rows == self.rows and bool(torch.equal(order, torch.arange(rows, device=order.device))):
            return
        if rows > self.keys[0].size(0):  # the beam widens: a search that starts with one row a sentence
            old_caches = self.keys + self.values
            self._allocate(rows, self.capacity)
            for new, old in zip(self.keys + self.values, old_caches):
                new[:, :, :length] = old[:self.rows, :, :length].index_select(0, order)
        else:
            for cache in self.keys + self.values:
                cache[:rows, :, :length] = cache[:self.rows, :, :length].index_select(0, order)
        if rows != self.rows:
            # The rows now belong to other sentences. With the same row count, ``order`` only permutes the
            # hypotheses of each sentence (fairseq's beam search), which share their sentence's source.
            self.cross_keys = [k.index_select(0, order) for k in self.cross_keys]
            self.cross_values = [v.index_select(0, order) for v in self.cross_values]
            if self.source_attend is not None:
                self.source_attend = self.source_attend.index_select(0, order)
        if self.key_valid is not None:
            self.key_valid = self.key_valid[:self.rows].index_select(0, order)
            self.row_lengths = self.row_lengths.index_select(0, order)
        self.rows = rows

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self, tokens: Tensor) -> Tensor:
        """Decoder features (rows, d) of the position after each row's prefix, whose last token is ``tokens``."""
        return self.group_step(tokens.view(-1, 1))

    def block_step(self, tokens: Tensor) -> Tensor:
        """m new tokens a row at once, causal among themselves (blockwise decoding's verification: every
        position of a block through the same weights in one pass); tokens (rows, m), or (m,) for one row.
        Returns the features (rows * m, d) of the positions after each of them, row-major; the prefix grows by
        m (``keep_block`` or ``truncate`` take back those not accepted). The same arithmetic a row as m
        ``step`` calls."""
        return self.group_step(tokens.view(self.rows if tokens.dim() == 2 else 1, -1))

    def keep_block(self, start: int, accepted: Tensor) -> None:
        """Of the positions fed since the prefix was ``start`` slots long, row r keeps the first
        ``accepted[r]`` (rows,). Alike in every row (batch 1 above all), the cache just ends earlier; else each
        row's rejected slots are masked out of its attention, and the cache ends after the last slot any row kept."""
        fed = self.length - start
        if not 0 <= start <= self.length or accepted.numel() != self.rows or not bool(
                ((accepted >= 0) & (accepted <= fed)).all()):
            raise ValueError(f"keep_block({start}, {accepted.tolist()}): the engine holds {self.rows} rows and "
                             f"{self.length} slots")
        if self.row_lengths is None:
            if bool((accepted == accepted[0]).all()):
                self.length = start + int(accepted[0])
                return
            self.key_valid = torch.ones(self.keys[0].size(0), self.capacity, dtype=torch.bool,
                                        device=self.embed_tokens.device)
            self.row_lengths = torch.full((self.rows,), self.length, dtype=torch.long, device=accepted.device)
        self.key_valid[:self.rows, start:self.length] = (torch.arange(fed, device=accepted.device).unsqueeze(0)
                                                        < accepted.unsqueeze(1))
        self.row_lengths = self.row_lengths - fed + accepted
        self.length = start + int(accepted.max())

    def group_step(self, tokens: Tensor, causal: bool = True) -> Tensor:
        """tokens (rows, m): each row's next m tokens at once, at positions t .. t + m - 1, causal among
        themselves, or (``causal`` False) each seeing all m (a double-token step's pair, which the model
        decodes as one unit). Returns their features (rows * m, d), row-major; every row's prefix grows by m.
        Every weight is read once for all rows * m positions."""
        rows, m = tokens.shape
        if rows != self.rows:
            raise ValueError(f"{rows} rows of tokens for the engine's {self.rows} rows")
        t = self.length
        while t + m > self.capacity:
            self._grow()
        positions = None
        if self.row_lengths is not None:  # each row at its own position; the new slots are its own
            positions = self.row_lengths.unsqueeze(1) + torch.arange(m, device=self.row_lengths.device)
            self.key_valid[:rows, t:t + m] = True
            self.row_lengths = self.row_lengths + m
        x = self._run(self._embed(tokens.reshape(-1), t, m, positions), t, m, causal)
        self.length = t + m
        return x

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of the prefix (the accepted part of a block), every row alike."""
        if self.row_lengths is not None:
            raise ValueError("truncate: the rows' prefixes differ in length (keep_block takes a block back "
                             "row by row)")
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length}: the prefix has {self.length} positions")
        self.length = length

    def _embed(self, tokens: Tensor, t: int, group: int, positions: Optional[Tensor] = None) -> Tensor:
        """Embeddings of ``tokens`` (rows * group, row-major): positions t, ..., t + group - 1 of each row, or
        ``positions`` (rows, group); past the decoder's last position, that one (as the blockwise generator
        clamps a block that runs past the length limit)."""
        x = self.embed_scale * F.embedding(tokens, self.embed_tokens)
        if self.project_in is not None:
            x = self.project_in(x)
        last = t + group if positions is None else int(positions.max()) + 1
        table = self._position_table(last)
        if table is not None:
            if positions is None and last <= table.size(0):
                x = x + (table[t] if group == 1 else table[t:t + group].repeat(tokens.numel() // group, 1))
            else:
                if positions is None:
                    positions = torch.arange(t, t + group, device=x.device).repeat(tokens.numel() // group, 1)
                x = x + table[positions.reshape(-1).clamp(max=table.size(0) - 1)]
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return x

    def _run(self, x: Tensor, t: int, group: int, causal: bool) -> Tensor:
        """The layers, the final norm and projection on x (rows * group, d): positions t .. t + group - 1 of
        each row, causal among themselves or not (see ``group_step``)."""
        rows = x.size(0) // group
        native_layers = self.native_layers
        if native_layers is not None and self.precision == "fp32" and x.size(0) > NATIVE_FLOAT_MAX_ROWS:
            native_layers = None
        if native_layers is not None:
            x = x.float().contiguous().clone()  # updated in place layer by layer
            attend = None if self.source_attend is None else self.source_attend.view(self.rows, -1)
            for index, layer in enumerate(native_layers):
                self.layer_step(layer, x, self.keys[index], self.values[index], t, self.cross_keys[index],
                                self.cross_values[index], attend, group=group, causal=causal,
                                self_attend=self.key_valid)
        # Position t + i of a causal group sees the prefix and the group up to itself
        mask = None
        if causal and group > 1 and native_layers is None:
            mask = (torch.arange(t + group, device=x.device).unsqueeze(0)
                    <= t + torch.arange(group, device=x.device).unsqueeze(1))
        if self.key_valid is not None and native_layers is None:  # (rows, 1, group or 1, t + group): its own slots
            kept = self.key_valid[:rows, None, None, :t + group]
            mask = kept if mask is None else kept & mask
        for index, layer in enumerate(self.layers if native_layers is None else ()):
            keys, values = self.keys[index], self.values[index]

            def self_attention(q, k, v, keys=keys, values=values, scaling=layer.scaling):
                keys[:rows, :, t:t + group] = k
                values[:rows, :, t:t + group] = v
                return attention(q, keys[:rows, :, :t + group], values[:rows, :, :t + group], mask, scaling)

            x = layer.forward(x, rows, group, self_attention, self.cross_keys[index], self.cross_values[index],
                              self.source_attend)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def logits(self, features: Tensor) -> Tensor:
        """The output layer: (rows, d) -> (rows, V), or (rows, C) over each sentence's candidate list (see
        ``OutputLayer.prepare``; the rows of a sentence are consecutive, as many for each sentence)."""
        sentences = self.output.candidates.size(0) if self.output.candidates is not None else 1
        logits = self.output(features.view(sentences, -1, features.size(-1)))
        return logits.view(features.size(0), -1)


# model -> {(precision, features_only): (the parameters' fingerprint, engine, encoder)}: what fast_step_parts built
# for a loaded model, reused by every generator built on it (fairseq's hub interface builds one a translate call);
# and model -> its parameters, listed once (walking the modules at every call cost more than the check).
_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PARAMETERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def parameters_fingerprint(model) -> Tuple:
    """Changes when a parameter's data is replaced, moved, cast or written in place (training,
    ``load_state_dict``, ``half()``, ``to()``): then the engine's copies of the weights are stale. (A cast or a
    move puts new storage under every parameter, at another address while the old one is still held: the
    addresses and the in-place write counters say it all, at 1 us per 4 parameters.)"""
    parameters = _PARAMETERS.get(model)
    if parameters is None:
        parameters = _PARAMETERS[model] = list(model.parameters())
    return tuple([p.data_ptr() for p in parameters] + [p._version for p in parameters])


def fast_step_parts(model, precision: str, features_only: bool = False):
    """The decoder step and the encoder the fast step runs for ``model`` (``features_only``: see
    ``FastDecoderStep``). With int8 the encoder is a copy whose matrices are int8 (it runs once a sentence,
    but at batch 1 that was a third of a sentence's int8 time in float32).

    Built once per loaded model and precision: a later call, while the model's parameters are unchanged, gets an
    engine sharing the prepared weights (``FastDecoderStep.sharing_weights``) and the same encoder, so a
    ``hub.translate`` call (a new generator each time) costs what a generator built once does."""
    key, fingerprint = (precision, features_only), parameters_fingerprint(model)
    built = _BUILT.setdefault(model, {}).get(key)
    if built is not None and built[0] == fingerprint:
        return built[1].sharing_weights(), built[2]
    # (an inference copy: evaluation mode whatever mode the model is in when the generator is built)
    encoder = int8_encoder(model.encoder).eval() if precision == "int8" else model.encoder
    engine = FastDecoderStep(model.decoder, precision, features_only=features_only)
    _BUILT[model][key] = (fingerprint, engine, encoder)
    return engine.sharing_weights(), encoder
