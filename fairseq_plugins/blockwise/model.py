"""``blockwise_transformer``: a fairseq transformer with k proposal heads (Stern et al. 2018, section 3).

Between the last decoder layer and the (shared) output projection sits one feed-forward layer with hidden
size k * d_ff and output size k * d_model; head i adds its slice of that output to the decoder state
(residual) and applies the original output projection, so p_i predicts the token i - 1 positions after the
one the base predicts. By default p_1 is the identity: the base model's own predictions are kept exactly
(the paper's footnote), and the model's ``forward`` is that of the base, so every stock fairseq tool (beam
search, scoring) treats a blockwise checkpoint as the transformer it extends.

The decoder also runs a *block* of several new tokens against its cache in one call
(``block_features``), which is what the blockwise generator needs: verify k proposals and propose the next
k in a single invocation.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoder, TransformerModel, base_architecture

from ..common import incremental
from ..common.incremental import IncrementalState
from ..common.presets import transformer_multi30k, transformer_tiny
from ..common.textio import InputError
from ..common.warm_start import warm_start


HEAD_LAYOUTS = ("joint", "separate")


class ProposalHeads(nn.Module):
    """k proposal heads: residual feed-forward layers whose outputs go to the model's output projection.

    ``joint`` (the paper's): one FFN d -> k*d_ff -> k*d, ReLU, whose k output slices are added to the decoder
    state; every head reads the whole k*d_ff hidden layer, so even a block of 2 pays for the hidden units of
    all k heads. ``separate``: head i has its own FFN d -> d_ff -> d, so a block of k' < k heads reads only
    those heads' weights (at batch 1 a step is bound by weight reading). With ``learned_first_head`` False,
    head 1 is the identity and only heads 2..k have weights.
    """

    def __init__(self, embed_dim: int, ffn_dim_per_head: int, num_heads: int, learned_first_head: bool,
                 dropout: float, layout: str = "joint"):
        super().__init__()
        assert num_heads >= 1, f"a blockwise model needs at least one head, got {num_heads}"
        assert layout in HEAD_LAYOUTS, f"unknown head layout {layout!r}"
        self.embed_dim = embed_dim
        self.ffn_dim = ffn_dim_per_head
        self.num_heads = num_heads
        self.learned_first_head = learned_first_head
        self.layout = layout
        self.num_learned = num_heads if learned_first_head else num_heads - 1
        self.dropout = nn.Dropout(dropout)
        if self.num_learned > 0:
            hidden = (num_heads if layout == "joint" else self.num_learned) * ffn_dim_per_head
            self.fc1 = nn.Linear(embed_dim, hidden)
            if layout == "joint":
                self.fc2 = nn.Linear(hidden, self.num_learned * embed_dim)
                fc2_weight, fc2_bias = self.fc2.weight, self.fc2.bias
            else:  # one (d, d_ff) output matrix per learned head
                self.fc2_weight = nn.Parameter(torch.empty(self.num_learned, embed_dim, ffn_dim_per_head))
                self.fc2_bias = nn.Parameter(torch.empty(self.num_learned, embed_dim))
                fc2_weight, fc2_bias = self.fc2_weight, self.fc2_bias
            # Start each learned head at the identity (zero residual): heads begin as copies of the base,
            # a better starting point than noise for a warm-started model.
            nn.init.zeros_(fc2_weight)
            nn.init.zeros_(fc2_bias)

    def forward(self, x: Tensor, heads: Optional[Sequence[int]] = None) -> Tensor:
        """x: (..., d) decoder states -> (..., len(heads), d), heads 0-based (default: all k)."""
        heads = list(range(self.num_heads)) if heads is None else list(heads)
        learned = [h if self.learned_first_head else h - 1 for h in heads]
        needed = [j for j in learned if j >= 0]
        if needed:
            deltas = self._deltas(x, needed)
        outputs = []
        next_needed = 0
        for j in learned:
            if j < 0:
                outputs.append(x)
            else:
                outputs.append(x + deltas[..., next_needed, :])
                next_needed += 1
        return torch.stack(outputs, dim=-2)

    def _deltas(self, x: Tensor, needed: List[int]) -> Tensor:
        """The residuals (..., len(needed), d) of the learned heads ``needed`` (0-based among learned heads).

        Only the weights of those heads are read: fc2's rows in the joint layout, fc1's and fc2's blocks in
        the separate one.
        """
        d, h = self.embed_dim, self.ffn_dim
        if self.layout == "joint":
            hidden = self.dropout(F.relu(self.fc1(x)))
            weight, bias = row_blocks(self.fc2.weight, needed, d), row_blocks(self.fc2.bias, needed, d)
            return F.linear(hidden, weight, bias).view(*x.shape[:-1], len(needed), d)
        w1, b1 = row_blocks(self.fc1.weight, needed, h), row_blocks(self.fc1.bias, needed, h)
        hidden = self.dropout(F.relu(F.linear(x, w1, b1))).view(-1, len(needed), h)
        if needed == list(range(needed[0], needed[-1] + 1)):
            w2, b2 = self.fc2_weight[needed[0]:needed[-1] + 1], self.fc2_bias[needed[0]:needed[-1] + 1]
        else:
            index = torch.tensor(needed, device=x.device)
            w2, b2 = self.fc2_weight.index_select(0, index), self.fc2_bias.index_select(0, index)
        # Head by head: (n, N_rows, h) x (n, h, d) -> (n, N_rows, d), one batched matmul.
        deltas = torch.bmm(hidden.transpose(0, 1), w2.transpose(1, 2)).transpose(0, 1) + b2
        return deltas.reshape(*x.shape[:-1], len(needed), d)


def row_blocks(weight: Tensor, blocks: List[int], size: int) -> Tensor:
    """Rows [b*size, (b+1)*size) of ``weight`` for each b in ``blocks``, in that order (a view when contiguous)."""
    if blocks == list(range(blocks[0], blocks[-1] + 1)):
        return weight[blocks[0] * size:(blocks[-1] + 1) * size]
    rows = torch.tensor(blocks, device=weight.device)
    index = (rows.unsqueeze(1) * size + torch.arange(size, device=weight.device)).view(-1)
    return weight.index_select(0, index)


class BlockwiseTransformerDecoder(TransformerDecoder):
    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn, output_projection)
        if self.adaptive_softmax is not None:
            raise InputError("blockwise_transformer: --adaptive-softmax-cutoff is not supported (each proposal "
                             "head reuses the plain output projection)")
        self.proposal_heads = ProposalHeads(
            self.output_embed_dim, args.blockwise_ffn_dim, args.blockwise_heads,
            args.blockwise_learned_first_head, args.dropout, layout=args.blockwise_head_layout,
        )

    @property
    def num_proposal_heads(self) -> int:
        return self.proposal_heads.num_heads

    def head_logits(self, features: Tensor, heads: Optional[Sequence[int]] = None) -> Tensor:
        """features (..., d) from ``forward(features_only=True)`` -> logits (..., len(heads), V).

        Every requested head's rows go through the output projection in one matmul, so its weights are read
        once however many heads ask for it.
        """
        return self.output_layer(self.proposal_heads(features, heads))

    def block_logits(self, features: Tensor, num_heads: int, proposal_vocab: int = 0) -> Tuple[Tensor, Tensor]:
        """What one blockwise iteration needs at every fed position: p_1's logits (..., V) and heads 2..k's
        (..., k - 1, V'), V' = ``proposal_vocab`` (the most frequent tokens: fairseq dictionaries list them
        first; 0 = all).

        With the full vocabulary both come from one product with the output projection, so its weights are
        read once; a proposal vocabulary keeps p_1 exact (one full product) and makes the heads' rows cheap.
        """
        rows = self.proposal_heads(features, range(num_heads))
        if not proposal_vocab or num_heads == 1:
            logits = self.project(rows)
            return logits[..., 0, :], logits[..., 1:, :]
        return self.project(rows[..., 0, :]), self.project(rows[..., 1:, :], proposal_vocab)

    def project(self, x: Tensor, vocab: int = 0) -> Tensor:
        """The output projection of ``x`` (..., d) -> (..., V), or onto the first ``vocab`` entries only."""
        weight = self.output_projection.weight
        if vocab:
            weight = weight[:vocab]
        flat = x.reshape(-1, x.size(-1))
        # (W x^T)^T rather than x W^T: MKL multiplies a few rows by an 8k x 256 matrix 1.2-1.8x faster this way
        # round on the CPUs measured (4-32 rows, one thread); the result is a transposed view, not a copy.
        return torch.mm(weight, flat.t()).t().reshape(*x.shape[:-1], weight.size(0))

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only=False,
                **kwargs):
        x, extra = super().forward(prev_output_tokens, encoder_out=encoder_out,
                                   incremental_state=incremental_state, features_only=True, **kwargs)
        if features_only:
            return x, extra
        if self.proposal_heads.learned_first_head:
            return self.head_logits(x, [0]).squeeze(-2), extra
        return self.output_layer(x), extra

    # --- blocks of new tokens against the cache --------------------------------------------------------

    def cached_length(self, incremental_state: IncrementalState) -> int:
        """Number of key/value slots in the self-attention cache (0 before the first call)."""
        return incremental.cached_length(self, incremental_state)

    def block_features(self, tokens: Tensor, positions: Tensor, encoder_out, incremental_state: IncrementalState
                       ) -> Tensor:
        """Run m new tokens per sentence after the cached ones, causally among themselves.

        tokens, positions: (B, m); positions are 0-based target positions and may differ per sentence (the
        cache of a batch is ragged; its unused slots are masked by the key padding mask the generator keeps).
        Returns the final decoder states (B, m, d); the new keys and values are appended to the cache.
        """
        return incremental.new_token_features(self, tokens, positions, encoder_out, incremental_state, causal=True)

    def rollback_cache(self, incremental_state: IncrementalState, cached: Tensor, accepted: Tensor,
                       physical: int) -> None:
        """Drop the rejected tail of a block fed by ``block_features``.

        Before that call each row had ``cached`` (B,) valid slots, packed first among ``physical`` slots;
        the block was appended after them. Each row keeps its old slots plus the first ``accepted`` (B,) of
        its block, packed again; the rest of the row is padding, masked by the key padding mask.
        """
        new_cached = cached + accepted
        if bool((cached == physical).all()) and bool((accepted == accepted[0]).all()):
            self._truncate_cache(incremental_state, physical + int(accepted[0]))  # batch 1, or all alike
            return
        j = torch.arange(int(new_cached.max()), device=cached.device).unsqueeze(0)
        valid = j < new_cached.unsqueeze(1)
        slots = torch.where(j < cached.unsqueeze(1), j, physical + j - cached.unsqueeze(1))
        self._gather_cache(incremental_state, torch.where(valid, slots, torch.zeros_like(slots)), valid)

    def _gather_cache(self, incremental_state: IncrementalState, slots: Tensor, valid: Tensor) -> None:
        """Keep, per row, the cache slots ``slots`` (B, T') in that order; ``valid`` (B, T') marks real ones."""
        for layer in self.layers:
            attn = layer.self_attn
            state = attn.get_incremental_state(incremental_state, "attn_state")
            bsz, heads, _, head_dim = state["prev_key"].shape
            index = slots.view(bsz, 1, -1, 1).expand(bsz, heads, slots.size(1), head_dim)
            state["prev_key"] = state["prev_key"].gather(2, index)
            state["prev_value"] = state["prev_value"].gather(2, index)
            state["prev_key_padding_mask"] = ~valid
            attn.set_incremental_state(incremental_state, "attn_state", state)

    def _truncate_cache(self, incremental_state: IncrementalState, length: int) -> None:
        """Keep the first ``length`` slots of every row."""
        for layer in self.layers:
            attn = layer.self_attn
            state = attn.get_incremental_state(incremental_state, "attn_state")
            state["prev_key"] = state["prev_key"][:, :, :length]
            state["prev_value"] = state["prev_value"][:, :, :length]
            if state.get("prev_key_padding_mask") is not None:
                state["prev_key_padding_mask"] = state["prev_key_padding_mask"][:, :length]
            attn.set_incremental_state(incremental_state, "attn_state", state)


@register_model("blockwise_transformer")
class BlockwiseTransformerModel(TransformerModel):
    """A transformer whose decoder carries k proposal heads for blockwise parallel decoding."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        # No defaults here: the architecture presets set them (fairseq's convention for argparse models).
        parser.add_argument("--blockwise-heads", type=int, metavar="K",
                            help="number of proposal heads k (the largest block the model can propose)")
        parser.add_argument("--blockwise-ffn-dim", type=int, metavar="N",
                            help="hidden units of the heads' feed-forward layer per head (total k*N; "
                                 "default: --decoder-ffn-embed-dim, the paper's k * d_ff)")
        parser.add_argument("--blockwise-head-layout", choices=HEAD_LAYOUTS, metavar="LAYOUT",
                            help="joint: one FFN d -> k*N -> k*d shared by the heads (the paper's); separate: "
                                 "one FFN d -> N -> d per head, so decoding with --block-size k' reads only "
                                 "k' heads' weights (default: joint)")
        parser.add_argument("--blockwise-learned-first-head", action="store_true", default=None,
                            help="learn p_1 too instead of keeping the base model's predictions exactly")
        parser.add_argument("--blockwise-freeze-base", action="store_true", default=None,
                            help="train only the proposal heads (the paper's 'regular' setting); "
                                 "otherwise every parameter is fine-tuned")

    @classmethod
    def build_model(cls, args, task):
        blockwise_defaults(args, num_heads=getattr(args, "blockwise_heads", None) or 10)  # older checkpoints
        model = super().build_model(args, task)
        model.freeze_base = bool(args.blockwise_freeze_base)
        if model.freeze_base:
            for name, parameter in model.named_parameters():
                parameter.requires_grad = name.startswith("decoder.proposal_heads.")
        return model

    def train(self, mode: bool = True):
        """A frozen base stays in evaluation mode (no dropout) while its heads train: the heads then learn
        from the decoder states that decoding will give them."""
        super().train(mode)
        if mode and getattr(self, "freeze_base", False):
            for name, module in self.named_modules():
                if name and not name.startswith("decoder.proposal_heads") and not name == "decoder":
                    module.eval()
        return self

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return BlockwiseTransformerDecoder(args, tgt_dict, embed_tokens,
                                           no_encoder_attn=args.no_cross_attention)

    def load_base_checkpoint(self, path: str, flag: str) -> None:
        """Warm start: copy every parameter of a trained fairseq transformer; the heads keep their init."""
        warm_start(self, path, flag,
                   required=lambda key: not key.startswith("decoder.proposal_heads."))


def blockwise_defaults(args, num_heads: int = 10):
    if getattr(args, "blockwise_heads", None) is None:
        args.blockwise_heads = num_heads
    if getattr(args, "blockwise_ffn_dim", None) is None:
        args.blockwise_ffn_dim = args.decoder_ffn_embed_dim
    if getattr(args, "blockwise_head_layout", None) is None:
        args.blockwise_head_layout = "joint"  # also what checkpoints saved before the flag existed hold
    args.blockwise_learned_first_head = bool(getattr(args, "blockwise_learned_first_head", False))
    args.blockwise_freeze_base = bool(getattr(args, "blockwise_freeze_base", False))


@register_model_architecture("blockwise_transformer", "blockwise_transformer")
def blockwise_transformer(args):
    base_architecture(args)
    blockwise_defaults(args)


@register_model_architecture("blockwise_transformer", "blockwise_transformer_multi30k")
def blockwise_transformer_multi30k(args):
    """The baseline's sizes (examples/baseline): warm-starts from its checkpoint."""
    transformer_multi30k(args)
    blockwise_defaults(args)


@register_model_architecture("blockwise_transformer", "blockwise_transformer_tiny")
def blockwise_transformer_tiny(args):
    transformer_tiny(args)
    blockwise_defaults(args, num_heads=4)
