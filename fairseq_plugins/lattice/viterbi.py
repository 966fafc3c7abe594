"""Batched Viterbi over a lattice, all candidate lengths in one pass.

A state at position p is the candidate indices of the last ``order`` positions (p - order + 1 .. p), as one
number in base K, oldest digit most significant; position 0 is the start state 0 (BOS, and padding before
it). Ending after length l is the transition into the padding (end) symbol at position l + 1, which is
absorbing: a path that ends early is padded to the longest length at no cost. So the best path of every
length comes out of the same forward pass, and the length is chosen afterwards, with fairseq's length
normalisation score / (l + 1) ** lenpen (the +1 is EOS) unless it is turned off.
"""

from typing import List, NamedTuple, Tuple

import torch
from torch import Tensor

from ..kernels import native


class LatticePath(NamedTuple):
    indices: Tensor  # candidate index per position 1..length, (length,)
    scores: Tensor  # score of each transition, the end included: (length + 1,)
    score: float  # the path's score, normalised as asked
    length: int


def viterbi(transitions: Tensor, ends: Tensor, allowed_lengths: Tensor, k: int, order: int = 1,
            lenpen: float = 1.0, normalize: bool = True, nbest: int = 1) -> List[List[LatticePath]]:
    """Best paths of a batch of lattices.

    transitions    (batch, positions, K**order, K): score of candidate k at position t + 1 after state s at t
    ends           (batch, positions + 1, K**order): score of ending after length l in state s
    allowed_lengths (batch, positions + 1) bool: lengths l that may end a path
    -inf marks what is impossible (absent candidates, padding states). Returns, per sentence, up to
    ``nbest`` paths of different lengths, best first (none if no allowed length is reachable). Among paths
    of one length with equal scores, ties go to the lowest number (torch.max's first maximum): the lowest
    end state, then, walking back, the lowest dropped oldest digit at each position.
    """
    batch, positions, states, width = transitions.shape
    if width != k or states != k ** order or ends.shape != (batch, positions + 1, states):
        raise ValueError(f"lattice shapes disagree: transitions {tuple(transitions.shape)}, ends "
                         f"{tuple(ends.shape)}, K={k}, order={order}")
    suffixes = k ** (order - 1)
    alpha = torch.full((batch, states), float("-inf"), device=transitions.device, dtype=transitions.dtype)
    alpha[:, 0] = 0.0
    alphas, backpointers = [alpha], []
    # The recursion is sequential in the position (alpha at t + 1 needs alpha at t); the end scores are not,
    # so they are taken after it for every length at once.
    for length in range(positions):
        # state (first, suffix) + candidate c -> state (suffix, c): maximise over the dropped first digit.
        scores = alpha.view(batch, k, suffixes, 1) + transitions[:, length].view(batch, k, suffixes, k)
        best, first = scores.max(dim=1)
        alpha = best.reshape(batch, states)
        alphas.append(alpha)
        backpointers.append(first.reshape(batch, states))
    # (batch, positions + 1): the same sums and the same ties (the first maximum) as one length at a time.
    length_scores, end_states = (torch.stack(alphas, dim=1) + ends).max(dim=2)
    length_scores = length_scores.masked_fill(~allowed_lengths, float("-inf"))
    # Backtracking is a short walk of integers: do it on the CPU, then gather the path's scores in one go.
    pointers = torch.stack(backpointers, dim=1).cpu() if backpointers else None  # (batch, positions, states)
    end_states = end_states.cpu()
    results = []
    for b, best_lengths in enumerate(_best_lengths(length_scores, lenpen, normalize, nbest)):
        paths = []
        for length, score in best_lengths:
            states_on_path = _backtrack(pointers[b] if pointers is not None else None,
                                        int(end_states[b, length]), length, k, suffixes)
            indices = torch.tensor([s % k for s in states_on_path[1:]], dtype=torch.long)
            previous = torch.tensor(states_on_path[:-1], dtype=torch.long, device=transitions.device)
            steps = torch.arange(length, device=transitions.device)
            scores = torch.cat([transitions[b, steps, previous, indices.to(transitions.device)],
                                ends[b, length, states_on_path[-1]].view(1)]).cpu()
            paths.append(LatticePath(indices, scores, score, length))
        results.append(paths)
    return results


def _best_lengths(length_scores: Tensor, lenpen: float, normalize: bool, nbest: int) -> List[List[Tuple[int, float]]]:
    """Per sentence, up to ``nbest`` (length, ranked score) pairs, best first, from the best path score of every
    length (batch, positions + 1): normalised by (length + 1) ** lenpen (the +1 is EOS) unless ``normalize`` is
    off; unreachable lengths (-inf) left out."""
    lengths = torch.arange(length_scores.size(1), device=length_scores.device, dtype=length_scores.dtype)
    ranked = (length_scores / (lengths + 1) ** lenpen if normalize else length_scores).cpu()
    best = []
    for row in ranked:
        order = row.argsort(descending=True)[:nbest].tolist()
        best.append([(length, float(row[length])) for length in order if row[length] != float("-inf")])
    return best


def _backtrack(pointers, state: int, length: int, k: int, suffixes: int) -> List[int]:
    """States at positions 0..length of the best path ending in ``state`` at ``length``."""
    states = [state]
    for position in range(length, 0, -1):
        first = int(pointers[position - 1, state])  # the dropped oldest digit of the state at position - 1
        state = first * suffixes + state // k
        states.append(state)
    return states[::-1]


def beam_search_without_repeats(transitions: Tensor, ends: Tensor, allowed_lengths: Tensor, candidate_tokens: Tensor,
                                k: int, no_repeat_ngram_size: int, beam: int, order: int = 1, lenpen: float = 1.0,
                                normalize: bool = True, nbest: int = 1) -> List[List[LatticePath]]:
    """Best paths of a batch of lattices under fairseq's ``--no-repeat-ngram-size`` rule: no path repeats an
    n-gram of tokens. The rule depends on the whole history, which Viterbi's states (the last ``order``
    candidates) do not hold, so this is a beam search over the already scored lattice: ``beam`` partial paths
    per sentence, each extended by every candidate of the next position whose token would not complete an
    n-gram the path already contains (fairseq's NGramRepeatBlock), the best ``beam`` kept; a path of an allowed
    length l may end there (its score plus the end score), and the best ending of each length is kept. When the
    beam holds every partial path (small lattices) this is exact; otherwise it is a search, as fairseq's.

    Shapes as ``viterbi``, plus ``candidate_tokens`` (batch, positions, K): the token of each candidate slot.
    Returns the same: per sentence, up to ``nbest`` paths of different lengths, best first. float32 lattices on
    the CPU run in the native kernel (one sentence at a time, ~0.05 ms at K = 32 against ~2.5 ms for the torch
    loop); float16, bfloat16 and GPU lattices are copied there as float32 for it. Without the kernel, torch
    operations run the search where the lattice is; the two keep the same paths (ties aside)."""
    batch, positions, states, width = transitions.shape
    if width != k or states != k ** order or ends.shape != (batch, positions + 1, states):
        raise ValueError(f"lattice shapes disagree: transitions {tuple(transitions.shape)}, ends "
                         f"{tuple(ends.shape)}, K={k}, order={order}")
    if no_repeat_ngram_size < 1 or beam < 1:
        raise ValueError(f"no_repeat_ngram_size {no_repeat_ngram_size} and beam {beam} must be >= 1")
    if transitions.dtype in (torch.float32, torch.float16, torch.bfloat16) and native.available():
        # A lattice scored on the GPU or in half precision is searched here too, in float32 on the CPU: its copy
        # (K x K x P floats a sentence at order 1) costs far less than the torch loop's many small kernels
        # (measured on an H200: the loop was 8.7 of 13.6 ms a sentence at K = 32). float64 stays exact in torch.
        dtype = transitions.dtype
        on_cpu = [t.to(device="cpu", dtype=torch.float32) if t.is_floating_point() else t.cpu()
                  for t in (transitions, ends, allowed_lengths, candidate_tokens)]
        found = [native.lattice_beam_search(*(t[b] for t in on_cpu), k ** (order - 1), no_repeat_ngram_size, beam)
                 for b in range(batch)]
        best_end, best_paths, best_steps = (torch.stack(parts) for parts in zip(*found))
        best_end, best_steps = best_end.to(dtype), best_steps.to(dtype)
    else:
        best_end, best_paths, best_steps = _beam_search_in_torch(transitions, ends, allowed_lengths,
                                                                 candidate_tokens, k, no_repeat_ngram_size, beam,
                                                                 order)
    best_paths, best_steps = best_paths.cpu(), best_steps.cpu()
    return [[LatticePath(best_paths[b, length, :length].clone(), best_steps[b, length, :length + 1].clone(), score,
                         length) for length, score in best_lengths]
            for b, best_lengths in enumerate(_best_lengths(best_end.cpu(), lenpen, normalize, nbest))]


def _beam_search_in_torch(transitions: Tensor, ends: Tensor, allowed_lengths: Tensor, candidate_tokens: Tensor,
                          k: int, n: int, beam: int, order: int):
    """``beam_search_without_repeats``' search, batched in torch operations: the best ending score of each
    length (batch, P + 1), and each length's best path (batch, P + 1, P) and its step scores with the end's
    (batch, P + 1, P + 1), meaningful where the score is finite."""
    batch, positions = transitions.shape[:2]
    device, dtype = transitions.device, transitions.dtype
    rows = torch.arange(batch, device=device)
    state = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the start state
    score = torch.zeros(batch, 1, dtype=dtype, device=device)
    history = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)  # candidate indices on each path
    tokens = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)  # their tokens
    steps = torch.zeros(batch, 1, 0, dtype=dtype, device=device)  # their transition scores
    best_end = torch.full((batch, positions + 1), float("-inf"), dtype=dtype, device=device)
    best_paths = torch.zeros(batch, positions + 1, max(positions, 1), dtype=torch.long, device=device)
    best_steps = torch.zeros(batch, positions + 1, positions + 1, dtype=dtype, device=device)
    suffixes = k ** (order - 1)
    for length in range(positions + 1):
        # Paths of this length end here (end score from their state), where the length is allowed.
        end_steps = ends[:, length].gather(1, state)
        ending = (score + end_steps).masked_fill(~allowed_lengths[:, length:length + 1], float("-inf"))
        best_end[:, length], end_at = ending.max(dim=1)
        best_paths[:, length, :length] = history[rows, end_at]
        best_steps[:, length, :length] = steps[rows, end_at]
        best_steps[:, length, length] = end_steps[rows, end_at]
        if length == positions:
            break
        extended = transitions[rows.unsqueeze(1), length, state]  # (batch, paths, K)
        banned = _repeating(tokens, candidate_tokens[:, length], n)
        if banned is not None:
            extended = extended.masked_fill(banned, float("-inf"))
        candidates = (score.unsqueeze(2) + extended).view(batch, -1)
        score, chosen = candidates.topk(min(beam, candidates.size(1)), dim=1)
        path, candidate = chosen // k, chosen % k
        state = (state.gather(1, path) % suffixes) * k + candidate

        def grow(old: Tensor, new: Tensor) -> Tensor:  # each kept path's history, one position longer
            return torch.cat([old.gather(1, path.unsqueeze(2).expand(-1, -1, length)), new.unsqueeze(2)], dim=2)
        history = grow(history, candidate)
        tokens = grow(tokens, candidate_tokens[:, length].gather(1, candidate))
        steps = grow(steps, extended.view(batch, -1).gather(1, chosen))
    return best_end, best_paths, best_steps


def _repeating(tokens: Tensor, next_tokens: Tensor, n: int):
    """(batch, paths, K) bool: whether candidate c after path p would complete an n-gram that p already holds
    (fairseq's rule), from the paths' tokens (batch, paths, length) and the next position's (batch, K); None
    when no path is long enough to hold one."""
    length = tokens.size(2)
    if length < n - 1 or length == 0:
        return None
    # Earlier n-grams: their first n - 1 tokens (windows j .. j + n - 2, j = 0 .. length - n + 1) and the
    # token after them; a candidate is banned when a window equals the path's last n - 1 tokens.
    followers = tokens[:, :, n - 1:]  # (batch, paths, length - n + 1)
    if followers.size(2) == 0:
        return None
    if n == 1:
        match = torch.ones_like(followers, dtype=torch.bool)
    else:
        windows = tokens.unfold(2, n - 1, 1)[:, :, :followers.size(2)]  # (batch, paths, length - n + 1, n - 1)
        match = (windows == tokens[:, :, length - n + 1:].unsqueeze(2)).all(dim=3)
    hits = (followers.unsqueeze(3) == next_tokens.view(next_tokens.size(0), 1, 1, -1)) & match.unsqueeze(3)
    return hits.any(dim=2)
