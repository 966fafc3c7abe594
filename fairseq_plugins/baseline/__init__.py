"""The baseline every method is measured against: fairseq's stock transformer, in named presets."""

from . import model  # noqa: F401

# `bench --method baseline` measures the stock generator against itself: a check of the harness (ratio ~1).
BENCH_TASK = "translation"
