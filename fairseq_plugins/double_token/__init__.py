"""Double-token bidirectional decoding (Imamura & Sumita 2020): two target tokens per decoder step.

Registers model ``double_token_transformer`` (presets ``double_token_transformer``, ``_multi30k``,
``_tiny``) and task ``double_token_translation``: targets folded on the fly into the order given by
``--token-order bidir|l2r|r2l`` and ``--tokens-per-step 1|2`` (the paper's five systems), decoded by
DoubleTopK beam search and returned in natural order. See docs/double_token.md.
"""

from . import model, task  # noqa: F401

BENCH_TASK = "double_token_translation"
