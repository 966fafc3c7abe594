"""The transformer sizes the methods' architecture presets start from, and the one rule every preset follows:
set only what the command line left unset. Registers nothing: baseline/model.py registers these sizes as
fairseq ``transformer`` presets; the other methods' presets call them and add their own settings.
"""

from fairseq.models.transformer import base_architecture


def set_default(args, name: str, value) -> None:
    """Set a flag the command line and the preset left unset (an explicit 0 stays, for the checks to see)."""
    if getattr(args, name, None) is None:
        setattr(args, name, value)


def transformer_multi30k(args) -> None:
    """The recipe of ``examples/baseline``: 3+3 layers, 256-d, shared embeddings; then fairseq's own defaults."""
    for name, value in (
        ("encoder_embed_dim", 256), ("encoder_ffn_embed_dim", 1024),
        ("encoder_layers", 3), ("encoder_attention_heads", 4),
        ("decoder_layers", 3), ("decoder_attention_heads", 4),
        ("dropout", 0.3), ("share_all_embeddings", True),
    ):
        set_default(args, name, value)
    # The decoder mirrors the encoder unless told otherwise.
    set_default(args, "decoder_embed_dim", args.encoder_embed_dim)
    set_default(args, "decoder_ffn_embed_dim", args.encoder_ffn_embed_dim)
    base_architecture(args)


def transformer_base_multi30k(args) -> None:
    """fairseq's transformer-base shape (6+6 layers, 512-d, 2048 FFN, 8 heads) with shared embeddings on Multi30k:
    the size at which the CTranslate2 comparison is reported beside the baseline's (issue 53); the rest as
    ``transformer_multi30k``."""
    for name, value in (
        ("encoder_embed_dim", 512), ("encoder_ffn_embed_dim", 2048),
        ("encoder_layers", 6), ("encoder_attention_heads", 8),
        ("decoder_layers", 6), ("decoder_attention_heads", 8),
    ):
        set_default(args, name, value)
    transformer_multi30k(args)


def transformer_tiny(args) -> None:
    """For the demo and the tests: 2+2 layers, 64-d; the rest as ``transformer_multi30k``."""
    for name, value in (
        ("encoder_embed_dim", 64), ("encoder_ffn_embed_dim", 128),
        ("encoder_layers", 2), ("encoder_attention_heads", 2),
        ("decoder_layers", 2), ("decoder_attention_heads", 2),
        ("dropout", 0.1),
    ):
        set_default(args, name, value)
    transformer_multi30k(args)
