"""Sequence-to-lattice translation (2021): IBM-Model-2 candidate tables from word alignments, a top-K
lattice per target position, a Markov transformer scoring every lattice edge in one call, Viterbi over
lengths L +- dL.

Registers model ``lattice_transformer`` (presets ``lattice_transformer``, ``_multi30k``, ``_tiny``) and
task ``lattice_translation`` (its generator). Tables: ``fairseq-plugins align`` then
``fairseq-plugins lattice-table``. See docs/lattice.md.
"""

from . import model, task  # noqa: F401

BENCH_TASK = "lattice_translation"
