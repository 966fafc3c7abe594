"""Architecture presets of fairseq's stock ``transformer`` model (no new model class).

``baseline_transformer_multi30k`` is the recipe of ``examples/baseline``: 3+3 layers, 256-d, shared
embeddings; it trains on two CPU cores in about 80 minutes. ``baseline_transformer_base_multi30k`` is fairseq's
transformer-base shape (6+6 layers, 512-d, 2048 FFN) for the comparisons whose balance moves with model size
(``ARCH=baseline_transformer_base_multi30k examples/baseline/run.sh``). ``baseline_transformer_tiny`` is for the
demo and the tests. Each preset sets only what it changes, then defers to the stock preset; the sizes live in
``common/presets.py``, where the other methods' presets start from them too.
"""

from fairseq.models import register_model_architecture

from ..common.presets import transformer_base_multi30k, transformer_multi30k, transformer_tiny


@register_model_architecture("transformer", "baseline_transformer_multi30k")
def baseline_transformer_multi30k(args):
    transformer_multi30k(args)


@register_model_architecture("transformer", "baseline_transformer_base_multi30k")
def baseline_transformer_base_multi30k(args):
    transformer_base_multi30k(args)


@register_model_architecture("transformer", "baseline_transformer_tiny")
def baseline_transformer_tiny(args):
    transformer_tiny(args)
