"""``lattice_transformer``: a fairseq transformer encoder and a Markov lattice scorer in place of the decoder.

The scorer gives P(y_t | y_{t-order}..y_{t-1}, t, x): its input for target position t is the window of the
``--lattice-markov-order`` previous tokens (1: y_{t-1} alone, the paper's first-order model; 2: also
y_{t-2}), each embedded with its own position; ``--lattice-scorer-layers`` layers of self-attention inside
that window (causal), cross-attention to the encoder memory, and a feed-forward block; then fairseq's
output projection. Nothing outside the window reaches position t, so the scorer is a Markov model and can
score every edge of a lattice at once: one row per (position, previous-token state), no recurrence.

Training (``forward``) builds the windows from ``prev_output_tokens`` and returns full-vocabulary logits,
so fairseq's stock criterions (label-smoothed cross entropy) train it through fairseq-train.
``window_features`` on every (position, state) row of a lattice, then ``candidate_logits``, is what the
generator calls: scores of the K candidates of position t for every state of the candidates before it. At
inference it calls ``HoistedLatticeScorer.window_features`` instead: the same features, with the work that
does not depend on the row (per-vocabulary and per-position tables of the first layer, the cross-attention
output projection folded into the memory's values) done once per model or per sentence, and, with
``--lattice-scorer-precision int8``, the feed-forward matrices as int8 (fairseq_plugins.kernels.int8, quantized once a
model).
"""

import logging
import math
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq import utils
from fairseq.models import FairseqDecoder, register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.modules import FairseqDropout, LayerNorm, MultiheadAttention

from ..common.presets import set_default, transformer_multi30k, transformer_tiny
from ..common.textio import InputError
from ..common.warm_start import layer_count, load_base_state, warm_start
from ..kernels.attention import softmax_last_dim
from ..kernels.int8 import Int8Matrix, int8_model_unsupported_reason
from ..kernels.precision import check_precision

logger = logging.getLogger(__name__)

MARKOV_ORDERS = (1, 2)
# The int8 kernel of the scorer's feed-forward matrices (``--lattice-scorer-precision int8``): torch's fbgemm. A
# sentence is ~1200 rows at K = 64 (multi30k), where fbgemm's product of fc1 (256 -> 1024) and fc2 (1024 -> 256)
# takes 1.1 + 1.2 ms and the native kernel (AVX2, made for the few rows of a decoder step) 6.2 + 7.5 ms, slower than
# float32's 5.5 + 5.6 ms (1216 rows, one thread, AMD EPYC with AVX-512 VNNI); fbgemm is already the faster at 64
# rows (0.08 + 0.09 ms against 0.35 + 0.31). One kernel for every call, so a row's scores do not depend on the batch
# (the two kernels round activations differently).
INT8_BACKEND = "fbgemm"


def scorer_int8_unsupported_reason(scorer: "LatticeScorer") -> Optional[str]:
    """Why the scorer's feed-forward matrices cannot run as int8, or None when they can."""
    reason = int8_model_unsupported_reason(scorer, "fbgemm's int8 kernels")
    if reason is not None:
        return reason
    for index, layer in enumerate(scorer.layers):
        if not (type(layer.fc1) is nn.Linear and type(layer.fc2) is nn.Linear):
            return f"scorer layer {index}'s feed-forward block is not two nn.Linear layers"
    return None


def encoder_memory(encoder_out: Dict):
    """The encoder's (source, batch, dim) memory and its (batch, source) padding mask (None: no padding)."""
    memory = encoder_out["encoder_out"][0]
    memory_padding = encoder_out["encoder_padding_mask"][0] if encoder_out["encoder_padding_mask"] else None
    return memory, memory_padding


class MarkovScorerLayer(nn.Module):
    """One scorer block: self-attention inside each row's window, cross-attention, feed-forward.

    Rows are independent: ``x`` is (batch, rows, window, dim); the rows of a sentence share its encoder memory.
    """

    def __init__(self, embed_dim: int, ffn_dim: int, heads: int, encoder_dim: int, dropout: float,
                 attention_dropout: float, activation_dropout: float, activation_fn: str, normalize_before: bool):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads, dropout=attention_dropout, self_attention=True)
        self.encoder_attn = MultiheadAttention(embed_dim, heads, kdim=encoder_dim, vdim=encoder_dim,
                                               dropout=attention_dropout, encoder_decoder_attention=True)
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.encoder_attn_layer_norm = LayerNorm(embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.activation_fn = utils.get_activation_fn(activation_fn)
        self.dropout = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.activation_dropout = FairseqDropout(activation_dropout, module_name=self.__class__.__name__)
        self.normalize_before = normalize_before

    def _residual(self, x: Tensor, sublayer, layer_norm: LayerNorm) -> Tensor:
        # fairseq's transformer layers: post-norm by default, pre-norm with --decoder-normalize-before.
        y = sublayer(layer_norm(x) if self.normalize_before else x)
        x = x + self.dropout(y)
        return x if self.normalize_before else layer_norm(x)

    def _window_self_attention(self, x: Tensor, window_mask: Optional[Tensor]) -> Tensor:
        batch, rows, window, dim = x.shape
        if window == 1:
            # One key: the attention weight is 1, so attention is out_proj(v_proj(x)); skipping q, k and the
            # softmax is exact (and most of a first-order scorer's self-attention cost).
            return self.self_attn.out_proj(self.self_attn.v_proj(x))
        flat = x.reshape(batch * rows, window, dim).transpose(0, 1)
        y, _ = self.self_attn(flat, flat, flat, attn_mask=window_mask, need_weights=False)
        return y.transpose(0, 1).reshape(batch, rows, window, dim)

    def _encoder_attention(self, x: Tensor, encoder_out: Tensor, encoder_padding_mask: Optional[Tensor]) -> Tensor:
        batch, rows, window, dim = x.shape
        query = x.reshape(batch, rows * window, dim).transpose(0, 1)
        y, _ = self.encoder_attn(query, encoder_out, encoder_out, key_padding_mask=encoder_padding_mask,
                                 static_kv=True, need_weights=False)
        return y.transpose(0, 1).reshape(batch, rows, window, dim)

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation_dropout(self.activation_fn(self.fc1(x))))

    def forward(self, x: Tensor, window_mask: Optional[Tensor], encoder_out: Tensor,
                encoder_padding_mask: Optional[Tensor], last_only: bool = False) -> Tensor:
        x = self._residual(x, lambda h: self._window_self_attention(h, window_mask), self.self_attn_layer_norm)
        if last_only:
            # Only the window's last element is scored; earlier ones mattered only as keys above.
            x = x[:, :, -1:]
        x = self._residual(x, lambda h: self._encoder_attention(h, encoder_out, encoder_padding_mask),
                           self.encoder_attn_layer_norm)
        return self._residual(x, self._feed_forward, self.final_layer_norm)


class LatticeScorer(FairseqDecoder):
    """The Markov scorer (the model's decoder): window of previous tokens + position -> next-token logits."""

    def __init__(self, args, dictionary, embed_tokens: nn.Embedding):
        super().__init__(dictionary)
        self.markov_order = int(args.lattice_markov_order)
        if self.markov_order not in MARKOV_ORDERS:
            raise InputError(f"--lattice-markov-order {self.markov_order}: choose one of {MARKOV_ORDERS}")
        if args.lattice_scorer_layers < 1:
            raise InputError(f"--lattice-scorer-layers {args.lattice_scorer_layers}: needs at least 1 layer")
        embed_dim = args.decoder_embed_dim
        if embed_tokens.embedding_dim != embed_dim:
            raise InputError(f"--decoder-embed-dim {embed_dim} differs from the target embeddings' "
                             f"{embed_tokens.embedding_dim}")
        self.padding_idx = dictionary.pad()
        self.eos_idx = dictionary.eos()
        self.embed_tokens = embed_tokens
        self.embed_scale = 1.0 if args.no_scale_embedding else math.sqrt(embed_dim)
        # Position t (1-based target position) at index t; explicit indices, since lattice rows are not
        # left-to-right sequences.
        self.max_target_positions = args.max_target_positions
        self.embed_positions = nn.Embedding(args.max_target_positions + 2, embed_dim)
        nn.init.normal_(self.embed_positions.weight, mean=0, std=embed_dim ** -0.5)
        self.dropout_module = FairseqDropout(args.dropout, module_name=self.__class__.__name__)
        self.layers = nn.ModuleList(
            MarkovScorerLayer(embed_dim, args.lattice_scorer_ffn_dim, args.decoder_attention_heads,
                              args.encoder_embed_dim, args.dropout, args.attention_dropout,
                              args.activation_dropout, args.activation_fn, args.decoder_normalize_before)
            for _ in range(args.lattice_scorer_layers)
        )
        self.layer_norm = LayerNorm(embed_dim) if args.decoder_normalize_before else None
        self.output_projection = nn.Linear(embed_dim, len(dictionary), bias=False)
        if args.share_decoder_input_output_embed or args.share_all_embeddings:
            self.output_projection.weight = self.embed_tokens.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0, std=embed_dim ** -0.5)

    def max_positions(self):
        return self.max_target_positions

    # ---- hidden states of windows -------------------------------------------------------------------
    def _window_mask(self, window_tokens: Tensor) -> Optional[Tensor]:
        """Additive (rows x heads, window, window) mask: causal, padding keys hidden, each element sees itself."""
        window = window_tokens.size(-1)
        if window == 1:
            return None
        flat = window_tokens.reshape(-1, window)
        causal = torch.ones(window, window, dtype=torch.bool, device=flat.device).tril()
        eye = torch.eye(window, dtype=torch.bool, device=flat.device)
        # A padding element (before the sentence start) still attends to itself, so no row is all -inf.
        allowed = causal & ((flat != self.padding_idx).unsqueeze(1) | eye)
        heads = self.layers[0].self_attn.num_heads
        mask = torch.zeros(allowed.shape, device=flat.device).masked_fill(~allowed, float("-inf"))
        return mask.repeat_interleave(heads, dim=0)

    def embed_windows(self, window_tokens: Tensor, window_positions: Tensor) -> Tensor:
        """(batch, rows, window) tokens at their positions -> (batch, rows, window, dim) scorer inputs."""
        x = self.embed_scale * self.embed_tokens(window_tokens) + self.embed_positions(window_positions)
        return self.dropout_module(x)

    def window_features(self, window_tokens: Tensor, window_positions: Tensor, encoder_out: Dict) -> Tensor:
        """(batch, rows, window) tokens at (batch, rows, window) positions -> (batch, rows, dim) features of
        each row's last element. The reference computation, and training's; inference may use
        ``HoistedLatticeScorer``, the same features with the per-vocabulary and per-sentence work hoisted."""
        x = self.embed_windows(window_tokens, window_positions)
        memory, memory_padding = encoder_memory(encoder_out)
        window_mask = self._window_mask(window_tokens)
        for index, layer in enumerate(self.layers):
            x = layer(x, window_mask, memory, memory_padding, last_only=index == len(self.layers) - 1)
        x = x[:, :, -1]
        return self.layer_norm(x) if self.layer_norm is not None else x

    def window_positions(self, targets: Tensor) -> Tensor:
        """Position indices of the windows of rows that predict target positions ``targets`` (1-based):
        (..., order). y_i (y_0 = BOS) is embedded at index i + 1; padding before BOS at index 0."""
        offsets = torch.arange(1 - self.markov_order, 1, device=targets.device)
        return (targets.unsqueeze(-1) + offsets).clamp(min=0)

    # ---- training: the windows of prev_output_tokens ------------------------------------------------
    def training_windows(self, prev_output_tokens: Tensor):
        """Row t (0-based, predicting y_{t+1}) holds prev_output_tokens[t - order + 1 .. t]."""
        batch, length = prev_output_tokens.shape
        padded = F.pad(prev_output_tokens, (self.markov_order - 1, 0), value=self.padding_idx)
        tokens = padded.unfold(1, self.markov_order, 1)  # (batch, length, order)
        targets = torch.arange(1, length + 1, device=prev_output_tokens.device)
        return tokens, self.window_positions(targets).unsqueeze(0).expand(batch, -1, -1)

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        if incremental_state is not None:
            raise InputError("lattice_transformer scores lattices in parallel and has no incremental decoding: "
                             "decode it with --task lattice_translation")
        features = self.extract_features(prev_output_tokens, encoder_out)
        return self.output_layer(features), {"attn": [None], "inner_states": None}

    def extract_features(self, prev_output_tokens, encoder_out=None, **kwargs):
        tokens, positions = self.training_windows(prev_output_tokens)
        return self.window_features(tokens, positions, encoder_out)

    def output_layer(self, features):
        return self.output_projection(features)

    # ---- inference: edge scores of a lattice ----------------------------------------------------------
    def candidate_logits(self, features: Tensor, candidates: Tensor) -> Tensor:
        """(batch, positions, states, dim) features x (batch, positions, K) candidates -> logits of each
        candidate, (batch, positions, states, K): the output projection restricted to the lattice."""
        # (batch, positions, K, dim); F.embedding's gather is ~4x faster than indexing on the CPU
        weights = F.embedding(candidates, self.output_projection.weight)
        return torch.matmul(features, weights.transpose(-1, -2))

    def full_log_normalizer(self, features: Tensor, rows_per_chunk: int = 4096) -> Tensor:
        """log sum_v exp(logit_v) over the whole vocabulary (a softmax's normaliser), per row; in chunks of
        rows, since all rows' logits at once would be rows x vocabulary floats."""
        flat = features.reshape(-1, features.size(-1))
        parts = [torch.logsumexp(self.output_layer(chunk).float(), dim=-1) for chunk in flat.split(rows_per_chunk)]
        return torch.cat(parts).view(features.shape[:-1])


class HoistedLatticeScorer:
    """``LatticeScorer.window_features`` at inference with the work that does not depend on the row hoisted out
    of the rows: the same features up to float rounding (the tests compare them to 1e-5), fewer multiply-adds
    per row. Build it from a trained scorer; ``LatticeGenerator`` does (``--lattice-no-hoist`` turns it off).

    What is hoisted, and where it is exact:

    * every layer, the cross-attention's output projection: out_proj(sum_j a_j v_j) = sum_j a_j (W_o v_j) + b_o
      (per head), so W_o goes into the memory's values once per sentence (heads x source vectors of d)
      instead of into every row; used where that is fewer multiply-adds a row, (heads - 1) x source < d.
    * the first layer, when the window is one token (``--lattice-markov-order 1``) and it is post-norm: with a
      single key the attention weight is 1, so the self-attention sublayer h = x + out_proj(v_proj(x)) is affine
      in x = scale * E[y] + P[t]: a table over the vocabulary plus a table over the positions. The
      cross-attention query q_proj(LN(h)) = (W_q diag(g) h - mean(h) W_q g) / spread(h) + W_q b + b_q (g, b the
      layer norm's gain and bias) is then also a vocabulary table plus a position table, corrected by each
      row's layer-norm mean and spread: no d x d product is left before the cross-attention scores.

    Not hoisted (the layer's own code runs): self-attention over a window of two tokens (the softmax over two
    keys is not linear), pre-norm (--decoder-normalize-before: the layer norm comes before the linear maps),
    and the self-attention and query of every later layer (their input depends on the previous layer's
    cross-attention and feed-forward, not only on token and position).

    With ``precision="int8"`` (``--lattice-scorer-precision int8``, float32 CPU models) every layer's feed-forward
    matrices fc1 and fc2 are int8 with one scale per weight row and per activation row (``Int8Matrix``, the
    fbgemm kernel: INT8_BACKEND), quantized here, once per model: not exact, the scores move by int8 rounding
    (the tests bound it). The feed-forward block is ~85% of the hoisted first-order scorer's time at d = 256,
    d_ff = 1024; nothing else of that scorer multiplies a row by a matrix (the output projection is the K
    candidates' rows, gathered per position), so nothing else is int8. The self-attention and query
    projections of later layers, and of order 2, stay float32.

    Only for eval mode without dropout at inference (``exact_for``); the tables (and int8 matrices) are those of
    the weights when it was built (``matches`` says whether they still are).
    """

    def __init__(self, scorer: LatticeScorer, precision: str = "fp32"):
        check_precision(precision, "--lattice-scorer-precision")
        if precision == "int8":
            reason = scorer_int8_unsupported_reason(scorer)
            if reason is not None:
                raise InputError(f"--lattice-scorer-precision int8: {reason}")
        self.scorer = scorer
        self.precision = precision
        # The same Parameter objects whatever happens to their data (in-place updates, .to(), .double()),
        # listed once: walking the modules on every sentence costs ~0.05 ms.
        self._parameters = list(scorer.parameters())
        self.fingerprint = self.weights_fingerprint(self._parameters)
        first = scorer.layers[0]
        self.first_layer_tables = None
        if scorer.markov_order == 1 and not first.normalize_before:
            with torch.no_grad():
                self.first_layer_tables = self._first_layer_tables(scorer)
        self.int8_feed_forward: Optional[List[Tuple[Int8Matrix, Int8Matrix]]] = None
        if precision == "int8":  # quantized once here, for every sentence until the weights change
            self.int8_feed_forward = [
                tuple(Int8Matrix(fc.weight, bias=fc.bias, backend=INT8_BACKEND) for fc in (layer.fc1, layer.fc2))
                for layer in scorer.layers]

    # ---- validity ---------------------------------------------------------------------------------------
    @staticmethod
    def exact_for(scorer: LatticeScorer, dropouts: Optional[List[FairseqDropout]] = None) -> bool:
        """Whether the hoisted computation equals the scorer's: eval mode, no dropout kept at inference
        (--retain-dropout draws a mask per row, which no table can hold). ``dropouts``: the scorer's
        FairseqDropout modules, if the caller listed them already."""
        if dropouts is None:
            dropouts = [module for module in scorer.modules() if isinstance(module, FairseqDropout)]
        return not scorer.training and not any(module.apply_during_inference and module.p > 0 for module in dropouts)

    @staticmethod
    def weights_fingerprint(parameters: List[Tensor]):
        # In-place updates (load_state_dict, optimiser steps) bump a tensor's version; .to()/.half() change the
        # data's address or type.
        return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in parameters)

    def matches(self, scorer: LatticeScorer) -> bool:
        """Whether this was built from ``scorer`` as its weights are now."""
        return scorer is self.scorer and self.weights_fingerprint(self._parameters) == self.fingerprint

    # ---- tables -----------------------------------------------------------------------------------------
    @staticmethod
    def _first_layer_tables(scorer: LatticeScorer) -> Dict[str, Tensor]:
        layer = scorer.layers[0]
        # At least float32 (a half model's tables are summed and normalised in float32).
        dtype = torch.promote_types(scorer.embed_positions.weight.dtype, torch.float32)

        def weight(tensor: Optional[Tensor]) -> Optional[Tensor]:
            return tensor.to(dtype) if tensor is not None else None

        self_attn = layer.self_attn

        def value_output(x: Tensor, biases: bool) -> Tensor:  # out_proj(v_proj(x)), with or without biases
            v = F.linear(x, weight(self_attn.v_proj.weight), weight(self_attn.v_proj.bias) if biases else None)
            return F.linear(v, weight(self_attn.out_proj.weight), weight(self_attn.out_proj.bias) if biases else None)

        tokens = scorer.embed_scale * weight(scorer.embed_tokens.weight)
        positions = weight(scorer.embed_positions.weight)
        # h = x + out_proj(v_proj(x)) with x = tokens[y] + positions[t]: the linear part of each, biases once.
        token_table = tokens + value_output(tokens, biases=False)
        position_table = positions + value_output(positions, biases=True)

        norm = layer.self_attn_layer_norm
        dim = token_table.size(-1)
        gain = weight(norm.weight) if norm.weight is not None else token_table.new_ones(dim)
        shift = weight(norm.bias) if norm.bias is not None else token_table.new_zeros(dim)
        cross = layer.encoder_attn
        query_weight, query_bias = weight(cross.q_proj.weight), weight(cross.q_proj.bias)
        # fairseq scales the projected query (bias included) by head_dim ** -0.5.
        return {
            "token": token_table, "position": position_table,
            "query_token": cross.scaling * F.linear(token_table * gain, query_weight),
            "query_position": cross.scaling * F.linear(position_table * gain, query_weight),
            "query_mean": cross.scaling * F.linear(gain, query_weight),
            "query_bias": cross.scaling * F.linear(shift, query_weight, query_bias),
        }

    def _first_layer_self_attention(self, window_tokens: Tensor, window_positions: Tensor, dtype: torch.dtype):
        """The first layer's self-attention sublayer (residual and layer norm included) from the tables, and
        the scaled cross-attention query of its output: two (batch, rows, 1, dim) tensors."""
        tables = self.first_layer_tables
        norm = self.scorer.layers[0].self_attn_layer_norm
        h = F.embedding(window_tokens, tables["token"]) + F.embedding(window_positions, tables["position"])
        # Two passes rather than torch.var_mean, which is ~20x slower on the CPU on these shapes.
        mean = h.mean(dim=-1, keepdim=True)
        centered = h - mean
        spread = torch.sqrt((centered * centered).mean(dim=-1, keepdim=True) + norm.eps)
        query = F.embedding(window_tokens, tables["query_token"]) + F.embedding(window_positions,
                                                                                tables["query_position"])
        query = torch.addcmul(query, mean, tables["query_mean"], value=-1) / spread + tables["query_bias"]
        return norm(h.to(dtype)), query.to(dtype)

    # ---- per sentence -----------------------------------------------------------------------------------
    @staticmethod
    def _memory_keys_values(layer: MarkovScorerLayer, memory: Tensor):
        """The layer's cross-attention keys (batch, heads, source, head_dim) of the memory, its values, and
        whether the values hold the output projection: then (batch, heads x source, dim), else (batch, heads,
        source, head_dim)."""
        attention = layer.encoder_attn
        source, batch, _ = memory.shape
        heads, head_dim, dim = attention.num_heads, attention.head_dim, attention.embed_dim
        keys = attention.k_proj(memory).view(source, batch, heads, head_dim).permute(1, 2, 0, 3)
        values = attention.v_proj(memory).view(source, batch, heads, head_dim).permute(1, 2, 0, 3)
        # Folded, a row attends over heads x source vectors of d; unfolded, over source vectors of d (the
        # heads' slices) and then a d x d output projection.
        fold = (heads - 1) * source < dim
        if fold:
            output_weight = attention.out_proj.weight.view(dim, heads, head_dim)
            values = torch.einsum("bhse,dhe->bhsd", values, output_weight).reshape(batch, heads * source, dim)
        return keys, values, fold

    def _encoder_attention(self, layer: MarkovScorerLayer, x: Tensor, query: Optional[Tensor], keys: Tensor,
                           values: Tensor, fold: bool, memory_padding: Optional[Tensor]) -> Tensor:
        """fairseq's MultiheadAttention over the memory (eval mode) for (batch, rows, window, dim) ``x``, with
        its scaled query when the tables gave it."""
        attention = layer.encoder_attn
        batch, rows, window, dim = x.shape
        heads, head_dim = attention.num_heads, attention.head_dim
        if query is None:
            query = attention.q_proj(x) * attention.scaling
        query = query.reshape(batch, rows * window, heads, head_dim).transpose(1, 2)
        scores = torch.matmul(query, keys.transpose(-1, -2))  # (batch, heads, rows x window, source)
        if memory_padding is not None:
            scores = scores.masked_fill(memory_padding.view(batch, 1, 1, -1), float("-inf"))
        probs = softmax_last_dim(scores).type_as(scores)
        if fold:
            y = torch.matmul(probs.transpose(1, 2).reshape(batch, rows * window, -1), values)
            if attention.out_proj.bias is not None:
                y = y + attention.out_proj.bias
        else:
            y = attention.out_proj(torch.matmul(probs, values).transpose(1, 2).reshape(batch, rows * window, dim))
        return y.view(batch, rows, window, dim)

    def _feed_forward(self, index: int, layer: MarkovScorerLayer, x: Tensor) -> Tensor:
        """The layer's feed-forward block (without its residual and layer norm): float32, or int8."""
        if self.int8_feed_forward is None:
            return layer._feed_forward(x)
        fc1, fc2 = self.int8_feed_forward[index]
        hidden = fc1(x)  # a new tensor (fbgemm's output), so ReLU may overwrite it
        hidden = hidden.relu_() if layer.activation_fn is F.relu else layer.activation_fn(hidden)
        return fc2(layer.activation_dropout(hidden))

    # ---- features ---------------------------------------------------------------------------------------
    def window_features(self, window_tokens: Tensor, window_positions: Tensor, encoder_out: Dict) -> Tensor:
        """``LatticeScorer.window_features`` (eval mode), hoisted."""
        scorer = self.scorer
        memory, memory_padding = encoder_memory(encoder_out)
        window_mask = scorer._window_mask(window_tokens)
        tables = self.first_layer_tables is not None
        if tables:
            x, query = self._first_layer_self_attention(window_tokens, window_positions,
                                                        scorer.embed_positions.weight.dtype)
        else:
            x, query = scorer.embed_windows(window_tokens, window_positions), None
        last = len(scorer.layers) - 1
        for index, layer in enumerate(scorer.layers):
            if not (index == 0 and tables):
                x = layer._residual(x, partial(layer._window_self_attention, window_mask=window_mask),
                                    layer.self_attn_layer_norm)
            if index == last:
                x = x[:, :, -1:]  # as MarkovScorerLayer: only the window's last element is scored
            keys, values, fold = self._memory_keys_values(layer, memory)
            x = layer._residual(x, partial(self._encoder_attention, layer, query=query, keys=keys, values=values,
                                           fold=fold, memory_padding=memory_padding),
                                layer.encoder_attn_layer_norm)
            query = None
            x = layer._residual(x, partial(self._feed_forward, index, layer), layer.final_layer_norm)
        x = x[:, :, -1]
        return scorer.layer_norm(x) if scorer.layer_norm is not None else x


@register_model("lattice_transformer")
class LatticeTransformerModel(TransformerModel):
    """Transformer encoder + Markov lattice scorer; train it with fairseq-train (any task whose batches have
    prev_output_tokens, e.g. ``translation``) and decode it with ``--task lattice_translation``."""

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        parser.add_argument("--lattice-scorer-layers", type=int, metavar="N",
                            help="layers of the lattice scorer (the paper: 1)")
        parser.add_argument("--lattice-scorer-ffn-dim", type=int, metavar="N",
                            help="feed-forward dimension of the scorer layers (default: --decoder-ffn-embed-dim)")
        parser.add_argument("--lattice-markov-order", type=int, metavar="N",
                            help="previous target tokens the scorer sees: 1 (first-order, the paper) or 2; "
                                 "decoding keeps K^order states per position")

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return LatticeScorer(args, tgt_dict, embed_tokens)

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **kwargs):
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        return self.decoder(prev_output_tokens, encoder_out=encoder_out)

    def load_base_checkpoint(self, path: str, flag: str) -> None:
        """Warm start from a trained fairseq transformer of the same sizes and data (e.g. the baseline): its
        encoder, target embeddings and output matrix; the scorer's layers and positions keep their init.

        The encoder may be deeper than the base's (depth moved from the scorer to the encoder, where a layer
        costs a thirtieth as much at decoding): the base's layers become the lowest ones and the layers above
        them keep their initialisation."""
        base = load_base_state(path, flag)
        base_layers, own_layers = layer_count(base, "encoder"), len(self.encoder.layers)
        if base_layers > own_layers:
            raise InputError(f"{flag} {path}: the base has {base_layers} encoder layers and this model "
                             f"{own_layers} (--encoder-layers must be at least the base's)")
        fresh = tuple(f"encoder.layers.{index}." for index in range(base_layers, own_layers))
        shared = ("encoder.", "decoder.embed_tokens.", "decoder.output_projection.")
        warm_start(self, path, flag, required=lambda key: key.startswith("encoder.") and not key.startswith(fresh),
                   take=lambda key: key.startswith(shared) and not key.endswith("_float_tensor"), base_state=base)
        if fresh:
            logger.info("encoder layers %d-%d start from their initialisation (the base has %d)",
                        base_layers, own_layers - 1, base_layers)


def _lattice_defaults(args):
    set_default(args, "lattice_scorer_layers", 1)
    set_default(args, "lattice_markov_order", 1)


@register_model_architecture("lattice_transformer", "lattice_transformer")
def lattice_transformer(args):
    """Transformer base encoder (6 layers, 512-d) and a one-layer first-order scorer."""
    _lattice_defaults(args)
    base_architecture(args)
    set_default(args, "lattice_scorer_ffn_dim", args.decoder_ffn_embed_dim)


@register_model_architecture("lattice_transformer", "lattice_transformer_multi30k")
def lattice_transformer_multi30k(args):
    """The baseline's encoder (3 layers, 256-d, shared embeddings) and a one-layer first-order scorer."""
    _lattice_defaults(args)
    transformer_multi30k(args)
    set_default(args, "lattice_scorer_ffn_dim", args.decoder_ffn_embed_dim)


@register_model_architecture("lattice_transformer", "lattice_transformer_tiny")
def lattice_transformer_tiny(args):
    _lattice_defaults(args)
    transformer_tiny(args)
    set_default(args, "lattice_scorer_ffn_dim", args.decoder_ffn_embed_dim)
