"""The fast CPU kernels and the decoder step built on them, for any fairseq model; registers nothing.

- ``native/``: the C kernels (products, a transformer layer's step, lattice beam search, ByteNet's stack step),
  built at first use and loaded with ctypes;
- ``int8``: int8 matrices with per-row activation scales (the native kernel, fbgemm where none is built), int8
  copies of models and encoders; ``packed_linear``: float32 products of a few rows; ``attention``: the softmax
  and attention arithmetic of many small problems; ``precision``: the precision names and the product of each;
- ``shortlist`` and ``output_layer``: candidate lists and the output layer over them;
- ``decoder_step``: ``FastDecoderStep``, one incremental step of a fairseq transformer decoder on these kernels;
  ``static_step``: ``StaticDecoderStep``, the same step at shapes fixed for a batch, for CUDA graphs
  (``cuda_graphs``: capturing and replaying a call);
  ``sequence_generator``: fairseq's SequenceGenerator with its decoder calls on it; ``fast_step_flags``:
  ``--fast-step``, ``--fast-step-precision`` and ``--fast-step-cuda-graphs`` with their checks, for any task
  whose generator runs on it.

Used by the methods (fast_step, blockwise, double_token, lattice, rnn_fc, bytenet); imports ``common``, never a
method.
"""
