"""ByteNet (Kalchbrenner et al. 2016): linear-time convolutional translation and character language model.

Registers models ``bytenet`` (presets ``bytenet``, ``bytenet_multi30k_char``, ``bytenet_tiny``) and
``bytenet_lm`` (presets ``bytenet_lm``, ``bytenet_lm_shakespeare``, ``bytenet_lm_tiny``), and task
``bytenet_translation`` (``--bytenet-decoding cached|recompute``), and ``--bpe char``, the character tokens of
``fairseq-plugins prepare --char`` for raw text in fairseq-interactive and the hub interface
(char_bpe.py). See docs/bytenet.md and docs/python-api.md.
"""

from . import char_bpe, model, task  # noqa: F401

# `bench --method bytenet`: cached (stock generator) against recomputed decoding with --bytenet-decoding.
BENCH_TASK = "bytenet_translation"
