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

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..common.generation import generator_options, refuse_unsupported_generation_flags
from ..common.reused_generators import ReusedGenerators, generation_settings_key
from ..common.textio import InputError
from ..kernels.fast_step_flags import (FastStepConfig, check_fast_step_models, fast_step_cuda_graphs,
                                      fast_step_precision)
from ..kernels.sequence_generator import FastStepSequenceGenerator
from ..kernels.shortlist import TaskCandidateLists
from .generator import FastStepEarlyStoppingGenerator


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
class FastStepTranslationTask(ReusedGenerators, TaskCandidateLists, TranslationTask):
    """With --fast-step, a generator built for the same models, parameters and settings is reused
    (``hub.translate`` asks for one every call)."""

    cfg: FastStepTranslationConfig

    def candidate_lists_path(self) -> str:
        return self.cfg.fast_step_shortlist

    def _check_flags(self) -> Optional[str]:
        """--fast-step's precision, or None without --fast-step; an InputError for a flag that does not fit."""
        precision = fast_step_precision(self.cfg)
        if precision is None:
            for flag, given in (("--fast-step-shortlist", bool(self.cfg.fast_step_shortlist)),
                                ("--fast-step-early-stop", self.cfg.fast_step_early_stop),
                                ("--fast-step-cuda-graphs", self.cfg.fast_step_cuda_graphs)):
                if given:
                    raise InputError(f"{flag}: only used with --fast-step (add it, or drop {flag})")
        if self.cfg.fast_step_early_stop_delta < 0:
            raise InputError(f"--fast-step-early-stop-delta {self.cfg.fast_step_early_stop_delta}: must be >= 0")
        return precision

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        # (the task's flags checked once per value: each read of an omegaconf field costs ~8 us, and a
        # hub.translate call asks for a generator every time)
        flags = generation_settings_key(self.cfg)
        if self.__dict__.get("_checked_flags", (None,))[0] != flags:
            self._checked_flags = (flags, self._check_flags())
        precision = self._checked_flags[1]
        if precision is None:
            return super().build_generator(models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        fingerprint = check_fast_step_models(models, precision)
        return self.reused_generator(
            models, args, lambda: self._build_fast_step_generator(models, args, precision, extra_gen_cls_kwargs,
                                                                  prefix_allowed_tokens_fn),
            seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, fingerprint=(flags, fingerprint))

    def _build_fast_step_generator(self, models, args, precision, extra_gen_cls_kwargs, prefix_allowed_tokens_fn):
        if getattr(args, "score_reference", False):  # (scoring references is fairseq's own generator)
            return super().build_generator(models, args, None, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        if getattr(args, "print_alignment", None):
            raise InputError("--print-alignment: not supported with --fast-step (it computes no attention "
                             "weights for the output)")
        device = next(models[0].parameters()).device
        if self.cfg.fast_step_cuda_graphs:
            for flag, given in (("--fast-step-early-stop", self.cfg.fast_step_early_stop),
                                ("--fast-step-shortlist", bool(self.cfg.fast_step_shortlist))):
                if given:
                    raise InputError(f"--fast-step-cuda-graphs: not with {flag}")
        cuda_graphs = fast_step_cuda_graphs(self.cfg, precision, models)
        shortlist = self.shortlist()
        if self.cfg.fast_step_early_stop:
            refuse_unsupported_generation_flags(args, "--fast-step-early-stop", extra={
                "--temperature": getattr(args, "temperature", 1.0) != 1.0,
                "--lm-path": bool(getattr(args, "lm_path", None))})
            return FastStepEarlyStoppingGenerator(
                models, self.target_dictionary, precision=precision,
                shortlist=None if shortlist is None else shortlist.to(device),
                early_stop_delta=self.cfg.fast_step_early_stop_delta, **generator_options(args, "beam", "nbest"))
        extra = {"precision": precision, "shortlist": None if shortlist is None else shortlist.to(device),
                 "cuda_graphs": cuda_graphs, **(extra_gen_cls_kwargs or {})}
        return super().build_generator(models, args, seq_gen_cls=FastStepSequenceGenerator,
                                       extra_gen_cls_kwargs=extra, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
