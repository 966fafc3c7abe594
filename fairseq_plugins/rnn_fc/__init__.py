"""Fast CPU decoding (Devlin 2017): the ``rnn_fc`` model (bidirectional GRU encoder, AttGRU + stacked FC-ReLU
decoder), and task ``rnn_fc_translation`` whose generator switches each decoding speedup on and off: exact
ones (pre-computed input projections and source keys, merged recurrent states, beam-batched matmuls), int8
matmuls, candidate lists (``fairseq-plugins shortlist``; any fairseq model) and early stopping.
See docs/rnn_fc.md.
"""

from . import model, task  # noqa: F401

BENCH_TASK = "rnn_fc_translation"
