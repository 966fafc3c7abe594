"""Architecture presets of fairseq's stock ``transformer`` model (no new model class).

``baseline_transformer_multi30k`` is the recipe of ``examples/baseline``: 3+3 layers, 256-d, shared
embeddings; it trains on two CPU cores in about 80 minutes. ``baseline_transformer_tiny`` is for the
demo and the tests. Each preset sets only what it changes, then defers to the stock preset.
"""

from fairseq.models import register_model_architecture
from fairseq.models.transformer import base_architecture


def _default(args, name, value):
    if getattr(args, name, None) is None:
        setattr(args, name, value)


@register_model_architecture("transformer", "baseline_transformer_multi30k")
def baseline_transformer_multi30k(args):
    for name, value in (
        ("encoder_embed_dim", 256), ("encoder_ffn_embed_dim", 1024),
        ("encoder_layers", 3), ("encoder_attention_heads", 4),
        ("decoder_layers", 3), ("decoder_attention_heads", 4),
        ("dropout", 0.3), ("share_all_embeddings", True),
    ):
        _default(args, name, value)
    # The decoder mirrors the encoder unless told otherwise.
    _default(args, "decoder_embed_dim", args.encoder_embed_dim)
    _default(args, "decoder_ffn_embed_dim", args.encoder_ffn_embed_dim)
    base_architecture(args)


@register_model_architecture("transformer", "baseline_transformer_tiny")
def baseline_transformer_tiny(args):
    for name, value in (
        ("encoder_embed_dim", 64), ("encoder_ffn_embed_dim", 128),
        ("encoder_layers", 2), ("encoder_attention_heads", 2),
        ("decoder_layers", 2), ("decoder_attention_heads", 2),
        ("dropout", 0.1),
    ):
        _default(args, name, value)
    baseline_transformer_multi30k(args)
