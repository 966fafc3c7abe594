"""The output layer of a decoder step over the whole vocabulary or over each sentence's candidate list
(``shortlist.Shortlist``), in float32 or int8 (the rows of a list keep the full int8 matrix's values and scales,
so a list's logits are the full matrix's logits of those ids). Used by the fast step and rnn_fc's steppers."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..common.textio import InputError
from .int8 import Int8Matrix
from .packed_linear import PackedLinear
from .precision import check_precision


class OutputLayer:
    """Logits over the vocabulary or a candidate list: x W^T (+ b), W (V, d) the model's softmax weights."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], precision: str = "fp32"):
        check_precision(precision)
        self.weight, self.bias, self.precision = weight.detach(), None if bias is None else bias.detach(), precision
        # A candidate list's int8 rows (and row scales) are the full int8 matrix's rows.
        self.full_int8 = Int8Matrix(self.weight, bias=self.bias) if precision == "int8" else None
        self.full_fp32 = PackedLinear(self.weight) if precision == "fp32" else None
        self.candidates = None
        self.weights = self.int8_lists = self.padding = None

    def prepare(self, candidates: Optional[Tensor], valid: Optional[Tensor] = None) -> None:
        """Per batch: each sentence's candidate ids (B, C), or None for the whole vocabulary; ``valid`` (B, C):
        which ids are in the sentence's list (the rest pad it to the batch's longest list and get -inf)."""
        self.candidates = candidates
        self.padding = None
        if candidates is None:
            return
        if valid is not None and not bool(valid.all()):
            self.padding = torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))
        self.weights = self.weight[candidates]  # (B, C, d)
        self.sliced_bias = None if self.bias is None else self.bias[candidates]  # (B, C)
        if self.precision == "int8":
            self.int8_lists = [self.full_int8.select(ids) for ids in candidates]

    def __call__(self, x: Tensor, sentence: Optional[int] = None) -> Tensor:
        """x (B, k, d) -> logits (B, k, C); with ``sentence``, x (1, k, d) belongs to that sentence."""
        if self.candidates is None:
            if self.precision == "int8":
                return self.full_int8(x)  # the bias included
            logits = self.full_fp32(x)
            return logits if self.bias is None else logits + self.bias
        sentences = range(x.size(0)) if sentence is None else [sentence]
        if self.precision == "int8":  # each list's matrix holds its biases
            logits = torch.stack([self.int8_lists[b](x[i]) for i, b in enumerate(sentences)])
        else:
            if sentence is None:
                logits = torch.bmm(x, self.weights.transpose(1, 2))
            else:
                logits = F.linear(x, self.weights[sentence])
            if self.sliced_bias is not None:
                bias = self.sliced_bias if sentence is None else self.sliced_bias[sentence:sentence + 1]
                logits = logits + bias.unsqueeze(1)
        if self.padding is not None:
            padding = self.padding if sentence is None else self.padding[sentence:sentence + 1]
            logits = logits + padding.unsqueeze(1)
        return logits

    def keep_sentences(self, sentences: Tensor) -> None:
        """Keep the lists of ``sentences`` (indices into the current batch), in that order: a generator that
        drops finished sentences from its batch."""
        if self.candidates is None:
            return
        self.candidates = self.candidates.index_select(0, sentences)
        self.weights = self.weights.index_select(0, sentences)
        if self.sliced_bias is not None:
            self.sliced_bias = self.sliced_bias.index_select(0, sentences)
        if self.padding is not None:
            self.padding = self.padding.index_select(0, sentences)
        if self.int8_lists is not None:
            self.int8_lists = [self.int8_lists[i] for i in sentences.tolist()]


def output_layer_of(model, precision: str) -> OutputLayer:
    projection = getattr(model.decoder, "output_projection", None)
    if not isinstance(projection, nn.Linear):
        raise InputError(f"{type(model.decoder).__name__} has no output_projection Linear layer (e.g. an adaptive "
                         "softmax): candidate lists and int8 need one")
    return OutputLayer(projection.weight, projection.bias, precision)
