"""fairseq's SequenceGenerator with its decoder calls made by ``FastDecoderStep`` (the generator of
``--task fast_step_translation --fast-step`` and of double-token's single-token orders with ``--fast-step``).

Only the model side changes: ``FastStepEnsemble`` replaces fairseq's ``EnsembleModel`` (forward_decoder, the
reordering of the incremental state and of the encoder output), so beam search, greedy decoding, sampling,
length limits, --prefix-size, --constraints, --no-repeat-ngram-size and scoring are the stock generator's own
code. With candidate lists the log-probabilities are over each sentence's list and every other word gets -inf.
Two shortcuts give the same hypotheses with less around the model: on the native kernels without candidate lists
the whole search of a batch is one native call (native/search.c: fp_greedy_search for one sentence,
fp_beam_search, fairseq's beam search, for a batch, at beam 1 for greedy decoding; tests/test_native_search.py),
and elsewhere greedy decoding (beam 1, nothing else asked) runs this module's own loop with fairseq's rules.
"""

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from fairseq import search
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator
from torch import Tensor

from ..common.generation import GenerationStats
from ..common.step_rules import nan_to_minus_inf_
from ..common.textio import InputError
from . import native
from .decoder_step import fast_step_parts
from .static_step import StaticDecoderStep


STATE_KEY = "fast_step"  # marks fairseq's per-batch incremental state as started


class FastStepEnsemble(EnsembleModel):
    """``static_step``: the decoder calls run on ``StaticDecoderStep`` (one shape a batch, on the engine's
    weights), ``cuda_graphs``: captured as CUDA graphs (implies ``static_step``; --fast-step-cuda-graphs)."""

    def __init__(self, models, precision: str = "fp32", shortlist=None, static_step: bool = False,
                 cuda_graphs: bool = False):
        super().__init__(models)
        if len(models) != 1:
            raise InputError("--fast-step runs one model, not an ensemble")
        self.engine, self.encoder = fast_step_parts(models[0], precision)
        self.static = None
        if static_step or cuda_graphs:
            if shortlist is not None:
                raise InputError("--fast-step-cuda-graphs: not with --fast-step-shortlist (the static step's "
                                 "logits cover the whole vocabulary)")
            try:
                self.static = StaticDecoderStep(self.engine, cuda_graphs)
            except ValueError as error:
                raise InputError(f"--fast-step-cuda-graphs: {error}") from None
        self.max_steps = 64  # positions a row may take in the batch (the generator sets fairseq's limit + 2)
        self.shortlist = shortlist
        self.vocabulary = models[0].decoder.output_projection.out_features
        self.beam = 1
        self.started = False
        self.row_candidates: Optional[Tensor] = None

    def prepare(self, src_tokens: Tensor, beam: int) -> None:
        """Per batch, before fairseq's generation starts: the beam and each sentence's candidate list."""
        self.beam, self.started, self.row_candidates = beam, False, None
        if self.shortlist is not None:
            candidates, valid = self.shortlist.candidates(src_tokens)
            self.engine.output.prepare(candidates, valid)
            self.row_candidates = candidates.repeat_interleave(beam, dim=0)
        self.steps = 0
        self.candidates = 0 if self.row_candidates is None else int(valid.sum())

    def forward_encoder(self, net_input: Dict[str, Tensor]):
        return [self.encoder.forward_torchscript(net_input)]

    def forward_decoder(self, tokens: Tensor, encoder_outs: List[Dict[str, List[Tensor]]],
                        incremental_states: List[Dict[str, Dict[str, Optional[Tensor]]]], temperature: float = 1.0):
        state = incremental_states[0]
        if STATE_KEY not in state:  # fairseq gives each batch a fresh incremental state
            self.start(encoder_outs[0])
            state[STATE_KEY] = {}
        length = self.decoder_step.length
        if tokens.size(1) != length + 1:
            raise RuntimeError(f"the fast decoder step is at position {length}, fairseq asks for "
                               f"position {tokens.size(1) - 1}: it decodes one position a call, in order")
        return self.next_lprobs(tokens[:, -1], temperature), None

    @property
    def decoder_step(self):
        """What runs the decoder calls: the static step, or the engine."""
        return self.engine if self.static is None else self.static

    def start(self, encoder_out: Dict[str, List[Tensor]]) -> None:
        """A batch's decoding starts: the step takes the encoder output, for ``max_steps`` positions."""
        self.decoder_step.start(encoder_out, max_steps=self.max_steps)
        self.started = True

    def next_lprobs(self, previous: Tensor, temperature: float = 1.0) -> Tensor:
        """Log-probabilities (rows, V) of the next token after each row's prefix, whose last token is
        ``previous`` (fairseq's get_normalized_probs: log-softmax in float32 of logits / temperature)."""
        lprobs = self.next_list_lprobs(previous, temperature)
        if self.row_candidates is None:
            return lprobs
        full = lprobs.new_full((lprobs.size(0), self.vocabulary), float("-inf"))
        return full.scatter_(1, self.row_candidates, lprobs)

    def next_list_lprobs(self, previous: Tensor, temperature: float = 1.0) -> Tensor:
        """``next_lprobs`` over each row's candidate list only (rows, C), the columns of ``row_candidates``
        (padding columns -inf); without lists, over the vocabulary."""
        if self.static is not None:
            logits = self.static.step(previous)
        else:
            logits = self.engine.logits(self.engine.step(previous))
        if temperature != 1.0:
            logits = logits / temperature
        self.steps += 1
        return F.log_softmax(logits.float(), dim=-1)

    def reorder_incremental_state(self, incremental_states, new_order: Tensor) -> None:
        if new_order.numel() != self.engine.rows and self.row_candidates is not None:
            # Finished sentences leave the batch: keep the lists of those that stay (each has `beam` rows).
            self.engine.output.keep_sentences(new_order[::self.beam] // self.beam)
            self.row_candidates = self.row_candidates.index_select(0, new_order)
        self.decoder_step.reorder(new_order)

    def reorder_encoder_out(self, encoder_outs, new_order: Tensor):
        # Once the engine has started it holds what it needs of the encoder output (the cross-attention keys
        # and values, reordered by reorder_incremental_state): fairseq's copy is not read again.
        if self.started:
            return encoder_outs
        return super().reorder_encoder_out(encoder_outs, new_order)


class FastStepSequenceGenerator(SequenceGenerator, GenerationStats):
    """``SequenceGenerator`` (same constructor) whose decoder steps run on ``FastDecoderStep``."""

    stat_counters = {"sentences": 0, "steps": 0, "candidates": 0}

    def __init__(self, models, tgt_dict, precision: str = "fp32", shortlist=None, static_step: bool = False,
                 cuda_graphs: bool = False, **kwargs):
        # (given an ensemble, fairseq's constructor takes it as it is: no EnsembleModel of its own to replace,
        # which cost hub.translate, a generator a call, a second walk over the model)
        super().__init__(FastStepEnsemble(models, precision, shortlist, static_step, cuda_graphs), tgt_dict,
                         **kwargs)
        self.precision = precision
        self.reset_generation_stats()

    @torch.no_grad()
    def _generate(self, sample: Dict[str, Dict[str, Tensor]], prefix_tokens: Optional[Tensor] = None,
                  constraints: Optional[Tensor] = None, bos_token: Optional[int] = None):
        src_tokens = sample["net_input"]["src_tokens"]
        self.model.prepare(src_tokens, self.beam_size)
        # the positions a row may take (fairseq's limit; --match-source-len: the source's length) and the end
        self.model.max_steps = (src_tokens.size(1) if self.match_source_len else self._max_len(src_tokens)) + 2
        hypotheses = None
        if self._plain_search(prefix_tokens, constraints, bos_token):
            # greedy: one native call at batch 1, the batch's native beam search at beam 1 on larger batches
            if self._plain_greedy(prefix_tokens, constraints, bos_token) and src_tokens.size(0) == 1:
                hypotheses = self._greedy(sample)
            else:
                hypotheses = self._native_beam(sample)
                if hypotheses is None and self._plain_greedy(prefix_tokens, constraints, bos_token):
                    hypotheses = self._greedy(sample)
        if hypotheses is None:
            hypotheses = super()._generate(sample, prefix_tokens, constraints, bos_token)
        self._stats["sentences"] += src_tokens.size(0)
        self._stats["steps"] += self.model.steps
        self._stats["candidates"] += self.model.candidates
        return hypotheses

    def _plain_search(self, prefix_tokens, constraints, bos_token) -> bool:
        """fairseq's plain beam search (no prefix, constraints, LM, n-gram blocking, ...): the native searches
        apply, or at beam 1 the greedy loop below."""
        return (type(self.search) is search.BeamSearch and prefix_tokens is None
                and constraints is None and bos_token is None and self.lm_model is None
                and self.repeat_ngram_blocker is None and not self.match_source_len
                and getattr(self, "token_indices_to_suppress", None) is None)

    def _plain_greedy(self, prefix_tokens, constraints, bos_token) -> bool:
        """Beam 1 with nothing that needs fairseq's beam-search bookkeeping: the greedy loop below applies."""
        return self.beam_size == 1 and self._plain_search(prefix_tokens, constraints, bos_token)

    def _max_len(self, src_tokens: Tensor) -> int:
        """fairseq's SequenceGenerator length limit for a batch."""
        max_len = min(int(self.max_len_a * src_tokens.size(1) + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        return max_len

    def _native_beam(self, sample) -> Optional[List[List[Dict[str, Tensor]]]]:
        """The batch's whole beam search in one native call, where the engine has one (else None: fairseq's
        own), each sentence's hypotheses finalised and ordered as fairseq's (sorted by score, best first)."""
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        if self.model.row_candidates is not None or self.temperature != 1.0 or self.model.static is not None \
                or self.model.engine.beam_searcher is None or src_tokens.device.type != "cpu" \
                or self.beam_size > native.MAX_NATIVE_BEAM:
            return None
        max_len = self._max_len(src_tokens)
        self.model.engine.start(self.model.forward_encoder(net_input)[0], max_steps=1)
        searched = self.model.engine.beam_search(self.beam_size, self.eos, self.eos, self.pad, self.unk,
                                                 self.unk_penalty, self.min_len, max_len)
        if searched is None:
            return None
        self.model.started = True
        self.model.steps += max(tokens.numel() for finished in searched for tokens, _ in finished)
        batch = []
        for finished in searched:
            hypotheses = [self._finished(tokens, cumulative)[0] for tokens, cumulative in finished]
            order = torch.sort(torch.tensor([float(h["score"].item()) for h in hypotheses]), descending=True)[1]
            batch.append([hypotheses[i] for i in order])
        return batch

    def _greedy(self, sample) -> List[List[Dict[str, Tensor]]]:
        """fairseq's beam search at beam 1 without its per-step bookkeeping: the same length limits, pad/unk/
        min-length rules, cumulative float32 scores, positional scores and length normalisation, so the same
        hypotheses; finished sentences leave the batch."""
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz = src_tokens.size(0)
        max_len = self._max_len(src_tokens)
        self.model.start(self.model.forward_encoder(net_input)[0])
        if bsz == 1 and self.model.row_candidates is None and self.temperature == 1.0 and self.model.static is None:
            searched = self.model.engine.greedy_search(self.eos, self.eos, self.pad, self.unk, self.unk_penalty,
                                                       self.min_len, max_len)
            if searched is not None:  # the whole search in one native call
                self.model.steps += searched[0].numel()
                return [self._finished(*searched)]
        device = src_tokens.device
        sentences = torch.arange(bsz, device=device)  # the sentence of each live row
        tokens = torch.full((bsz, max_len + 2), self.pad, dtype=torch.long, device=device)
        tokens[:, 0] = self.eos
        scores = torch.zeros(bsz, max_len + 1, device=device)
        finished: List[Optional[List[Dict[str, Tensor]]]] = [None] * bsz
        for step in range(max_len + 1):
            lists = self.model.row_candidates  # each row's candidate ids (rows, C), ascending; or None
            if lists is None:
                lprobs = self.model.next_lprobs(tokens[:, step], self.temperature)
                nan_to_minus_inf_(lprobs)
                lprobs[:, self.pad] = -math.inf
                lprobs[:, self.unk] -= self.unk_penalty
                if step >= max_len:
                    lprobs[:, :self.eos] = -math.inf
                    lprobs[:, self.eos + 1:] = -math.inf
                if step < self.min_len:
                    lprobs[:, self.eos] = -math.inf
            else:
                # The same rules over the lists' columns only: every other word has -inf in the full row, and
                # the columns keep the vocabulary's order, so the best column is the full row's argmax.
                lprobs = self.model.next_list_lprobs(tokens[:, step], self.temperature)
                nan_to_minus_inf_(lprobs)
                lprobs.masked_fill_(lists == self.pad, -math.inf)
                if self.unk_penalty:
                    lprobs = lprobs - self.unk_penalty * (lists == self.unk)
                if step >= max_len:
                    lprobs.masked_fill_(lists != self.eos, -math.inf)
                if step < self.min_len:
                    lprobs.masked_fill_(lists == self.eos, -math.inf)
            if step > 0:
                lprobs = lprobs + scores[:, step - 1].unsqueeze(-1)
            # fairseq's beam search takes the top 2 x beam; the best is the same argmax, ties included
            best_scores, best = torch.topk(lprobs, k=min(2, lprobs.size(1)), dim=1)
            best = best[:, 0] if lists is None else lists.gather(1, best[:, :1]).squeeze(1)
            scores[:, step] = best_scores[:, 0]
            tokens[:, step + 1] = best
            ended = best == self.eos
            if not bool(ended.any()):
                continue
            for row in ended.nonzero().view(-1).tolist():
                finished[int(sentences[row])] = self._finished(tokens[row, 1:step + 2].clone(),
                                                               scores[row, :step + 1].clone())
            live = (~ended).nonzero().view(-1)
            if live.numel() == 0:
                break
            self.model.reorder_incremental_state(None, live)
            sentences, tokens, scores = sentences[live], tokens[live], scores[live]
        return finished

    def _finished(self, tokens: Tensor, cumulative: Tensor) -> List[Dict[str, Tensor]]:
        """A sentence's hypothesis as fairseq's beam search finalises it, from its tokens (end token included)
        and the cumulative score after each."""
        positional = cumulative.clone()
        positional[1:] = cumulative[1:] - cumulative[:-1]
        score = cumulative[-1].clone()
        if self.normalize_scores:
            score /= tokens.numel() ** self.len_penalty
        return [{"tokens": tokens, "score": score, "attention": torch.empty(0), "alignment": torch.empty(0),
                 "positional_scores": positional}]

    def generation_stats(self) -> Dict:
        stats = {"precision": self.precision, "decoder_calls": self._stats["steps"],
                 "sentences": self._stats["sentences"]}
        if self.model.shortlist is not None and self._stats["sentences"]:
            stats["candidates_per_sentence"] = self._stats["candidates"] / self._stats["sentences"]
        return stats
