"""A fast decoder step for any fairseq transformer (``FastDecoderStep``): static caches, fused projections,
int8 weights and candidate lists as options, used by fairseq's own beam search and greedy decoding through
task ``fast_step_translation --fast-step``. See docs/fast-step.md.
"""

from . import task  # noqa: F401
from .engine import FastDecoderStep, unsupported_reason
from .generator import FastStepEarlyStoppingGenerator, FastStepEnsemble, FastStepSequenceGenerator, FastStepStepper

__all__ = ["FastDecoderStep", "FastStepEarlyStoppingGenerator", "FastStepEnsemble", "FastStepSequenceGenerator",
           "FastStepStepper", "unsupported_reason"]

# `bench --method fast_step --fast-step ...`: the fast step against the stock generator on the same model.
BENCH_TASK = "fast_step_translation"
