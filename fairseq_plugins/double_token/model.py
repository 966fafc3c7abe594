"""``double_token_transformer``: a fairseq transformer whose decoder emits one or two tokens per step.

The decoder has learned positional embeddings (both slots of a step attend to the same inputs; their
positions tell them which of the two tokens to predict) and a self-attention mask whose unit is a step (paper Fig. 1b): with two tokens a step, both positions of step s
see every input of steps <= s, i.e. the two start symbols and the pairs decoded before. In incremental
decoding a call appends the newest pair to fairseq's ``incremental_state`` and returns both slots' outputs;
``reorder_incremental_state`` is fairseq's own. With one token a step it is exactly fairseq's transformer.

How many tokens a step, and in which order, is the task's ``--tokens-per-step`` / ``--token-order``; the
task copies them into the model's arguments, so a checkpoint knows how it was trained.
"""

import logging
from typing import Optional

import torch
from torch import Tensor

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoder, TransformerModel, base_architecture
from fairseq.modules import SinusoidalPositionalEmbedding

from ..common import incremental
from ..common.presets import transformer_multi30k, transformer_tiny
from ..common.textio import InputError
from ..common.warm_start import warm_start
from .folding import check_token_order

logger = logging.getLogger(__name__)


class DoubleTokenTransformerDecoder(TransformerDecoder):
    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn, output_projection)
        self.tokens_per_step = args.tokens_per_step
        if self.tokens_per_step > 1 and self.embed_positions is None:
            raise InputError("double_token_transformer: --no-token-positional-embeddings leaves the slots of a "
                             "step indistinguishable; positional embeddings are required")
        self._step_mask = torch.empty(0)

    def buffered_future_mask(self, tensor: Tensor) -> Tensor:
        """(T, T) additive mask: position i sees position j iff j's step is not after i's step."""
        dim = tensor.size(0)
        if self._step_mask.size(0) < dim or self._step_mask.device != tensor.device:
            step = torch.arange(dim, device=tensor.device) // self.tokens_per_step
            self._step_mask = torch.zeros(dim, dim, device=tensor.device).masked_fill(
                step.unsqueeze(0) > step.unsqueeze(1), float("-inf"))
        return self._step_mask[:dim, :dim].to(tensor)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         full_context_alignment=False, alignment_layer=None, alignment_heads=None):
        if incremental_state is None or self.tokens_per_step == 1:
            return super().extract_features(prev_output_tokens, encoder_out, incremental_state,
                                            full_context_alignment, alignment_layer, alignment_heads)
        # Incremental, two tokens a step: the newest pair (prev_output_tokens holds every input so far).
        length = prev_output_tokens.size(1)
        if length % self.tokens_per_step:
            raise ValueError(f"double-token incremental decoding feeds whole steps of {self.tokens_per_step} "
                             f"tokens; got {length} input tokens")
        positions = torch.arange(length - self.tokens_per_step, length, device=prev_output_tokens.device)
        new_tokens = prev_output_tokens[:, -self.tokens_per_step:]
        x = incremental.new_token_features(self, new_tokens, positions.expand_as(new_tokens), encoder_out,
                                           incremental_state, causal=False)
        return x, {"attn": [None], "inner_states": [x]}


@register_model("double_token_transformer")
class DoubleTokenTransformerModel(TransformerModel):
    """A transformer for double-token decoding; train and decode it with ``--task double_token_translation``."""

    @classmethod
    def build_model(cls, args, task):
        if getattr(args, "tokens_per_step", None) is None or getattr(args, "token_order", None) is None:
            raise InputError("--arch double_token_transformer*: needs --task double_token_translation, which "
                             "sets --token-order and --tokens-per-step")
        check_token_order(args.token_order, args.tokens_per_step)
        return super().build_model(args, task)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return DoubleTokenTransformerDecoder(args, tgt_dict, embed_tokens, no_encoder_attn=args.no_cross_attention)

    def load_base_checkpoint(self, path: str, flag: str) -> None:
        """Warm start from a trained fairseq transformer of the same sizes and data (e.g. the baseline).

        Every tensor is copied as it is, but for two things double-token adds: the EOD symbol, the last row of
        each embedding and output matrix (it starts as EOS's row with two tokens a step, where EOD is the end
        marker in place of EOS; as zeros with one, where it is never a target), and the decoder's learned
        positions, which start as the base's sinusoidal table (or its learned positions, copied as they are).
        So with one token a step (l2r-1) the warm-started model decodes as the base does.
        """
        two_a_step = self.decoder.tokens_per_step == 2
        eos = self.decoder.dictionary.eos()

        def add_eod_row(key: str, base: Tensor, own: Tensor) -> Optional[Tensor]:
            if own.dim() != 2 or own.shape[0] != base.shape[0] + 1 or own.shape[1:] != base.shape[1:]:
                return None
            eod_row = base[eos] if two_a_step else torch.zeros_like(base[eos])
            return torch.cat([base, eod_row.unsqueeze(0)])

        positions = self.decoder.embed_positions
        learned_positions = "decoder.embed_positions.weight"
        copied = warm_start(
            self, path, flag,
            required=lambda key: key != learned_positions, take=lambda key: not key.endswith("_float_tensor"),
            adapt=add_eod_row)
        if learned_positions not in copied:  # a sinusoidal base: its table, indexed as fairseq indexes both
            table = SinusoidalPositionalEmbedding.get_embedding(
                positions.num_embeddings, positions.embedding_dim, positions.padding_idx)
            with torch.no_grad():
                positions.weight.copy_(table)
            logger.info("decoder positions start from the base's sinusoidal table")


def _learned_target_positions(args):
    # The paper's decoder: learned positions, whatever the preset below uses for the encoder.
    args.decoder_learned_pos = True


@register_model_architecture("double_token_transformer", "double_token_transformer")
def double_token_transformer(args):
    """Transformer base (fairseq's ``transformer``), decoder with learned positions."""
    _learned_target_positions(args)
    base_architecture(args)


@register_model_architecture("double_token_transformer", "double_token_transformer_multi30k")
def double_token_transformer_multi30k(args):
    """The baseline's sizes (3+3 layers, 256-d, shared embeddings), decoder with learned positions."""
    _learned_target_positions(args)
    transformer_multi30k(args)


@register_model_architecture("double_token_transformer", "double_token_transformer_tiny")
def double_token_transformer_tiny(args):
    _learned_target_positions(args)
    transformer_tiny(args)
