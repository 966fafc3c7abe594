"""Task ``fast_step_translation --fast-step``: any fairseq transformer decoded on the fast decoder step
(``kernels.decoder_step.FastDecoderStep``: static caches, fused projections, int8 weights and candidate lists as
options), by fairseq's own beam search and greedy decoding (``kernels.sequence_generator``) or, with
``--fast-step-early-stop``, by the project's beam search with early stopping (generator.py). See
docs/fast-step.md.
"""

from . import task  # noqa: F401

# `bench --method fast_step --fast-step ...`: the fast step against the stock generator on the same model.
BENCH_TASK = "fast_step_translation"
