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

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoder, TransformerModel, base_architecture

from ..baseline.model import baseline_transformer_multi30k, baseline_transformer_tiny
from ..common import incremental
from ..common.incremental import IncrementalState
from ..common.warm_start import warm_start


class ProposalHeads(nn.Module):
    """One FFN (d -> k*d_ff -> k*d, ReLU) whose k output slices are added to the decoder state.

    With ``learned_first_head`` False, head 1 is the identity and the FFN only produces heads 2..k.
    """

    def __init__(self, embed_dim: int, ffn_dim_per_head: int, num_heads: int, learned_first_head: bool,
                 dropout: float):
        super().__init__()
        assert num_heads >= 1, f"a blockwise model needs at least one head, got {num_heads}"
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.learned_first_head = learned_first_head
        self.num_learned = num_heads if learned_first_head else num_heads - 1
        self.dropout = nn.Dropout(dropout)
        if self.num_learned > 0:
            self.fc1 = nn.Linear(embed_dim, num_heads * ffn_dim_per_head)
            self.fc2 = nn.Linear(num_heads * ffn_dim_per_head, self.num_learned * embed_dim)
            # Start each learned head at the identity (zero residual): heads begin as copies of the base,
            # a better starting point than noise for a warm-started model.
            nn.init.zeros_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor, heads: Optional[Sequence[int]] = None) -> Tensor:
        """x: (..., d) decoder states -> (..., len(heads), d), heads 0-based (default: all k)."""
        heads = list(range(self.num_heads)) if heads is None else list(heads)
        learned = [h if self.learned_first_head else h - 1 for h in heads]
        needed = [j for j in learned if j >= 0]
        if needed:
            hidden = self.dropout(F.relu(self.fc1(x)))
            d = self.embed_dim
            # Only the output rows of the requested heads are computed (one head per batch in training
            # with --blockwise-loss sample, the block size's heads at inference).
            if needed == list(range(needed[0], needed[-1] + 1)):  # contiguous heads: a view, no copy
                weight = self.fc2.weight[needed[0] * d:(needed[-1] + 1) * d]
                bias = self.fc2.bias[needed[0] * d:(needed[-1] + 1) * d]
            else:
                rows = torch.tensor(needed, device=x.device)
                row_index = (rows.unsqueeze(1) * d + torch.arange(d, device=x.device)).view(-1)
                weight, bias = self.fc2.weight.index_select(0, row_index), self.fc2.bias.index_select(0, row_index)
            deltas = F.linear(hidden, weight, bias).view(*x.shape[:-1], len(needed), d)
        outputs = []
        next_needed = 0
        for j in learned:
            if j < 0:
                outputs.append(x)
            else:
                outputs.append(x + deltas[..., next_needed, :])
                next_needed += 1
        return torch.stack(outputs, dim=-2)


class BlockwiseTransformerDecoder(TransformerDecoder):
    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn, output_projection)
        if self.adaptive_softmax is not None:
            raise ValueError("blockwise_transformer: --adaptive-softmax-cutoff is not supported (each proposal "
                             "head reuses the plain output projection)")
        self.proposal_heads = ProposalHeads(
            self.output_embed_dim, args.blockwise_ffn_dim, args.blockwise_heads,
            args.blockwise_learned_first_head, args.dropout,
        )

    @property
    def num_proposal_heads(self) -> int:
        return self.proposal_heads.num_heads

    def head_logits(self, features: Tensor, heads: Optional[Sequence[int]] = None) -> Tensor:
        """features (..., d) from ``forward(features_only=True)`` -> logits (..., len(heads), V)."""
        return self.output_layer(self.proposal_heads(features, heads))

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
        parser.add_argument("--blockwise-learned-first-head", action="store_true", default=None,
                            help="learn p_1 too instead of keeping the base model's predictions exactly")
        parser.add_argument("--blockwise-freeze-base", action="store_true", default=None,
                            help="train only the proposal heads (the paper's 'regular' setting); "
                                 "otherwise every parameter is fine-tuned")

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        if args.blockwise_freeze_base:
            for name, parameter in model.named_parameters():
                parameter.requires_grad = name.startswith("decoder.proposal_heads.")
        return model

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return BlockwiseTransformerDecoder(args, tgt_dict, embed_tokens,
                                           no_encoder_attn=args.no_cross_attention)

    def load_base_checkpoint(self, path: str) -> None:
        """Warm start: copy every parameter of a trained fairseq transformer; the heads keep their init."""
        warm_start(self, path, "--blockwise-base-checkpoint",
                   required=lambda key: not key.startswith("decoder.proposal_heads."))


def blockwise_defaults(args, num_heads: int = 10):
    if getattr(args, "blockwise_heads", None) is None:
        args.blockwise_heads = num_heads
    if getattr(args, "blockwise_ffn_dim", None) is None:
        args.blockwise_ffn_dim = args.decoder_ffn_embed_dim
    args.blockwise_learned_first_head = bool(getattr(args, "blockwise_learned_first_head", False))
    args.blockwise_freeze_base = bool(getattr(args, "blockwise_freeze_base", False))


@register_model_architecture("blockwise_transformer", "blockwise_transformer")
def blockwise_transformer(args):
    base_architecture(args)
    blockwise_defaults(args)


@register_model_architecture("blockwise_transformer", "blockwise_transformer_multi30k")
def blockwise_transformer_multi30k(args):
    """The baseline's sizes (examples/baseline): warm-starts from its checkpoint."""
    baseline_transformer_multi30k(args)
    blockwise_defaults(args)


@register_model_architecture("blockwise_transformer", "blockwise_transformer_tiny")
def blockwise_transformer_tiny(args):
    baseline_transformer_tiny(args)
    blockwise_defaults(args, num_heads=4)
