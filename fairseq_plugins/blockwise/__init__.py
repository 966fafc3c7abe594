"""Blockwise parallel decoding (Stern, Shazeer, Uszkoreit 2018): proposal heads, predict-verify-accept.

Registers model ``blockwise_transformer`` (presets ``blockwise_transformer``, ``_multi30k``, ``_tiny``),
criterion ``blockwise_label_smoothed_cross_entropy`` and task ``blockwise_translation``, whose generator
is built from the task's ``--block-*`` flags. See docs/blockwise.md.
"""

from . import criterion, model, task  # noqa: F401

BENCH_TASK = "blockwise_translation"
