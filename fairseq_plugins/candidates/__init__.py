"""Candidate lists (Devlin 2017; Marian's lexical shortlists) for any fairseq decoder: each sentence's softmax
runs over the top translations of its source words plus the most frequent target words, in float32 or int8.
``Shortlist`` builds, saves and loads the lists; ``OutputLayer`` is the output projection over them. Shared
by rnn_fc and the fast decoder step; registers nothing."""

from .output_layer import PRECISIONS, OutputLayer, output_layer_of
from .shortlist import Shortlist, TaskCandidateLists, read_lexical_table

__all__ = ["PRECISIONS", "OutputLayer", "Shortlist", "TaskCandidateLists", "output_layer_of", "read_lexical_table"]
