"""``fast_step_translation``: fairseq's translation task whose generator, with ``--fast-step``, runs the decoder
steps on ``FastDecoderStep`` (fp32 or int8, optionally over candidate lists, optionally with Devlin (2017)'s
early stopping): the fast CPU decoder for any fairseq transformer. Without ``--fast-step`` it is stock
translation. Any model trained with ``--task translation`` (the baseline) decodes with it unchanged:

    fairseq-generate DATA --user-dir fairseq_plugins --task fast_step_translation --fast-step \\
        --fast-step-precision int8 --fast-step-shortlist shortlist.pt --fast-step-early-stop \\
        --path checkpoint.pt --beam 6
"""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..candidates import PRECISIONS, TaskCandidateLists
from ..common.generation import refuse_unsupported_generation_flags
from ..common.textio import InputError
from ..int8 import int8_encoder_unsupported_reason, int8_model_unsupported_reason
from .engine import unsupported_reason
from .generator import FastStepEarlyStoppingGenerator, FastStepSequenceGenerator


@dataclass
class FastStepConfig(FairseqDataclass):
    """The fast step's flags, for any task whose generator can run on it (this one, blockwise_translation)."""

    fast_step: bool = field(
        default=False, metadata={"help": "decode with the fast decoder step (static caches, fused projections, "
                                         "a decoder layer a kernel call; the task's search around it)"},
    )
    fast_step_precision: ChoiceEnum(list(PRECISIONS)) = field(
        default="fp32", metadata={"help": "with --fast-step: fp32 (fairseq's outputs), or int8 weights with "
                                          "per-row activation scales (CPU)"},
    )


def check_fast_step_model(model, precision: str, features_only: bool = False) -> None:
    """InputError naming the flag where --fast-step (at ``precision``) cannot run ``model``."""
    reason = unsupported_reason(model.decoder, features_only)
    if reason is not None:
        raise InputError(f"--fast-step: this model is not supported ({reason}); drop --fast-step")
    reason = int8_model_unsupported_reason(model) if precision == "int8" else None
    if reason is not None:
        raise InputError(f"--fast-step-precision int8: {reason}")
    reason = int8_encoder_unsupported_reason(model.encoder) if precision == "int8" else None
    if reason is not None:
        raise InputError(f"--fast-step-precision int8: this model's encoder is not supported ({reason}); use fp32")


def fast_step_precision(cfg: FastStepConfig) -> Optional[str]:
    """--fast-step-precision of a task's config with --fast-step, None without it (an InputError where the
    precision is given without --fast-step)."""
    precision = str(cfg.fast_step_precision)
    if cfg.fast_step:
        return precision
    if precision != "fp32":
        raise InputError("--fast-step-precision: only used with --fast-step (add it, or drop --fast-step-precision)")
    return None


def check_fast_step_models(models, precision: str) -> None:
    """``check_fast_step_model`` for a task's --path models, of which --fast-step runs one."""
    if len(models) != 1:
        raise InputError("--fast-step: runs one model, not an ensemble (give one --path)")
    check_fast_step_model(models[0], precision)


@dataclass
class FastStepTranslationConfig(FastStepConfig, TranslationConfig):
    fast_step_shortlist: str = field(
        default="", metadata={"help": "with --fast-step: candidate lists from `fairseq-plugins shortlist`; each "
                                      "sentence's softmax runs over its list only (empty: the whole vocabulary)"},
    )
    fast_step_early_stop: bool = field(
        default=False, metadata={"help": "with --fast-step: stop a sentence's beam search once its best unfinished "
                                         "hypothesis is more than --fast-step-early-stop-delta below its best "
                                         "finished one (cumulative log-probabilities; Devlin 2017)"},
    )
    fast_step_early_stop_delta: float = field(
        default=3.0, metadata={"help": "the early-stopping margin, >= 0 (larger: fewer sentences stop early)"},
    )


@register_task("fast_step_translation", dataclass=FastStepTranslationConfig)
class FastStepTranslationTask(TaskCandidateLists, TranslationTask):
    cfg: FastStepTranslationConfig

    def candidate_lists_path(self) -> str:
        return self.cfg.fast_step_shortlist

    def _check_flags(self) -> None:
        if not self.cfg.fast_step:
            for flag, given in (("--fast-step-precision", str(self.cfg.fast_step_precision) != "fp32"),
                                ("--fast-step-shortlist", bool(self.cfg.fast_step_shortlist)),
                                ("--fast-step-early-stop", self.cfg.fast_step_early_stop)):
                if given:
                    raise InputError(f"{flag}: only used with --fast-step (add it, or drop {flag})")
        if self.cfg.fast_step_early_stop_delta < 0:
            raise InputError(f"--fast-step-early-stop-delta {self.cfg.fast_step_early_stop_delta}: must be >= 0")

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        self._check_flags()
        if not self.cfg.fast_step or getattr(args, "score_reference", False):
            return super().build_generator(models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        precision = str(self.cfg.fast_step_precision)
        check_fast_step_models(models, precision)
        if getattr(args, "print_alignment", None):
            raise InputError("--print-alignment: not supported with --fast-step (it computes no attention "
                             "weights for the output)")
        device = next(models[0].parameters()).device
        shortlist = self.shortlist()
        if self.cfg.fast_step_early_stop:
            try:
                refuse_unsupported_generation_flags(args, "--fast-step-early-stop", extra={
                    "--temperature": getattr(args, "temperature", 1.0) != 1.0,
                    "--lm-path": bool(getattr(args, "lm_path", None))})
            except ValueError as e:
                raise InputError(str(e)) from None
            return FastStepEarlyStoppingGenerator(
                models, self.target_dictionary, beam=getattr(args, "beam", 5), precision=precision,
                shortlist=None if shortlist is None else shortlist.to(device),
                early_stop_delta=self.cfg.fast_step_early_stop_delta, max_len_a=getattr(args, "max_len_a", 0),
                max_len_b=getattr(args, "max_len_b", 200), min_len=getattr(args, "min_len", 1),
                lenpen=getattr(args, "lenpen", 1.0), normalize_scores=not getattr(args, "unnormalized", False),
                unk_penalty=getattr(args, "unkpen", 0.0), nbest=getattr(args, "nbest", 1))
        extra = {"precision": precision, "shortlist": None if shortlist is None else shortlist.to(device),
                 **(extra_gen_cls_kwargs or {})}
        return super().build_generator(models, args, seq_gen_cls=FastStepSequenceGenerator,
                                       extra_gen_cls_kwargs=extra, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
