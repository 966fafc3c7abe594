"""Blockwise parallel decoding (Stern et al. 2018): predict, verify, accept, one decoder call per iteration.

State per sentence: the accepted prefix (its keys and values live in fairseq's ``incremental_state``), the
decoder state at the last accepted token, and p_1's log-probabilities there. Each iteration:

1. predict: p_1's (constrained) argmax is the next token, certain under greedy decoding; heads 2..k of
   the same state propose the k - 1 tokens after it;
2. verify + propose (one call, paper section 4): the k-token block runs against the cache with a causal
   mask; p_1 at block position i checks the proposal at i + 1, and the heads at every position are the
   proposals for the next iteration;
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
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ..common.generation import MethodGenerator
from ..common.step_rules import StepRules

logger = logging.getLogger(__name__)


class BlockwiseGenerator(MethodGenerator):
    method_name = "blockwise"

    def __init__(self, model, tgt_dict, block_size: int, acceptance: str = "exact", topk: int = 2,
                 distance: float = 1.0, min_block_size: int = 1, max_len_a: float = 0.0, max_len_b: int = 200,
                 min_len: int = 1, normalize_scores: bool = True, len_penalty: float = 1.0,
                 unk_penalty: float = 0.0, temperature: float = 1.0):
        self.model = model
        self.decoder = model.decoder
        self.block_size = block_size
        self.acceptance = acceptance
        self.topk = topk
        self.distance = distance
        self.min_block_size = min_block_size
        self.rules = StepRules(tgt_dict, min_len=min_len, max_len_a=max_len_a, max_len_b=max_len_b,
                               unk_penalty=unk_penalty, normalize_scores=normalize_scores, len_penalty=len_penalty)
        self.max_positions = model.max_decoder_positions()
        self.temperature = temperature
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.learned_first_head = self.decoder.proposal_heads.learned_first_head
        self.reset_generation_stats()

    # --- statistics (bench harness hooks; fairseq-generate gets a summary line at exit) ------------------

    def reset_generation_stats(self) -> None:
        self._stats = {"sentences": 0, "tokens": 0, "iterations": 0, "decoder_invocations": 0, "batches": 0}

    def generation_stats(self) -> Dict:
        s = dict(self._stats)
        # Mean accepted block size: output tokens per predict-verify-accept iteration of a sentence.
        s["mean_accepted_block_size"] = round(s["tokens"] / s["iterations"], 4) if s["iterations"] else 0.0
        s["block_size"] = self.block_size
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
        encoder_out = self.model.encoder.forward_torchscript(net_input)
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        bos = self.eos if bos_token is None else bos_token
        start = torch.full((bsz, 1), bos, dtype=torch.long, device=device)
        state = self.decoder.block_features(start, torch.zeros_like(start), encoder_out, incremental_state)[:, 0]
        self._stats["decoder_invocations"] += 1

        rows = torch.arange(bsz, device=device)      # original sentence index of each live row
        generated = torch.zeros(bsz, dtype=torch.long, device=device)  # output tokens so far
        cached = torch.ones(bsz, dtype=torch.long, device=device)      # valid cache slots (inputs fed)
        lprobs = self._base_lprobs(state.unsqueeze(1), generated, max_len)[:, 0]   # p_1 at the last accepted input
        tokens: List[List[Tensor]] = [[] for _ in range(bsz)]
        scores: List[List[Tensor]] = [[] for _ in range(bsz)]
        k = self.block_size
        steps = torch.arange(k, device=device)

        while rows.numel() > 0:
            first_score, first = lprobs.max(dim=-1)
            block = first.unsqueeze(1)
            if k > 1:
                block = torch.cat([block, self._proposals(state)], dim=1)  # (B, k)
            self._stats["iterations"] += rows.numel()

            # Rows whose certain next token is EOS finish without another call.
            done_now = first.eq(self.eos)
            for r in done_now.nonzero().view(-1).tolist():
                tokens[rows[r]].append(first[r:r + 1])
                scores[rows[r]].append(first_score[r:r + 1])
            if done_now.any():
                encoder_out, (rows, generated, cached, block, first_score) = self._drop_rows(
                    done_now, incremental_state, encoder_out, (rows, generated, cached, block, first_score))
                if rows.numel() == 0:
                    break

            positions = (cached.unsqueeze(1) + steps).clamp(max=self.max_positions - 1)
            physical = self.decoder.cached_length(incremental_state)
            features = self.decoder.block_features(block, positions, encoder_out, incremental_state)
            self._stats["decoder_invocations"] += 1
            # p_1 at block position i predicts output token number generated + i + 1.
            block_lprobs = self._base_lprobs(features, generated + 1, max_len)  # (B, k, V)

            token_scores = torch.cat(
                [first_score.unsqueeze(1), block_lprobs[:, :-1].gather(2, block[:, 1:].unsqueeze(2)).squeeze(2)], 1)
            verified = self._verified(block[:, 1:], block_lprobs[:, :-1], token_scores[:, 1:])
            accepted = 1 + verified.long().cumprod(dim=1).sum(dim=1)  # (B,) in 1..k
            # Cut after the first EOS inside the accepted part.
            is_eos = block.eq(self.eos) & (steps.unsqueeze(0) < accepted.unsqueeze(1))
            finished = is_eos.any(dim=1)
            first_eos = torch.where(is_eos, steps.unsqueeze(0), k).min(dim=1).values
            accepted = torch.where(finished, first_eos + 1, accepted)

            for r, (n, row) in enumerate(zip(accepted.tolist(), rows.tolist())):
                tokens[row].append(block[r, :n])
                scores[row].append(token_scores[r, :n])

            row_index, last = torch.arange(rows.numel(), device=device), accepted - 1
            state, lprobs = features[row_index, last], block_lprobs[row_index, last]
            generated = generated + accepted
            self.decoder.rollback_cache(incremental_state, cached, accepted, physical)
            cached = cached + accepted

            if finished.any():
                encoder_out, (rows, generated, cached, state, lprobs) = self._drop_rows(
                    finished, incremental_state, encoder_out, (rows, generated, cached, state, lprobs))
                if rows.numel() == 0:
                    break

        return [self._hypothesis(torch.cat(tokens[i]), torch.cat(scores[i])) for i in range(bsz)]

    def _hypothesis(self, tokens: Tensor, positional_scores: Tensor) -> List[Dict]:
        self._stats["sentences"] += 1
        self._stats["tokens"] += tokens.numel()
        return [{"tokens": tokens, "score": self.rules.score(positional_scores), "attention": None, "alignment": None,
                 "positional_scores": positional_scores}]

    def _base_lprobs(self, features: Tensor, first_index: Tensor, max_len: int) -> Tensor:
        """p_1's log-probabilities (B, m, V) under the stock generator's constraints.

        Position i of row b predicts output token number first_index[b] + i: EOS is forbidden before
        --min-len, and forced at max_len; pad is never produced; --unkpen applies.
        """
        if self.learned_first_head:
            logits = self.decoder.head_logits(features, [0]).squeeze(-2)
        else:
            logits = self.decoder.output_layer(features)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        lprobs = torch.log_softmax(logits.float(), dim=-1)
        lprobs[lprobs != lprobs] = -math.inf
        index = first_index.unsqueeze(1) + torch.arange(lprobs.size(1), device=lprobs.device)
        return self.rules.apply(lprobs, index, max_len)

    def _proposals(self, state: Tensor) -> Tensor:
        """Heads 2..k at the last accepted state: (B, d) -> (B, k - 1) proposed tokens."""
        logits = self.decoder.head_logits(state, list(range(1, self.block_size))).float()
        logits[..., self.pad] = -math.inf
        return logits.argmax(dim=-1)

    def _verified(self, proposed: Tensor, lprobs: Tensor, proposed_scores: Tensor) -> Tensor:
        """(B, k-1) bool: is the proposal at block position i + 1 acceptable under p_1 at position i?"""
        allowed = proposed_scores > -math.inf  # never accept what the constraints forbid
        if self.acceptance == "exact":
            ok = proposed.eq(lprobs.argmax(dim=-1))
        elif self.acceptance == "topk":
            kth_best = lprobs.topk(self.topk, dim=-1).values[..., -1]
            ok = proposed_scores >= kth_best
        else:  # distance: log-probability gap to p_1's best token
            ok = proposed_scores >= lprobs.max(dim=-1).values - self.distance
        forced = torch.arange(proposed.size(1), device=proposed.device) < self.min_block_size - 1
        return (ok | forced.unsqueeze(0)) & allowed

    def _drop_rows(self, done: Tensor, incremental_state, encoder_out, tensors):
        """Remove the ``done`` rows from the batch: cache, encoder output and the given per-row tensors."""
        keep = (~done).nonzero().view(-1)
        if keep.numel() > 0:  # the caller stops once the batch is empty
            self.decoder.reorder_incremental_state_scripting(incremental_state, keep)
            encoder_out = self.model.encoder.reorder_encoder_out(encoder_out, keep)
        return encoder_out, tuple(t.index_select(0, keep) for t in tensors)
