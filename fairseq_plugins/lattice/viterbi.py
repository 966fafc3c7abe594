"""Batched Viterbi over a lattice, all candidate lengths in one pass.

A state at position p is the candidate indices of the last ``order`` positions (p - order + 1 .. p), as one
number in base K, oldest digit most significant; position 0 is the start state 0 (BOS, and padding before
it). Ending after length l is the transition into the padding (end) symbol at position l + 1, which is
absorbing: a path that ends early is padded to the longest length at no cost. So the best path of every
length comes out of the same forward pass, and the length is chosen afterwards, with fairseq's length
normalisation score / (l + 1) ** lenpen (the +1 is EOS) unless it is turned off.
"""

from typing import List, NamedTuple

import torch
from torch import Tensor


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
    lengths = torch.arange(positions + 1, device=alpha.device, dtype=alpha.dtype)
    ranked = length_scores / (lengths + 1) ** lenpen if normalize else length_scores
    # Backtracking is a short walk of integers: do it on the CPU, then gather the path's scores in one go.
    pointers = torch.stack(backpointers, dim=1).cpu() if backpointers else None  # (batch, positions, states)
    ranked, end_states = ranked.cpu(), end_states.cpu()
    results = []
    for b in range(batch):
        paths = []
        for length in ranked[b].argsort(descending=True)[:nbest].tolist():
            if ranked[b, length] == float("-inf"):
                break
            states_on_path = _backtrack(pointers[b] if pointers is not None else None,
                                        int(end_states[b, length]), length, k, suffixes)
            indices = torch.tensor([s % k for s in states_on_path[1:]], dtype=torch.long)
            previous = torch.tensor(states_on_path[:-1], dtype=torch.long, device=transitions.device)
            steps = torch.arange(length, device=transitions.device)
            scores = torch.cat([transitions[b, steps, previous, indices.to(transitions.device)],
                                ends[b, length, states_on_path[-1]].view(1)]).cpu()
            paths.append(LatticePath(indices, scores, float(ranked[b, length]), length))
        results.append(paths)
    return results


def _backtrack(pointers, state: int, length: int, k: int, suffixes: int) -> List[int]:
    """States at positions 0..length of the best path ending in ``state`` at ``length``."""
    states = [state]
    for position in range(length, 0, -1):
        first = int(pointers[position - 1, state])  # the dropped oldest digit of the state at position - 1
        state = first * suffixes + state // k
        states.append(state)
    return states[::-1]
