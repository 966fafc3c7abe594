"""int8 matmuls for any fairseq model on CPU, with results that do not depend on the batch.

Weights are int8 with one scale per output row; activations are quantized with one scale per input row
(per token), as int8 inference engines do, so a row's result is the same at batch 1 and batch 64.

Two kernels compute it. The native one (fairseq_plugins/native: kernel.c, built at first use) rounds each row to int8
with its own symmetric scale and sums int8 products in int32 with AVX2; at one row it costs 5 us for a
256x256 matrix, where torch's dynamic-quantization kernel (fbgemm) costs 100-200 us. It also runs a whole
transformer decoder layer in one call (the fast step's int8 path). Where no C compiler is found, fbgemm
computes the same per-row product: torch picks one activation range per call, so each row is first divided
by its own largest magnitude, a guard row fixes the call's range to [-1, 1] whatever the other rows hold,
and the product is multiplied back.

Registers nothing; used by the fast step (``--fast-step-precision int8``) and rnn_fc's steppers
(``--rnn-fc-precision int8``) for rnn_fc and transformer models.
"""

from .linear import (Int8EncoderSelfAttention, Int8GRU, Int8Linear, Int8Matrix, int8_copy, int8_encoder,
                     int8_encoder_unsupported_reason, int8_model_unsupported_reason, int8_module_names)

__all__ = ["Int8EncoderSelfAttention", "Int8GRU", "Int8Linear", "Int8Matrix", "int8_copy", "int8_encoder",
           "int8_encoder_unsupported_reason", "int8_model_unsupported_reason", "int8_module_names"]
