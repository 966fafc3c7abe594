"""``blockwise_translation``: translation whose generator is blockwise parallel decoding.

Training is stock translation plus the warm start (``--blockwise-base-checkpoint``), which lives here
because only the task knows whether a model is being built fresh (warm start) or to receive a saved
checkpoint (no warm start: the checkpoint already holds everything).
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
from ..kernels.fast_step_flags import (FastStepConfig, check_fast_step_model, fast_step_cuda_graphs,
                                      fast_step_precision)
from .fast_step import FastStepBlockwiseGenerator
from .generator import BlockwiseGenerator
from .model import BlockwiseTransformerModel

logger = logging.getLogger(__name__)

BLOCK_ACCEPTANCE_CHOICES = ChoiceEnum(["exact", "topk", "distance"])


@dataclass
class BlockwiseTranslationConfig(FastStepConfig, TranslationConfig):
    block_size: int = field(
        default=0,
        metadata={"help": "tokens proposed and verified per iteration, at most the model's --blockwise-heads "
                          "(0: the model's)"},
    )
    block_acceptance: BLOCK_ACCEPTANCE_CHOICES = field(
        default="exact",
        metadata={"help": "exact: accept a proposal only if it is p_1's argmax (output identical to greedy); "
                          "topk: if it is among p_1's --block-topk best; distance: if its log-probability "
                          "under p_1 is within --block-distance of the best token's"},
    )
    block_topk: int = field(default=2, metadata={"help": "N of --block-acceptance topk"})
    block_distance: float = field(
        default=1.0, metadata={"help": "EPS of --block-acceptance distance: largest accepted gap in natural-log "
                                       "probability between a proposal and p_1's best token"},
    )
    min_block_size: int = field(
        default=1, metadata={"help": "accept at least this many tokens per iteration even if verification "
                                     "fails (1: verification decides alone)"},
    )
    block_adaptive_threshold: float = field(
        default=0.0, metadata={"help": "adaptive block size: propose only the tokens before the first head whose "
                                       "top probability is below this threshold, in (0, 1) (0: always the "
                                       "full block). Exact acceptance keeps the output identical to greedy"},
    )
    block_proposal_vocab: int = field(
        default=0, metadata={"help": "heads 2..k propose only among the N most frequent target tokens (the first "
                                     "N of the dictionary), a cheaper product than the whole vocabulary; p_1 "
                                     "still verifies over all of it, so exact acceptance stays exact (0: all)"},
    )
    blockwise_base_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "training: warm-start every parameter but the proposal heads from this "
                                        "trained fairseq transformer checkpoint (e.g. the baseline's)"},
    )


@register_task("blockwise_translation", dataclass=BlockwiseTranslationConfig)
class BlockwiseTranslationTask(TranslationTask):
    cfg: BlockwiseTranslationConfig

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        warm_start_built_model(model, cfg, from_checkpoint, self.cfg.blockwise_base_checkpoint,
                               "--blockwise-base-checkpoint", BlockwiseTransformerModel, "blockwise_transformer*")
        return model

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        model = models[0]
        if not isinstance(model, BlockwiseTransformerModel):
            raise InputError(
                f"--path: the checkpoint holds a {type(model).__name__}, not a blockwise_transformer; "
                "blockwise decoding needs proposal heads (train with --arch blockwise_transformer*, "
                "or decode this model with --task translation)")
        if len(models) > 1:
            raise InputError("--path: blockwise decoding runs one model, not an ensemble")
        model_k = model.decoder.num_proposal_heads
        block_size = self.cfg.block_size or model_k
        if not 1 <= block_size <= model_k:
            raise InputError(f"--block-size {self.cfg.block_size}: the model has {model_k} proposal heads "
                             f"(--blockwise-heads), so the block size must be 1..{model_k}")
        if self.cfg.block_acceptance == "topk" and self.cfg.block_topk < 1:
            raise InputError(f"--block-topk {self.cfg.block_topk}: must be at least 1")
        if self.cfg.block_acceptance == "distance" and self.cfg.block_distance < 0:
            raise InputError(f"--block-distance {self.cfg.block_distance}: must be >= 0")
        if not 1 <= self.cfg.min_block_size <= block_size:
            raise InputError(f"--min-block-size {self.cfg.min_block_size}: must be 1..{block_size} (the block size)")
        threshold = self.cfg.block_adaptive_threshold
        if threshold != 0 and not 0 < threshold < 1:
            raise InputError(f"--block-adaptive-threshold {threshold}: must be in (0, 1), or 0 for a fixed block")
        vocab = self.cfg.block_proposal_vocab
        special = self.target_dictionary.nspecial
        if vocab != 0 and not special < vocab <= len(self.target_dictionary):
            raise InputError(f"--block-proposal-vocab {vocab}: must be 0 (the whole vocabulary) or "
                             f"{special + 1}..{len(self.target_dictionary)} (past the special symbols, at most "
                             "the target dictionary's size)")
        refuse_unsupported_generation_flags(args, "--task blockwise_translation", extra={
            "--beam (blockwise decoding is greedy: pass --beam 1; for beam search use --task translation)":
                getattr(args, "beam", 1) != 1,
            "--nbest": getattr(args, "nbest", 1) != 1,
        })
        precision = fast_step_precision(self.cfg)
        generator_class, extra = BlockwiseGenerator, {}
        if precision is not None:  # the blockwise model's own heads make the outputs from the decoder's features
            check_fast_step_model(model, precision, features_only=True)
            generator_class, extra = FastStepBlockwiseGenerator, {"precision": precision}
        if fast_step_cuda_graphs(self.cfg, precision, models):
            extra["cuda_graphs"] = True
        return generator_class(
            model, self.target_dictionary, block_size, **extra,
            acceptance=self.cfg.block_acceptance, topk=self.cfg.block_topk, distance=self.cfg.block_distance,
            min_block_size=self.cfg.min_block_size, adaptive_threshold=threshold,
            proposal_vocab=vocab, **generator_options(args, "temperature"),
        )
