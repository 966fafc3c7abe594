"""LatticeGenerator: encoder, lattice, parallel scoring, Viterbi; no left-to-right loop over the model.

Per batch, with |x| the source length and L = round(slope * |x| + intercept) the table's length estimate:
  1. encoder    one call of the model's encoder (its matrices int8 with ``encoder_precision="int8"``,
                --lattice-encoder-precision int8: a copy made once, when the generator is built);
  2. lattice    the top-K tokens of P(y_t | x, t) at t = 1 .. L + dL + 1 from the candidate table;
  3. scoring    one call of the scorer on every (position, state) row that can be on a path (the rows of states
                impossible in every sentence of the batch, e.g. the K - 1 padding states at position 1, are
                skipped): the log-probability of each of the K candidates of position t, and of ending (EOS),
                given the state of the positions before; normalised over the lattice (K candidates + EOS, the
                default) or over the vocabulary; the scorer's per-vocabulary and per-sentence work hoisted out
                of the rows (HoistedLatticeScorer, exact up to float rounding) unless ``hoist=False``
                (--lattice-no-hoist); its feed-forward matrices int8 with ``precision="int8"``
                (--lattice-scorer-precision int8, quantized once, when the generator is built);
  4. Viterbi    the best path of every length L - dL .. L + dL at once, then fairseq's length normalisation.
With ``cuda_graphs`` (--lattice-cuda-graphs, a model on a CUDA device) the lattice is built first, then the
encoder and the scoring of every row run as one CUDA graph per shape (batch size, and the source length and the
lattice's positions each rounded up to a multiple of 16, the padding masked), captured at its first use and
replayed after (``kernels.cuda_graphs``): the "scoring" phase then holds the encoder.
Phase times, decoder calls and the lattice recall of the references (when the batch has them) are kept
for ``fairseq-plugins bench`` (generation_stats) and logged once at exit.
"""

import logging
import time
from typing import Dict

import torch
import torch.nn.functional as F
from fairseq.modules import FairseqDropout
from torch import Tensor

from ..common.generation import MethodGenerator
from ..common.textio import InputError
from ..kernels.cuda_graphs import CapturedCalls, capturable_encoder_out, encoder_unsupported_reason, length_bucket
from ..kernels.decoder_step import parameters_fingerprint
from ..kernels.int8 import int8_encoder
from ..kernels.precision import check_precision
from .ibm2 import CandidateTable, never_candidates
from .model import HoistedLatticeScorer
from .viterbi import beam_search_without_repeats, viterbi

logger = logging.getLogger(__name__)

NORMALIZATIONS = ("lattice", "vocab")
PHASES = ("encoder", "lattice", "scoring", "viterbi")


class LatticeGenerator(MethodGenerator):
    method_name = "lattice"

    def __init__(self, models, tgt_dict, table: CandidateTable, k: int = 64, length_delta: int = 3,
                 normalization: str = "lattice", nbest: int = 1, len_penalty: float = 1.0, normalize_scores: bool = True,
                 max_len_a: float = 0.0, max_len_b: int = 200, min_len: int = 1, hoist: bool = True,
                 precision: str = "fp32", encoder_precision: str = "fp32", mass: float = 1.0,
                 no_repeat_ngram_size: int = 0, beam: int = 0, cuda_graphs: bool = False):
        if len(models) != 1:
            raise InputError("lattice decoding takes one model (no ensembles)")
        if k < 1:
            raise InputError(f"--lattice-k {k}: needs at least one candidate per position")
        if not 0.0 < mass <= 1.0:
            raise InputError(f"--lattice-mass {mass}: must be in (0, 1] (1 keeps all K candidates of a position)")
        if no_repeat_ngram_size < 0 or beam < 0:
            raise InputError(f"--no-repeat-ngram-size {no_repeat_ngram_size}, --lattice-beam {beam}: must be >= 0")
        if length_delta < 0:
            raise InputError(f"--lattice-length-delta {length_delta}: must be >= 0")
        if normalization not in NORMALIZATIONS:
            raise InputError(f"--lattice-normalize {normalization}: choose one of {', '.join(NORMALIZATIONS)}")
        check_precision(precision, "--lattice-scorer-precision")
        if precision == "int8" and not hoist:
            raise InputError("--lattice-scorer-precision int8 runs on the hoisted scorer: drop --lattice-no-hoist")
        check_precision(encoder_precision, "--lattice-encoder-precision")
        self.model = models[0]
        # int8: a copy of the encoder with int8 matrices, made once here (the model's own stays float32)
        # (an inference copy: evaluation mode whatever mode the model is in when the generator is built)
        self.encoder = int8_encoder(self.model.encoder).eval() if encoder_precision == "int8" else self.model.encoder
        self.encoder_precision = encoder_precision
        self.scorer = self.model.decoder
        self.order = self.scorer.markov_order
        self.tgt_dict = tgt_dict
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.k = min(k, self.vocab_size)
        self.mass = mass
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.beam = beam or self.k  # the search under --no-repeat-ngram-size; Viterbi otherwise
        self.excluded = never_candidates(tgt_dict)
        self.table = table
        self.length_delta = length_delta
        self.normalization = normalization
        self.nbest, self.lenpen, self.normalize_scores = nbest, len_penalty, normalize_scores
        self.max_len_a, self.max_len_b, self.min_len = max_len_a, max_len_b, max(1, min_len)
        self.hoist = hoist
        self.precision = precision
        # Built (the int8 matrices quantized) once here; again only if the weights change.
        self._hoisted = HoistedLatticeScorer(self.scorer, precision) if hoist else None
        self._dropouts = [module for module in self.scorer.modules() if isinstance(module, FairseqDropout)]
        self.cuda_graphs = cuda_graphs
        self._captured: "CapturedCalls | None" = None
        self._captured_weights = None  # the model's parameters' fingerprint when its graphs were captured
        if cuda_graphs:
            device = next(self.model.parameters()).device
            for flag, given in (("--lattice-scorer-precision int8", precision == "int8"),
                                ("--lattice-encoder-precision int8", encoder_precision == "int8"),
                                ("--lattice-no-hoist", not hoist)):
                if given:
                    raise InputError(f"--lattice-cuda-graphs: not with {flag}")
            if device.type != "cuda":
                raise InputError(f"--lattice-cuda-graphs: CUDA graphs need the model on a CUDA device, it is on "
                                 f"{device} (drop the flag, or decode on a GPU)")
            reason = encoder_unsupported_reason(self.encoder)
            if reason is not None:
                raise InputError(f"--lattice-cuda-graphs: {reason}")
        self.reset_generation_stats()

    # ---- statistics --------------------------------------------------------------------------------
    stat_counters = {**{f"{phase}_seconds": 0.0 for phase in PHASES},
                     **dict(sentences=0, batches=0, decoder_calls=0, reference_tokens=0, reference_tokens_in_lattice=0,
                            lattice_positions=0, lattice_candidates=0, scored_rows=0)}

    def generation_stats(self) -> Dict:
        stats = super().generation_stats()
        if stats["reference_tokens"]:
            stats["lattice_recall"] = stats["reference_tokens_in_lattice"] / stats["reference_tokens"]
        if stats["sentences"]:
            for phase in PHASES:
                stats[f"{phase}_ms_per_sentence"] = 1000 * stats[f"{phase}_seconds"] / stats["sentences"]
        if stats["lattice_positions"]:
            stats["candidates_per_position"] = stats["lattice_candidates"] / stats["lattice_positions"]
        stats.update(k=self.k, mass=self.mass, no_repeat_ngram_size=self.no_repeat_ngram_size,
                     search_beam=self.beam if self.no_repeat_ngram_size else None, length_delta=self.length_delta,
                     normalization=self.normalization, markov_order=self.order,
                     scorer_layers=len(self.scorer.layers), hoisted=self.hoist, scorer_precision=self.precision,
                     encoder_precision=self.encoder_precision, cuda_graphs=self.cuda_graphs,
                     graphs_captured=0 if self._captured is None else self._captured.captures)
        return stats

    def _log_summary(self) -> None:
        stats = self.generation_stats()
        if not stats["sentences"]:
            return
        phases = ", ".join(f"{phase} {stats[f'{phase}_ms_per_sentence']:.2f}" for phase in PHASES)
        recall = f"; lattice recall of the references {stats['lattice_recall']:.3f}" if "lattice_recall" in stats else ""
        width = f"K={self.k}"
        if self.mass < 1.0:
            width += f", mass {self.mass:g} ({stats['candidates_per_position']:.1f} candidates a position)"
        search = f"no-repeat-{self.no_repeat_ngram_size} search, beam {self.beam}" if self.no_repeat_ngram_size \
            else "viterbi"
        logger.info("lattice decoding: %d sentences, %s, lengths L+-%d, %s; ms per sentence: %s%s",
                    stats["sentences"], width, self.length_delta, search, phases, recall)

    def _tick(self, phase: str, start: float, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        self._stats[f"{phase}_seconds"] += now - start
        return now

    # ---- decoding ----------------------------------------------------------------------------------
    def _source_content(self, src_tokens: Tensor):
        """Right-padded source tokens without EOS (fairseq may left-pad), and their lengths."""
        keep = src_tokens.ne(self.pad) & src_tokens.ne(self.eos)
        lengths = keep.sum(dim=1)
        # Stable sort moves the kept tokens to the front in their order.
        order = (~keep).to(torch.int8).argsort(dim=1, stable=True)
        content = src_tokens.gather(1, order)[:, :max(int(lengths.max()), 1)]
        width = torch.arange(content.size(1), device=content.device).unsqueeze(0)
        return content.masked_fill(width >= lengths.unsqueeze(1), self.pad), lengths

    def _length_ranges(self, source_lengths: Tensor):
        estimate = self.table.predicted_lengths(source_lengths)
        cap = torch.full_like(estimate, self.scorer.max_positions() - 1)
        cap = torch.minimum(cap, (self.max_len_a * source_lengths.double() + self.max_len_b).long()).clamp(min=1)
        shortest = torch.minimum((estimate - self.length_delta).clamp(min=self.min_len), cap)
        longest = torch.minimum(estimate + self.length_delta, cap)
        return estimate, shortest, longest

    def _states(self, lattice_tokens: Tensor, lattice_valid: Tensor, positions: int):
        """Tokens, positions and validity of every (position t = 1..positions + 1, state) row: the scorer's
        input windows. Positions before the first hold BOS (index 0 at position 0) and padding."""
        batch, _, k = lattice_tokens.shape
        order = self.order
        device = lattice_tokens.device
        start_tokens = torch.full((batch, order, k), self.pad, dtype=torch.long, device=device)
        start_tokens[:, -1, 0] = self.eos  # fairseq's BOS for the target side
        start_valid = torch.zeros(batch, order, k, dtype=torch.bool, device=device)
        start_valid[:, :, 0] = True
        tokens = torch.cat([start_tokens, lattice_tokens[:, :positions]], dim=1)  # positions 1-order .. positions
        valid = torch.cat([start_valid, lattice_valid[:, :positions]], dim=1)
        states = k ** order
        state_ids = torch.arange(states, device=device)
        window_tokens, window_valid = [], []
        for j in range(order):
            digit = (state_ids // k ** (order - 1 - j)) % k
            # Row t (1-based) of digit j reads position t - order + j, i.e. index t - 1 + j of `tokens`.
            span = slice(j, j + positions + 1)
            window_tokens.append(tokens[:, span].index_select(2, digit))
            window_valid.append(valid[:, span].index_select(2, digit))
        window_tokens = torch.stack(window_tokens, dim=-1)  # (batch, positions + 1, states, order)
        state_valid = torch.stack(window_valid, dim=-1).all(dim=-1)
        window_positions = self.scorer.window_positions(torch.arange(1, positions + 2, device=device))
        window_positions = window_positions.view(1, positions + 1, 1, order).expand_as(window_tokens)
        return window_tokens, window_positions, state_valid

    def forget_hoisted_tables(self) -> None:
        """Rebuild the hoisted tables (and int8 matrices) from the weights at the next sentence. The weights'
        fingerprint sees in-place updates of the parameters and their replacement, not updates through
        ``param.data`` (which fairseq's optimisers use): the task calls this before each validation."""
        self._hoisted = None

    def _scorer_features(self):
        """The scorer's ``window_features``: hoisted (the tables rebuilt if the weights changed since) unless
        --lattice-no-hoist, or unless the hoisting would not be exact (dropout kept at inference)."""
        if not self.hoist or not HoistedLatticeScorer.exact_for(self.scorer, self._dropouts):
            if self.precision == "int8":
                raise InputError("--lattice-scorer-precision int8 runs on the hoisted scorer, which dropout kept at "
                                 "inference (--retain-dropout) turns off")
            return self.scorer.window_features
        if self._hoisted is None or not self._hoisted.matches(self.scorer):
            self._hoisted = HoistedLatticeScorer(self.scorer, self.precision)
            self._captured = None  # (its graphs read the old tables)
        return self._hoisted.window_features

    def _possible_features(self, window_features, window_tokens: Tensor, window_positions: Tensor, state_valid: Tensor,
                           encoder_out) -> Tensor:
        """(batch, rows, dim) features of the (batch, rows, order) windows, computed only for the rows whose
        state is possible in some sentence of the batch; the others (e.g. the K - 1 padding states at position
        1, 1/(L + dL + 1) of the rows at order 1) are zeros, and their scores are masked to -inf afterwards like
        any impossible state's. Every row is computed on its own, so the kept rows' features are those of the
        full call (bit for bit in the tests)."""
        batch, rows, order = window_tokens.shape
        keep = state_valid.view(batch, rows).any(dim=0)
        if bool(keep.all()):
            self._stats["scored_rows"] += batch * rows
            return window_features(window_tokens, window_positions, encoder_out)
        kept = keep.nonzero().squeeze(1)
        self._stats["scored_rows"] += batch * kept.numel()
        computed = window_features(window_tokens.index_select(1, kept), window_positions.index_select(1, kept),
                                   encoder_out)
        features = computed.new_zeros(batch, rows, computed.size(-1))
        features[:, kept] = computed
        return features

    def _edge_scores(self, features: Tensor, next_tokens: Tensor, next_valid: Tensor):
        """Log-probabilities of the next position's candidates and of EOS for every row."""
        logits = self.scorer.candidate_logits(features, next_tokens).float()  # (batch, P + 1, states, K)
        logits = logits.masked_fill(~next_valid.unsqueeze(2), float("-inf"))
        eos_weight = self.scorer.output_projection.weight[self.eos]
        eos_logits = torch.matmul(features, eos_weight).float()  # (batch, P + 1, states)
        if self.normalization == "vocab":
            normalizer = self.scorer.full_log_normalizer(features)
        else:
            normalizer = torch.logaddexp(torch.logsumexp(logits, dim=-1), eos_logits)
        return logits - normalizer.unsqueeze(-1), eos_logits - normalizer

    def _score(self, window_features, encoder_out, lattice_tokens: Tensor, lattice_valid: Tensor,
               skip_impossible: bool):
        """The edge scores of a lattice of ``positions + 1`` positions (``lattice_tokens``' length): every
        candidate's and EOS's log-probability (batch, positions + 1, states, K) and (..., states), and the states
        possible in each sentence. ``skip_impossible``: rows of a state impossible in every sentence are not
        computed (a host read: not in a captured call)."""
        positions = lattice_tokens.size(1) - 1
        window_tokens, window_positions, state_valid = self._states(lattice_tokens, lattice_valid, positions)
        batch, rows, states, order = window_tokens.shape
        window_tokens = window_tokens.view(batch, rows * states, order)
        window_positions = window_positions.reshape(batch, rows * states, order)
        if skip_impossible:
            features = self._possible_features(window_features, window_tokens, window_positions, state_valid,
                                               encoder_out)
        else:
            features = window_features(window_tokens, window_positions, encoder_out)
        features = features.view(batch, rows, states, -1)
        candidate_scores, eos_scores = self._edge_scores(features, lattice_tokens[:, :rows], lattice_valid[:, :rows])
        return candidate_scores, eos_scores, state_valid

    def _encode_and_score(self, src_tokens: Tensor, lattice_tokens: Tensor, lattice_valid: Tensor):
        """The encoder and ``_score`` of every row on the hoisted scorer in one call, no host read in it: what
        --lattice-cuda-graphs captures."""
        return self._score(self._hoisted.window_features, capturable_encoder_out(self.encoder, src_tokens),
                           lattice_tokens, lattice_valid, skip_impossible=False)

    def _captured_scores(self, src_tokens: Tensor, lattice_tokens: Tensor, lattice_valid: Tensor):
        """``_encode_and_score`` as a CUDA graph: the source padded on the left and the lattice's positions on the
        right to their length buckets (the padding masked: a position's scores depend on the positions before it
        only), the outputs cut back to the lattice's positions. The graphs are captured again once the model's
        weights change (they read the weights where they were)."""
        weights = parameters_fingerprint(self.model)
        if self._captured is None or self._captured_weights != weights:
            self._captured, self._captured_weights = CapturedCalls(self._encode_and_score), weights
        source_len, positions = src_tokens.size(1), lattice_tokens.size(1)
        padded_positions = min(length_bucket(positions), self.scorer.max_positions())
        src_tokens = F.pad(src_tokens, (length_bucket(source_len) - source_len, 0), value=self.pad)
        lattice_tokens = F.pad(lattice_tokens, (0, 0, 0, padded_positions - positions), value=self.pad)
        lattice_valid = F.pad(lattice_valid, (0, 0, 0, padded_positions - positions), value=False)
        candidate_scores, eos_scores, state_valid = self._captured(src_tokens, lattice_tokens, lattice_valid)
        self._stats["scored_rows"] += state_valid.numel()
        return candidate_scores[:, :positions], eos_scores[:, :positions], state_valid[:, :positions]

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        self._begin_generate(prefix_tokens, constraints)
        model = self.model
        if model.training:  # eval() walks every module (~0.45 ms a call here): only when needed
            model.eval()
        window_features = self._scorer_features()  # before the clock: a rebuild of the tables is set-up
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        device = src_tokens.device
        started = time.perf_counter()
        if not self.cuda_graphs:
            encoder_out = self.encoder.forward_torchscript(net_input)
            started = self._tick("encoder", started, device)

        source, source_lengths = self._source_content(src_tokens)
        estimate, shortest, longest = self._length_ranges(source_lengths)
        positions = int(longest.max())
        # One position more than the longest path: its candidates normalise the final EOS like any other.
        lattice_tokens, lattice_probs = self.table.lattice(source, source_lengths, estimate, positions + 1, self.k,
                                                           self.vocab_size, self.excluded, self.mass)
        lattice_valid = lattice_probs > 0
        started = self._tick("lattice", started, device)

        batch, order = lattice_tokens.size(0), self.order
        if self.cuda_graphs:
            if self._hoisted is None or window_features != self._hoisted.window_features:
                raise InputError("--lattice-cuda-graphs runs on the hoisted scorer, which dropout kept at inference "
                                 "(--retain-dropout) turns off")
            candidate_scores, eos_scores, state_valid = self._captured_scores(src_tokens, lattice_tokens,
                                                                              lattice_valid)
        else:
            candidate_scores, eos_scores, state_valid = self._score(
                window_features, encoder_out, lattice_tokens, lattice_valid, skip_impossible=True)
        impossible = ~state_valid
        transitions = candidate_scores[:, :positions].masked_fill(impossible[:, :positions].unsqueeze(-1), float("-inf"))
        ends = eos_scores.masked_fill(impossible, float("-inf"))
        self._stats["decoder_calls"] += 1
        started = self._tick("scoring", started, device)

        lengths = torch.arange(positions + 1, device=device).unsqueeze(0)
        allowed = (lengths >= shortest.unsqueeze(1)) & (lengths <= longest.unsqueeze(1))
        if self.no_repeat_ngram_size:
            paths = beam_search_without_repeats(transitions, ends, allowed, lattice_tokens[:, :positions], self.k,
                                                self.no_repeat_ngram_size, self.beam, order, lenpen=self.lenpen,
                                                normalize=self.normalize_scores, nbest=self.nbest)
        else:
            paths = viterbi(transitions, ends, allowed, self.k, order, lenpen=self.lenpen,
                            normalize=self.normalize_scores, nbest=self.nbest)
        hypotheses = []
        for b, sentence_paths in enumerate(paths):
            hypotheses.append([self._hypothesis(lattice_tokens[b], path) for path in sentence_paths])
        self._tick("viterbi", started, device)

        self._stats["sentences"] += batch
        self._stats["batches"] += 1
        self._stats["lattice_positions"] += int(longest.sum())
        within_longest = torch.arange(positions, device=device).unsqueeze(0) < longest.unsqueeze(1)
        self._stats["lattice_candidates"] += int((lattice_valid[:, :positions] & within_longest.unsqueeze(-1)).sum())
        if sample.get("target") is not None:
            self._count_recall(sample["target"], lattice_tokens, lattice_valid)
        return hypotheses

    def _hypothesis(self, lattice_tokens: Tensor, path) -> Dict:
        positions = torch.arange(path.length, device=lattice_tokens.device)
        tokens = lattice_tokens[positions, path.indices.to(lattice_tokens.device)]
        tokens = torch.cat([tokens, tokens.new_tensor([self.eos])])
        return {"tokens": tokens, "score": path.score, "positional_scores": path.scores.to(lattice_tokens.device),
                "attention": None, "alignment": None}

    def _count_recall(self, target: Tensor, lattice_tokens: Tensor, lattice_valid: Tensor) -> None:
        """Reference tokens found among their position's candidates (the lattice's ceiling on quality)."""
        real = target.ne(self.pad) & target.ne(self.eos)
        width = min(target.size(1), lattice_tokens.size(1))
        present = ((lattice_tokens[:, :width] == target[:, :width].unsqueeze(-1)) & lattice_valid[:, :width]).any(-1)
        self._stats["reference_tokens"] += int(real.sum())
        self._stats["reference_tokens_in_lattice"] += int((present & real[:, :width]).sum())
