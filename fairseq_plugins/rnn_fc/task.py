"""``rnn_fc_translation``: fairseq's translation task whose generator is RnnFcGenerator, with Devlin (2017)'s
decoding switches as task flags. Decodes rnn_fc models (every switch) and any other fairseq encoder-decoder
model, the baseline transformer included (candidate lists, int8, early stopping). Training needs it only for
the warm start of a transformer encoder (``--rnn-fc-base-checkpoint``); ``--task translation`` trains rnn_fc
otherwise just as well.
"""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..common.generation import generator_options, refuse_unsupported_generation_flags
from ..common.textio import InputError
from ..common.warm_start import warm_start_built_model
from ..kernels.int8 import int8_model_unsupported_reason
from ..kernels.precision import PRECISIONS
from ..kernels.shortlist import TaskCandidateLists
from .generator import RnnFcGenerator
from .model import RnnFcModel
from .steppers import SPEEDUPS


def parse_speedups(value: str):
    """'all', 'none' or a comma-separated subset of SPEEDUPS -> a tuple of names."""
    value = value.strip()
    if value == "all":
        return SPEEDUPS
    if value == "none":
        return ()
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in SPEEDUPS]
    if unknown or not names:
        raise InputError(f"--rnn-fc-speedups {value}: give all, none, or a comma-separated subset of "
                         f"{', '.join(SPEEDUPS)}")
    return names


@dataclass
class RnnFcTranslationConfig(TranslationConfig):
    rnn_fc_speedups: str = field(
        default="all",
        metadata={"help": "exact speedups of rnn_fc decoding: all, none (the plain decoder), or a comma-separated "
                          "subset of batched (beam-batched matmuls), embeddings (pre-computed input projections), "
                          "attention (source keys once a sentence), merged (one state matmul per distinct parent)"},
    )
    rnn_fc_precompute_words: int = field(
        default=20000, metadata={"help": "with the embeddings speedup: the N most frequent target words whose "
                                         "input projections are looked up"},
    )
    rnn_fc_precision: ChoiceEnum(list(PRECISIONS)) = field(
        default="fp32", metadata={"help": "matmul precision: fp32, or int8 weights with per-row "
                                          "activation scales (outputs do not depend on the batch; candidate "
                                          "lists keep the whole matrix's int8 rows)"},
    )
    rnn_fc_shortlist: str = field(
        default="", metadata={"help": "candidate lists from `fairseq-plugins shortlist`: the softmax runs over "
                                      "each sentence's list only (empty: the whole vocabulary)"},
    )
    rnn_fc_early_stop: bool = field(
        default=False, metadata={"help": "stop a sentence once its best unfinished hypothesis is more than "
                                         "--rnn-fc-delta below its best finished one (cumulative log-probs)"},
    )
    rnn_fc_delta: float = field(default=3.0, metadata={"help": "the early-stopping margin delta"})
    rnn_fc_base_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "training: start an rnn_fc model's transformer encoder (--rnn-fc-encoder "
                                        "transformer) and its embeddings from this trained fairseq transformer of "
                                        "the same encoder sizes and data (e.g. the baseline's); the decoder keeps "
                                        "its initialisation. Not applied when the training resumes"},
    )


@register_task("rnn_fc_translation", dataclass=RnnFcTranslationConfig)
class RnnFcTranslationTask(TaskCandidateLists, TranslationTask):
    cfg: RnnFcTranslationConfig

    def candidate_lists_path(self) -> str:
        return self.cfg.rnn_fc_shortlist

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        warm_start_built_model(model, cfg, from_checkpoint, self.cfg.rnn_fc_base_checkpoint, "--rnn-fc-base-checkpoint",
                               RnnFcModel, "rnn_fc*")
        return model

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        refuse_unsupported_generation_flags(args, "rnn_fc decoding", extra={
            "--temperature": getattr(args, "temperature", 1.0) != 1.0,
            "--lm-path": bool(getattr(args, "lm_path", None)),
        })
        if self.cfg.rnn_fc_precompute_words < 0:
            raise InputError(f"--rnn-fc-precompute-words {self.cfg.rnn_fc_precompute_words}: must not be negative")
        if self.cfg.rnn_fc_early_stop and self.cfg.rnn_fc_delta < 0:
            raise InputError(f"--rnn-fc-delta {self.cfg.rnn_fc_delta}: must not be negative")
        speedups = parse_speedups(self.cfg.rnn_fc_speedups)
        device = next(models[0].parameters()).device
        reason = (int8_model_unsupported_reason(models[0], "fbgemm's int8 kernels")
                  if str(self.cfg.rnn_fc_precision) == "int8" else None)
        if reason is not None:
            raise InputError(f"--rnn-fc-precision int8: {reason}")
        shortlist = self.shortlist()
        return RnnFcGenerator(
            models, self.target_dictionary, speedups=speedups, precompute_words=self.cfg.rnn_fc_precompute_words,
            precision=str(self.cfg.rnn_fc_precision), shortlist=None if shortlist is None else shortlist.to(device),
            early_stop_delta=self.cfg.rnn_fc_delta if self.cfg.rnn_fc_early_stop else None,
            **generator_options(args, "beam", "nbest", beam=6),
        )
