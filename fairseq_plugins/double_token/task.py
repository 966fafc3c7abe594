"""``double_token_translation``: translation in any of the paper's five decoding orders (its Table 2).

The task folds targets on the fly (``FoldedTargetDataset``; the binarised data is fairseq's own), adds the
EOD symbol to the dictionaries, trains the stock criterions on the folded target, and builds the generator
that decodes in the same order and returns natural-order hypotheses:

  --token-order l2r   --tokens-per-step 1   single-token L2R: fairseq's own SequenceGenerator
  --token-order r2l   --tokens-per-step 1   single-token R2L: fairseq's beam search, outputs reversed back
  --token-order l2r   --tokens-per-step 2   double-token L2R \
  --token-order r2l   --tokens-per-step 2   double-token R2L  } DoubleTokenGenerator (DoubleTopK beam search)
  --token-order bidir --tokens-per-step 2   double-token bidirectional (the paper's method; the default)

``--fast-step`` (``--fast-step-precision fp32|int8``) runs each of them on the fast decoder step
(docs/fast-step.md): the same search, the decoder's pairs through ``FastDecoderStep.group_step``; in float32
the same hypotheses as without it.
"""

import logging
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..common.generation import generator_options, refuse_unsupported_generation_flags
from ..common.textio import InputError
from ..common.warm_start import warm_start_built_model
from ..kernels.fast_step_flags import (FastStepConfig, check_fast_step_models, fast_step_cuda_graphs,
                                      fast_step_precision)
from ..kernels.sequence_generator import FastStepSequenceGenerator
from .folding import EOD_SYMBOL, TOKEN_ORDERS, FoldedTargetDataset, check_token_order
from .generator import (FORCED_EOD_SCORES, DoubleTokenGenerator, FastStepRightToLeftGenerator,
                        RightToLeftSequenceGenerator)
from .model import DoubleTokenTransformerModel

logger = logging.getLogger(__name__)

TOKEN_ORDER_CHOICES = ChoiceEnum(list(TOKEN_ORDERS))


@dataclass
class DoubleTokenTranslationConfig(FastStepConfig, TranslationConfig):
    token_order: TOKEN_ORDER_CHOICES = field(
        default="bidir",
        metadata={"help": "order the decoder produces the target in: bidir (left half left-to-right and right "
                          "half right-to-left, one token of each per step; needs --tokens-per-step 2), l2r, r2l"},
    )
    tokens_per_step: int = field(
        default=2, metadata={"help": "target tokens the decoder emits per step (1 or 2); a checkpoint decodes "
                                     "only with the --token-order and --tokens-per-step it was trained with"},
    )
    left_candidates: int = field(
        default=0, metadata={"help": "DoubleTopK: best first-slot candidates kept over all live hypotheses "
                                     "(0: 2 x --beam)"},
    )
    pair_candidates: int = field(
        default=0, metadata={"help": "DoubleTopK: best (first, second) pairs kept after pairing each first-slot "
                                     "candidate with second-slot tokens (0: 3 x --beam); at least --beam"},
    )
    forced_eod_score: ChoiceEnum(FORCED_EOD_SCORES) = field(
        default="model", metadata={"help": "score of the second slot's EOD that a first-slot EOD forces: 'model' "
                                           "(its log-probability under the model) or 'one' (probability 1, as "
                                           "the authors' code scores it)"},
    )
    double_token_base_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "training: warm-start from this trained fairseq transformer checkpoint "
                                        "of the same sizes and data (e.g. the baseline's): every tensor copied, "
                                        "EOD's rows and the decoder's learned positions (from the base's "
                                        "sinusoidal table) added"},
    )


@register_task("double_token_translation", dataclass=DoubleTokenTranslationConfig)
class DoubleTokenTranslationTask(TranslationTask):
    cfg: DoubleTokenTranslationConfig

    def __init__(self, cfg: DoubleTokenTranslationConfig, src_dict, tgt_dict):
        # A plain str: the checkpoint pickles the model's arguments, and a ChoiceEnum does not pickle.
        self.token_order = str(cfg.token_order)
        check_token_order(self.token_order, cfg.tokens_per_step)
        super().__init__(cfg, src_dict, tgt_dict)
        # EOD joins both dictionaries, so a joined dictionary (shared embeddings) stays joined.
        self.eod = tgt_dict.add_symbol(EOD_SYMBOL)
        src_dict.add_symbol(EOD_SYMBOL)

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        self.datasets[split] = FoldedTargetDataset(self.datasets[split], self.token_order,
                                                   self.cfg.tokens_per_step, self.tgt_dict.eos(), self.eod)

    def max_positions(self):
        # A folded target is up to one token longer than the natural one (two EODs instead of one EOS).
        extra = 1 if self.cfg.tokens_per_step == 2 else 0
        return self.cfg.max_source_positions, self.cfg.max_target_positions - extra

    def build_model(self, cfg, from_checkpoint=False):
        if not from_checkpoint:  # a checkpoint keeps the order it was trained in (checked by build_generator)
            cfg.token_order, cfg.tokens_per_step = self.token_order, self.cfg.tokens_per_step
        model = super().build_model(cfg, from_checkpoint)
        if from_checkpoint:  # before fairseq loads its weights: a plain model's embeddings lack EOD's row
            self._refuse_other_models(model)
        warm_start_built_model(model, cfg, from_checkpoint, self.cfg.double_token_base_checkpoint,
                               "--double-token-base-checkpoint", DoubleTokenTransformerModel,
                               "double_token_transformer*")
        return model

    # --- training: the stock criterions see the folded target ---------------------------------------------

    @staticmethod
    def _folded(sample):
        if not sample or "folded_target" not in sample:
            return sample
        return {**sample, "target": sample["folded_target"], "ntokens": sample["folded_ntokens"],
                "natural_target": sample["target"]}

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        return super().train_step(self._folded(sample), model, criterion, optimizer, update_num, ignore_grad)

    def valid_step(self, sample, model, criterion):
        return super().valid_step(self._folded(sample), model, criterion)

    def _inference_with_bleu(self, generator, sample, model):
        # --eval-bleu scores natural-order hypotheses against the natural-order target.
        if "natural_target" in sample:
            sample = {**sample, "target": sample["natural_target"]}
        return super()._inference_with_bleu(generator, sample, model)

    # --- decoding -----------------------------------------------------------------------------------------

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        for model in models:
            self._check_trained_order(model)
        order, per_step = self.token_order, self.cfg.tokens_per_step
        precision = self._fast_step_precision(models)
        if per_step == 1:
            if order == "r2l":
                if (getattr(args, "prefix_size", 0) > 0 or getattr(args, "constraints", None)
                        or getattr(args, "print_alignment", None)):
                    raise InputError("--prefix-size/--constraints/--print-alignment: not supported with "
                                     "--token-order r2l --tokens-per-step 1")
                seq_gen_cls = RightToLeftSequenceGenerator if precision is None else FastStepRightToLeftGenerator
            elif precision is not None:
                seq_gen_cls = FastStepSequenceGenerator
            if precision is not None:
                extra_gen_cls_kwargs = {"precision": precision, **(extra_gen_cls_kwargs or {}),
                                        "cuda_graphs": fast_step_cuda_graphs(self.cfg, precision, models)}
            return super().build_generator(models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        if len(models) > 1:
            raise InputError("--path: double-token decoding runs one model, not an ensemble")
        refuse_unsupported_generation_flags(args, "--tokens-per-step 2")
        options = generator_options(args, "beam", "temperature")
        beam = options.pop("beam")
        left = self.cfg.left_candidates or 2 * beam
        pairs = self.cfg.pair_candidates or 3 * beam
        if left < 1:
            raise InputError(f"--left-candidates {self.cfg.left_candidates}: must be at least 1 (0: 2 x --beam)")
        if pairs < beam:
            raise InputError(f"--pair-candidates {self.cfg.pair_candidates}: must be at least --beam {beam} "
                             "(0: 3 x --beam)")
        return DoubleTokenGenerator(
            models[0], self.target_dictionary, self.eod, order, beam_size=beam,
            left_candidates=left, pair_candidates=pairs, forced_eod_score=self.cfg.forced_eod_score,
            fast_step_precision=precision, cuda_graphs=fast_step_cuda_graphs(self.cfg, precision, models),
            **options,
        )

    def _fast_step_precision(self, models) -> Optional[str]:
        """--fast-step's precision, or None without it; an InputError where the flags or the model do not fit."""
        precision = fast_step_precision(self.cfg)
        if precision is None:
            fast_step_cuda_graphs(self.cfg, precision, models)  # (refused without --fast-step)
            return None
        check_fast_step_models(models, precision)
        return precision

    @staticmethod
    def _refuse_other_models(model) -> None:
        if not isinstance(model, DoubleTokenTransformerModel):
            raise InputError(f"--path: the checkpoint holds a {type(model).__name__}, not a double_token_transformer "
                             "(train with --task double_token_translation --arch double_token_transformer*)")

    def _check_trained_order(self, model) -> None:
        self._refuse_other_models(model)
        trained = (model.args.token_order, model.args.tokens_per_step)
        asked = (self.token_order, self.cfg.tokens_per_step)
        if trained != asked:
            raise InputError(
                f"--token-order {asked[0]} --tokens-per-step {asked[1]}: the checkpoint was trained with "
                f"--token-order {trained[0]} --tokens-per-step {trained[1]}; decode it with those")
