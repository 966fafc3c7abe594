"""Several new target tokens per sentence through a fairseq ``TransformerDecoder`` in one incremental call.

fairseq's incremental path feeds one token per step (it keeps only ``prev_output_tokens[:, -1:]``). Methods
that append more per step (blockwise verification blocks, double-token pairs) run the decoder's own layers
here instead: the new tokens' keys and values are appended to the same ``incremental_state`` fairseq's
layers keep, so ``reorder_incremental_state`` and later single-token steps keep working.
"""

from typing import Dict, Optional

import torch
from torch import Tensor

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


def cached_length(decoder, incremental_state: IncrementalState) -> int:
    """Number of key/value slots in the decoder's self-attention cache (0 before the first call)."""
    state = decoder.layers[0].self_attn.get_incremental_state(incremental_state, "attn_state")
    if state is None or state.get("prev_key") is None:
        return 0
    return state["prev_key"].size(2)


def position_embeddings(decoder, positions: Tensor) -> Tensor:
    """(B, m) 0-based target positions -> (B, m, d) embeddings of the decoder's positional embedding."""
    # Both positional embedding kinds number an unpadded row 0..n-1 as padding_idx+1..padding_idx+n;
    # embedding one such row and indexing it works for either without touching their internals.
    row = positions.new_full((1, int(positions.max()) + 1), decoder.embed_positions.padding_idx + 1)
    table = decoder.embed_positions(row)[0]  # (n, d)
    return table[positions]


def new_token_features(decoder, tokens: Tensor, positions: Tensor, encoder_out, incremental_state: IncrementalState,
                       causal: bool = True) -> Tensor:
    """Run m new tokens per sentence after the cached ones and return the final decoder states (B, m, d).

    tokens, positions: (B, m); positions are 0-based target positions and may differ per sentence. Every new
    token sees every cached slot (a ragged cache's unused slots are masked by its key padding mask). Among
    the new tokens, ``causal`` lets token i see tokens <= i only; otherwise they all see each other (one
    decoding unit, e.g. a double-token pair).
    """
    assert not decoder.cross_self_attention, "several tokens a step do not support --cross-self-attention"
    m = tokens.size(1)
    cached = cached_length(decoder, incremental_state)
    x = decoder.embed_scale * decoder.embed_tokens(tokens)
    if decoder.project_in_dim is not None:
        x = decoder.project_in_dim(x)
    if decoder.embed_positions is not None:
        x = x + position_embeddings(decoder, positions)
    if decoder.layernorm_embedding is not None:
        x = decoder.layernorm_embedding(x)
    x = decoder.dropout_module(x).transpose(0, 1)  # (m, B, d)

    new_mask = torch.triu(x.new_full((m, m), float("-inf")), 1) if causal else x.new_zeros(m, m)
    self_attn_mask = torch.cat([x.new_zeros(m, cached), new_mask], dim=1)
    enc = encoder_out["encoder_out"][0] if encoder_out and len(encoder_out["encoder_out"]) > 0 else None
    enc_mask = (encoder_out["encoder_padding_mask"][0]
                if encoder_out and len(encoder_out["encoder_padding_mask"]) > 0 else None)
    for layer in decoder.layers:
        x, _, _ = layer(x, enc, enc_mask, incremental_state, self_attn_mask=self_attn_mask)
    if decoder.layer_norm is not None:
        x = decoder.layer_norm(x)
    x = x.transpose(0, 1)
    if decoder.project_out_dim is not None:
        x = decoder.project_out_dim(x)
    return x
