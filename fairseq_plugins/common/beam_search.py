"""Beam search over a step model, with fairseq's rules and Devlin (2017)'s early stopping; and
``BeamSearchGenerator``, fairseq-generate's generator interface around it (rnn_fc decoding, and the fast
decoder step with early stopping).

The search is fairseq's SequenceGenerator's (so that, with no switch on, it gives fairseq's outputs): each
step takes the 2 x beam best continuations; EOS among the first beam of them finishes a hypothesis (score
normalised by length ** lenpen unless --unnormalized); the first beam that are not EOS form the next beam;
a sentence is done with beam finished hypotheses, or at its maximum length (EOS forced).

What it adds:
- the step model sees each new beam's parents (``parents``) instead of reordered states, so a model can
  compute what depends only on the previous state once per distinct parent (merged recurrent states);
- the output layer may run over a per-sentence candidate list (``candidates``: vocabulary ids), the search
  maps the picked columns back to vocabulary ids;
- early stopping (``early_stop_delta``): a sentence is done once its best unfinished hypothesis is more
  than delta below its best finished one, both as cumulative log-probabilities. A continuation can only
  lower a cumulative log-probability, so with --unnormalized no stopped hypothesis could have won; with
  length normalisation a long one could in principle, which is why the BLEU of each setting is measured.
"""

import logging
from typing import Dict, List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from .generation import MethodGenerator
from .step_rules import StepRules
from .textio import InputError

logger = logging.getLogger(__name__)


class CandidateLists(Protocol):
    """What the search reads of candidate lists (``kernels.shortlist.Shortlist``)."""

    def candidates(self, src_tokens: Tensor) -> Tuple[Tensor, Tensor]:
        """Each sentence's list of vocabulary ids (B, C), padded to the longest list, and which are real (B, C)."""


class StepModel(Protocol):
    def start(self, sample: Dict, candidates: Optional[Tensor], candidate_valid: Optional[Tensor] = None) -> None:
        """Encode the batch; ``candidates`` (B, C) are each sentence's output ids (None: the vocabulary), padded
        to the longest list; ``candidate_valid`` (B, C) says which are real: the padding must get no
        probability (-inf logits before the softmax), or a sentence's scores would depend on its batch."""

    def step(self, tokens: Tensor, parents: Optional[Tensor]) -> Tensor:
        """Log-probabilities (B, k, C) of the next token after ``tokens`` (B, k), the last token of each of the
        k hypotheses of every sentence; ``parents`` (B, k) are the rows of the previous step they extend
        (None at the first step)."""


class BeamSearch:
    def __init__(self, tgt_dict, beam: int = 5, max_len_a: float = 0.0, max_len_b: int = 200, min_len: int = 1,
                 len_penalty: float = 1.0, normalize_scores: bool = True, unk_penalty: float = 0.0, nbest: int = 1,
                 early_stop_delta: Optional[float] = None, max_len: int = 1024):
        if nbest > beam:
            raise InputError(f"--nbest {nbest} cannot exceed --beam {beam}")
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.beam, self.nbest = beam, nbest
        self.rules = StepRules(tgt_dict, min_len=min_len, max_len_a=max_len_a, max_len_b=max_len_b,
                               unk_penalty=unk_penalty, normalize_scores=normalize_scores, len_penalty=len_penalty)
        self.max_len = max_len  # the model's positions
        self.early_stop_delta = early_stop_delta
        self.steps = 0  # decoder steps of the last search (for statistics)
        self.stopped_early = 0

    def search(self, model: StepModel, sample: Dict, candidates: Optional[Tensor] = None,
               candidate_valid: Optional[Tensor] = None) -> List[List[Dict]]:
        src_tokens = sample["net_input"]["src_tokens"]
        batch, device = src_tokens.size(0), src_tokens.device
        # As fairseq: the longest source of the batch sets every sentence's limit.
        src_len = int(sample["net_input"]["src_lengths"].max())
        max_len = self.rules.max_len(src_len, self.max_len - 1)
        model.start(sample, candidates, candidate_valid)
        beam = self.beam
        mask = columns_of = None
        if candidates is not None:
            mask = torch.zeros(candidates.shape, device=device)
            mask.masked_fill_(~candidate_valid, float("-inf"))
            mask = mask.unsqueeze(1)  # (B, 1, C)
            # Where padding, unknown and EOS sit in each sentence's list: once a batch, not every step.
            columns_of = {symbol: candidates.eq(symbol).unsqueeze(1) for symbol in (self.pad, self.unk, self.eos)}

        tokens = torch.full((batch, 1, 1), self.eos, dtype=torch.long, device=device)  # BOS is EOS in fairseq
        scores = torch.zeros(batch, 1, device=device)
        positional = torch.zeros(batch, 1, 0, device=device)
        parents = None
        finished: List[List[Dict]] = [[] for _ in range(batch)]
        done = [False] * batch
        self.stopped_early = 0
        step = 0
        for step in range(max_len + 1):
            lprobs = model.step(tokens[:, :, -1], parents).float()  # (B, k, C)
            if mask is not None:
                lprobs = lprobs + mask
            width = lprobs.size(-1)
            self.rules.apply(lprobs, step, max_len, columns=columns_of)
            k = lprobs.size(1)
            cumulative = scores.unsqueeze(-1) + lprobs  # (B, k, C)
            top = min(2 * beam, k * width)
            values, flat = cumulative.view(batch, -1).topk(top, dim=1)
            rows, columns = flat // width, flat % width
            picked = columns if candidates is None else candidates.gather(1, columns)
            is_eos = picked.eq(self.eos) & values.ne(float("-inf"))

            eos_ranks = is_eos[:, :beam].tolist()
            for b in range(batch):
                if done[b]:
                    continue
                for rank, eos in enumerate(eos_ranks[b]):
                    if eos and len(finished[b]) < beam:
                        row = rows[b, rank]
                        finished[b].append(self._hypothesis(tokens[b, row], positional[b, row], float(values[b, rank]),
                                                            float(values[b, rank] - scores[b, row]), step))
                if len(finished[b]) >= beam or step == max_len:
                    done[b] = True
            if all(done) or step == max_len:
                break

            # The next beam: the first `beam` candidates that are not EOS (fairseq's active hypotheses).
            blocked = is_eos | values.eq(float("-inf"))
            order = torch.sort(blocked.to(torch.uint8), dim=1, stable=True).indices[:, :beam]
            new_values = values.gather(1, order)
            parents = rows.gather(1, order)
            new_tokens = picked.gather(1, order)
            step_scores = new_values - scores.gather(1, parents)
            tokens = torch.cat([tokens.gather(1, parents.unsqueeze(-1).expand(-1, -1, tokens.size(2))),
                                new_tokens.unsqueeze(-1)], dim=2)
            positional = torch.cat([positional.gather(1, parents.unsqueeze(-1).expand(-1, -1, positional.size(2))),
                                    step_scores.unsqueeze(-1)], dim=2)
            scores = new_values

            if self.early_stop_delta is not None:
                for b in range(batch):
                    if not done[b] and finished[b]:
                        best_finished = max(h["cumulative"] for h in finished[b])
                        if float(scores[b].max()) < best_finished - self.early_stop_delta:
                            done[b] = True
                            self.stopped_early += 1
                if all(done):
                    break
        self.steps = step + 1
        results = []
        for b in range(batch):
            hypotheses = sorted(finished[b], key=lambda h: -h["score"])[:self.nbest]
            for h in hypotheses:
                h.pop("cumulative")
            results.append(hypotheses)
        return results

    def _hypothesis(self, prefix: Tensor, positional: Tensor, cumulative: float, eos_score: float,
                    step: int) -> Dict:
        length = step + 1  # tokens including EOS
        score = self.rules.normalize(cumulative, length)
        tokens = torch.cat([prefix[1:], prefix.new_tensor([self.eos])])
        return {
            "tokens": tokens,
            "score": score,
            "cumulative": cumulative,
            "positional_scores": torch.cat([positional, positional.new_tensor([eos_score])]),
            "attention": None,
            "alignment": torch.empty(0),
        }


def flat_rows(parents: Tensor, previous_rows: int) -> Tensor:
    """(B, k) parent rows within each sentence -> (B * k,) rows of the previous step's flat (B * k') layout."""
    batch = parents.size(0)
    offsets = torch.arange(batch, device=parents.device).unsqueeze(1) * previous_rows
    return (parents + offsets).view(-1)


def unique_rows(rows: Tensor) -> Tuple[Tensor, Tensor]:
    """Distinct rows and, for each row, its index among them."""
    return torch.unique(rows, return_inverse=True)


class BeamSearchGenerator(MethodGenerator):
    """``BeamSearch`` over a step model (``stepper``: ``start``/``step`` as ``StepModel``, counting its model
    calls in ``row_calls``) as fairseq-generate's generator, with candidate lists. Statistics for
    ``fairseq-plugins bench`` (generation_stats) and the exit log: decoder steps, model calls, candidate-list
    sizes, sentences stopped early; ``settings`` adds the subclass's switches to both."""

    def __init__(self, model, tgt_dict, stepper, beam: int = 5, shortlist: Optional[CandidateLists] = None,
                 early_stop_delta: Optional[float] = None, settings: Optional[Dict] = None, **search_args):
        self.model, self.stepper, self.tgt_dict = model, stepper, tgt_dict
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()  # fairseq-generate reads the generator's eos
        self.shortlist = shortlist
        self.search = BeamSearch(tgt_dict, beam=beam, early_stop_delta=early_stop_delta,
                                 max_len=model.max_decoder_positions(), **search_args)
        self.settings = dict(settings or {}, shortlist=shortlist is not None, early_stop_delta=early_stop_delta,
                             beam=beam)
        self.reset_generation_stats()

    stat_counters = {"sentences": 0, "batches": 0, "steps": 0, "row_calls": 0, "candidates": 0, "stopped_early": 0}

    def generation_stats(self) -> Dict:
        stats = dict(super().generation_stats(), **self.settings)
        if stats["batches"]:
            stats["steps_per_batch"] = stats["steps"] / stats["batches"]
            stats["model_calls_per_step"] = stats["row_calls"] / max(stats["steps"], 1)
        if stats["sentences"] and self.shortlist is not None:
            stats["candidates_per_sentence"] = stats["candidates"] / stats["sentences"]
        return stats

    def _log_summary(self) -> None:
        stats = self.generation_stats()
        if stats["sentences"]:
            settings = ", ".join(f"{key}={value}" for key, value in self.settings.items() if key != "shortlist")
            logger.info("%s decoding: %d sentences, %.1f steps a batch, %.2f model calls a step, %s; %d stopped "
                        "early%s", self.method_name, stats["sentences"], stats["steps_per_batch"],
                        stats["model_calls_per_step"], settings, stats["stopped_early"],
                        f", {stats['candidates_per_sentence']:.0f} candidates a sentence" if self.shortlist else "")

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        self._begin_generate(prefix_tokens, constraints)
        src_tokens = sample["net_input"]["src_tokens"]
        candidates = valid = None
        if self.shortlist is not None:
            candidates, valid = self.shortlist.candidates(src_tokens)
            self._stats["candidates"] += int(valid.sum())
        hypotheses = self.search.search(self.stepper, sample, candidates, valid)
        self._stats["sentences"] += src_tokens.size(0)
        self._stats["batches"] += 1
        self._stats["steps"] += self.search.steps
        self._stats["row_calls"] += self.stepper.row_calls
        self._stats["stopped_early"] += self.search.stopped_early
        return hypotheses
