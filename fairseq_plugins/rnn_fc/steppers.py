"""Step models for the beam search (common/beam_search.py): one decoder step of k hypotheses per sentence.

- ``RnnFcStepper``: the rnn_fc decoder, each of Devlin (2017)'s exact speedups a switch (SPEEDUPS):
    batched     all hypotheses of the beam in one matmul per weight (off: one row at a time)
    embeddings  the input projections W e + b of the N most frequent target words looked up in a table
                computed once (off: the matmul every step)
    attention   the source keys K s_j computed once a sentence (off: every step)
    merged      U h computed once per distinct previous state (hypotheses that extend the same parent
                share it; off: once per hypothesis)
  None of them changes the arithmetic of a row, so outputs are the plain decoder's.
- ``FairseqStepper``: any fairseq encoder-decoder model through its incremental decoder (the baseline
  transformer included), for the switches that are not rnn_fc's own: candidate lists and int8.

Both end in an ``OutputLayer``: the softmax weights over the vocabulary or over each sentence's candidate list,
in float32 or int8.
"""

import logging
from typing import Dict, Optional

import torch
from torch import Tensor

from ..common.beam_search import flat_rows, unique_rows
from ..common.dictionaries import ids_by_count
from ..kernels.int8 import int8_copy
from ..kernels.output_layer import output_layer_of

logger = logging.getLogger(__name__)

SPEEDUPS = ("batched", "embeddings", "attention", "merged")
class RnnFcStepper:
    def __init__(self, model, speedups=SPEEDUPS, precompute_words: int = 20000, precision: str = "fp32"):
        unknown = set(speedups) - set(SPEEDUPS)
        if unknown:
            raise ValueError(f"unknown speedup(s) {', '.join(sorted(unknown))}: choose from {', '.join(SPEEDUPS)}")
        self.speedups = frozenset(speedups)
        self.output = output_layer_of(model, precision)
        float_decoder = model.decoder
        self.model = int8_copy(model, keep_float={"decoder.output_projection"}) if precision == "int8" else model
        self.decoder = self.model.decoder
        self.table = self.table_row = None
        if "embeddings" in self.speedups and precompute_words > 0:
            self._precompute_input_projections(float_decoder, precompute_words)

    def _precompute_input_projections(self, decoder, words: int) -> None:
        """The input projections of the ``words`` most frequent target words (by the dictionary's counts),
        from the float32 weights; other words keep the matmul."""
        dictionary = decoder.dictionary
        ids = ids_by_count(dictionary)[:words]
        ids = torch.tensor(sorted(ids), dtype=torch.long, device=decoder.embed_tokens.weight.device)
        with torch.no_grad():
            self.table = decoder.input_projection(ids)
        self.table_row = torch.full((len(dictionary),), -1, dtype=torch.long, device=ids.device)
        self.table_row[ids] = torch.arange(ids.numel(), device=ids.device)

    @property
    def precomputed_words(self) -> int:
        return 0 if self.table is None else self.table.size(0)

    # ---- per batch ---------------------------------------------------------------------------------
    def start(self, sample: Dict, candidates: Optional[Tensor], candidate_valid: Optional[Tensor] = None) -> None:
        net_input = sample["net_input"]
        encoder_out = self.model.encoder(net_input["src_tokens"], net_input["src_lengths"])
        self.values = encoder_out["encoder_out"][0]  # (B, T, C)
        self.padding_mask = encoder_out["encoder_padding_mask"][0]
        self.state = encoder_out["decoder_init_state"][0].unsqueeze(1)  # (B, 1, H)
        self.top_state = None
        self.keys = self.decoder.source_keys(self.values) if "attention" in self.speedups else None
        self.output.prepare(candidates, candidate_valid)
        self.row_calls = 0

    def _input_part(self, tokens: Tensor) -> Tensor:
        if self.table is None:
            return self.decoder.input_projection(tokens)
        rows = self.table_row[tokens]
        looked_up = rows >= 0
        if bool(looked_up.all()):
            return self.table[rows]
        part = self.decoder.input_projection(tokens)  # rare words: the matmul, then the table's rows
        return torch.where(looked_up.unsqueeze(-1), self.table[rows.clamp(min=0)], part)

    def step(self, tokens: Tensor, parents: Optional[Tensor]) -> Tensor:
        batch, k = tokens.shape
        previous = self.state.size(1)
        hidden = self.state.size(-1)
        if parents is None:
            parents = tokens.new_zeros(batch, k)
        rows = flat_rows(parents, previous)
        flat_state = self.state.reshape(batch * previous, hidden)
        state = flat_state[rows].view(batch, k, hidden)
        top_state = None
        if self.top_state is not None:
            top_state = self.top_state.reshape(batch * previous, -1)[rows].view(batch, k, -1)
        state_part = None
        if "merged" in self.speedups:
            distinct, inverse = unique_rows(rows)
            if "batched" in self.speedups:
                projected = self.decoder.state_projection(flat_state[distinct])
            else:
                projected = torch.cat([self.decoder.state_projection(flat_state[r:r + 1]) for r in distinct.tolist()])
            state_part = projected[inverse].view(batch, k, -1)

        if "batched" in self.speedups:
            lprobs, self.state, self.top_state = self._rows(tokens, state, state_part, top_state, slice(None), None)
            self.row_calls += 1
            return lprobs
        outputs, states, tops = [], [], []
        for b in range(batch):
            for j in range(k):
                lprobs, new_state, new_top = self._rows(
                    tokens[b:b + 1, j:j + 1], state[b:b + 1, j:j + 1],
                    None if state_part is None else state_part[b:b + 1, j:j + 1],
                    None if top_state is None else top_state[b:b + 1, j:j + 1], slice(b, b + 1), b)
                outputs.append(lprobs)
                states.append(new_state)
                tops.append(new_top)
                self.row_calls += 1
        self.state = torch.cat(states, 0).view(batch, k, hidden)
        self.top_state = None if tops[0] is None else torch.cat(tops, 0).view(batch, k, -1)
        return torch.cat(outputs, 0).view(batch, k, -1)

    def _rows(self, tokens: Tensor, state: Tensor, state_part: Optional[Tensor], top_state: Optional[Tensor],
              sentences: slice, sentence: Optional[int]):
        """One step for tokens/state (b, k, .) of sentences ``sentences`` -> (log-probs, new state, new top)."""
        decoder = self.decoder
        values, mask = self.values[sentences], self.padding_mask[sentences]
        keys = self.keys[sentences] if self.keys is not None else decoder.source_keys(values)
        if state_part is None:
            state_part = decoder.state_projection(state)
        new_state, context = decoder.step(self._input_part(tokens), state, state_part, keys, values, mask)
        b, k, _ = new_state.shape
        features = decoder.fc_stack(new_state, context)
        out, new_top = decoder.top_step(features.view(b * k, -1), None if top_state is None else top_state.view(b * k, -1))
        logits = self.output(out.view(b, k, -1), sentence)
        return torch.log_softmax(logits.float(), dim=-1), new_state, None if new_top is None else new_top.view(b, k, -1)


class FairseqStepper:
    """Any fairseq encoder-decoder model with an incremental decoder, as fairseq's generator drives it."""

    def __init__(self, model, precision: str = "fp32"):
        self.output = output_layer_of(model, precision)
        self.model = int8_copy(model, keep_float={"decoder.output_projection"}) if precision == "int8" else model

    def start(self, sample: Dict, candidates: Optional[Tensor], candidate_valid: Optional[Tensor] = None) -> None:
        net_input = sample["net_input"]
        self.encoder_out = self.model.encoder.forward_torchscript(net_input)
        self.incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        self.history = None
        self.rows = 1
        self.output.prepare(candidates, candidate_valid)
        self.row_calls = 0

    def step(self, tokens: Tensor, parents: Optional[Tensor]) -> Tensor:
        batch, k = tokens.shape
        decoder = self.model.decoder
        if parents is None:
            self.history = tokens.reshape(batch * k, 1)
        else:
            order = flat_rows(parents, self.rows)
            decoder.reorder_incremental_state_scripting(self.incremental_state, order)
            if k != self.rows:
                # Hypotheses stay with their sentence, so the encoder output changes only when the beam widens.
                self.encoder_out = self.model.encoder.reorder_encoder_out(self.encoder_out, order)
            self.history = torch.cat([self.history[order], tokens.reshape(batch * k, 1)], dim=1)
        self.rows = k
        features, _ = decoder(self.history, encoder_out=self.encoder_out, incremental_state=self.incremental_state,
                              features_only=True)
        self.row_calls += 1
        logits = self.output(features[:, -1].view(batch, k, -1))
        return torch.log_softmax(logits.float(), dim=-1)
