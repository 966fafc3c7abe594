"""Blockwise parallel decoding (Stern et al. 2018): predict, verify, accept, one decoder call per iteration.

State per sentence: the accepted prefix (its keys and values live in fairseq's ``incremental_state``), the
decoder state at the last accepted token, and p_1's log-probabilities there. Each iteration:

1. predict: p_1's (constrained) argmax is the next token, certain under greedy decoding; heads 2..k of
   the same state propose the k - 1 tokens after it (computed by the previous call);
2. verify + propose (one decoder call and one output-projection matmul, paper section 4): the block runs
   against the cache with a causal mask; p_1 at block position i checks the proposal at i + 1, and the
   heads at every position propose for the next iteration, whichever position ends up the last accepted.
   p_1's rows and the heads' rows go through the output projection together, so its weights are read
   once per call; acceptance needs only argmaxes, and the scores of accepted tokens a logsumexp per row;
3. accept: the longest verified prefix of the block (``exact``: it equals p_1's argmax; ``topk``: it is
   among p_1's N best; ``distance``: its log-probability is within EPS of the best), at least
   ``--min-block-size`` tokens, cut after EOS. The rejected tail's keys and values are dropped from the
   cache; the prefix is never recomputed.

Sentences of a batch accept different numbers of tokens: their caches are packed per sentence and the
unused slots masked, and finished sentences leave the batch. With ``exact`` acceptance the output is
token-for-token that of ``fairseq-generate --beam 1`` (same constraints: EOS never first, forced at
``max_len``, pad never, ``--unkpen``), and scores are computed the same way.
"""

import logging
import math
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..common.generation import MethodGenerator
from ..common.step_rules import StepRules

logger = logging.getLogger(__name__)


class BlockwiseGenerator(MethodGenerator):
    method_name = "blockwise"
    step_backend = "fairseq"  # whose decoder step the calls run on (step_cost_figures names it)

    def __init__(self, model, tgt_dict, block_size: int, acceptance: str = "exact", topk: int = 2,
                 distance: float = 1.0, min_block_size: int = 1, adaptive_threshold: float = 0.0,
                 proposal_vocab: int = 0,
                 max_len_a: float = 0.0, max_len_b: int = 200, min_len: int = 1, normalize_scores: bool = True,
                 len_penalty: float = 1.0, unk_penalty: float = 0.0, temperature: float = 1.0):
        self.model = model
        self.decoder = model.decoder
        self.block_size = block_size
        self.acceptance = acceptance
        self.topk = topk
        self.distance = distance
        self.min_block_size = min_block_size
        self.adaptive_threshold = adaptive_threshold
        self.proposal_vocab = proposal_vocab
        self.rules = StepRules(tgt_dict, min_len=min_len, max_len_a=max_len_a, max_len_b=max_len_b,
                               unk_penalty=unk_penalty, normalize_scores=normalize_scores, len_penalty=len_penalty)
        self.max_positions = model.max_decoder_positions()
        self.temperature = temperature
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.reset_generation_stats()

    # --- statistics (bench harness hooks; fairseq-generate gets a summary line at exit) ------------------

    stat_counters = {"sentences": 0, "tokens": 0, "iterations": 0, "decoder_invocations": 0, "batches": 0,
                     "block_tokens_fed": 0, "blocks_fed": 0}

    def generation_stats(self) -> Dict:
        s = super().generation_stats()
        # Mean accepted block size: output tokens per predict-verify-accept iteration of a sentence.
        s["mean_accepted_block_size"] = round(s["tokens"] / s["iterations"], 4) if s["iterations"] else 0.0
        # Tokens fed per verification call and sentence (k, or fewer with --block-adaptive-threshold).
        s["mean_block_fed"] = round(s["block_tokens_fed"] / s["blocks_fed"], 4) if s["blocks_fed"] else 0.0
        s["block_size"] = self.block_size
        s["adaptive_threshold"] = self.adaptive_threshold
        s["proposal_vocab"] = self.proposal_vocab
        return s

    def _log_summary(self) -> None:
        s = self.generation_stats()
        if s["sentences"]:
            # Calls are batched: greedy decoding makes one per output token of a batch's longest sentence.
            logger.info("blockwise (k=%d, %s): %d sentences, %d tokens, mean accepted block size %.2f, "
                        "%d decoder invocations in %d batches (%.1f per batch)", self.block_size, self.acceptance,
                        s["sentences"], s["tokens"], s["mean_accepted_block_size"], s["decoder_invocations"],
                        s["batches"], s["decoder_invocations"] / s["batches"])

    # --- decoding ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        self._begin_generate(prefix_tokens, constraints)
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.shape[:2]
        max_len = self.rules.max_len(src_len, self.max_positions - 1)
        device = src_tokens.device

        self._stats["batches"] += 1
        encoder_out = self._encode(net_input)
        incremental_state = self._begin(encoder_out, max_len)
        bos = self.eos if bos_token is None else bos_token
        start = torch.full((bsz, 1), bos, dtype=torch.long, device=device)
        rows = torch.arange(bsz, device=device)      # original sentence index of each live row
        generated = torch.zeros(bsz, dtype=torch.long, device=device)  # output tokens so far
        cached = torch.zeros(bsz, dtype=torch.long, device=device)     # valid cache slots (inputs fed)
        # Per live row, at the last accepted input: p_1's constrained logits and their logsumexp, the heads'
        # proposals for the tokens after p_1's choice, and how many of them to feed.
        base, lse, proposals, lengths = self._call(start, cached, generated, encoder_out, incremental_state,
                                                   max_len, last=torch.zeros_like(rows))[:4]
        cached = cached + 1
        tokens: List[List[Tensor]] = [[] for _ in range(bsz)]
        scores: List[List[Tensor]] = [[] for _ in range(bsz)]

        while rows.numel() > 0:
            first_logit, first = base.max(dim=-1)
            first_score = first_logit - lse
            width = int(lengths.max()) if self.adaptive_threshold else self.block_size - 1
            block = torch.cat([first.unsqueeze(1), proposals[:, :width]], dim=1)  # (B, m)
            self._stats["iterations"] += rows.numel()

            # Rows whose certain next token is EOS finish without another call.
            done_now = first.eq(self.eos)
            for r in done_now.nonzero().view(-1).tolist():
                tokens[rows[r]].append(first[r:r + 1])
                scores[rows[r]].append(first_score[r:r + 1])
            if done_now.any():
                encoder_out, (rows, generated, cached, block, first_score, lengths) = self._drop_rows(
                    done_now, incremental_state, encoder_out, (rows, generated, cached, block, first_score, lengths))
                if rows.numel() == 0:
                    break

            m = block.size(1)
            self._stats["block_tokens_fed"] += rows.numel() * m
            self._stats["blocks_fed"] += rows.numel()
            physical = self._cached_length(incremental_state)
            block_base, block_lse, block_logits = self._verify_call(block, cached, generated, encoder_out,
                                                                    incremental_state, max_len)
            # p_1 at block position i scores the proposal at i + 1.
            proposed_scores = (block_base[:, :-1].gather(2, block[:, 1:].unsqueeze(2)).squeeze(2)
                               - block_lse[:, :-1])
            token_scores = torch.cat([first_score.unsqueeze(1), proposed_scores], 1)
            verified = self._verified(block[:, 1:], block_base[:, :-1], proposed_scores)
            if self.adaptive_threshold:  # a row's block ends where its own confident proposals end
                verified &= torch.arange(m - 1, device=device).unsqueeze(0) < lengths.unsqueeze(1)
            accepted = 1 + verified.long().cumprod(dim=1).sum(dim=1)  # (B,) in 1..m
            # Cut after the first EOS inside the accepted part.
            steps = torch.arange(m, device=device).unsqueeze(0)
            is_eos = block.eq(self.eos) & (steps < accepted.unsqueeze(1))
            finished = is_eos.any(dim=1)
            first_eos = torch.where(is_eos, steps, m).min(dim=1).values
            accepted = torch.where(finished, first_eos + 1, accepted)

            for r, (n, row) in enumerate(zip(accepted.tolist(), rows.tolist())):
                tokens[row].append(block[r, :n])
                scores[row].append(token_scores[r, :n])

            row_index, last = torch.arange(rows.numel(), device=device), accepted - 1
            base, lse = block_base[row_index, last], block_lse[row_index, last]
            proposals, lengths = self._proposals(self._proposal_logits(block_logits, row_index, last))
            generated = generated + accepted
            self._rollback(incremental_state, cached, accepted, physical)
            cached = cached + accepted

            if finished.any():
                encoder_out, (rows, generated, cached, base, lse, proposals, lengths) = self._drop_rows(
                    finished, incremental_state, encoder_out, (rows, generated, cached, base, lse, proposals, lengths))
                if rows.numel() == 0:
                    break

        return [self._hypothesis(torch.cat(tokens[i]), torch.cat(scores[i])) for i in range(bsz)]

    # --- cost of one call (bench harness hook) ----------------------------------------------------------

    @torch.no_grad()
    def step_cost_figures(self, samples: List[Dict], repeats: int = 20, prefix: int = 8) -> Dict:
        """Time one verify-and-propose call against one greedy step, both on the same cached prefix.

        The greedy step is what greedy decoding asks of the model per token (fairseq's decoder, or the fast
        step's with --fast-step): the decoder on one token and the log-softmax of its output projection. The
        call is this generator's per-iteration model work: the decoder on a block of ``block_size`` tokens,
        p_1's output product at every block position and its logsumexp, the heads' proposals at the last
        (on fairseq's decoder one output product for p_1 and the heads at every position), argmaxes. Each
        sample (a batch: every sentence a row of both) is encoded and the first ``prefix`` tokens of its
        references are cached; the two are then timed alternately ``repeats`` times, the cache cut back after
        each. Returns the median of the per-sample ratios of median times (the paper's speed arithmetic:
        speed ~ mean accepted block / this ratio), the medians in milliseconds and the rows of a sample.
        """
        ratios, call_ms, step_ms = [], [], []
        for sample in samples:
            net_input = sample["net_input"]
            device = net_input["src_tokens"].device
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            encoder_out = self._encode(net_input)
            # (a shorter reference's padding is fed like any token: only the time is kept)
            tokens = net_input["prev_output_tokens"][:, :prefix]
            rows, length = tokens.shape
            max_len = self.rules.max_len(net_input["src_tokens"].size(1), self.max_positions - 1)
            state = self._begin(encoder_out, max_len)
            self._block_features(tokens, torch.arange(length, device=device).expand(rows, length), encoder_out, state)
            cached = torch.full((rows,), length, device=device)
            block = tokens[:, -1:].expand(rows, self.block_size).contiguous()
            last_row = torch.arange(rows, device=device)
            last_position = torch.full((rows,), self.block_size - 1, device=device)
            step_input = torch.cat([tokens, tokens[:, -1:]], dim=1)
            times = {"call": [], "step": []}
            saved = dict(self._stats)
            for _ in range(repeats + 1):  # the first of each is a warm-up
                sync()
                start = time.perf_counter()
                self._greedy_step(step_input, encoder_out, state)
                sync()
                times["step"].append(time.perf_counter() - start)
                self._truncate(state, length)
                start = time.perf_counter()
                _base, _lse, block_logits = self._verify_call(block, cached, cached - 1, encoder_out, state, max_len)
                _base.argmax(dim=-1)
                self._proposals(self._proposal_logits(block_logits, last_row, last_position))
                sync()
                times["call"].append(time.perf_counter() - start)
                self._truncate(state, length)
            self._stats = saved  # timing calls are not decoding
            call, step = statistics.median(times["call"][1:]), statistics.median(times["step"][1:])
            ratios.append(call / step)
            call_ms.append(1000 * call)
            step_ms.append(1000 * step)
        return {"call_cost_vs_greedy_step": round(statistics.median(ratios), 4),
                "call_cost_range": [round(min(ratios), 4), round(max(ratios), 4)],
                "call_ms": round(statistics.median(call_ms), 4), "greedy_step_ms": round(statistics.median(step_ms), 4),
                "call_cost_samples": len(samples), "call_cost_repeats": repeats,
                "call_cost_batch_size": samples[0]["net_input"]["src_tokens"].size(0) if samples else 0,
                "call_cost_step": self.step_backend}

    def _hypothesis(self, tokens: Tensor, positional_scores: Tensor) -> List[Dict]:
        self._stats["sentences"] += 1
        self._stats["tokens"] += tokens.numel()
        return [{"tokens": tokens, "score": self.rules.score(positional_scores), "attention": None, "alignment": None,
                 "positional_scores": positional_scores}]

    def _verify_call(self, block: Tensor, cached: Tensor, generated: Tensor, encoder_out, incremental_state,
                     max_len: int) -> Tuple[Tensor, Tensor, Tensor]:
        """One decoder call on ``block`` (B, m) and one output matmul for p_1 and the heads at every position.

        Returns p_1's constrained logits (B, m, V) and their raw logsumexp (B, m) (position i predicts output
        token number generated + i + 1), and what ``_proposal_logits`` reads the proposals from: here heads
        2..k's logits (B, m, k - 1, V') at every position.
        """
        positions = (cached.unsqueeze(1) + torch.arange(block.size(1), device=block.device)).clamp(
            max=self.max_positions - 1)
        features = self._block_features(block, positions, encoder_out, incremental_state)
        self._stats["decoder_invocations"] += 1
        base, proposal_source = self._block_logits(features)
        index = (generated + 1).unsqueeze(1) + torch.arange(block.size(1), device=block.device)
        base, lse = self._first_head_scores(base, index, max_len)
        return base, lse, proposal_source

    def _first_head_scores(self, logits: Tensor, index: Tensor, max_len: int) -> Tuple[Tensor, Tensor]:
        """p_1's raw logits (..., V) -> its constrained logits and the raw logsumexp (...); ``index`` (...) is the
        output position each row predicts."""
        base = logits.float()
        if self.temperature != 1.0:
            base = base / self.temperature
        base.masked_fill_(base != base, -math.inf)  # as fairseq does with NaN log-probabilities
        # log_softmax before the rules, as SequenceGenerator: a score is logit - logsumexp of the raw row.
        lse = torch.logsumexp(base, dim=-1)
        # The rules only mask and shift columns, so on logits they select what they would on log-probabilities.
        return self.rules.apply(base, index, max_len), lse

    def _proposal_logits(self, proposal_source, row_index: Tensor, last: Tensor) -> Tensor:
        """Heads 2..k's logits (B, k - 1, V') at block position ``last`` (B,) of each row, the last accepted."""
        logits = self._heads_logits_at(proposal_source, row_index, last).float()
        return logits / self.temperature if self.temperature != 1.0 else logits

    def _call(self, block, cached, generated, encoder_out, incremental_state, max_len, last: Tensor):
        """The first call (on BOS): its p_1 row, logsumexp and proposals at block position ``last`` (B,)."""
        base, lse, source = self._verify_call(block, cached, generated - 1, encoder_out, incremental_state, max_len)
        row_index = torch.arange(block.size(0), device=block.device)
        proposals, lengths = self._proposals(self._proposal_logits(source, row_index, last))
        return base[row_index, last], lse[row_index, last], proposals, lengths

    def _proposals(self, logits: Tensor) -> Tuple[Tensor, Tensor]:
        """Heads 2..k at the last accepted position: logits (B, k - 1, V) -> the proposed tokens (B, k - 1) and
        how many of them to feed next (B,): all, or with --block-adaptive-threshold those before the first
        head whose top probability is below the threshold (never fewer than --min-block-size - 1)."""
        logits[..., self.pad] = -math.inf
        top, proposals = logits.max(dim=-1)
        if not self.adaptive_threshold:
            return proposals, proposals.new_full((proposals.size(0),), proposals.size(1))
        confident = (top - torch.logsumexp(logits, dim=-1)) >= math.log(self.adaptive_threshold)
        lengths = confident.long().cumprod(dim=1).sum(dim=1).clamp(min=self.min_block_size - 1)
        return proposals, lengths

    def _verified(self, proposed: Tensor, logits: Tensor, proposed_scores: Tensor, first: int = 0) -> Tensor:
        """(B, m-1) bool: is the proposal at block position i + 1 acceptable under p_1 at position i?

        ``logits`` are p_1's constrained logits: argmax, rank and gaps are those of its log-probabilities.
        ``first``: the block position of the first column (where only some positions are checked).
        """
        allowed = proposed_scores > -math.inf  # never accept what the constraints forbid
        if self.acceptance == "exact":
            ok = proposed.eq(logits.argmax(dim=-1))
        elif self.acceptance == "topk":
            kth_best = logits.topk(min(self.topk, logits.size(-1)), dim=-1).values[..., -1]
            ok = logits.gather(2, proposed.unsqueeze(2)).squeeze(2) >= kth_best
        else:  # distance: log-probability gap to p_1's best token
            ok = logits.gather(2, proposed.unsqueeze(2)).squeeze(2) >= logits.max(dim=-1).values - self.distance
        forced = torch.arange(first, first + proposed.size(1), device=proposed.device) < self.min_block_size - 1
        return (ok | forced.unsqueeze(0)) & allowed

    def _drop_rows(self, done: Tensor, incremental_state, encoder_out, tensors):
        """Remove the ``done`` rows from the batch: cache, encoder output and the given per-row tensors."""
        keep = (~done).nonzero().view(-1)
        if keep.numel() > 0:  # the caller stops once the batch is empty
            encoder_out = self._keep_rows(keep, incremental_state, encoder_out)
        return encoder_out, tuple(t.index_select(0, keep) for t in tensors)

    # --- the model's side: fairseq's decoder and incremental state (FastStepBlockwiseGenerator: the fast step)

    def _encode(self, net_input):
        return self.model.encoder.forward_torchscript(net_input)

    def _begin(self, encoder_out, max_len: int) -> Dict[str, Dict[str, Optional[Tensor]]]:
        """The per-batch decoder state: fairseq's incremental state."""
        return {}

    def _block_features(self, block: Tensor, positions: Tensor, encoder_out, state) -> Tensor:
        """Decoder features (B, m, d) of a block (B, m) fed after each row's cached inputs."""
        return self.decoder.block_features(block, positions, encoder_out, state)

    def _block_logits(self, features: Tensor) -> Tuple[Tensor, Tensor]:
        """p_1's logits (B, m, V) and heads 2..k's (B, m, k - 1, V') in one pass over the output projection."""
        return self.decoder.block_logits(features, self.block_size, self.proposal_vocab)

    def _heads_logits_at(self, proposal_source: Tensor, row_index: Tensor, last: Tensor) -> Tensor:
        """The proposal logits at the chosen positions, already computed for every position."""
        return proposal_source[row_index, last]

    def _cached_length(self, state) -> int:
        return self.decoder.cached_length(state)

    def _rollback(self, state, cached: Tensor, accepted: Tensor, physical: int) -> None:
        self.decoder.rollback_cache(state, cached, accepted, physical)

    def _truncate(self, state, length: int) -> None:
        """Keep the first ``length`` cached inputs of every row."""
        self.decoder._truncate_cache(state, length)

    def _greedy_step(self, tokens: Tensor, encoder_out, state) -> Tensor:
        """A greedy decoding step on the model (timing): the next token after ``tokens`` (B, t + 1), whose
        first t inputs are cached."""
        logits, _ = self.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
        return torch.log_softmax(logits.float(), dim=-1).argmax(dim=-1)

    def _keep_rows(self, keep: Tensor, state, encoder_out):
        self.decoder.reorder_incremental_state_scripting(state, keep)
        return self.model.encoder.reorder_encoder_out(encoder_out, keep)
