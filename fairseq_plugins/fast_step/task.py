"""``fast_step_translation``: fairseq's translation task whose generator, with ``--fast-step``, runs the decoder
steps on ``FastDecoderStep`` (fp32 or int8, optionally over candidate lists). Without ``--fast-step`` it is
stock translation. Any model trained with ``--task translation`` (the baseline) decodes with it unchanged:

    fairseq-generate DATA --user-dir fairseq_plugins --task fast_step_translation --fast-step \\
        --fast-step-precision int8 --fast-step-shortlist shortlist.pt --path checkpoint.pt --beam 1
"""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..candidates import PRECISIONS, TaskCandidateLists
from ..common.textio import InputError
from .engine import unsupported_reason
from .generator import FastStepSequenceGenerator


@dataclass
class FastStepTranslationConfig(TranslationConfig):
    fast_step: bool = field(
        default=False, metadata={"help": "decode with the fast decoder step (static caches, fused projections; "
                                         "fairseq's beam search and greedy decoding around it)"},
    )
    fast_step_precision: ChoiceEnum(list(PRECISIONS)) = field(
        default="fp32", metadata={"help": "with --fast-step: fp32 (fairseq's outputs), or int8 weights with "
                                          "per-row activation scales (CPU)"},
    )
    fast_step_shortlist: str = field(
        default="", metadata={"help": "with --fast-step: candidate lists from `fairseq-plugins shortlist`; each "
                                      "sentence's softmax runs over its list only (empty: the whole vocabulary)"},
    )


@register_task("fast_step_translation", dataclass=FastStepTranslationConfig)
class FastStepTranslationTask(TaskCandidateLists, TranslationTask):
    cfg: FastStepTranslationConfig

    def candidate_lists_path(self) -> str:
        return self.cfg.fast_step_shortlist

    def _check_flags(self) -> None:
        if not self.cfg.fast_step:
            for flag, given in (("--fast-step-precision", str(self.cfg.fast_step_precision) != "fp32"),
                                ("--fast-step-shortlist", bool(self.cfg.fast_step_shortlist))):
                if given:
                    raise InputError(f"{flag}: only used with --fast-step (add it, or drop {flag})")

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        self._check_flags()
        if not self.cfg.fast_step or getattr(args, "score_reference", False):
            return super().build_generator(models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        if len(models) != 1:
            raise InputError("--fast-step: runs one model, not an ensemble (give one --path)")
        reason = unsupported_reason(models[0].decoder)
        if reason is not None:
            raise InputError(f"--fast-step: this model is not supported ({reason}); drop --fast-step")
        if getattr(args, "print_alignment", None):
            raise InputError("--print-alignment: not supported with --fast-step (it computes no attention "
                             "weights for the output)")
        precision = str(self.cfg.fast_step_precision)
        device = next(models[0].parameters()).device
        if precision == "int8" and device.type != "cpu":
            raise InputError("--fast-step-precision int8: fbgemm's int8 kernels run on the CPU only (add --cpu)")
        shortlist = self.shortlist()
        extra = {"precision": precision, "shortlist": None if shortlist is None else shortlist.to(device),
                 **(extra_gen_cls_kwargs or {})}
        return super().build_generator(models, args, seq_gen_cls=FastStepSequenceGenerator,
                                       extra_gen_cls_kwargs=extra, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
