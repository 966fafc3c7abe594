"""ByteNet (Kalchbrenner et al. 2016): a dilated CNN encoder with a masked dilated CNN decoder stacked on it.

``bytenet`` (translation): the source network runs over the source dynamically unfolded to
|t̂| = a|s| + b frames (|s| counts the source's end-of-sentence token, as fairseq's source lengths do);
the target network's input at step t is [target embedding ; source representation at t], a zero source
frame from |t̂| on, so decoding may run past |t̂| until EOS. ``bytenet_lm`` is the target network alone.
Both decode incrementally at O(layers) per token (layers.DilatedConv1d keeps each layer's past frames in
``incremental_state``), so the stock SequenceGenerator, fairseq-generate and fairseq-eval-lm run them.
"""

import logging
from typing import Dict, List, Optional

import torch
from fairseq import utils
from fairseq.models import (
    FairseqEncoder,
    FairseqEncoderDecoderModel,
    FairseqIncrementalDecoder,
    FairseqLanguageModel,
    register_model,
    register_model_architecture,
)
from fairseq.modules import FairseqDropout
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask
from torch import Tensor, nn

from ..common.dictionaries import check_vocabulary_sizes, data_directory, keep_or_check_model_dictionaries
from ..common.presets import set_default
from ..common.textio import InputError
from .layers import BLOCK_TYPES, DilatedStack, IncrementalState, keeps_every_row, parse_dilations

logger = logging.getLogger(__name__)

EncoderOut = Dict[str, List[Tensor]]


def unfolded_length(source_length: Tensor, a: float, b: float) -> Tensor:
    """|t̂| = floor(a|s| + b), at least 1 (the 1e-6 keeps e.g. 1.4 * 45 = 62.999... from flooring to 62)."""
    return torch.floor(source_length.double() * a + b + 1e-6).long().clamp(min=1)


def _add_stack_args(parser, side: str):
    parser.add_argument(f"--{side}-embed-dim", type=int, metavar="N", help=f"{side} token embedding size")
    parser.add_argument(f"--{side}-hidden-dim", type=int, metavar="N",
                        help=f"{side} residual blocks' inner width (d of the paper's Fig. 3: 2d -> d -> 2d)")
    parser.add_argument(f"--{side}-blocks", type=int, metavar="N", help=f"{side} residual blocks")
    parser.add_argument(f"--{side}-dilations", type=str, metavar="R,R,...",
                        help=f"{side} dilation rates, cycled over the blocks (the paper: 1,2,4,8,16)")
    parser.add_argument(f"--{side}-block-type", choices=sorted(BLOCK_TYPES),
                        help=f"{side} residual block: relu (Fig. 3 left) or multiplicative (Fig. 3 right)")
    parser.add_argument(f"--{side}-layerdrop", type=float, metavar="P",
                        help=f"LayerDrop: in training, skip each {side} residual block with probability P "
                             "(every block runs at inference; 0, the default, skips none; with several workers "
                             "use --ddp-backend legacy_ddp or --find-unused-parameters)")


def _add_shared_args(parser):
    parser.add_argument("--kernel-size", type=int, metavar="K", help="taps of every dilated convolution")
    parser.add_argument("--output-hidden-dim", type=int, metavar="N",
                        help="width of the output layers (1x1 convolution + ReLU, then 1x1 to the vocabulary)")
    parser.add_argument("--dropout", type=float, metavar="P", help="dropout on embeddings and block outputs")


class ByteNetEncoder(FairseqEncoder):
    """The source network: embedding, then unmasked dilated residual blocks over the unfolded source."""

    def __init__(self, args, dictionary, embed_tokens):
        super().__init__(dictionary)
        self.padding_idx = dictionary.pad()
        self.embed_tokens = embed_tokens
        self.dropout = FairseqDropout(args.dropout, module_name=self.__class__.__name__)
        self.stack = DilatedStack(
            args.encoder_embed_dim, args.encoder_hidden_dim, args.encoder_blocks,
            parse_dilations(args.encoder_dilations, "--encoder-dilations"), args.kernel_size,
            args.encoder_block_type, masked=False, dropout=args.dropout,
            layerdrop=args.encoder_layerdrop,
        )
        self.unfold_a, self.unfold_b = args.unfold_a, args.unfold_b
        self.max_source_positions = args.max_source_positions

    def forward(self, src_tokens: Tensor, src_lengths: Optional[Tensor] = None, **kwargs) -> EncoderOut:
        # Source frame t feeds target step t, so sentences must start at frame 0: fairseq left-pads sources.
        tokens = utils.convert_padding_direction(src_tokens, self.padding_idx, left_to_right=True)
        lengths = tokens.ne(self.padding_idx).sum(dim=1)
        unfolded = unfolded_length(lengths, self.unfold_a, self.unfold_b)
        frames = int(torch.maximum(lengths, unfolded).max())
        if frames > tokens.size(1):
            tokens = nn.functional.pad(tokens, (0, frames - tokens.size(1)), value=self.padding_idx)
        tokens = tokens[:, :frames]  # a batch padded wider than needed (e.g. --required-seq-len-multiple)
        positions = torch.arange(frames, device=tokens.device).unsqueeze(0)
        in_source = positions < lengths.unsqueeze(1)
        active = positions < torch.maximum(lengths, unfolded).unsqueeze(1)
        # Unfolded frames past the source start from zero input and are filled in by the convolutions.
        x = self.dropout(self.embed_tokens(tokens) * in_source.unsqueeze(-1).type_as(self.embed_tokens.weight))
        x = self.stack(x, keep=active)
        x = x * (positions < unfolded.unsqueeze(1)).unsqueeze(-1).type_as(x)
        return {"encoder_out": [x], "unfolded_lengths": [unfolded], "src_lengths": [lengths]}

    def reorder_encoder_out(self, encoder_out: EncoderOut, new_order: Tensor) -> EncoderOut:
        if keeps_every_row(new_order, encoder_out["encoder_out"][0].size(0)):
            return encoder_out
        return {key: [value.index_select(0, new_order) for value in values] for key, values in encoder_out.items()}

    def max_positions(self):
        return self.max_source_positions


class ByteNetDecoder(FairseqIncrementalDecoder):
    """The target network: masked dilated residual blocks, then 1x1 + ReLU, 1x1 to the vocabulary.

    ``source_channels`` > 0 stacks it on an encoder (input [embedding ; source frame t]); 0 makes a
    language model.
    """

    def __init__(self, args, dictionary, embed_tokens, source_channels: int = 0):
        super().__init__(dictionary)
        self.embed_tokens = embed_tokens
        self.source_channels = source_channels
        channels = args.decoder_embed_dim + source_channels
        self.dropout = FairseqDropout(args.dropout, module_name=self.__class__.__name__)
        self.stack = DilatedStack(
            channels, args.decoder_hidden_dim, args.decoder_blocks,
            parse_dilations(args.decoder_dilations, "--decoder-dilations"), args.kernel_size,
            args.decoder_block_type, masked=True, dropout=args.dropout,
            layerdrop=args.decoder_layerdrop,
        )
        self.output_hidden = nn.Linear(channels, args.output_hidden_dim)
        self.output_projection = nn.Linear(args.output_hidden_dim, len(dictionary))
        self.max_target_positions = args.max_target_positions

    def receptive_field(self) -> int:
        return self.stack.receptive_field()

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Optional[EncoderOut] = None,
        incremental_state: Optional[IncrementalState] = None,
        features_only: bool = False,
        **kwargs,
    ):
        x = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        if not features_only:
            x = self.output_layer(x)
        return x, {"attn": [None]}

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        start = 0
        if incremental_state is not None:
            saved = self.get_incremental_state(incremental_state, "steps")
            start = int(saved["count"].item()) if saved is not None else 0
            self.set_incremental_state(
                incremental_state, "steps", {"count": torch.tensor(prev_output_tokens.size(1))}
            )
        tokens = prev_output_tokens[:, start:]
        x = self.embed_tokens(tokens)
        if self.source_channels:
            if encoder_out is None:
                raise ValueError("a ByteNet translation decoder needs the encoder's output")
            x = torch.cat([x, self._source_frames(encoder_out["encoder_out"][0], start, tokens.size(1))], dim=-1)
        return self.stack(self.dropout(x), incremental_state=incremental_state)

    @staticmethod
    def _source_frames(source: Tensor, start: int, count: int) -> Tensor:
        """Source frames start .. start+count-1; zero beyond the unfolded length (already zero inside it)."""
        frames = source[:, start:start + count]
        if frames.size(1) < count:
            frames = nn.functional.pad(frames, (0, 0, 0, count - frames.size(1)))
        return frames

    def output_layer(self, features, **kwargs):
        return self.output_projection(torch.relu(self.output_hidden(features)))

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        # Only the stack holds frames (the step count is the same for every hypothesis).
        self.stack.reorder_incremental_state(incremental_state, new_order)

    def reorder_incremental_state_scripting(self, incremental_state: IncrementalState, new_order: Tensor):
        # What the generator calls at every step: the stack directly, instead of fairseq's default walk over
        # every submodule.
        self.reorder_incremental_state(incremental_state, new_order)

    def max_positions(self):
        return self.max_target_positions


@register_model("bytenet")
class ByteNetModel(FairseqEncoderDecoderModel):
    """ByteNet for translation (presets: bytenet, bytenet_multi30k_char, bytenet_tiny)."""

    @staticmethod
    def add_args(parser):
        _add_stack_args(parser, "encoder")
        _add_stack_args(parser, "decoder")
        _add_shared_args(parser)
        parser.add_argument("--unfold-a", type=float, metavar="A",
                            help="dynamic unfolding |t̂| = a|s| + b: the source is unfolded to this many frames")
        parser.add_argument("--unfold-b", type=float, metavar="B", help="b of the dynamic unfolding")
        parser.add_argument("--share-all-embeddings", action="store_true",
                            help="one embedding for source and target (needs a joined dictionary and equal sizes)")
        parser.add_argument("--max-source-positions", type=int, metavar="N",
                            help="longest source accepted (convolutions have no length limit; this bounds memory)")
        parser.add_argument("--max-target-positions", type=int, metavar="N", help="longest target accepted")

    @classmethod
    def build_model(cls, args, task):
        bytenet(args)  # fill what a preset left unset
        if isinstance(task, LanguageModelingTask):
            raise InputError(
                f"--arch {args.arch}: a ByteNet translation model (source and target networks) given to --task "
                "language_modeling (fairseq-train, or fairseq-eval-lm with a translation checkpoint as --path): "
                "the language model is --arch bytenet_lm (or a preset of it, e.g. bytenet_lm_shakespeare)")
        _check_args(args)
        keep_or_check_model_dictionaries(args, task, "ByteNet")
        if args.unfold_a <= 0:
            raise InputError(f"--unfold-a {args.unfold_a}: expected a positive number")
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        encoder_embed = nn.Embedding(len(src_dict), args.encoder_embed_dim, src_dict.pad())
        if args.share_all_embeddings:
            if src_dict != tgt_dict:
                raise InputError("--share-all-embeddings needs a joined dictionary (fairseq-preprocess --joined-dictionary)")
            if args.encoder_embed_dim != args.decoder_embed_dim:
                raise InputError("--share-all-embeddings needs --encoder-embed-dim == --decoder-embed-dim")
            decoder_embed = encoder_embed
        else:
            decoder_embed = nn.Embedding(len(tgt_dict), args.decoder_embed_dim, tgt_dict.pad())
        _warn_if_unfolding_changed(args)
        encoder = ByteNetEncoder(args, src_dict, encoder_embed)
        decoder = ByteNetDecoder(args, tgt_dict, decoder_embed, source_channels=args.encoder_embed_dim)
        model = cls(encoder, decoder)
        model.data_directory = data_directory(task)
        return model

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_vocabulary_sizes(state_dict, {"encoder.embed_tokens.weight": len(self.encoder.dictionary),
                                            "decoder.embed_tokens.weight": len(self.decoder.dictionary)},
                               getattr(self, "data_directory", "the data directory"), "ByteNet")
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


@register_model("bytenet_lm")
class ByteNetLanguageModel(FairseqLanguageModel):
    """The ByteNet target network as a language model (presets: bytenet_lm, bytenet_lm_shakespeare, bytenet_lm_tiny)."""

    @staticmethod
    def add_args(parser):
        _add_stack_args(parser, "decoder")
        _add_shared_args(parser)
        parser.add_argument("--max-target-positions", type=int, metavar="N", help="longest sequence accepted")

    @classmethod
    def build_model(cls, args, task):
        bytenet_lm(args)
        if isinstance(task, TranslationTask):
            raise InputError(
                f"--arch {args.arch}: a ByteNet language model (target network only) given to --task "
                f"{getattr(args, 'task', 'translation')}: the translation model is --arch bytenet (or a preset of "
                "it, e.g. bytenet_multi30k_char)")
        _check_args(args, sides=("decoder",))
        first_build = keep_or_check_model_dictionaries(args, task, "ByteNet language")
        dictionary = task.target_dictionary
        embed = nn.Embedding(len(dictionary), args.decoder_embed_dim, dictionary.pad())
        model = cls(ByteNetDecoder(args, dictionary, embed))
        if first_build:  # a training's flags; a checkpoint loaded to score or decode was checked when it trained
            _check_training_blocks(args, model.decoder)
        model.data_directory = data_directory(task)
        return model

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_vocabulary_sizes(state_dict, {"decoder.embed_tokens.weight": len(self.decoder.dictionary)},
                               getattr(self, "data_directory", "the data directory"), "ByteNet language")
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def _check_training_blocks(args, decoder) -> None:
    """--task language_modeling with --sample-break-mode none cuts the text into --tokens-per-sample blocks and
    gives no context across them. Below the receptive field a token is predicted from less than the model could
    see (a warning: the extra depth still adds capacity, as the 20-block Tiny Shakespeare LM shows); a layer whose
    farthest tap reaches back further than a whole block sees only padding there, at every position (an error).
    Run on a first build only (fairseq-train's), not when a checkpoint is loaded to be scored (fairseq-eval-lm's
    --context-window is another matter)."""
    block, mode = getattr(args, "tokens_per_sample", None), getattr(args, "sample_break_mode", None)
    field = decoder.receptive_field()
    if block is None or str(mode) != "none" or block >= field:
        return
    cycle = parse_dilations(args.decoder_dilations, "--decoder-dilations")
    used = {cycle[i % len(cycle)] for i in range(args.decoder_blocks)}
    blind = sorted(d for d in used if (args.kernel_size - 1) * d >= block)
    message = (
        f"--tokens-per-sample {block}: below this model's receptive field ({field} tokens: --decoder-blocks "
        f"{args.decoder_blocks}, --decoder-dilations {args.decoder_dilations}, --kernel-size {args.kernel_size}). "
        f"With --sample-break-mode none each training block is {block} tokens with no context before it, so a "
        f"token is predicted from at most the {block} before it, not the {field} the model can see")
    if blind:
        raise InputError(
            f"{message}, and the convolutions of dilation {', '.join(map(str, blind))} reach back further than "
            f"a block, so their farthest taps only ever see padding: use --tokens-per-sample "
            f"{(args.kernel_size - 1) * max(blind) + 1} or more, or smaller dilations")
    logger.warning("%s (use --tokens-per-sample %d for all of it)", message, field)


def _check_args(args, sides=("encoder", "decoder")):
    """Clear errors for flag values a convolution would otherwise reject with a shape error."""
    if args.kernel_size < 1:
        raise InputError(f"--kernel-size {args.kernel_size}: expected a positive number of taps")
    if args.output_hidden_dim < 1:
        raise InputError(f"--output-hidden-dim {args.output_hidden_dim}: expected >= 1")
    if not 0 <= args.dropout < 1:
        raise InputError(f"--dropout {args.dropout}: expected 0 <= P < 1")
    if "encoder" in sides and args.kernel_size % 2 == 0:
        raise InputError(f"--kernel-size {args.kernel_size}: the source network's centred convolutions need it odd")
    for side in sides:
        for name in ("embed_dim", "hidden_dim", "blocks"):
            if getattr(args, f"{side}_{name}") < 1:
                raise InputError(f"--{side}-{name.replace('_', '-')} {getattr(args, f'{side}_{name}')}: expected >= 1")
        parse_dilations(getattr(args, f"{side}_dilations"), f"--{side}-dilations")
        if not 0 <= getattr(args, f"{side}_layerdrop") < 1:
            raise InputError(f"--{side}-layerdrop {getattr(args, f'{side}_layerdrop')}: expected 0 <= P < 1")


def _warn_if_unfolding_changed(args):
    """The unfolding a checkpoint was trained with is kept; a --model-overrides change is allowed but said."""
    if getattr(args, "bytenet_trained_unfold", None) is None:
        args.bytenet_trained_unfold = [args.unfold_a, args.unfold_b]
    trained = tuple(args.bytenet_trained_unfold)
    if trained != (args.unfold_a, args.unfold_b):
        logger.warning(
            "decoding with --unfold-a %s --unfold-b %s, but this model was trained with %s and %s: the target "
            "network will see source frames at other steps than in training", args.unfold_a, args.unfold_b, *trained,
        )


def _stack_defaults(args, side, embed, hidden, blocks, dilations="1,2,4,8,16", block_type="relu"):
    for name, value in (("embed_dim", embed), ("hidden_dim", hidden), ("blocks", blocks),
                        ("dilations", dilations), ("block_type", block_type), ("layerdrop", 0.0)):
        set_default(args, f"{side}_{name}", value)


def _shared_defaults(args, kernel_size=3, output_hidden=None, dropout=0.0, max_positions=4096):
    set_default(args, "kernel_size", kernel_size)
    set_default(args, "output_hidden_dim", output_hidden or args.decoder_hidden_dim)
    set_default(args, "dropout", dropout)
    set_default(args, "max_target_positions", max_positions)


def _translation_defaults(args, d, blocks=30, dropout=0.0):
    """The paper's layout for hidden size d: source stream d (blocks d -> d/2 -> d), target stream
    [embedding d ; source d] = 2d (blocks 2d -> d -> 2d, Fig. 3), output layers d wide."""
    _stack_defaults(args, "encoder", d, d // 2, blocks)
    _stack_defaults(args, "decoder", d, d, blocks)
    _shared_defaults(args, output_hidden=d, dropout=dropout)
    set_default(args, "unfold_a", 1.2)
    set_default(args, "unfold_b", 0.0)
    set_default(args, "share_all_embeddings", False)
    set_default(args, "max_source_positions", 4096)


@register_model_architecture("bytenet", "bytenet")
def bytenet(args):
    """The paper's translation model: 30 + 30 ReLU blocks in sets of five (dilations 1-16), k = 3, d = 800."""
    _translation_defaults(args, d=800)


@register_model_architecture("bytenet", "bytenet_multi30k_char")
def bytenet_multi30k_char(args):
    """Character-level Multi30k on two CPU cores: 10 + 10 blocks, d = 256 (6.0M parameters)."""
    _translation_defaults(args, d=256, blocks=10, dropout=0.1)


@register_model_architecture("bytenet", "bytenet_tiny")
def bytenet_tiny(args):
    """For tests: 5 + 5 blocks, d = 32."""
    _translation_defaults(args, d=32, blocks=5)


def _lm_defaults(args, d, blocks, block_type, dropout=0.0):
    """The target network alone: stream 2d (embedding 2d), blocks 2d -> d -> 2d, output layers d wide."""
    _stack_defaults(args, "decoder", 2 * d, d, blocks, block_type=block_type)
    _shared_defaults(args, output_hidden=d, dropout=dropout)


@register_model_architecture("bytenet_lm", "bytenet_lm")
def bytenet_lm(args):
    """The paper's character LM: 30 residual multiplicative blocks in sets of five (dilations 1-16), k = 3, d = 512."""
    _lm_defaults(args, d=512, blocks=30, block_type="multiplicative")


@register_model_architecture("bytenet_lm", "bytenet_lm_shakespeare")
def bytenet_lm_shakespeare(args):
    """Tiny Shakespeare on two CPU cores: 10 multiplicative blocks, d = 128."""
    _lm_defaults(args, d=128, blocks=10, block_type="multiplicative", dropout=0.1)


@register_model_architecture("bytenet_lm", "bytenet_lm_tiny")
def bytenet_lm_tiny(args):
    """For tests: 5 multiplicative blocks, d = 16."""
    _lm_defaults(args, d=16, blocks=5, block_type="multiplicative")
