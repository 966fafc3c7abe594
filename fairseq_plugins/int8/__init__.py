"""int8 matmuls for any fairseq model on CPU, with results that do not depend on the batch.

Weights are int8 with one scale per output row; activations are quantized with one scale per input row
(per token), as int8 inference engines do. torch's dynamic-quantization kernel (fbgemm) picks one
activation range per call, so with its stock modules a sentence's output changes with its batch-mates and
beam-mates. Here each row is first divided by its own largest magnitude, a guard row fixes the call's range
to [-1, 1] whatever the other rows hold, and the product is multiplied back: the kernel's fixed range then
acts as a per-row scale, and a row's result is the same at batch 1 and batch 64.

Registers nothing; used by rnn_fc's steppers (``--rnn-fc-precision int8``) for rnn_fc and transformer models.
"""

from .linear import Int8GRU, Int8Linear, Int8Matrix, int8_copy, int8_module_names

__all__ = ["Int8GRU", "Int8Linear", "Int8Matrix", "int8_copy", "int8_module_names"]
