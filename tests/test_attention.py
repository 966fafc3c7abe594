"""kernels/attention.py: the short-row softmax and attention as two matmuls, against torch's own kernels."""

import pytest
import torch
import torch.nn.functional as F

from fairseq_plugins.kernels.attention import attention, softmax_last_dim

NEG = float("-inf")


def test_the_short_row_softmax_equals_torch_softmax():
    """A row shorter than 16 is padded with -inf (torch's short-row path is ~13x slower): the same
    probabilities as torch.softmax, -inf (masked) entries included."""
    g = torch.Generator().manual_seed(2)
    for width in (1, 2, 7, 15, 16, 23):
        scores = torch.randn(2, 4, 9, width, generator=g) * 5
        scores[0, :, :, -1] = NEG
        if width == 1:
            scores[0] = 0.0
        probabilities = softmax_last_dim(scores)
        assert probabilities.shape == scores.shape and probabilities.dtype == torch.float32
        torch.testing.assert_close(probabilities, torch.softmax(scores, dim=-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("keys_length", [1, 9, 15, 16, 40])
def test_attention_equals_scaled_dot_product_attention(keys_length):
    """With and without a boolean mask (a causal group, padded keys), several leading dimensions."""
    g = torch.Generator().manual_seed(keys_length)
    q = torch.randn(6, 4, 3, 16, generator=g)
    keys, values = torch.randn(6, 4, keys_length, 16, generator=g), torch.randn(6, 4, keys_length, 16, generator=g)
    causal = torch.arange(keys_length).unsqueeze(0) <= keys_length - 3 + torch.arange(3).unsqueeze(1)
    padded = torch.ones(6, 1, 1, keys_length, dtype=torch.bool)
    padded[::2, :, :, : keys_length // 2] = False
    for attend in (None, causal if keys_length >= 3 else None, padded):
        expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=0.3)
        torch.testing.assert_close(attention(q, keys, values, attend, 0.3), expected, rtol=0, atol=2e-6)
