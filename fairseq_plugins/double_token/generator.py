"""Generators of the double-token task; both return hypotheses in natural order, in fairseq's format.

``DoubleTokenGenerator`` is the paper's Algorithm 1 for two tokens a step. Each step the decoder scores both
slots of the next pair for every live hypothesis in one call, then:

  DoubleTopK   the best ``left_candidates`` (default 2W) first-slot extensions over all W live hypotheses,
               by cumulative score; each is paired with its hypothesis' second-slot tokens, scored by the
               first-slot score plus the second-slot log-probability, and the best ``pair_candidates``
               (default 3W) pairs are kept. A first-slot EOD forces a second-slot EOD (the sentence is over),
               scored by the model's log-probability of EOD in that slot (``forced_eod_score="model"``, the
               default) or, as the authors' code does, with probability 1 (``"one"``: log-probability 0).
  FINALIZE     a pair holding an EOD ends its hypothesis, if it is among the W best candidates (as fairseq
               finalizes EOS); a sentence is done when it has W finished hypotheses.
  EXPANDBEAM   the W best candidates without EOD are the next step's live hypotheses.

W = 1 is greedy decoding: the best pair is both slots' argmax. Scores are the model's log-probabilities of
every decoded token; a hypothesis' score is their sum, divided by (natural length + 1) ** lenpen like
fairseq's (the +1 is the EOS, whose positional score is that of the EOD(s)).

The decoder calls go through ``FairseqPairSteps`` (the model's own incremental decoder) or, with
``--fast-step``, ``FastPairSteps``: each hypothesis' pair through ``FastDecoderStep.group_step`` (both slots as
rows of one product per weight, each slot seeing the other), float32 or int8; the search is the same code.

``RightToLeftSequenceGenerator`` is fairseq's own beam search on a right-to-left model, its hypotheses
reversed back to natural order (``FastStepRightToLeftGenerator``: the same on the fast step).
"""

import logging
import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq.sequence_generator import SequenceGenerator

from ..common.generation import MethodGenerator
from ..common.step_rules import StepRules, nan_to_minus_inf_
from ..common.textio import InputError
from ..kernels.decoder_step import fast_step_parts
from ..kernels.static_step import StaticDecoderStep
from ..kernels.sequence_generator import FastStepSequenceGenerator
from .folding import unfold_indices

logger = logging.getLogger(__name__)

# How the second slot's EOD, forced by a first-slot EOD, is scored: the model's log-probability, or 0 (the
# authors' code: the token is certain, so it costs nothing).
FORCED_EOD_SCORES = ("model", "one")


class RightToLeftSequenceGenerator(SequenceGenerator):
    """fairseq's SequenceGenerator on a model trained on reversed targets; outputs in natural order."""

    def _generate(self, sample, **kwargs):
        finalized = super()._generate(sample, **kwargs)
        for hypotheses in finalized:
            for hypo in hypotheses:
                tokens = hypo["tokens"]
                body = torch.arange(tokens.numel() - 1, -1, -1, device=tokens.device)
                if tokens.numel() and tokens[-1] == self.eos:  # EOS stays last
                    body = torch.cat([body[1:], body[:1]])
                hypo["tokens"] = tokens[body]
                hypo["positional_scores"] = hypo["positional_scores"][body]
                if hypo.get("attention") is not None and hypo["attention"].numel():
                    hypo["attention"] = hypo["attention"][:, body]
        return finalized


class FastStepRightToLeftGenerator(RightToLeftSequenceGenerator, FastStepSequenceGenerator):
    """Single-token R2L on the fast step: fairseq's search over ``FastDecoderStep``, outputs reversed back."""


def encode_for_beam(encoder, net_input: Dict[str, Tensor], beam: int) -> Dict[str, List[Tensor]]:
    """The encoder output of a batch with ``beam`` rows for every sentence (its hypotheses)."""
    encoder_out = encoder.forward_torchscript(net_input)
    src_tokens = net_input["src_tokens"]
    rows = torch.arange(src_tokens.size(0), device=src_tokens.device).repeat_interleave(beam)
    return encoder.reorder_encoder_out(encoder_out, rows)


class FairseqPairSteps:
    """The model side of ``DoubleTokenGenerator`` on the model's own encoder and incremental decoder."""

    def __init__(self, model):
        self.model = model

    def start(self, net_input: Dict[str, Tensor], beam: int, max_len: int) -> None:
        """Encode a batch; every sentence gets ``beam`` rows."""
        self.encoder_out = encode_for_beam(self.model.encoder, net_input, beam)
        self.incremental_state: Dict[str, Dict[str, Tensor]] = {}

    def logits(self, tokens: Tensor) -> Tensor:
        """(rows, 2, V): the logits of both slots of the step whose inputs are ``tokens``' last pair (``tokens``:
        every row's inputs so far)."""
        return self.model.decoder(tokens, encoder_out=self.encoder_out, incremental_state=self.incremental_state)[0]

    def reorder(self, rows: Tensor, kept_rows: Optional[Tensor]) -> None:
        """The next step's row i continues row ``rows[i]``; ``kept_rows`` (or None: all): the rows of the
        sentences still decoded, before this step's reordering."""
        self.model.decoder.reorder_incremental_state_scripting(self.incremental_state, rows)
        if kept_rows is not None:
            self.encoder_out = self.model.encoder.reorder_encoder_out(self.encoder_out, kept_rows)


class FastPairSteps:
    """The model side of ``DoubleTokenGenerator`` on the fast decoder step (``--fast-step``): a step's pairs
    go through each layer as the rows of one product, the two slots of a hypothesis seeing each other
    (``group_step(causal=False)``, the model's step mask); int8 with ``precision`` int8 (the encoder too).
    ``static_step`` (``cuda_graphs``: --fast-step-cuda-graphs, each step captured as a CUDA graph): on
    ``StaticDecoderStep``, one shape for the whole batch, the output layer inside the call, finished sentences'
    rows masked rather than removed."""

    def __init__(self, model, precision: str, static_step: bool = False, cuda_graphs: bool = False):
        self.engine, self.encoder = fast_step_parts(model, precision)
        self.static = StaticDecoderStep(self.engine, cuda_graphs) if static_step or cuda_graphs else None
        self.decoder_step = self.engine if self.static is None else self.static  # what runs the calls

    def start(self, net_input: Dict[str, Tensor], beam: int, max_len: int) -> None:
        self.decoder_step.start(encode_for_beam(self.encoder, net_input, beam), max_steps=max_len + 4)

    def logits(self, tokens: Tensor) -> Tensor:
        if self.static is not None:
            return self.static.group_step(tokens[:, -2:], causal=False, logits=True).view(tokens.size(0), 2, -1)
        features = self.engine.group_step(tokens[:, -2:], causal=False)
        return self.engine.logits(features).view(tokens.size(0), 2, -1)

    def reorder(self, rows: Tensor, kept_rows: Optional[Tensor]) -> None:
        self.decoder_step.reorder(rows)  # the step's source keys and values follow the rows


class DoubleTokenGenerator(MethodGenerator):
    method_name = "double-token"

    def __init__(self, model, tgt_dict, eod: int, token_order: str, beam_size: int = 5, left_candidates: int = 10,
                 pair_candidates: int = 15, max_len_a: float = 0.0, max_len_b: int = 200, min_len: int = 1,
                 normalize_scores: bool = True, len_penalty: float = 1.0, unk_penalty: float = 0.0,
                 temperature: float = 1.0, forced_eod_score: str = "model", fast_step_precision: Optional[str] = None,
                 static_step: bool = False, cuda_graphs: bool = False):
        """``fast_step_precision``: decode on the fast decoder step at this precision (fp32, int8); None:
        on the model's own decoder. ``static_step``, ``cuda_graphs``: see ``FastPairSteps``."""
        assert model.decoder.tokens_per_step == 2, "DoubleTokenGenerator decodes two-token-a-step models"
        assert beam_size >= 1 and left_candidates >= 1 and pair_candidates >= beam_size
        self.model = model
        self.eod, self.token_order = eod, token_order
        self.beam_size, self.left_candidates, self.pair_candidates = beam_size, left_candidates, pair_candidates
        # Lengths count natural tokens; the end of an output is EOD (see _constrained_lprobs).
        self.rules = StepRules(tgt_dict, min_len=min_len, max_len_a=max_len_a, max_len_b=max_len_b,
                               unk_penalty=unk_penalty, normalize_scores=normalize_scores, len_penalty=len_penalty)
        # Inputs of the step that emits natural tokens 2s+1, 2s+2 sit at positions 2s, 2s+1.
        self.max_positions = model.max_decoder_positions()
        self.temperature = temperature
        if forced_eod_score not in FORCED_EOD_SCORES:
            raise InputError(f"--forced-eod-score {forced_eod_score}: one of {', '.join(FORCED_EOD_SCORES)}")
        self.forced_eod_is_certain = forced_eod_score == "one"
        self.eos = tgt_dict.eos()
        self.fast_step_precision = fast_step_precision
        if fast_step_precision is None and (static_step or cuda_graphs):
            raise InputError("--fast-step-cuda-graphs: only used with --fast-step")
        self.steps = FairseqPairSteps(model) if fast_step_precision is None else FastPairSteps(
            model, fast_step_precision, static_step, cuda_graphs)
        self.reset_generation_stats()

    # --- statistics (bench harness hooks; fairseq-generate gets a summary line at exit) --------------------

    stat_counters = {"sentences": 0, "tokens": 0, "decoder_invocations": 0, "batches": 0}

    def generation_stats(self) -> Dict:
        stats = super().generation_stats()  # tokens: of the best hypotheses, EOS included
        if self.fast_step_precision is not None:
            stats["fast_step_precision"] = self.fast_step_precision
            stats["static_step"] = self.steps.static is not None
            stats["cuda_graphs"] = self.steps.static is not None and self.steps.static.cuda_graphs
        return stats

    def _log_summary(self) -> None:
        s = self.generation_stats()
        if s["sentences"]:
            logger.info("double-token (%s, beam %d): %d sentences, %d tokens of best hypotheses, %d decoder "
                        "invocations in %d batches", self.token_order, self.beam_size, s["sentences"], s["tokens"],
                        s["decoder_invocations"], s["batches"])

    # --- decoding -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        self._begin_generate(prefix_tokens, constraints)
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.shape[:2]
        device = src_tokens.device
        W = self.beam_size
        max_len = self.rules.max_len(src_len, self.max_positions - 3)
        self._stats["batches"] += 1

        self.steps.start(net_input, W, max_len)
        start = self.eos if bos_token is None else bos_token
        # Rows are (live sentence, beam); column 2s, 2s+1 hold the inputs of step s.
        tokens = torch.full((bsz * W, 2), start, dtype=torch.long, device=device)
        slot_scores = torch.zeros(bsz * W, 0, device=device)
        cumulative = torch.zeros(bsz, W, device=device)
        cumulative[:, 1:] = -math.inf  # at step 0 all beams are the same: expand only the first
        sentences = torch.arange(bsz, device=device)  # original index of each live sentence
        finalized: List[List[Dict]] = [[] for _ in range(bsz)]  # CPU tensors until the end: no device reads

        step = 0
        while sentences.numel() > 0:
            live = sentences.numel()
            logits = self.steps.logits(tokens)
            self._stats["decoder_invocations"] += 1
            lprobs = self._constrained_lprobs(logits, step, max_len).view(live, W, 2, -1)
            vocab = lprobs.size(-1)

            # DoubleTopK, first slot: the best extensions over all live hypotheses of a sentence.
            left_total = (cumulative.unsqueeze(-1) + lprobs[:, :, 0]).view(live, W * vocab)
            left_score, left_index = left_total.topk(min(self.left_candidates, W * vocab), dim=1)
            left_beam, left_token = left_index // vocab, left_index % vocab
            # ... second slot: each first-slot candidate with its own hypothesis' second-slot distribution.
            # The second slot does not depend on the first slot's token, so of each hypothesis only its
            # `pairs` best second-slot tokens can be among the `pairs` best pairs: select from those
            # (L x pairs scores instead of L x V; the same result).
            pairs = min(self.pair_candidates, vocab)
            right_score, right_token = lprobs[:, :, 1].topk(pairs, dim=-1)  # (live, W, pairs)
            index = left_beam.unsqueeze(-1).expand(-1, -1, pairs)
            right_score, right_token = right_score.gather(1, index), right_token.gather(1, index)  # (live, L, pairs)
            ended = left_token.eq(self.eod)
            if ended.any():  # after a first-slot EOD the only second slot is EOD
                eod_score = lprobs[:, :, 1, self.eod].gather(1, left_beam)
                if self.forced_eod_is_certain:
                    eod_score = torch.zeros_like(eod_score)
                first = torch.arange(pairs, device=device) == 0
                right_score = torch.where(ended.unsqueeze(-1), torch.where(first, eod_score.unsqueeze(-1), -math.inf),
                                          right_score)
                right_token = torch.where(ended.unsqueeze(-1), self.eod, right_token)
            pair_total = (left_score.unsqueeze(-1) + right_score).view(live, -1)
            pair_score, pair_index = pair_total.topk(min(self.pair_candidates, pair_total.size(1)), dim=1)
            candidate = pair_index // pairs
            right_token = right_token.view(live, -1).gather(1, pair_index)
            beam = left_beam.gather(1, candidate)
            left_token = left_token.gather(1, candidate)
            row = torch.arange(live, device=device).unsqueeze(1) * W + beam  # (live, P) rows of `tokens`
            pair_slot_scores = torch.stack([
                lprobs[:, :, 0].reshape(live * W, vocab)[row, left_token],
                lprobs[:, :, 1].reshape(live * W, vocab)[row, right_token]], dim=-1)  # (live, P, 2)
            if self.forced_eod_is_certain:
                pair_slot_scores[..., 1].masked_fill_(left_token.eq(self.eod), 0.0)

            # FINALIZE: pairs with an EOD among the W best candidates.
            has_eod = (left_token.eq(self.eod) | right_token.eq(self.eod)) & (pair_score > -math.inf)
            finishing = has_eod[:, :W]
            if finishing.any():
                # Gathered on the device, then one copy to the CPU: a per-hypothesis loop of indexing and int()
                # reads would wait for the GPU at every read.
                i, j = finishing.nonzero(as_tuple=True)  # row-major: each sentence's candidates best first
                r = row[i, j]
                folded = torch.cat([tokens[r, 2:], left_token[i, j].unsqueeze(1), right_token[i, j].unsqueeze(1)], 1)
                scores = torch.cat([slot_scores[r], pair_slot_scores[i, j]], dim=1)
                folded, scores, ending = folded.cpu(), scores.cpu(), sentences[i].tolist()
                for n, sentence in enumerate(ending):
                    if len(finalized[sentence]) < W:
                        finalized[sentence].append(self._hypothesis(folded[n], scores[n]))
            done = torch.tensor([len(finalized[i]) >= W for i in sentences.tolist()], device=device)
            if 2 * step >= max_len:  # every slot was forced to EOD: nothing can continue
                done[:] = True

            # EXPANDBEAM: the W best candidates without EOD continue.
            continuing = pair_score.masked_fill(has_eod, -math.inf)
            next_score, next_candidate = continuing.topk(W, dim=1)
            keep = (~done).nonzero().view(-1)
            if keep.numel() == 0:
                break
            next_row = row.gather(1, next_candidate)[keep].view(-1)
            next_pair = torch.stack([left_token.gather(1, next_candidate), right_token.gather(1, next_candidate)],
                                    dim=-1)[keep].view(-1, 2)
            next_pair_scores = pair_slot_scores.gather(1, next_candidate.unsqueeze(-1).expand(-1, -1, 2))[keep]
            kept_rows = None
            if keep.numel() < live:
                kept_rows = (keep.unsqueeze(1) * W + torch.arange(W, device=device)).view(-1)
            self.steps.reorder(next_row, kept_rows)
            tokens = torch.cat([tokens[next_row], next_pair], dim=1)
            slot_scores = torch.cat([slot_scores[next_row], next_pair_scores.view(-1, 2)], dim=1)
            cumulative = next_score[keep]
            sentences = sentences[keep]
            step += 1

        for hypotheses in finalized:
            hypotheses.sort(key=lambda h: float(h["score"]), reverse=True)
            for hypothesis in hypotheses:  # on the device, as fairseq's generator returns them
                for key in ("tokens", "score", "positional_scores"):
                    hypothesis[key] = hypothesis[key].to(device)
            self._stats["sentences"] += 1
            self._stats["tokens"] += hypotheses[0]["tokens"].numel()
        return finalized

    def _constrained_lprobs(self, logits: Tensor, step: int, max_len: int) -> Tensor:
        """(rows, 2, V) log-probabilities of step ``step``'s two slots, under fairseq's decoding constraints.

        The slots emit natural tokens 2s+1 and 2s+2: an EOD in the first slot ends the sentence at 2s
        tokens, in the second at 2s+1, so EOD is forbidden where that would be fewer than --min-len tokens
        and forced where more would exceed the maximum length. Pad and EOS (the start symbol, never a
        target with two tokens a step) are never produced; --unkpen applies.
        """
        if self.temperature != 1.0:
            logits = logits / self.temperature
        lprobs = torch.log_softmax(logits.float(), dim=-1)
        nan_to_minus_inf_(lprobs)
        lprobs[..., self.eos] = -math.inf
        for slot in (0, 1):  # natural length if this slot is EOD: 2s, 2s + 1
            self.rules.apply(lprobs[:, slot], 2 * step + slot, max_len, end=self.eod)
        return lprobs

    def _hypothesis(self, folded: Tensor, slot_scores: Tensor) -> Dict:
        """A finished folded hypothesis (ending with the pair holding its EOD) in fairseq's natural-order form."""
        kept = unfold_indices(folded.tolist(), self.token_order, 2, self.eod)
        index = torch.tensor(kept, dtype=torch.long, device=folded.device)
        tokens = torch.cat([folded[index], folded.new_full((1,), self.eos)])
        # The EOS position scores every slot not kept: the EOD(s) of the last pair.
        eos_score = slot_scores.sum() - slot_scores[index].sum()
        positional_scores = torch.cat([slot_scores[index], eos_score.view(1)])
        return {"tokens": tokens, "score": self.rules.score(positional_scores), "attention": None, "alignment": None,
                "positional_scores": positional_scores}
