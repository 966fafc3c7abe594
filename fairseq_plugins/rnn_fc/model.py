"""``rnn_fc``: Devlin (2017)'s fast CPU model. A bidirectional GRU encoder; a decoder whose only recurrence
is one attentional GRU (AttGRU) at the bottom, followed by stacked fully-connected ReLU layers applied at
every step, a top FC-tanh (or GRU) layer and the softmax.

AttGRU, one target step (h: decoder state, e: embedding of the previous target token, s_j: encoder states):
    x = W e + b_x            [q | z | r | n] parts, input projections (the lookup of --rnn-fc-precompute-words)
    u = U h + b_u            [q | z | r | n] parts, state projections (merged across beam rows sharing h)
    alpha = softmax_j(v . tanh(K s_j + x_q + u_q))          attention from the previous state and input;
    c = sum_j alpha_j s_j                                   K s_j is computed once a sentence
    g = C c                  [z | r | n] parts: the context enters every gate
    z = sigmoid(x_z + u_z + g_z),  r = sigmoid(x_r + u_r + g_r)
    h' = (1 - z) * tanh(x_n + g_n + r * u_n) + z * h
Then the FC stack over [h'; c], in one of two layouts (--rnn-fc-fc-layout):
    paper     f_0 = [h'; c], f_i = relu(F_i f_{i-1}) (+ f_{i-1} on every second layer, once sizes match), clipped
              to --rnn-fc-activation-clip: the paper's layout. Layers 0 and 2 have no identity path and the skips
              add non-negative values, so a deep stack washes its input out and trains slowly.
    residual  f_0 = P [h'; c] (one projection to the FC width), f_i = f_{i-1} + dropout(relu(F_i LN(f_{i-1}))),
              then LN(f_N): pre-norm residual blocks, the same number of FC-ReLU matrices (+ P).
Top o = tanh(T f_N) (or a GRU over f_N); logits = O o. The FC matrices start from He initialisation with zero
biases and the top from Xavier (torch's default Linear init leaves a ReLU stack's output ~independent of its input).

The encoder is the paper's bidirectional GRU, or (``--rnn-fc-encoder transformer``, our deviation) a fairseq
transformer encoder that can start from a trained transformer's (``--rnn-fc-base-checkpoint`` of the
``rnn_fc_translation`` task) and stay frozen (``--rnn-fc-freeze-encoder``): Devlin's speedups are all in the
decoder, and an encoder runs once a sentence, so a trained one buys BLEU at a small, fixed cost per sentence.

The decoder exposes these pieces (input_projection, state_projection, source_keys, attend, ...) so that the
fast generator (generator.py) can switch each speedup on and off; ``forward`` runs the same pieces over a
whole target sequence for fairseq-train, and the incremental path makes stock fairseq-generate work too.
"""

import logging
from itertools import chain
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq import utils
from fairseq.models import (FairseqEncoder, FairseqEncoderDecoderModel, FairseqIncrementalDecoder, register_model,
                            register_model_architecture)
from fairseq.models.transformer import TransformerEncoder, base_architecture as transformer_base_architecture
from fairseq.modules import FairseqDropout

from ..common.presets import set_default
from ..common.textio import InputError
from ..common.warm_start import warm_start

logger = logging.getLogger(__name__)

TOP_LAYERS = ("tanh", "gru")
FC_LAYOUTS = ("residual", "paper")
# he: He for the FC-ReLU layers, Xavier for the projections into and out of the stack, zero biases (the fix);
# torch: nn.Linear's own default, what the first models had (kept to measure the fix, see docs/rnn_fc.md).
FC_INITS = ("he", "torch")
ENCODERS = ("bigru", "transformer")


def _embedding(dictionary, dim: int) -> nn.Embedding:
    embedding = nn.Embedding(len(dictionary), dim, padding_idx=dictionary.pad())
    nn.init.normal_(embedding.weight, mean=0, std=dim ** -0.5)
    nn.init.constant_(embedding.weight[dictionary.pad()], 0)
    return embedding


class RnnFcEncoder(FairseqEncoder):
    """Embeddings and a --encoder-layers bidirectional GRU; the decoder's first state from the mean state."""

    def __init__(self, args, dictionary, embed_tokens: nn.Embedding):
        super().__init__(dictionary)
        self.embed_tokens = embed_tokens
        self.padding_idx = dictionary.pad()
        self.dropout_in = FairseqDropout(args.dropout, module_name=self.__class__.__name__)
        self.gru = nn.GRU(embed_tokens.embedding_dim, args.encoder_hidden_size, num_layers=args.encoder_layers,
                          bidirectional=True, dropout=args.dropout if args.encoder_layers > 1 else 0.0)
        self.output_dim = 2 * args.encoder_hidden_size
        self.init_state = nn.Linear(self.output_dim, args.decoder_hidden_size)
        self.max_source_positions = args.max_source_positions

    def forward(self, src_tokens: Tensor, src_lengths: Tensor, **kwargs):
        # fairseq pads sources on the left by default; packing wants them on the right.
        src_tokens = utils.convert_padding_direction(src_tokens, self.padding_idx, left_to_right=True)
        padding_mask = src_tokens.eq(self.padding_idx)  # (B, T)
        lengths = (~padding_mask).long().sum(1)
        x = self.dropout_in(self.embed_tokens(src_tokens))  # (B, T, d)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.clamp(min=1).cpu(), batch_first=True,
                                                   enforce_sorted=False)
        states, _ = self.gru(packed)
        states, _ = nn.utils.rnn.pad_packed_sequence(states, batch_first=True, total_length=src_tokens.size(1))
        return {
            "encoder_out": [states],  # (B, T, 2 * hidden), batch first
            "encoder_padding_mask": [padding_mask],
            "decoder_init_state": [_first_state(self.init_state, states, padding_mask)],
        }

    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order: Tensor):
        return _reorder_batch_first(encoder_out, new_order)

    def max_positions(self):
        return self.max_source_positions


def _reorder_batch_first(encoder_out: Dict[str, List[Tensor]], new_order: Tensor):
    return {key: [value.index_select(0, new_order) for value in values] for key, values in encoder_out.items()}


def _first_state(init_state: nn.Linear, states: Tensor, padding_mask: Tensor) -> Tensor:
    """The decoder's first state: tanh of a projection of the mean encoder state over the real tokens."""
    valid = (~padding_mask).unsqueeze(-1).type_as(states)
    mean = (states * valid).sum(1) / valid.sum(1).clamp(min=1)
    return torch.tanh(init_state(mean))


class RnnFcTransformerEncoder(TransformerEncoder):
    """fairseq's transformer encoder under the rnn_fc decoder's interface: batch-first states, the padding mask
    and the decoder's first state. Its parameters keep the transformer's names, so a trained transformer's
    ``encoder.*`` tensors load into it as they are (``init_state`` is its own)."""

    def __init__(self, args, dictionary, embed_tokens: nn.Embedding):
        super().__init__(args, dictionary, embed_tokens)
        self.output_dim = embed_tokens.embedding_dim
        self.init_state = nn.Linear(self.output_dim, args.decoder_hidden_size)

    def forward(self, src_tokens: Tensor, src_lengths: Tensor, **kwargs):
        out = super().forward(src_tokens, src_lengths=src_lengths)
        states = out["encoder_out"][0].transpose(0, 1)  # (B, T, C)
        padding_mask = out["encoder_padding_mask"][0]
        return {
            "encoder_out": [states],
            "encoder_padding_mask": [padding_mask],
            "decoder_init_state": [_first_state(self.init_state, states, padding_mask)],
        }

    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order: Tensor):
        return _reorder_batch_first(encoder_out, new_order)


class RnnFcDecoder(FairseqIncrementalDecoder):
    def __init__(self, args, dictionary, embed_tokens: nn.Embedding, encoder_dim: int):
        super().__init__(dictionary)
        self.embed_tokens = embed_tokens
        embed_dim = embed_tokens.embedding_dim
        hidden, att = args.decoder_hidden_size, args.rnn_fc_attention_dim
        self.hidden_size, self.attention_dim, self.encoder_dim = hidden, att, encoder_dim
        self.dropout_module = FairseqDropout(args.dropout, module_name=self.__class__.__name__)
        self.input_proj = nn.Linear(embed_dim, att + 3 * hidden)
        self.state_proj = nn.Linear(hidden, att + 3 * hidden)
        self.key_proj = nn.Linear(encoder_dim, att, bias=False)
        self.attention_v = nn.Linear(att, 1, bias=False)
        self.context_proj = nn.Linear(encoder_dim, 3 * hidden, bias=False)
        self.layout = args.rnn_fc_fc_layout
        if self.layout not in FC_LAYOUTS:
            raise InputError(f"--rnn-fc-fc-layout {self.layout}: choose one of {', '.join(FC_LAYOUTS)}")
        layers, width = args.rnn_fc_fc_layers, args.rnn_fc_fc_dim
        self.fc_dropout = FairseqDropout(args.rnn_fc_fc_dropout, module_name=self.__class__.__name__)
        self.fc_input = self.fc_norms = self.fc_final_norm = None
        if self.layout == "paper":
            sizes = [hidden + encoder_dim] + [width] * layers
            self.fc_layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
            top_in = sizes[-1]
        else:
            self.fc_layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
            if layers:
                self.fc_input = nn.Linear(hidden + encoder_dim, width)
                self.fc_norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
                self.fc_final_norm = nn.LayerNorm(width)
            top_in = width if layers else hidden + encoder_dim
        if args.rnn_fc_fc_init not in FC_INITS:
            raise InputError(f"--rnn-fc-fc-init {args.rnn_fc_fc_init}: choose one of {', '.join(FC_INITS)}")
        he_init = args.rnn_fc_fc_init == "he"
        if he_init and self.fc_input is not None:
            nn.init.xavier_uniform_(self.fc_input.weight)
            nn.init.zeros_(self.fc_input.bias)
        for layer in self.fc_layers if he_init else ():
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        self.activation_clip = args.rnn_fc_activation_clip
        self.top = args.rnn_fc_top
        if self.top not in TOP_LAYERS:
            raise InputError(f"--rnn-fc-top {self.top}: choose one of {', '.join(TOP_LAYERS)}")
        out_dim = args.decoder_output_dim
        if self.top == "tanh":
            self.top_layer = nn.Linear(top_in, out_dim)
            if he_init:
                nn.init.xavier_uniform_(self.top_layer.weight)
                nn.init.zeros_(self.top_layer.bias)
        else:
            self.top_layer = nn.GRU(top_in, out_dim)
        if args.share_decoder_input_output_embed:
            if out_dim != embed_dim:
                raise InputError(f"--share-decoder-input-output-embed needs --decoder-output-dim ({out_dim}) "
                                 f"== --decoder-embed-dim ({embed_dim})")
            self.output_projection = nn.Linear(out_dim, len(dictionary), bias=False)
            self.output_projection.weight = embed_tokens.weight
        else:
            self.output_projection = nn.Linear(out_dim, len(dictionary), bias=False)
            nn.init.normal_(self.output_projection.weight, mean=0, std=out_dim ** -0.5)
        self.max_target_positions = args.max_target_positions

    # ---- the pieces of one step ----------------------------------------------------------------------
    def input_projection(self, tokens: Tensor) -> Tensor:
        """W e + b_x of the previous target tokens: (...,) -> (..., att + 3 hidden)."""
        return self.input_proj(self.dropout_module(self.embed_tokens(tokens)))

    def state_projection(self, state: Tensor) -> Tensor:
        """U h + b_u: (n, hidden) -> (n, att + 3 hidden)."""
        return self.state_proj(state)

    def source_keys(self, encoder_states: Tensor) -> Tensor:
        """K s_j: (B, T, encoder_dim) -> (B, T, att)."""
        return self.key_proj(encoder_states)

    def attend(self, query: Tensor, keys: Tensor, values: Tensor, padding_mask: Tensor) -> Tensor:
        """Context vectors of k query rows per sentence. query (B, k, att), keys (B, T, att), values
        (B, T, encoder_dim), padding_mask (B, T) -> (B, k, encoder_dim)."""
        energies = self.attention_v(torch.tanh(keys.unsqueeze(1) + query.unsqueeze(2))).squeeze(-1)  # (B, k, T)
        energies = energies.masked_fill(padding_mask.unsqueeze(1), float("-inf"))
        return torch.bmm(torch.softmax(energies, dim=-1), values)

    def gru_update(self, input_part: Tensor, state_part: Tensor, context: Tensor, state: Tensor) -> Tensor:
        """The GRU gates from the three projections (the query parts are skipped) -> the new state."""
        att, hidden = self.attention_dim, self.hidden_size
        gates = self.context_proj(context)
        x_z, x_r, x_n = input_part[..., att:].split(hidden, dim=-1)
        u_z, u_r, u_n = state_part[..., att:].split(hidden, dim=-1)
        g_z, g_r, g_n = gates.split(hidden, dim=-1)
        z = torch.sigmoid(x_z + u_z + g_z)
        r = torch.sigmoid(x_r + u_r + g_r)
        return (1 - z) * torch.tanh(x_n + g_n + r * u_n) + z * state

    def fc_stack(self, state: Tensor, context: Tensor) -> Tensor:
        x = torch.cat([state, context], dim=-1)
        if self.layout == "residual":
            if self.fc_input is None:
                return x
            x = self.fc_input(x)
            for norm, layer in zip(self.fc_norms, self.fc_layers):
                x = x + self.fc_dropout(torch.relu(layer(norm(x))))
            x = self.fc_final_norm(x)
            # A normalised output exceeds a fixed-point range only in outliers; the clip keeps the paper's bound.
            return x.clamp(-self.activation_clip, self.activation_clip) if self.activation_clip > 0 else x
        for i, layer in enumerate(self.fc_layers):
            y = torch.relu(layer(self.fc_dropout(x)))
            # A skip connection on every second layer (the first has a different input size).
            if i % 2 == 1 and y.shape == x.shape:
                y = y + x
            x = y.clamp(max=self.activation_clip) if self.activation_clip > 0 else y
        return x

    def top_step(self, features: Tensor, top_state: Optional[Tensor]):
        """One step of the top layer: (n, fc) -> ((n, out), new top state or None)."""
        features = self.dropout_module(features)
        if self.top == "tanh":
            return torch.tanh(self.top_layer(features)), None
        out, new_state = self.top_layer(features.unsqueeze(0), None if top_state is None else top_state.unsqueeze(0))
        return out.squeeze(0), new_state.squeeze(0)

    def logits(self, outputs: Tensor, candidates: Optional[Tensor] = None) -> Tensor:
        """Output layer over the whole vocabulary, or over ``candidates`` (a candidate list) only."""
        outputs = self.dropout_module(outputs)
        if candidates is None:
            return self.output_projection(outputs)
        return F.linear(outputs, self.output_projection.weight[candidates])

    def step(self, input_part: Tensor, state: Tensor, state_part: Tensor, keys: Tensor, values: Tensor,
             padding_mask: Tensor):
        """AttGRU for k rows per sentence given their projections: (B, k, .) tensors -> (new state, context)."""
        att = self.attention_dim
        context = self.attend(input_part[..., :att] + state_part[..., :att], keys, values, padding_mask)
        return self.gru_update(input_part, state_part, context, state), context

    # ---- fairseq interface -----------------------------------------------------------------------------
    def forward(self, prev_output_tokens: Tensor, encoder_out=None, incremental_state=None, features_only=False,
                **kwargs):
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        return (x if features_only else self.output_layer(x)), extra

    def extract_features(self, prev_output_tokens: Tensor, encoder_out=None, incremental_state=None, **kwargs):
        values = encoder_out["encoder_out"][0]
        padding_mask = encoder_out["encoder_padding_mask"][0]
        cached = self.get_incremental_state(incremental_state, "rnn_fc_state") if incremental_state is not None \
            else None
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
        if cached is None:
            state = encoder_out["decoder_init_state"][0]
            keys = self.source_keys(values)
            top_state = None
        else:
            state, keys, top_state = cached["state"], cached["keys"], cached.get("top_state")
        inputs = self.input_projection(prev_output_tokens)  # (B, T, .)
        states, contexts = [], []
        for t in range(prev_output_tokens.size(1)):
            state_part = self.state_projection(state)
            state, context = self.step(inputs[:, t:t + 1], state.unsqueeze(1), state_part.unsqueeze(1), keys, values,
                                       padding_mask)
            state, context = state.squeeze(1), context.squeeze(1)
            states.append(state)
            contexts.append(context)
        features = self.fc_stack(torch.stack(states, 1), torch.stack(contexts, 1))  # (B, T, fc)
        if self.top == "tanh":
            outputs, _ = self.top_step(features, None)
        else:
            features = self.dropout_module(features)
            out, last = self.top_layer(features.transpose(0, 1), None if top_state is None else top_state.unsqueeze(0))
            outputs, top_state = out.transpose(0, 1), last.squeeze(0)
        if incremental_state is not None:
            new_cache = {"state": state, "keys": keys}
            if top_state is not None:
                new_cache["top_state"] = top_state
            self.set_incremental_state(incremental_state, "rnn_fc_state", new_cache)
        return outputs, {"attn": None}

    def output_layer(self, features: Tensor) -> Tensor:
        return self.logits(features)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        cached = self.get_incremental_state(incremental_state, "rnn_fc_state")
        if cached is None:
            return
        self.set_incremental_state(incremental_state, "rnn_fc_state",
                                   {key: value.index_select(0, new_order) for key, value in cached.items()})

    def max_positions(self):
        return self.max_target_positions


@register_model("rnn_fc")
class RnnFcModel(FairseqEncoderDecoderModel):
    """Devlin (2017): bidirectional GRU encoder, AttGRU + stacked FC-ReLU decoder (see the module docstring)."""

    @staticmethod
    def add_args(parser):
        parser.add_argument("--dropout", type=float, metavar="D", help="dropout probability")
        parser.add_argument("--encoder-embed-dim", type=int, metavar="N", help="source embedding size")
        parser.add_argument("--encoder-hidden-size", type=int, metavar="N", help="encoder GRU size per direction")
        parser.add_argument("--encoder-layers", type=int, metavar="N", help="bidirectional GRU layers")
        parser.add_argument("--decoder-embed-dim", type=int, metavar="N", help="target embedding size")
        parser.add_argument("--decoder-hidden-size", type=int, metavar="N", help="AttGRU state size")
        parser.add_argument("--decoder-output-dim", type=int, metavar="N",
                            help="size of the top (FC-tanh or GRU) layer, the softmax's input")
        parser.add_argument("--rnn-fc-attention-dim", type=int, metavar="N", help="attention hidden size")
        parser.add_argument("--rnn-fc-fc-layers", type=int, metavar="N",
                            help="stacked fully-connected ReLU layers above the AttGRU")
        parser.add_argument("--rnn-fc-fc-dim", type=int, metavar="N", help="size of each fully-connected layer")
        parser.add_argument("--rnn-fc-top", choices=TOP_LAYERS, help="top layer below the softmax: FC-tanh or GRU")
        parser.add_argument("--rnn-fc-fc-layout", choices=FC_LAYOUTS,
                            help="residual: a projection to the FC width, then pre-norm residual FC-ReLU blocks and "
                                 "a final layer norm (default); paper: Devlin's stack, skips on every second layer")
        parser.add_argument("--rnn-fc-fc-init", choices=FC_INITS,
                            help="he: He initialisation of the FC-ReLU layers and Xavier for the FC-tanh top, zero "
                                 "biases (default); torch: nn.Linear's default, under which the stack's output "
                                 "barely depends on its input (kept to measure the difference)")
        parser.add_argument("--rnn-fc-fc-dropout", type=float, metavar="D",
                            help="dropout inside the FC stack (residual: on each block's output; paper: on each "
                                 "layer's input); --dropout still applies to the embeddings, the top and the softmax")
        parser.add_argument("--rnn-fc-weight-clip", type=float, metavar="W",
                            help="keep every weight matrix in [-W, W] during training, so that it fits a "
                                 "low-precision range (0: off)")
        parser.add_argument("--rnn-fc-activation-clip", type=float, metavar="A",
                            help="clip the fully-connected activations to at most A (0: off)")
        parser.add_argument("--rnn-fc-encoder", choices=ENCODERS,
                            help="bigru: the paper's bidirectional GRU encoder (default); transformer: fairseq's "
                                 "transformer encoder (--encoder-embed-dim, --encoder-layers, "
                                 "--encoder-ffn-embed-dim, --encoder-attention-heads), which the "
                                 "rnn_fc_translation task's --rnn-fc-base-checkpoint can start from a trained "
                                 "transformer's (our deviation from the paper)")
        parser.add_argument("--rnn-fc-freeze-encoder", action="store_true",
                            help="train the decoder only: the encoder's parameters (its embeddings too, which "
                                 "--share-all-embeddings shares with the decoder and the softmax) keep their "
                                 "values, e.g. those of --rnn-fc-base-checkpoint; the first-state projection "
                                 "still trains")
        parser.add_argument("--share-decoder-input-output-embed", action="store_true",
                            help="tie the softmax weights to the target embeddings")
        parser.add_argument("--share-all-embeddings", action="store_true",
                            help="one embedding for source and target (needs a joint dictionary)")

    @classmethod
    def build_model(cls, args, task):
        if not hasattr(args, "rnn_fc_fc_layout"):  # a checkpoint saved before the residual layout existed
            args.rnn_fc_fc_layout = "paper"
        rnn_fc_base(args)
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        encoder_embed = _embedding(src_dict, args.encoder_embed_dim)
        if args.share_all_embeddings:
            if src_dict != tgt_dict:
                raise InputError("--share-all-embeddings needs a joint dictionary (the same dict for both sides)")
            if args.encoder_embed_dim != args.decoder_embed_dim:
                raise InputError("--share-all-embeddings needs --encoder-embed-dim == --decoder-embed-dim")
            decoder_embed = encoder_embed
        else:
            decoder_embed = _embedding(tgt_dict, args.decoder_embed_dim)
        if args.rnn_fc_encoder not in ENCODERS:
            raise InputError(f"--rnn-fc-encoder {args.rnn_fc_encoder}: choose one of {', '.join(ENCODERS)}")
        encoder_cls = RnnFcTransformerEncoder if args.rnn_fc_encoder == "transformer" else RnnFcEncoder
        encoder = encoder_cls(args, src_dict, encoder_embed)
        decoder = RnnFcDecoder(args, tgt_dict, decoder_embed, encoder.output_dim)
        model = cls(encoder, decoder, weight_clip=args.rnn_fc_weight_clip)
        if args.rnn_fc_freeze_encoder:
            for name, param in encoder.named_parameters():
                param.requires_grad = name.startswith("init_state.")
        return model

    def __init__(self, encoder, decoder, weight_clip: float = 0.0):
        super().__init__(encoder, decoder)
        self.weight_clip = weight_clip

    def load_base_checkpoint(self, path: str, flag: str) -> None:
        """Warm start of a transformer encoder from a trained fairseq transformer of the same encoder sizes and
        dictionaries (e.g. the baseline): every ``encoder.*`` tensor but the first-state projection, and the target
        embeddings (the softmax's too when tied to them). The rest of the decoder keeps its initialisation."""
        if not isinstance(self.encoder, RnnFcTransformerEncoder):
            raise InputError(f"{flag} {path}: needs --rnn-fc-encoder transformer (a BiGRU encoder has no "
                             "transformer to start from)")
        warm_start(self, path, flag,
                   required=lambda key: key.startswith("encoder.") and not key.startswith("encoder.init_state."),
                   take=lambda key: key.startswith(("encoder.", "decoder.embed_tokens."))
                   and not key.endswith("_float_tensor"))

    def clipped_weights(self):
        """The matrices --rnn-fc-weight-clip keeps in range: every Linear and GRU weight (not embeddings), except
        a transformer encoder's, which come from an unclipped training (--rnn-fc-base-checkpoint) and which the
        fast decoder does not run in low precision."""
        modules = self.modules()
        if isinstance(self.encoder, RnnFcTransformerEncoder):
            modules = chain(self.decoder.modules(), [self.encoder.init_state])
        for module in modules:
            if isinstance(module, (nn.Linear, nn.GRU)):
                for name, param in module.named_parameters(recurse=False):
                    if name.startswith("weight") and param is not self.decoder.embed_tokens.weight:
                        yield param

    def clip_weights(self) -> None:
        if self.weight_clip > 0:
            with torch.no_grad():
                for param in self.clipped_weights():
                    param.clamp_(-self.weight_clip, self.weight_clip)

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **kwargs):
        # Projected training: each update's weights are put back in range before they are used.
        if self.training:
            self.clip_weights()
        return super().forward(src_tokens, src_lengths, prev_output_tokens, **kwargs)

    def max_positions(self):
        return (self.encoder.max_positions(), self.decoder.max_positions())


# ---- presets ------------------------------------------------------------------------------------------
def _set(args, **values):
    for name, value in values.items():
        set_default(args, name, value)


@register_model_architecture("rnn_fc", "rnn_fc")
def rnn_fc_base(args):
    """Every default; the other presets set what they change first."""
    _set(args, dropout=0.2, encoder_embed_dim=512, encoder_hidden_size=512, encoder_layers=3)
    _set(args, decoder_embed_dim=args.encoder_embed_dim, decoder_hidden_size=512, rnn_fc_attention_dim=512,
         rnn_fc_fc_layers=7, rnn_fc_fc_dim=1024, rnn_fc_top="tanh", rnn_fc_weight_clip=0.0,
         rnn_fc_activation_clip=0.0, share_decoder_input_output_embed=False, share_all_embeddings=False,
         max_source_positions=1024, max_target_positions=1024, rnn_fc_fc_layout="residual",
         rnn_fc_fc_init="he", rnn_fc_encoder="bigru", rnn_fc_freeze_encoder=False)
    _set(args, rnn_fc_fc_dropout=args.dropout if args.rnn_fc_fc_layout == "paper" else 0.1)
    _set(args, decoder_output_dim=args.decoder_embed_dim)
    # checkpoints pickle args: plain strs, never ChoiceEnum values
    args.rnn_fc_top, args.rnn_fc_fc_layout = str(args.rnn_fc_top), str(args.rnn_fc_fc_layout)
    args.rnn_fc_encoder = str(args.rnn_fc_encoder)
    if args.rnn_fc_encoder == "transformer":
        # fairseq's own defaults for whatever transformer-encoder setting the preset left open (post-norm,
        # sinusoidal positions, ...); the rnn_fc settings above are already set and stay.
        transformer_base_architecture(args)


# The paper's Table 2 compares FC depth and the top layer; S1-S6 are that ladder at the rnn_fc sizes.
TABLE2_LADDER = {"s1": (0, "tanh"), "s2": (0, "gru"), "s3": (3, "tanh"), "s4": (3, "gru"), "s5": (7, "tanh"),
                 "s6": (7, "gru")}


def _table2_preset(name: str, fc_layers: int, top: str):
    def preset(args):
        _set(args, rnn_fc_fc_layers=fc_layers, rnn_fc_top=top)
        rnn_fc_base(args)

    preset.__doc__ = f"Table 2 {name.upper()}: {fc_layers} FC-ReLU layers, {'FC-tanh' if top == 'tanh' else 'GRU'} top."
    register_model_architecture("rnn_fc", f"rnn_fc_{name}")(preset)


for _name, (_layers, _top) in TABLE2_LADDER.items():
    _table2_preset(_name, _layers, _top)


@register_model_architecture("rnn_fc", "rnn_fc_multi30k")
def rnn_fc_multi30k(args):
    """Sized for Multi30k on two CPU cores (the baseline transformer's 256-d, joint dictionary)."""
    # encoder_ffn_embed_dim and encoder_attention_heads: a transformer encoder (--rnn-fc-encoder) the baseline's.
    _set(args, encoder_ffn_embed_dim=1024, encoder_attention_heads=4)
    _set(args, encoder_embed_dim=256, encoder_hidden_size=256, decoder_hidden_size=256, rnn_fc_attention_dim=256,
         rnn_fc_fc_layers=4, rnn_fc_fc_dim=512, dropout=0.3, share_all_embeddings=True,
         share_decoder_input_output_embed=True, rnn_fc_weight_clip=1.0, rnn_fc_activation_clip=16.0)
    rnn_fc_base(args)


@register_model_architecture("rnn_fc", "rnn_fc_multi30k_transformer_encoder")
def rnn_fc_multi30k_transformer_encoder(args):
    """rnn_fc_multi30k's decoder on the baseline transformer's encoder (3 layers, 256-d, 4 heads, FFN 1024), to
    start from a trained one (--rnn-fc-base-checkpoint); the decoder has its own embeddings, tied to its softmax,
    so that a frozen encoder (--rnn-fc-freeze-encoder) leaves them free to train."""
    _set(args, rnn_fc_encoder="transformer", share_all_embeddings=False, share_decoder_input_output_embed=True)
    rnn_fc_multi30k(args)


@register_model_architecture("rnn_fc", "rnn_fc_tiny")
def rnn_fc_tiny(args):
    """For the tests and the demo."""
    _set(args, encoder_ffn_embed_dim=128, encoder_attention_heads=2)
    _set(args, encoder_embed_dim=64, encoder_hidden_size=64, encoder_layers=2, decoder_hidden_size=64,
         rnn_fc_attention_dim=64, rnn_fc_fc_layers=2, rnn_fc_fc_dim=128, dropout=0.1)
    rnn_fc_base(args)
