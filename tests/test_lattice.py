"""Sequence-to-lattice: Viterbi, candidate tables, aligners, the Markov scorer, the generator, end to end."""

import itertools
import json
import math
import os
import random
import stat
import subprocess
from collections import Counter, defaultdict
from fractions import Fraction

import pytest
import torch
from fairseq.modules import FairseqDropout

from conftest import TRAIN_FLAGS, TRAIN_THREADS, DictionaryTask, plugins_cli, random_batch, run, word_dictionary

from fairseq_plugins.tools.align import align_corpus, find_binary, read_pharaoh
from fairseq_plugins.kernels import native
from fairseq_plugins.common.textio import InputError
from fairseq_plugins.lattice.generator import LatticeGenerator
from fairseq_plugins.lattice.ibm2 import CandidateTable, lattice_recall
from fairseq_plugins.lattice.model import (HoistedLatticeScorer, LatticeTransformerModel,
                                           lattice_transformer_tiny)
from fairseq_plugins.lattice.viterbi import _beam_search_in_torch, beam_search_without_repeats, viterbi

NEG = float("-inf")


# --- Viterbi against brute force -------------------------------------------------------------------------------

def repeats_an_ngram(tokens, n):
    """Whether a token sequence holds some n-gram twice (what fairseq's --no-repeat-ngram-size forbids)."""
    ngrams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(ngrams) != len(set(ngrams))


def brute_force(transitions, ends, allowed, k, order, lenpen, normalize, tokens=None, no_repeat=0):
    """Every path of every allowed length, scored by walking the states one position at a time; with
    ``no_repeat`` n, those whose tokens (``tokens`` (positions, K)) repeat an n-gram are left out."""
    positions = transitions.size(0)
    best = {}
    for length in range(positions + 1):
        if not allowed[length]:
            continue
        for indices in itertools.product(range(k), repeat=length):
            if no_repeat and repeats_an_ngram([int(tokens[t, i]) for t, i in enumerate(indices)], no_repeat):
                continue
            state, score, steps = 0, 0.0, []
            for position, index in enumerate(indices):
                step = float(transitions[position, state, index])
                steps.append(step)
                score += step
                state = (state * k + index) % (k ** order)
            score += float(ends[length, state])
            if score == NEG:
                continue
            ranked = score / (length + 1) ** lenpen if normalize else score
            if length not in best or ranked > best[length][0]:
                best[length] = (ranked, list(indices))
    return best


@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("lenpen, normalize", [(1.0, True), (0.0, True), (2.0, True), (1.0, False)])
def test_viterbi_equals_brute_force_on_random_lattices(order, lenpen, normalize):
    generator = torch.Generator().manual_seed(order * 10 + int(lenpen))
    for trial in range(12):
        k = 3
        positions = 1 + trial % 4
        batch = 3
        transitions = -torch.rand(batch, positions, k ** order, k, generator=generator, dtype=torch.float64) * 3
        ends = -torch.rand(batch, positions + 1, k ** order, generator=generator, dtype=torch.float64) * 3
        # Some impossible edges (absent candidates) and a start that is only state 0, as the generator gives.
        transitions[torch.rand(transitions.shape, generator=generator) < 0.2] = NEG
        allowed = torch.rand(batch, positions + 1, generator=generator) < 0.7
        allowed[:, 0] = False
        paths = viterbi(transitions, ends, allowed, k, order, lenpen=lenpen, normalize=normalize, nbest=positions + 1)
        for b in range(batch):
            expected = brute_force(transitions[b], ends[b], allowed[b], k, order, lenpen, normalize)
            ranking = sorted(expected.items(), key=lambda item: -item[1][0])
            assert len(paths[b]) == len(ranking)
            for path, (length, (score, indices)) in zip(paths[b], ranking):
                assert path.length == length
                assert path.score == pytest.approx(score, abs=1e-9)
                assert path.indices.tolist() == indices
                raw = float(path.scores.sum())
                assert (raw / (length + 1) ** lenpen if normalize else raw) == pytest.approx(score, abs=1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # torch's loop; the native kernel
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("no_repeat", [1, 2, 3])
def test_no_repeat_beam_search_at_full_width_equals_brute_force(order, no_repeat, dtype):
    """With a beam as wide as every partial path, the search under --no-repeat-ngram-size is exact: the best
    path of each allowed length among those that repeat no n-gram, found by enumeration. Tokens from a
    vocabulary of 3 (2 for trigrams) over 5-6 positions make repeats common, so the rule binds."""
    generator = torch.Generator().manual_seed(order * 10 + no_repeat)
    vocabulary = 3 if no_repeat < 3 else 2
    binding = 0
    for trial in range(16):
        k, positions, batch = 3, 5 + trial % 2, 2
        transitions = -torch.rand(batch, positions, k ** order, k, generator=generator, dtype=dtype) * 3
        ends = -torch.rand(batch, positions + 1, k ** order, generator=generator, dtype=dtype) * 3
        transitions[torch.rand(transitions.shape, generator=generator) < 0.1] = NEG
        tokens = torch.randint(4, 4 + vocabulary, (batch, positions, k), generator=generator)
        allowed = torch.rand(batch, positions + 1, generator=generator) < 0.7
        allowed[:, 0] = False
        paths = beam_search_without_repeats(transitions, ends, allowed, tokens, k, no_repeat, beam=k ** positions,
                                            order=order, nbest=positions + 1)
        for b in range(batch):
            expected = brute_force(transitions[b], ends[b], allowed[b], k, order, 1.0, True, tokens[b], no_repeat)
            unconstrained = brute_force(transitions[b], ends[b], allowed[b], k, order, 1.0, True)
            binding += expected != unconstrained
            ranking = sorted(expected.items(), key=lambda item: -item[1][0])
            assert [(p.length, p.indices.tolist()) for p in paths[b]] == [(n, i) for n, (_, i) in ranking]
            tolerance = 1e-9 if dtype == torch.float64 else 1e-5
            for path, (length, (score, indices)) in zip(paths[b], ranking, strict=True):
                assert path.score == pytest.approx(score, abs=tolerance)
                assert float(path.scores.sum()) / (length + 1) == pytest.approx(score, abs=tolerance)
                assert path.scores.tolist() == path_steps(transitions[b], ends[b], indices, k, order)
    assert binding >= 5  # the rule changed the answer in many lattices, so it is what is tested


@pytest.mark.skipif(not native.available(), reason="needs a C compiler for the native kernels")
@pytest.mark.parametrize("order", [1, 2])
def test_no_repeat_beam_search_native_kernel_equals_the_torch_loop(order):
    """The native kernel (float32 CPU lattices) keeps the same paths as the torch loop at every beam width and
    n, with the same float32 sums; the lattices have impossible edges and lengths, and tokens that repeat."""
    generator = torch.Generator().manual_seed(order)
    k, positions, batch = 5, 9, 3
    compared = 0
    for n in (1, 2, 3):
        for beam in (1, 3, 7, 40):
            transitions = -torch.rand(batch, positions, k ** order, k, generator=generator) * 3
            transitions[torch.rand(transitions.shape, generator=generator) < 0.2] = NEG
            ends = -torch.rand(batch, positions + 1, k ** order, generator=generator) * 3
            tokens = torch.randint(4, 9, (batch, positions, k), generator=generator)
            allowed = torch.rand(batch, positions + 1, generator=generator) < 0.6
            best_end, best_paths, best_steps = _beam_search_in_torch(transitions, ends, allowed, tokens, k, n, beam,
                                                                     order)
            for b in range(batch):
                end, paths, steps = native.lattice_beam_search(transitions[b], ends[b], allowed[b], tokens[b],
                                                               k ** (order - 1), n, beam)
                assert torch.equal(end, best_end[b])
                for length in torch.isfinite(end).nonzero().flatten().tolist():
                    assert torch.equal(paths[length, :length], best_paths[b, length, :length])
                    assert torch.equal(steps[length, :length + 1], best_steps[b, length, :length + 1])
                    compared += 1
    assert compared > 60


@pytest.mark.skipif(not native.available(), reason="needs a C compiler for the native kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_repeat_beam_search_of_a_half_precision_lattice_runs_the_kernel_in_float32(dtype):
    """A half-precision lattice (as --fp16/--bf16 or a GPU scores it) is searched by the native kernel on a
    float32 copy: the paths of the torch loop over those float32 values, the scores back in the lattice's dtype."""
    generator = torch.Generator().manual_seed(0)
    # Path sums down to -100, where bfloat16 sums step by 0.5 and float16's by 0.06: summed in the lattice's
    # dtype (the torch loop), 20 (bfloat16) and 12 (float16) of these 51 best paths come out otherwise.
    k, positions, batch, n, beam = 6, 24, 4, 2, 6
    transitions = (-2 - torch.rand(batch, positions, k, k, generator=generator) * 3).to(dtype)
    ends = (-torch.rand(batch, positions + 1, k, generator=generator) * 3).to(dtype)
    tokens = torch.randint(4, 8, (batch, positions, k), generator=generator)
    allowed = torch.rand(batch, positions + 1, generator=generator) < 0.6
    best_end, best_paths, best_steps = _beam_search_in_torch(transitions.float(), ends.float(), allowed, tokens, k,
                                                             n, beam, 1)
    found = 0
    for b, paths in enumerate(beam_search_without_repeats(transitions, ends, allowed, tokens, k, n, beam,
                                                          nbest=positions + 1)):
        for path in paths:
            assert path.scores.dtype == dtype
            assert torch.equal(path.indices, best_paths[b, path.length, :path.length])
            assert torch.equal(path.scores, best_steps[b, path.length, :path.length + 1].to(dtype))
            found += 1
    assert found == int(torch.isfinite(best_end).sum())


def test_no_repeat_beam_search_narrow_beams_never_repeat():
    """At any width the paths found repeat no n-gram, and a wider beam never finds a worse best path here."""
    generator = torch.Generator().manual_seed(3)
    k, positions, batch = 6, 12, 4
    transitions = -torch.rand(batch, positions, k, k, generator=generator) * 3
    ends = -torch.rand(batch, positions + 1, k, generator=generator) * 3
    tokens = torch.randint(4, 8, (batch, positions, k), generator=generator)
    allowed = torch.zeros(batch, positions + 1, dtype=torch.bool)
    allowed[:, 8:] = True
    for n in (1, 2, 3):
        for beam in (1, 4, 16):
            for b, paths in enumerate(beam_search_without_repeats(transitions, ends, allowed, tokens, k, n, beam,
                                                                  nbest=3)):
                for path in paths:
                    found = [int(tokens[b, t, i]) for t, i in enumerate(path.indices.tolist())]
                    assert not repeats_an_ngram(found, n) and 8 <= path.length <= positions
    with pytest.raises(ValueError, match="no_repeat_ngram_size 0"):
        beam_search_without_repeats(transitions, ends, allowed, tokens, k, 0, 4)


def path_steps(transitions, ends, indices, k, order):
    """The transition scores of one path (candidate indices), then its end score."""
    state, steps = 0, []
    for position, index in enumerate(indices):
        steps.append(float(transitions[position, state, index]))
        state = (state * k + index) % (k ** order)
    return steps + [float(ends[len(indices), state])]


def path_score(transitions, ends, indices, k, order):
    """Score of one path (candidate indices, then the end), walking the states one position at a time."""
    state, score = 0, 0.0
    for position, index in enumerate(indices):
        score += float(transitions[position, state, index])
        state = (state * k + index) % (k ** order)
    return score + float(ends[len(indices), state])


def tie_rule(indices, k, order):
    """Viterbi's choice among equal-scoring paths of one length (its docstring) as a sort key, lowest first: the
    end state (its last ``order`` indices, oldest first), then each earlier index walking back."""
    digits = [0] * order + list(indices)  # before position 1: the start state's digits
    return digits[-order:], digits[-order - 1::-1]


@pytest.mark.parametrize("order", [1, 2])
def test_viterbi_breaks_ties_by_its_rule(order):
    """Integer scores from two values (exact sums): many paths of a length tie, and the path returned is the one
    the tie rule names, as with the one-length-at-a-time end scores it had before they were taken all at once."""
    generator = torch.Generator().manual_seed(7 + order)
    for trial in range(16):
        k, positions, batch = 3, 1 + trial % 4, 2
        transitions = -torch.randint(0, 2, (batch, positions, k ** order, k), generator=generator).double()
        ends = -torch.randint(0, 2, (batch, positions + 1, k ** order), generator=generator).double()
        transitions[torch.rand(transitions.shape, generator=generator) < 0.2] = NEG
        allowed = torch.ones(batch, positions + 1, dtype=torch.bool)
        paths = viterbi(transitions, ends, allowed, k, order, normalize=False, nbest=positions + 1)
        for b in range(batch):
            expected = {}
            for length in range(positions + 1):
                scored = [(path_score(transitions[b], ends[b], indices, k, order), list(indices))
                          for indices in itertools.product(range(k), repeat=length)]
                best = max(score for score, _ in scored)
                if best > NEG:
                    tied = [indices for score, indices in scored if score == best]
                    expected[length] = (best, min(tied, key=lambda indices: tie_rule(indices, k, order)))
            assert {path.length: (path.score, path.indices.tolist()) for path in paths[b]} == expected


def test_viterbi_with_no_reachable_length_returns_no_path():
    transitions = torch.full((1, 2, 2, 2), NEG)
    ends = torch.zeros(1, 3, 2)
    allowed = torch.tensor([[False, True, True]])
    assert viterbi(transitions, ends, allowed, 2, 1) == [[]]


# --- candidate tables -------------------------------------------------------------------------------------------

def hand_corpus():
    """Three sentence pairs over w-words; links chosen to exercise every counting rule."""
    d = word_dictionary(10)
    w = [d.index(f"w{i}") for i in range(10)]
    sources = [[w[0], w[1]], [w[0], w[2], w[3]], [w[1], w[0]]]
    targets = [[w[5], w[6]], [w[5], w[7], w[8]], [w[6], w[5], w[9]]]
    alignments = [
        [(0, 0), (1, 1)],          # diagonal
        [(0, 0), (1, 1), (2, 1)],  # target 1 aligned to two source words: 1/2 each; target 2 unaligned
        [],                        # no links: the diagonal round(j * S / T)
    ]
    return d, w, sources, targets, alignments


def test_table_counts_equal_hand_computed_counts():
    d, w, sources, targets, alignments = hand_corpus()
    table = CandidateTable.build(sources, targets, alignments, d, d, top_n=40)

    def lexical(x, offset):
        span = 2 * table.max_offset + 1
        key = x * span + offset + table.max_offset
        row = (table.lexical_keys == key).nonzero()
        if not len(row):
            return {}
        row = int(row[0])
        return {int(t): float(p) for t, p in zip(table.lexical_tokens[row], table.lexical_probs[row]) if p > 0}

    def positional(S, t):
        key = S * (table.max_target_position + 1) + t
        row = int((table.alignment_keys == key).nonzero()[0])
        return [float(p) for p in table.alignment_probs[row, :S]]

    # Sentence 3 has no links: j -> round(j * 2 / 3) = 0, 1, 1 (0-based), i.e. a = 1, 2, 2 for t = 1, 2, 3.
    # Sentence 2: t=3 (unaligned) takes t=2's links {2, 3} (nearest aligned target, 1/2 each).
    # (x, a - t) -> y counts:
    #   (w0, 0): s1 t=1 w5, s2 t=1 w5, s3 t=2 (a=2, x=w0) w5 -> w5 x3
    #   (w1, 0): s1 t=2 w6, s3 t=1 (a=1, x=w1) w6 -> w6 x2
    #   (w2, 0): s2 t=2 w7 x1/2; (w3, 1): s2 t=2 w7 x1/2; (w2, -1): s2 t=3 w8 x1/2; (w3, 0): s2 t=3 w8 x1/2
    #   (w0, -1): s3 t=3 (a=2, x=w0) w9 x1
    assert lexical(w[0], 0) == {w[5]: 1.0}
    assert lexical(w[1], 0) == {w[6]: 1.0}
    assert lexical(w[2], 0) == {w[7]: 1.0} and lexical(w[3], 1) == {w[7]: 1.0}
    assert lexical(w[2], -1) == {w[8]: 1.0} and lexical(w[3], 0) == {w[8]: 1.0}
    assert lexical(w[0], -1) == {w[9]: 1.0}
    assert table.max_offset == 1
    # P(a | S, t): S=2 t=1 from s1 (a=1) and s3 (a=1); S=2 t=2: s1 a=2, s3 a=2; S=2 t=3: s3 a=2.
    assert positional(2, 1) == [1.0, 0.0] and positional(2, 2) == [0.0, 1.0] and positional(2, 3) == [0.0, 1.0]
    # S=3: t=1 a=1; t=2 a in {2, 3} half each; t=3 (inherited) the same.
    assert positional(3, 1) == [1.0, 0.0, 0.0]
    assert positional(3, 2) == [0.0, 0.5, 0.5] and positional(3, 3) == [0.0, 0.5, 0.5]
    # Target length on source length: points (2, 2), (3, 3), (2, 3): slope 0.5, intercept 1.5.
    assert table.length_slope == pytest.approx(0.5) and table.length_intercept == pytest.approx(1.5)


def test_table_keeps_top_n_by_count_with_maximum_likelihood_probabilities():
    d = word_dictionary(10)
    w = [d.index(f"w{i}") for i in range(10)]
    # w0 aligned (offset 0) to w5 three times, w6 twice, w7 once.
    targets = [[w[5]]] * 3 + [[w[6]]] * 2 + [[w[7]]]
    table = CandidateTable.build([[w[0]]] * 6, targets, [[(0, 0)]] * 6, d, d, top_n=2)
    assert table.lexical_tokens.tolist() == [[w[5], w[6]]]
    assert table.lexical_probs[0].tolist() == pytest.approx([3 / 6, 2 / 6])  # not renormalised after the cut


def random_table(seed=0, sentences=60, vocab=12, top_n=4):
    g = torch.Generator().manual_seed(seed)
    d = word_dictionary(vocab)
    first = d.nspecial
    sources, targets, alignments = [], [], []
    for _ in range(sentences):
        S, T = (int(n) for n in torch.randint(1, 6, (2,), generator=g))
        sources.append(torch.randint(first, len(d), (S,), generator=g).tolist())
        targets.append(torch.randint(first, len(d), (T,), generator=g).tolist())
        links = {(int(torch.randint(0, S, (1,), generator=g)), j) for j in range(T) if torch.rand(1, generator=g) < 0.7}
        alignments.append(sorted(links))
    return d, CandidateTable.build(sources, targets, alignments, d, d, top_n=top_n), sources


def diagonal_source_position(t, S, target_length):
    """Where an (S, t) never counted in training puts P(a | S, t) (docs/lattice.md): the diagonal
    a = round(t * S / L), i.e. the source position 1 .. S nearest to that ratio rounded (exactly, as Python
    rounds)."""
    diagonal = round(Fraction(t * S, target_length))
    return min(range(1, S + 1), key=lambda a: abs(a - diagonal))


def ibm2_reference(lexical, alignment, source, t, target_length, vocab):
    """P(y | x, t) = sum_a P(y | x_a, a - t) P(a | S, t), by dictionaries and loops.

    ``lexical`` maps (x, a - t) to {y: P(y | x, a - t)}, ``alignment`` maps each counted (S, t) to
    [P(a | S, t) for a = 1 .. S]; an (S, t) it lacks has all of P(a | S, t) on the diagonal.
    """
    S = len(source)
    diagonal = diagonal_source_position(t, S, target_length)
    weights = alignment.get((S, t), [1.0 if a == diagonal else 0.0 for a in range(1, S + 1)])
    probs = [0.0] * vocab
    for a in range(1, S + 1):
        for y, p in lexical.get((source[a - 1], a - t), {}).items():
            probs[y] += p * weights[a - 1]
    return probs


def table_as_dictionaries(table):
    """The table's two count tables as the dictionaries ``ibm2_reference`` reads, decoded from its keys."""
    lexical = {}
    span = 2 * table.max_offset + 1
    for row, key in enumerate(table.lexical_keys.tolist()):
        x, offset = divmod(key, span)
        lexical[(x, offset - table.max_offset)] = {y: p for y, p in zip(table.lexical_tokens[row].tolist(),
                                                                        table.lexical_probs[row].tolist()) if p > 0}
    alignment = {}
    for row, key in enumerate(table.alignment_keys.tolist()):
        S, t = divmod(key, table.max_target_position + 1)
        alignment[(S, t)] = table.alignment_probs[row, :S].tolist()
    return lexical, alignment


def test_lattice_top_k_agrees_with_a_dense_reference_computation():
    d, table, sources = random_table()
    lexical, alignment = table_as_dictionaries(table)
    g = torch.Generator().manual_seed(1)
    # Sources of the training lengths (1-5 tokens), and of 6 and 7 tokens, no (S, t) of which was counted.
    batch = sources[:8] + [torch.randint(d.nspecial, len(d), (n,), generator=g).tolist() for n in (6, 7)]
    source = torch.full((len(batch), max(map(len, batch))), d.pad())
    for row, s in enumerate(batch):
        source[row, :len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in batch])
    excluded = [d.pad(), d.bos(), d.eos()]
    positions = 14  # beyond every (S, t) seen for some rows: exercises the diagonal backoff
    # The length estimate (what the generator builds lattices for), then longer lengths (lattice-recall's
    # reference lengths): past L an uncounted (S, t) backs off to the last source position whatever the
    # formula, before it to one inside the source; 12 and 14 for the 6- and 7-token sources put t * S / L on
    # halves, where the rounding shows.
    longer = torch.tensor([7, 9, 10, 11, 12, 8, 13, 9, 12, 14])
    backoffs_inside = 0
    for target_lengths in (table.predicted_lengths(lengths), longer):
        dense = table.position_distributions(source, lengths, target_lengths, positions, len(d))
        tokens, probs = table.lattice(source, lengths, target_lengths, positions, 3, len(d), excluded)
        for row, s in enumerate(batch):
            L = int(target_lengths[row])
            for t in range(1, positions + 1):
                reference = ibm2_reference(lexical, alignment, s, t, L, len(d))
                assert dense[row, t - 1].tolist() == pytest.approx(reference, abs=1e-6)
                ranked = sorted((p for y, p in enumerate(reference) if y not in excluded), reverse=True)[:3]
                assert probs[row, t - 1].tolist() == pytest.approx(ranked, abs=1e-6)
                for y, p in zip(tokens[row, t - 1].tolist(), probs[row, t - 1].tolist()):
                    assert y not in excluded and reference[y] == pytest.approx(p, abs=1e-6)
                if (len(s), t) not in alignment and 1 < diagonal_source_position(t, len(s), L) < len(s):
                    backoffs_inside += 1
    assert backoffs_inside >= 20  # the backoff is checked where its formula matters, not only at the ends


def test_table_file_round_trip_and_clear_errors(tmp_path):
    d, table, _ = random_table()
    path = tmp_path / "table.pt"
    table.save(str(path))
    loaded = CandidateTable.load(str(path), d, d)
    assert torch.equal(loaded.lexical_keys, table.lexical_keys) and loaded.length_slope == table.length_slope
    other = word_dictionary(13)
    with pytest.raises(InputError, match=rf"{path}: built with another target dictionary \(16 symbols"):
        CandidateTable.load(str(path), d, other)
    junk = tmp_path / "junk.pt"
    torch.save({"weights": torch.zeros(1)}, str(junk))
    with pytest.raises(InputError, match=f"{junk}: not a lattice table"):
        CandidateTable.load(str(junk))
    with pytest.raises(InputError, match="no such lattice table"):
        CandidateTable.load(str(tmp_path / "missing.pt"))
    with pytest.raises(InputError, match=r"alignments:1: link 0-5 is outside the sentence pair"):
        CandidateTable.build([[4]], [[5]], [[(0, 5)]], d, d)


def test_lattice_recall_counts_reference_tokens_in_the_top_k():
    d = word_dictionary(10)
    w = [d.index(f"w{i}") for i in range(10)]
    # w0 -> w5 (2/3) or w6 (1/3) at offset 0.
    table = CandidateTable.build([[w[0]]] * 3, [[w[5]], [w[5]], [w[6]]], [[(0, 0)]] * 3, d, d)
    excluded = [d.pad(), d.bos(), d.eos()]
    recall = lattice_recall(table, [[w[0]], [w[0]]], [[w[5]], [w[6]]], [1, 2], len(d), excluded)
    assert recall == {1: 0.5, 2: 1.0}


# --- aligners ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_parallel(tmp_path_factory):
    from fairseq_plugins.tools.synthetic import write_corpus

    out = write_corpus(str(tmp_path_factory.mktemp("aligned")), sizes={"train": 400})
    return os.path.join(out, "train.src"), os.path.join(out, "train.tgt")


def test_pip_backend_aligns_the_synthetic_lexicon(small_parallel, tmp_path):
    source, target = small_parallel
    out = tmp_path / "train.align"
    plugins_cli("align", "--source", source, "--target", target, "--output", out)
    alignments = read_pharaoh(str(out))
    sources = [line.split() for line in open(source)]
    targets = [line.split() for line in open(target)]
    assert len(alignments) == len(sources) == 400
    # The synthetic translation of a noun is the reversed word + "o": most links should say so.
    hits = total = 0
    for src, tgt, links in zip(sources, targets, alignments):
        for i, j in links:
            assert i < len(src) and j < len(tgt)
            if src[i] in ("dog", "cat", "horse", "house", "river"):
                total += 1
                hits += tgt[j] == src[i][::-1] + "o"
    assert total > 50 and hits / total > 0.9


def test_pip_backend_trains_as_fast_aligns_recipe_does(tmp_path):
    """fast_align -d -o -v, as the subprocess backend runs it: with -v (a sparse lexical prior) a word's table
    holds its translation only; the library's default training (plain EM) also keeps the words it merely
    co-occurred with (measured on this corpus: 60 entries above 1e-3 for 30 words, against 31)."""
    import math
    import random

    rng = random.Random(3)
    words = [f"w{i}" for i in range(30)]
    sentences = [rng.sample(words, 5) for _ in range(300)]
    (tmp_path / "s").write_text("".join(" ".join(s) + "\n" for s in sentences))
    (tmp_path / "t").write_text("".join(" ".join(w.upper() for w in s) + "\n" for s in sentences))
    align_corpus(str(tmp_path / "s"), str(tmp_path / "t"), lexical_table=str(tmp_path / "lex"))
    kept = [line.split("\t") for line in (tmp_path / "lex").read_text().splitlines()
            if math.exp(float(line.split("\t")[2])) > 1e-3]
    assert sorted((s, t) for s, t, _ in kept if s in words) == sorted((w, w.upper()) for w in words)
    assert len(kept) <= len(words) + 1  # (and the NULL word's)


def test_pip_backend_is_reproducible(small_parallel):
    source, target = small_parallel
    assert align_corpus(source, target) == align_corpus(source, target)  # one OpenMP thread


def test_align_rejects_bad_input_with_the_file_and_line(small_parallel, tmp_path):
    source, target = small_parallel
    short = tmp_path / "short.tgt"
    short.write_text("a b\n")
    proc = plugins_cli("align", "--source", source, "--target", short, "--output", tmp_path / "out", check=False)
    assert proc.returncode == 2 and f"but {short} has 1: parallel files must be sentence-aligned" in proc.stderr
    empty = tmp_path / "empty.src"
    empty.write_text("a b\n\n")
    other = tmp_path / "two.tgt"
    other.write_text("c d\ne f\n")
    proc = plugins_cli("align", "--source", empty, "--target", other, "--output", tmp_path / "out", check=False)
    assert proc.returncode == 2 and f"{empty}:2: empty line" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = plugins_cli("align", "--backend", "fast_align", "--fast-align", tmp_path / "nope", "--source", source,
                       "--target", target, "--output", tmp_path / "out", check=False)
    assert proc.returncode == 2 and f"--fast-align={tmp_path / 'nope'}: not an executable file" in proc.stderr


def test_missing_fast_align_binary_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("FAST_ALIGN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InputError, match="fast_align: not found .* or use --backend systran"):
        find_binary(None, "FAST_ALIGN", "fast_align")


FAKE_FAST_ALIGN = """#!/bin/sh
# Records its arguments and environment; writes the diagonal (forward) or nothing (reverse) as fast_align would.
echo "$@ OMP=$OMP_NUM_THREADS" >> "{log}"
echo "ITERATION 1 perplexity noise" >&2
table=""; corpus=""; reverse=0
while [ $# -gt 0 ]; do
  case $1 in -i) corpus=$2; shift;; -p) table=$2; shift;; -r) reverse=1;; esac; shift
done
[ -n "$table" ] && echo "a b -0.5" > "$table"
while IFS= read -r line; do
  if [ $reverse = 1 ]; then echo "0-0"; else echo "0-0 1-1"; fi
done < "$corpus"
"""
FAKE_ATOOLS = """#!/bin/sh
echo "atools $@ OMP=$OMP_NUM_THREADS" >> "{log}"
cat "$2"
"""


def test_subprocess_backend_runs_the_fast_align_recipe(tmp_path, monkeypatch):
    """The wrapper's plumbing, against stand-in binaries that record how they were called (the stand-in atools
    found beside the stand-in fast_align: not the real one `make test` names in $ATOOLS)."""
    monkeypatch.delenv("ATOOLS", raising=False)
    log = tmp_path / "calls.log"
    for name, script in (("fast_align", FAKE_FAST_ALIGN), ("atools", FAKE_ATOOLS)):
        path = tmp_path / name
        path.write_text(script.format(log=log))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    source, target = tmp_path / "c.src", tmp_path / "c.tgt"
    source.write_text("a b\nc d\n")
    target.write_text("x y\nz w\n")
    out, table = tmp_path / "c.align", tmp_path / "lex.table"
    proc = plugins_cli("align", "--backend", "fast_align", "--fast-align", tmp_path / "fast_align", "--source",
                       source, "--target", target, "--output", out, "--lexical-table", table,
                       env={"LOGLEVEL": "INFO"})
    assert out.read_text() == "0-0 1-1\n0-0 1-1\n" and table.read_text() == "a b -0.5\n"
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and all(call.endswith("OMP=1") for call in calls)
    assert " -d -o -v " in calls[0] and " -p " in calls[0] and " -r " not in calls[0]
    assert " -d -o -v " in calls[1] and " -r " in calls[1]
    assert calls[2].startswith("atools -i") and "-c grow-diag-final-and" in calls[2]
    assert "perplexity noise" not in proc.stderr  # fast_align's progress stays out of the log


# The subprocess backend against a real fast_align (built from source by `make test`): tests/test_fast_align.py.


# --- the Markov scorer ------------------------------------------------------------------------------------------

def tiny_model(order=1, layers=1, seed=0, normalize_before=False, max_source_positions=64):
    import argparse

    torch.manual_seed(seed)
    d = word_dictionary(20)
    args = argparse.Namespace(lattice_markov_order=order, lattice_scorer_layers=layers,
                              max_source_positions=max_source_positions, max_target_positions=64,
                              decoder_normalize_before=normalize_before)
    lattice_transformer_tiny(args)
    model = LatticeTransformerModel.build_model(args, DictionaryTask(d))
    return model.eval(), d


@pytest.mark.parametrize("order", [1, 2])
def test_scorer_is_markov_of_its_order(order):
    model, d = tiny_model(order, layers=2)
    sample = random_batch(d, 2, seed=1)
    encoder_out = model.encoder(**sample["net_input"])
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(d.nspecial, len(d), (2, 8), generator=g)
    prev[:, 0] = d.eos()
    logits, _ = model.decoder(prev, encoder_out=encoder_out)
    changed = prev.clone()
    changed[:, 3] = (changed[:, 3] + 1 - d.nspecial) % (len(d) - d.nspecial) + d.nspecial
    logits_changed, _ = model.decoder(changed, encoder_out=encoder_out)
    differs = (logits - logits_changed).abs().amax(dim=(0, 2)) > 1e-6
    # Row t reads prev[t - order + 1 .. t]: changing prev[3] moves rows 3 .. 3 + order - 1 only.
    assert differs.tolist() == [3 <= t < 3 + order for t in range(8)]


def lattice_generator(model, d, table, **kwargs):
    return LatticeGenerator([model], d, table, **kwargs)


def tiny_table(d, seed=0):
    """A table over the tiny dictionary with every word a candidate of every source word near the diagonal."""
    g = torch.Generator().manual_seed(seed)
    sources, targets, alignments = [], [], []
    for _ in range(80):
        S = int(torch.randint(2, 7, (1,), generator=g))
        T = int(torch.randint(2, 7, (1,), generator=g))
        sources.append(torch.randint(d.nspecial, len(d), (S,), generator=g).tolist())
        targets.append(torch.randint(d.nspecial, len(d), (T,), generator=g).tolist())
        alignments.append([(min(S - 1, round(j * S / T)), j) for j in range(T)])
    return CandidateTable.build(sources, targets, alignments, d, d, top_n=40)


def teacher_forced_scores(model, sample, b, tokens):
    """log P(y_t | window, x) of ``tokens`` (EOS last) under the training forward pass."""
    net_input = {k: v[b:b + 1] for k, v in sample["net_input"].items()}
    encoder_out = model.encoder(**net_input)
    prev = torch.cat([tokens.new_tensor([model.decoder.eos_idx]), tokens[:-1]]).unsqueeze(0)
    logits, _ = model.decoder(prev, encoder_out=encoder_out)
    return torch.log_softmax(logits.float(), dim=-1)[0].gather(1, tokens.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("order", [1, 2])
def test_lattice_scores_equal_the_training_forward_pass(order):
    """With --lattice-normalize vocab, every positional score of the decoded path is the model's own
    teacher-forced log-probability: the parallel lattice scoring computes the same windows as training."""
    model, d = tiny_model(order, layers=2)
    sample = random_batch(d, 3, seed=2)
    generator = lattice_generator(model, d, tiny_table(d), k=4, length_delta=2, normalization="vocab", nbest=3)
    hypotheses = generator.generate([model], sample)
    for b, hypos in enumerate(hypotheses):
        assert len(hypos) == 3
        for hypo in hypos:
            expected = teacher_forced_scores(model, sample, b, hypo["tokens"])
            assert torch.allclose(hypo["positional_scores"], expected, atol=1e-5)


def noisy_lexicon_corpus(d, sentences=1500, seed=0):
    """Sentence pairs drawn word by word: each target token from its source token's own five translations, with
    unequal probabilities, and linked to it (one link per target token, on the diagonal). Many sentences and
    unequal probabilities leave no tie at the K-th place of a lattice position, so the lattice is defined."""
    rng = random.Random(seed)
    words = list(range(d.nspecial, len(d)))
    translations = {x: rng.sample(words, 5) for x in words}
    sources, targets, alignments = [], [], []
    for _ in range(sentences):
        S = rng.randint(2, 6)
        T = S + rng.choice([-1, 0, 1])
        source = [rng.choice(words) for _ in range(S)]
        links = [(min(S - 1, round(j * S / T)), j) for j in range(T)]
        targets.append([rng.choices(translations[source[i]], weights=[40, 25, 17, 11, 7])[0] for i, _ in links])
        sources.append(source)
        alignments.append(links)
    return sources, targets, alignments


def counted_model(sources, targets, alignments):
    """The table's model by its definition (docs/lattice.md), from a corpus with one link per target token, so
    every link counts 1: P(y | x, a - t) and P(a | S, t) by maximum likelihood (the dictionaries of
    ``ibm2_reference``), the target unigram P(y), and the least-squares length line (slope, intercept)."""
    lexical, alignment, unigram = defaultdict(Counter), defaultdict(Counter), Counter()
    for source, target, links in zip(sources, targets, alignments):
        assert sorted(j for _, j in links) == list(range(len(target)))
        for i, j in links:
            a, t = i + 1, j + 1  # 1-based positions
            lexical[(source[i], a - t)][target[j]] += 1
            alignment[(len(source), t)][a] += 1
        unigram.update(target)
    lexical = {key: {y: n / sum(counts.values()) for y, n in counts.items()} for key, counts in lexical.items()}
    alignment = {(S, t): [counts[a] / sum(counts.values()) for a in range(1, S + 1)]
                 for (S, t), counts in alignment.items()}
    unigram = {y: n / sum(unigram.values()) for y, n in unigram.items()}
    x_mean = sum(map(len, sources)) / len(sources)
    y_mean = sum(map(len, targets)) / len(targets)
    slope = (sum((len(x) - x_mean) * (len(y) - y_mean) for x, y in zip(sources, targets))
             / sum((len(x) - x_mean) ** 2 for x in sources))
    return lexical, alignment, unigram, (slope, y_mean - slope * x_mean)


def lattice_scores(model, net_input, paths, lattice, normalization):
    """Every transition's score of each path (same length, EOS last) under the training forward pass: log P of
    each token and of EOS, normalised over the vocabulary or over the next position's candidates and EOS."""
    encoder_out = model.encoder(**net_input)
    encoder_out = model.encoder.reorder_encoder_out(encoder_out, torch.zeros(len(paths), dtype=torch.long))
    eos = model.decoder.eos_idx
    prev = torch.tensor([[eos] + path for path in paths])
    logits, _ = model.decoder(prev, encoder_out=encoder_out)
    logits = logits.double()
    scores = []
    for position in range(prev.size(1)):  # row `position` scores position + 1 (1-based): a token, or EOS last
        if normalization == "vocab":
            normalizer = logits[:, position].logsumexp(-1)
        else:
            normalizer = logits[:, position, lattice[position] + [eos]].logsumexp(-1)
        following = [path[position] for path in paths] if position < len(paths[0]) else [eos] * len(paths)
        scores.append(logits[:, position].gather(1, torch.tensor(following).unsqueeze(1)).squeeze(1) - normalizer)
    return torch.stack(scores, dim=1)


@pytest.mark.parametrize("normalization", ["lattice", "vocab"])
def test_generator_finds_the_best_path_of_the_lattice_by_brute_force(normalization):
    """Every path of every allowed length through the top K of P(y_t | x, t), both derived from the documented
    definitions (not from the generator's length range or the table's lattice), scored by the training forward
    pass; with --nbest, the generator's paths are the best of each length, the best lengths first."""
    model, d = tiny_model(1, layers=1, seed=3)
    sample = random_batch(d, 5, src_len=6, seed=4)
    corpus = noisy_lexicon_corpus(d)
    lexical, alignment, unigram, (slope, intercept) = counted_model(*corpus)
    table = CandidateTable.build(*corpus, d, d, top_n=40)
    assert max(map(len, lexical.values())) <= 40  # no cut to the top n: every count is in the table
    k, delta, min_len, max_len = 3, 2, 2, 6
    generator = lattice_generator(model, d, table, k=k, length_delta=delta, normalization=normalization,
                                  nbest=2 * delta + 1, min_len=min_len, max_len_b=max_len)
    hypotheses = generator.generate([model], sample)
    specials = {d.pad(), d.bos(), d.eos()}  # never lattice tokens
    for b, src_tokens in enumerate(sample["net_input"]["src_tokens"].tolist()):
        source = [token for token in src_tokens if token not in (d.pad(), d.eos())]
        S = len(source)
        # Lengths L - dL .. L + dL, L the length line's estimate, each clipped to [--min-len, --max-len-b]
        # (the model's 64 positions are far beyond).
        L = max(1, round(slope * S + intercept))
        lengths = sorted({min(max(length, min_len), max_len) for length in range(L - delta, L + delta + 1)})
        # The top K of P(y_t | x, t) + 1e-9 P(y) (the fill of empty slots) at t = 1 .. the longest + 1, whose
        # candidates normalise the last EOS.
        lattice = []
        for t in range(1, max(lengths) + 2):
            probs = ibm2_reference(lexical, alignment, source, t, L, len(d))
            probs = {y: p + 1e-9 * unigram.get(y, 0.0) for y, p in enumerate(probs) if y not in specials}
            most_likely = sorted(probs, key=lambda y: -probs[y])
            assert probs[most_likely[k - 1]] > 1.001 * probs[most_likely[k]], "a tie at the K-th place: no lattice"
            lattice.append([y for y in most_likely[:k] if probs[y] > 0])
        net_input = {key: value[b:b + 1] for key, value in sample["net_input"].items()}
        paths, best = {}, {}  # tokens -> (ranked score, transition scores); length -> best ranked score
        for length in lengths:
            candidates = [list(path) for path in itertools.product(*lattice[:length])]
            scores = lattice_scores(model, net_input, candidates, lattice, normalization)
            for path, steps in zip(candidates, scores.tolist()):
                ranked = sum(steps) / (length + 1)  # fairseq's normalisation, --lenpen 1
                paths[tuple(path)] = (ranked, steps)
                best[length] = max(best.get(length, -math.inf), ranked)
        ours = hypotheses[b]
        assert len(ours) == len(best) and len({len(h["tokens"]) for h in ours}) == len(ours)
        assert [h["score"] for h in ours] == pytest.approx(sorted(best.values(), reverse=True), abs=1e-4)
        for hypo in ours:
            path = tuple(hypo["tokens"][:-1].tolist())
            assert hypo["tokens"][-1] == d.eos() and path in paths, f"{path}: not a path of the lattice"
            ranked, steps = paths[path]
            assert ranked == pytest.approx(hypo["score"], abs=1e-4)
            assert ranked == pytest.approx(best[len(steps) - 1], abs=1e-4)
            assert hypo["positional_scores"].tolist() == pytest.approx(steps, abs=1e-4)


def test_batch_equals_one_sentence_at_a_time():
    model, d = tiny_model(1, layers=1)
    sample = random_batch(d, 5, seed=5)
    table = tiny_table(d)
    generator = lattice_generator(model, d, table, k=6)
    together = generator.generate([model], sample)
    for b in range(5):
        alone = generator.generate([model], {"net_input": {k: v[b:b + 1] for k, v in sample["net_input"].items()}})
        # One sentence alone is not padded; fairseq left-pads, so strip the padding columns.
        assert together[b][0]["tokens"].tolist() == alone[0][0]["tokens"].tolist()
        assert together[b][0]["score"] == pytest.approx(alone[0][0]["score"], abs=1e-5)
    stats = generator.generation_stats()
    assert stats["sentences"] == 10 and stats["decoder_calls"] == 6 and stats["scoring_seconds"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_cuda_decoding_equals_cpu_decoding():
    model, d = tiny_model(1, layers=2)
    sample = random_batch(d, 4, seed=6)
    table = tiny_table(d)
    on_cpu = lattice_generator(model, d, table, k=8).generate([model], sample)
    model = model.cuda()
    cuda_sample = {"net_input": {k: v.cuda() for k, v in sample["net_input"].items()}}
    generator = lattice_generator(model, d, table.to("cuda"), k=8)
    on_cuda = generator.generate([model], cuda_sample)
    for cpu_hypos, cuda_hypos in zip(on_cpu, on_cuda):
        assert cpu_hypos[0]["tokens"].tolist() == cuda_hypos[0]["tokens"].cpu().tolist()
        assert cpu_hypos[0]["score"] == pytest.approx(cuda_hypos[0]["score"], abs=1e-4)
    assert generator.generation_stats()["scoring_seconds"] > 0


# --- the hoisted scorer (the generator's default) ----------------------------------------------------------------

@pytest.mark.parametrize("order, layers, normalize_before", [(1, 1, False), (1, 2, False), (2, 1, False),
                                                             (2, 2, False), (1, 2, True)])
@pytest.mark.parametrize("source_length", [7, 70], ids=["values-folded", "values-unfolded"])
def test_hoisted_scorer_equals_the_scorer(order, layers, normalize_before, source_length):
    """HoistedLatticeScorer gives the scorer's own features and log-probabilities, to float rounding, on windows
    of any tokens (padding and BOS included) at any position: with the first layer's tables (first order,
    post-norm) or without, and with the cross-attention output projection folded into the memory's values
    (a short source) or not (a long one: (heads - 1) x source >= d)."""
    model, d = tiny_model(order, layers, seed=7, normalize_before=normalize_before, max_source_positions=128)
    scorer = model.decoder
    hoisted = HoistedLatticeScorer(scorer)
    assert (hoisted.first_layer_tables is not None) == (order == 1 and not normalize_before)
    sample = random_batch(d, 3, src_len=source_length, seed=8)
    encoder_out = model.encoder(**sample["net_input"])
    memory = encoder_out["encoder_out"][0]
    assert hoisted._memory_keys_values(scorer.layers[0], memory)[2] == (source_length == 7)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, len(d), (3, 50, order), generator=g)
    positions = torch.randint(0, scorer.max_positions() + 2, (3, 50, order), generator=g)
    with torch.no_grad():
        expected = scorer.window_features(tokens, positions, encoder_out)
        features = hoisted.window_features(tokens, positions, encoder_out)
        log_probs = [torch.log_softmax(scorer.output_layer(f), dim=-1) for f in (features, expected)]
    torch.testing.assert_close(features, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(*log_probs, rtol=0, atol=1e-5)


def decoded(hypotheses):
    return [[h["tokens"].tolist() for h in hypos] for hypos in hypotheses]


@pytest.mark.parametrize("order, layers, normalization", [(1, 1, "lattice"), (1, 2, "lattice"), (2, 1, "lattice"),
                                                          (1, 1, "vocab")])
def test_hoisting_changes_no_decoded_output(order, layers, normalization):
    model, d = tiny_model(order, layers, seed=10)
    sample, table = random_batch(d, 6, seed=11), tiny_table(d)
    hoisted, unhoisted = (lattice_generator(model, d, table, k=6, normalization=normalization, nbest=3, hoist=hoist)
                          .generate([model], sample) for hoist in (True, False))
    assert decoded(hoisted) == decoded(unhoisted)
    for ours, theirs in zip(hoisted, unhoisted, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)
            torch.testing.assert_close(a["positional_scores"], b["positional_scores"], rtol=0, atol=1e-5)


def test_hoisted_tables_follow_the_weights():
    """The generator's tables are rebuilt when the scorer's weights change in place (load_state_dict) or are
    replaced (.double()); dropout kept at inference turns the hoisting off (no table holds a random mask)."""
    model, d = tiny_model(1, 1, seed=12)
    other, _ = tiny_model(1, 1, seed=13)
    sample, table = random_batch(d, 4, seed=14), tiny_table(d)
    generator = lattice_generator(model, d, table, k=6, nbest=2)

    def scores(hypotheses):
        return [h["score"] for hypos in hypotheses for h in hypos]

    def unhoisted():
        return lattice_generator(model, d, table, k=6, nbest=2, hoist=False).generate([model], sample)

    before = generator.generate([model], sample)
    model.load_state_dict(other.state_dict())
    after = generator.generate([model], sample)
    assert scores(after) == pytest.approx(scores(unhoisted()), abs=1e-5)
    assert scores(after) != pytest.approx(scores(before), abs=1e-3)
    model.double()
    assert scores(generator.generate([model], sample)) == pytest.approx(scores(unhoisted()), abs=1e-5)
    for module in model.decoder.modules():
        if isinstance(module, FairseqDropout):
            module.apply_during_inference = True
    assert not HoistedLatticeScorer.exact_for(model.decoder)
    assert generator._scorer_features() == model.decoder.window_features


def test_validation_decodes_with_the_weights_the_optimiser_changed(tmp_path):
    """fairseq's optimisers update ``param.data`` in place, which the hoisted tables' fingerprint cannot see: the
    task rebuilds them at each validation (begin_valid_epoch), so --eval-bleu decodes with the current weights,
    as a generator built from scratch does; without it the old tables would stay."""
    import argparse

    from fairseq_plugins.lattice.task import LatticeTranslationConfig, LatticeTranslationTask

    model, d = tiny_model(1, layers=1, seed=21)
    path = str(tmp_path / "table.pt")
    tiny_table(d).save(path)
    task = LatticeTranslationTask(LatticeTranslationConfig(lattice_table=path, lattice_k=6), d, d)
    task.sequence_generator = task.build_generator([model], argparse.Namespace())
    sample = random_batch(d, 4, seed=22)
    scores = lambda hypotheses: [h[0]["score"] for h in hypotheses]  # noqa: E731
    before = scores(task.sequence_generator.generate([model], sample))
    with torch.no_grad():
        for p in model.decoder.parameters():  # as FairseqAdam.step does
            p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    stale = scores(task.sequence_generator.generate([model], sample))
    fresh = scores(task.build_generator([model], argparse.Namespace()).generate([model], sample))
    assert stale != pytest.approx(fresh, abs=1e-3) and fresh != pytest.approx(before, abs=1e-3)
    task.begin_valid_epoch(2, model)
    assert scores(task.sequence_generator.generate([model], sample)) == pytest.approx(fresh, abs=1e-6)


# --- skipping the rows of impossible states ----------------------------------------------------------------------

class EveryRowGenerator(LatticeGenerator):
    """The generator without the row skipping: every (position, state) row scored, impossible ones masked after."""

    def _possible_features(self, window_features, window_tokens, window_positions, state_valid, encoder_out):
        return window_features(window_tokens, window_positions, encoder_out)


@pytest.mark.parametrize("order, hoist, normalization, k", [(1, True, "lattice", 6), (1, False, "vocab", 6),
                                                            (2, True, "lattice", 4), (2, False, "lattice", 4),
                                                            (1, True, "lattice", 30)])
def test_skipping_the_rows_of_impossible_states_changes_no_output(order, hoist, normalization, k):
    """The rows of states impossible in every sentence of the batch are not scored: the same tokens and
    bit-identical scores as scoring every row and masking the impossible ones afterwards. Skipped: the padding
    states before BOS (K - 1 rows at position 1; at order 2 also K^2 - K at position 2), and with K = 30, more than
    the tiny vocabulary's 20 words, the states of absent candidates too."""
    model, d = tiny_model(order, layers=2, seed=15)
    sample, table = random_batch(d, 5, seed=16), tiny_table(d)
    kwargs = dict(k=k, normalization=normalization, nbest=3, hoist=hoist)
    skipping = lattice_generator(model, d, table, **kwargs)
    every_row = EveryRowGenerator([model], d, table, **kwargs)
    scored_rows = {}

    def counting(generator, name):
        window_features = generator._scorer_features()

        def features(tokens, positions, encoder_out):
            scored_rows[name] = tokens.size(1)
            return window_features(tokens, positions, encoder_out)
        generator._scorer_features = lambda: features

    counting(skipping, "skipping")
    counting(every_row, "every row")
    ours, theirs = skipping.generate([model], sample), every_row.generate([model], sample)
    assert decoded(ours) == decoded(theirs)
    for a, b in zip((h for hypos in ours for h in hypos), (h for hypos in theirs for h in hypos), strict=True):
        assert a["score"] == b["score"] and torch.equal(a["positional_scores"], b["positional_scores"])
    width = min(k, len(d) - d.nspecial)  # the generator's K: at most the vocabulary's words
    states = width ** order
    padding = (states - 1) + (states - width if order == 2 else 0)
    skipped = scored_rows["every row"] - scored_rows["skipping"]
    assert skipped > padding if k > len(d) - d.nspecial else skipped == padding


# --- int8 feed-forward matrices (--lattice-scorer-precision int8) ------------------------------------------------

# fbgemm's activation step (fairseq_plugins.kernels.int8, INT8_BACKEND): each row is divided by its largest magnitude and
# quantized to 128 levels over [-1, 1] (a guard row fixes the range): 2 max|x_i| / 127 (tests/test_int8.py).
FBGEMM_ACTIVATION_STEP = 2 / 127


def int8_rounding_variance(x, weight):
    """Variance of each element of x W^T's error under int8 rounding, (rows, out): uniform rounding (step^2 / 12)
    of the weights (step max|W_j| / 127, one a row of W) and of each row of x (step FBGEMM_ACTIVATION_STEP
    max|x_i|), first order; zeros of x (after ReLU, half of them) are exact in both kernels and add nothing."""
    weight_step = weight.abs().amax(1) / 127
    activation_step = FBGEMM_ACTIVATION_STEP * x.abs().amax(1, keepdim=True)
    return ((x ** 2).sum(1, keepdim=True) * weight_step ** 2
            + activation_step ** 2 * ((x != 0).float() @ (weight ** 2).t())) / 12


def feed_forward_error_variance(layer, x):
    """Predicted variance of each element of the int8 feed-forward block's error (rows, d), from int8 rounding:
    fc1's rounding through the ReLU (active units only) and fc2, plus fc2's own rounding."""
    pre_activation = layer.fc1(x)
    hidden = torch.relu(pre_activation)
    through_fc2 = (int8_rounding_variance(x, layer.fc1.weight) * (pre_activation > 0)) @ (layer.fc2.weight ** 2).t()
    return through_fc2 + int8_rounding_variance(hidden, layer.fc2.weight)


def hoisted_pair(order, layers, normalize_before=False, seed=7, rows=200):
    """A tiny model's fp32 and int8 hoisted scorers, random windows and encoder output, and the fp32 scorer's
    feed-forward inputs (layer index, (rows, d)) recorded while it computed the windows' features."""
    model, d = tiny_model(order, layers, seed=seed, normalize_before=normalize_before)
    scorer = model.decoder
    fp32, int8 = HoistedLatticeScorer(scorer), HoistedLatticeScorer(scorer, "int8")
    inputs = []
    feed_forward = fp32._feed_forward
    fp32._feed_forward = lambda index, layer, x: inputs.append((index, x.reshape(-1, x.size(-1)))) or feed_forward(
        index, layer, x)
    encoder_out = model.encoder(**random_batch(d, 3, seed=8)["net_input"])
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, len(d), (3, rows, order), generator=g)
    positions = torch.randint(0, scorer.max_positions() + 2, (3, rows, order), generator=g)
    with torch.no_grad():
        features = [scorer_.window_features(tokens, positions, encoder_out) for scorer_ in (fp32, int8)]
    return scorer, fp32, int8, inputs, features


@pytest.mark.parametrize("order, layers, normalize_before", [(1, 1, False), (2, 2, False), (1, 2, True)])
def test_the_int8_feed_forward_error_is_int8_rounding_error(order, layers, normalize_before):
    """Every layer's int8 feed-forward block on the fp32 scorer's own inputs: its error against the float32 block is
    the size int8 rounding predicts (feed_forward_error_variance: ratio 1.00-1.03 measured), neither float32 (no
    error) nor a coarser quantization (test_int8.py: a 4x coarse scale fails such a ratio); fc1 and fc2 are stored
    as int8, quantized when the scorer was built."""
    scorer, _, int8, inputs, _ = hoisted_pair(order, layers, normalize_before)
    assert sorted(index for index, _ in inputs) == list(range(layers))
    for index, x in inputs:
        layer = scorer.layers[index]
        with torch.no_grad():
            error = int8._feed_forward(index, layer, x) - layer._feed_forward(x)
            predicted = feed_forward_error_variance(layer, x)
        ratio = float(error.pow(2).mean().sqrt() / predicted.mean().sqrt())
        assert 0.8 < ratio < 1.25, (index, ratio)
        for matrix, linear in zip(int8.int8_feed_forward[index], (layer.fc1, layer.fc2), strict=True):
            assert matrix.backend == "fbgemm" and matrix.int8_weight().dtype == torch.int8
            assert matrix.int8_weight().shape == linear.weight.shape


@pytest.mark.parametrize("order", [1, 2])
def test_int8_scorer_log_probabilities_are_within_the_int8_rounding_bound(order):
    """The int8 scorer's log-probabilities (over the whole vocabulary) against the fp32 scorer's, row by row, within
    a bound derived from int8 rounding (one post-norm layer: only its feed-forward block is int8): the block's error
    e (predicted norm |e| = sqrt(sum of feed_forward_error_variance), taken 2x for the per-row spread of that
    prediction, 0.6-1.5 measured) passes the layer norm, at most max|gain| |e| / sigma (sigma: the row's spread,
    first order), then the logits, at most max_v |W_v| times that (Cauchy-Schwarz), then log-softmax, at most 2x the
    largest logit change. The error is above zero on every row: int8 ran."""
    scorer, _, _, inputs, (fp32_features, int8_features) = hoisted_pair(order, layers=1)
    layer = scorer.layers[0]
    (_, x), = inputs
    with torch.no_grad():
        log_probs = [torch.log_softmax(scorer.output_layer(f), dim=-1) for f in (fp32_features, int8_features)]
        error = (log_probs[0] - log_probs[1]).abs().amax(-1).view(-1)
        feed_forward_error = 2 * feed_forward_error_variance(layer, x).sum(1).sqrt()
        norm = layer.final_layer_norm
        sigma = ((x + layer._feed_forward(x)).var(1, unbiased=False) + norm.eps).sqrt()
        largest_output_row = scorer.output_projection.weight.norm(dim=1).max()
        logit_error = largest_output_row * norm.weight.abs().max() * feed_forward_error / sigma
    bound = 2 * logit_error
    assert bool((error > 0).all()), "a row's log-probabilities are float32's: int8 did not run"
    assert bool((error <= bound).all()), float((error / bound).max())  # 0.12 of the bound at most, measured
    assert float(error.max()) < 0.1  # 0.02-0.03 measured on these tiny models


def test_int8_lattice_decoding_end_to_end():
    """A random tiny model decoded with the int8 scorer: well-formed paths, one sentence at a time the same as in a
    batch (per-row activation scales), and with --lattice-normalize vocab every positional score is the float32
    model's teacher-forced log-probability up to int8 rounding (bounded above; 0.03 at most here), not exactly."""
    model, d = tiny_model(1, layers=2, seed=17)
    sample, table = random_batch(d, 5, seed=18), tiny_table(d)
    generator = lattice_generator(model, d, table, k=6, nbest=2, precision="int8")
    together = generator.generate([model], sample)
    for b, hypos in enumerate(together):
        assert len(hypos) == 2 and all(h["tokens"][-1] == d.eos() and math.isfinite(h["score"]) for h in hypos)
        alone = generator.generate([model], {"net_input": {key: value[b:b + 1]
                                                           for key, value in sample["net_input"].items()}})
        assert decoded(alone) == [decoded(together)[b]]
        assert [h["score"] for h in alone[0]] == pytest.approx([h["score"] for h in hypos], abs=1e-5)
    stats = generator.generation_stats()
    assert stats["scorer_precision"] == "int8" and stats["sentences"] == 10
    vocab = lattice_generator(model, d, table, k=6, nbest=2, normalization="vocab", precision="int8")
    differences = []
    for b, hypos in enumerate(vocab.generate([model], sample)):
        for hypo in hypos:
            expected = teacher_forced_scores(model, sample, b, hypo["tokens"]).detach()
            differences.append(float((hypo["positional_scores"] - expected).abs().max()))
    assert 0 < max(differences) < 0.1


def test_int8_encoder_decodes_from_an_int8_copy_of_the_encoder(tmp_path):
    """--lattice-encoder-precision int8: the generator encodes with a copy whose matrices are int8 (the model's own
    encoder stays float32); the paths are well formed and their scores move by int8 rounding only; a model that is
    not float32 is refused by the flag's name."""
    import argparse

    from fairseq_plugins.kernels.int8 import Int8EncoderSelfAttention
    from fairseq_plugins.lattice.task import LatticeTranslationConfig, LatticeTranslationTask

    model, d = tiny_model(1, layers=1, seed=21)
    sample, table = random_batch(d, 5, seed=22), tiny_table(d)
    fp32 = lattice_generator(model, d, table, k=6, nbest=1)
    int8 = lattice_generator(model, d, table, k=6, nbest=1, encoder_precision="int8")
    assert fp32.encoder is model.encoder and int8.encoder is not model.encoder
    assert all(isinstance(layer.self_attn, Int8EncoderSelfAttention) for layer in int8.encoder.layers)
    assert not any(isinstance(layer.self_attn, Int8EncoderSelfAttention) for layer in model.encoder.layers)
    scores = [[float(h[0]["score"]) for h in generator.generate([model], sample)] for generator in (fp32, int8)]
    assert 0 < max(abs(a - b) for a, b in zip(*scores)) < 0.1
    assert int8.generation_stats()["encoder_precision"] == "int8"
    path = str(tmp_path / "table.pt")
    table.save(path)
    task = LatticeTranslationTask(LatticeTranslationConfig(lattice_table=path, lattice_encoder_precision="int8"), d, d)
    with pytest.raises(InputError, match=r"^--lattice-encoder-precision int8: quantizes a float32 model, this one is "
                                         r"torch.float64 \(drop --fp16/--bf16\)$"):
        task.build_generator([tiny_model(1, 1, seed=21)[0].double()], argparse.Namespace())
    with pytest.raises(ValueError, match="^--lattice-encoder-precision int4: choose one of fp32, int8$"):
        lattice_generator(model, d, table, encoder_precision="int4")


def test_int8_scorer_refusals(tmp_path):
    """--lattice-scorer-precision int8 is refused by the flag's name before decoding starts: a model on another
    device (meta here; CUDA alike) or not float32, with --lattice-no-hoist or --retain-dropout; the generator refuses
    the same (a ValueError), also when the weights change to another dtype after it was built."""
    import argparse

    from fairseq_plugins.lattice.task import LatticeTranslationConfig, LatticeTranslationTask

    model, d = tiny_model(1, layers=1, seed=19)
    path = str(tmp_path / "table.pt")
    tiny_table(d).save(path)

    def build(model, **cfg):
        task = LatticeTranslationTask(LatticeTranslationConfig(lattice_table=path, lattice_k=6, **cfg), d, d)
        generation = argparse.Namespace(retain_dropout=cfg.pop("retain_dropout", False))
        return task.build_generator([model], generation)

    generator = build(model, lattice_scorer_precision="int8")
    assert generator.precision == "int8" and generator._hoisted.int8_feed_forward is not None
    assert build(model).precision == "fp32" and build(model)._hoisted.int8_feed_forward is None
    flag = "^--lattice-scorer-precision int8"
    for other, message in ((tiny_model(1, 1, seed=19)[0].double(), r": quantizes a float32 model, this one is "
                                                                     r"torch.float64 \(drop --fp16/--bf16\)$"),
                           (tiny_model(1, 1, seed=19)[0].bfloat16(), r": quantizes a float32 model, this one is "
                                                                       r"torch.bfloat16 \(drop --fp16/--bf16\)$"),
                           (tiny_model(1, 1, seed=19)[0].to("meta"), r": fbgemm's int8 kernels run on the CPU only, "
                                                                       r"the model is on meta \(add --cpu\)$")):
        with pytest.raises(InputError, match=flag + message):
            build(other, lattice_scorer_precision="int8")
        with pytest.raises(ValueError, match=flag + message):
            lattice_generator(other, d, tiny_table(d), k=6, precision="int8")
    with pytest.raises(InputError, match=flag + " runs on the hoisted scorer: drop --lattice-no-hoist$"):
        build(model, lattice_scorer_precision="int8", lattice_no_hoist=True)
    with pytest.raises(InputError, match=flag + " runs on the hoisted scorer, .* drop --retain-dropout$"):
        task = LatticeTranslationTask(LatticeTranslationConfig(lattice_table=path, lattice_scorer_precision="int8"),
                                      d, d)
        task.build_generator([model], argparse.Namespace(retain_dropout=True))
    with pytest.raises(ValueError, match=flag + " runs on the hoisted scorer: drop --lattice-no-hoist$"):
        lattice_generator(model, d, tiny_table(d), precision="int8", hoist=False)
    with pytest.raises(ValueError, match="^--lattice-scorer-precision int4: choose one of fp32, int8$"):
        lattice_generator(model, d, tiny_table(d), precision="int4")
    sample = random_batch(d, 2, seed=20)
    for module in model.decoder.modules():
        if isinstance(module, FairseqDropout):
            module.apply_during_inference = True
    with pytest.raises(ValueError, match=flag + " runs on the hoisted scorer, which dropout kept at inference"):
        generator.generate([model], sample)
    for module in model.decoder.modules():
        if isinstance(module, FairseqDropout):
            module.apply_during_inference = False
    generator.generate([model], sample)
    model.double()  # the generator rebuilds its scorer for the new weights, and refuses them
    with pytest.raises(ValueError, match=flag + ": quantizes a float32 model, this one is torch.float64"):
        generator.generate([model], {"net_input": {key: value for key, value in sample["net_input"].items()}})


# --- adaptive K: --lattice-mass -------------------------------------------------------------------------------

def test_lattice_mass_keeps_the_fewest_candidates_reaching_that_share_of_the_position():
    """Against a loop: at each position, the smallest number n of the most likely candidates (at least 1, at
    most K) whose probabilities sum to at least mass x the position's whole table probability; the others are
    absent (probability 0), the kept ones unchanged."""
    d, table, sources = random_table()
    source = torch.full((len(sources[:10]), max(map(len, sources[:10]))), d.pad())
    for row, s in enumerate(sources[:10]):
        source[row, :len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in sources[:10]])
    excluded = [d.pad(), d.bos(), d.eos()]
    targets, positions, k = table.predicted_lengths(lengths), 8, 6
    full_tokens, full_probs = table.lattice(source, lengths, targets, positions, k, len(d), excluded)
    dense = table.fill_with_frequent(table.position_distributions(source, lengths, targets, positions, len(d)))
    dense[:, :, excluded] = 0
    kept_counts = set()
    # Counted probabilities are ratios of small integers: masses like 0.6 put partial sums exactly on the cut,
    # where float rounding decides; these do not.
    for mass in (0.37, 0.61, 0.93):
        tokens, probs = table.lattice(source, lengths, targets, positions, k, len(d), excluded, mass=mass)
        assert torch.equal(tokens, full_tokens)
        for row in range(len(lengths)):
            for t in range(positions):
                total, ranked = float(dense[row, t].sum()), full_probs[row, t].tolist()
                partial_sums = [sum(ranked[:i]) for i in range(1, k + 1)]
                assert all(abs(p - mass * total) > 1e-6 * total for p in partial_sums)
                n = next((i for i, p in enumerate(partial_sums, 1) if p >= mass * total), k)
                assert probs[row, t, :n].tolist() == ranked[:n] and not probs[row, t, n:].any()
                kept_counts.add(n)
    assert len(kept_counts) >= 3  # the cut falls at different places, not always at 1 or at K


def test_lattice_mass_one_is_fixed_k_and_a_smaller_mass_scores_fewer_rows():
    model, d = tiny_model(1, layers=1, seed=3)
    sample, table = random_batch(d, 6, seed=4), tiny_table(d)
    fixed, whole = lattice_generator(model, d, table, k=8), lattice_generator(model, d, table, k=8, mass=1.0)
    adaptive = lattice_generator(model, d, table, k=8, mass=0.5)
    ours, theirs = whole.generate([model], sample), fixed.generate([model], sample)
    for a, b in zip((h for hs in ours for h in hs), (h for hs in theirs for h in hs), strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["positional_scores"], b["positional_scores"])
    lattices = []
    for generator in (fixed, adaptive):
        generator.reset_generation_stats()
        hypotheses = generator.generate([model], {"net_input": {key: v[:1] for key, v in sample["net_input"].items()}})
        lattices.append(generator.generation_stats())
        assert hypotheses[0] and hypotheses[0][0]["tokens"][-1] == d.eos()
    assert lattices[1]["candidates_per_position"] < lattices[0]["candidates_per_position"] == 8
    assert lattices[1]["scored_rows"] < lattices[0]["scored_rows"]
    for mass in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=f"--lattice-mass {mass}: must be in \\(0, 1\\]"):
            lattice_generator(model, d, table, mass=mass)


def test_an_empty_source_still_gets_a_translation():
    model, d = tiny_model(1, layers=1)
    src = torch.tensor([[d.pad(), d.pad(), d.eos()], [d.index("w3"), d.index("w4"), d.eos()]])
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([1, 3])}}
    hypotheses = lattice_generator(model, d, tiny_table(d), k=4).generate([model], sample)
    assert all(len(h) == 1 and h[0]["tokens"][-1] == d.eos() for h in hypotheses)


def test_generator_rejects_bad_settings():
    model, d = tiny_model()
    table = tiny_table(d)
    with pytest.raises(ValueError, match="--lattice-k 0"):
        lattice_generator(model, d, table, k=0)
    with pytest.raises(ValueError, match="--lattice-normalize softmax"):
        lattice_generator(model, d, table, normalization="softmax")
    with pytest.raises(ValueError, match="no ensembles"):
        LatticeGenerator([model, model], d, table)


# --- end to end: align, table, fairseq-train, fairseq-generate, bench ----------------------------------------

@pytest.fixture(scope="module")
def lattice_trained(prepared, trained, lattice_system):
    """The synthetic corpus aligned, its table, and a tiny lattice_transformer trained with fairseq-train
    (conftest's session system), with the data and the baseline beside them."""
    return {"data": prepared, "table": lattice_system["table"], "checkpoint": lattice_system["checkpoint"],
            "baseline": trained["checkpoint"]}


def generate(system, *flags, check=True):
    return run("fairseq_cli.generate", os.path.join(system["data"], "bin"), "--user-dir",
               os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/fairseq_plugins",
               "--task", "lattice_translation", "--path", system["checkpoint"], "--gen-subset", "test", *flags,
               check=check)


def test_recall_and_fairseq_generate_on_the_trained_model(lattice_trained, tmp_path):
    proc = plugins_cli("lattice-recall", "--table", lattice_trained["table"], "--data-bin",
                       os.path.join(lattice_trained["data"], "bin"), "-s", "src", "-t", "tgt", "--split", "test",
                       "--k", 1, 8, 32, "--json", tmp_path / "recall.json")
    recall = json.loads((tmp_path / "recall.json").read_text())["recall"]
    # A lexicon-like corpus (in 100 SentencePiece pieces): a few candidates per position hold most of it.
    assert recall["1"] < recall["8"] < recall["32"] and recall["8"] > 0.7 and recall["32"] > 0.9
    assert "K\trecall" in proc.stdout
    hypotheses = lambda out: sorted(l for l in out.splitlines() if l.startswith("H-"))  # noqa: E731
    batched = generate(lattice_trained, "--lattice-table", lattice_trained["table"], "--batch-size", 16,
                       "--scoring", "sacrebleu")
    assert len(hypotheses(batched.stdout)) == 40
    bleu = float(batched.stdout.strip().splitlines()[-1].split("BLEU = ")[1].split()[0])
    # A first-order scorer trained for a minute (~23 here; garbage or misordered outputs score ~0).
    assert bleu > 15, batched.stdout[-2000:]
    assert "lattice decoding: 40 sentences" in batched.stderr and "lattice recall of the references" in batched.stderr
    # Batching changes nothing: one sentence at a time gives the same hypotheses and scores.
    alone = generate(lattice_trained, "--lattice-table", lattice_trained["table"], "--batch-size", 1)
    for one, many in zip(hypotheses(alone.stdout), hypotheses(batched.stdout), strict=True):
        (key_one, score_one, text_one), (key_many, score_many, text_many) = one.split("\t"), many.split("\t")
        assert (key_one, text_one) == (key_many, text_many)
        assert float(score_one) == pytest.approx(float(score_many), abs=1e-4)  # float rounding of other shapes
    # --lattice-no-hoist: the scorer's own layers give the same hypotheses (the hoisting is exact on trained weights).
    unhoisted = generate(lattice_trained, "--lattice-table", lattice_trained["table"], "--batch-size", 16,
                         "--lattice-no-hoist")
    for plain, hoisted in zip(hypotheses(unhoisted.stdout), hypotheses(batched.stdout), strict=True):
        (key_plain, score_plain, text_plain), (key_hoisted, score_hoisted, text_hoisted) = (plain.split("\t"),
                                                                                          hoisted.split("\t"))
        assert (key_plain, text_plain) == (key_hoisted, text_hoisted)
        assert float(score_plain) == pytest.approx(float(score_hoisted), abs=1e-4)
    # --lattice-scorer-precision int8: the trained scorer's feed-forward matrices as int8; about the same hypotheses
    # and BLEU (int8 rounding moves the scores a little).
    int8 = generate(lattice_trained, "--lattice-table", lattice_trained["table"], "--batch-size", 16,
                    "--lattice-scorer-precision", "int8", "--scoring", "sacrebleu")
    assert len(hypotheses(int8.stdout)) == 40
    int8_bleu = float(int8.stdout.strip().splitlines()[-1].split("BLEU = ")[1].split()[0])
    same = sum(a.split("\t")[2] == b.split("\t")[2]
               for a, b in zip(hypotheses(int8.stdout), hypotheses(batched.stdout), strict=True))
    assert abs(int8_bleu - bleu) < 2 and same >= 30, (int8_bleu, bleu, same)
    # --no-repeat-ngram-size: the beam search over the scored lattice. Where the rule cannot bind (n longer than any
    # path) it finds Viterbi's paths; at n = 2 no hypothesis repeats a bigram of pieces (this model's Viterbi
    # outputs mostly do).
    texts = lambda out: [line.split("\t")[2] for line in hypotheses(out)]  # noqa: E731
    unbound = generate(lattice_trained, "--lattice-table", lattice_trained["table"], "--batch-size", 16,
                       "--no-repeat-ngram-size", 60)
    assert texts(unbound.stdout) == texts(batched.stdout) and "no-repeat-60 search, beam 64" in unbound.stderr
    no_repeat = generate(lattice_trained, "--lattice-table", lattice_trained["table"], "--batch-size", 16,
                         "--no-repeat-ngram-size", 2, "--lattice-beam", 16)
    assert len(texts(no_repeat.stdout)) == 40 and "beam 16" in no_repeat.stderr
    assert not any(repeats_an_ngram(text.split(), 2) for text in texts(no_repeat.stdout))
    assert sum(repeats_an_ngram(text.split(), 2) for text in texts(batched.stdout)) >= 20
    # --nbest: the best paths of different lengths, best first.
    nbest = generate(lattice_trained, "--lattice-table", lattice_trained["table"], "--batch-size", 16, "--nbest", 2)
    scores = {}
    for line in hypotheses(nbest.stdout):
        key, score, text = line.split("\t")
        scores.setdefault(key, []).append((float(score), len(text.split())))
    assert len(scores) == 40 and all(len(v) == 2 and v[0][1] != v[1][1] for v in scores.values())


def test_a_second_order_model_trains_and_decodes_with_the_vocabulary_softmax(lattice_trained, tmp_path):
    """--lattice-markov-order 2 end to end: fairseq-train (3 epochs), then fairseq-generate with --lattice-normalize
    vocab, whose positional scores (P- lines, base 2) must be the model's own teacher-forced log-probabilities of
    the printed tokens: the training forward pass over the whole sentence, the exact softmax over the vocabulary."""
    flags = list(TRAIN_FLAGS)
    flags[flags.index("--task") + 1] = "lattice_translation"
    flags[flags.index("--arch") + 1] = "lattice_transformer_tiny"
    save_dir = str(tmp_path / "checkpoints")
    run("fairseq_cli.train", os.path.join(lattice_trained["data"], "bin"), *flags, "--lattice-markov-order", 2,
        "--max-epoch", 3, "--save-dir", save_dir, env={"OMP_NUM_THREADS": TRAIN_THREADS})
    checkpoint = os.path.join(save_dir, "checkpoint_best.pt")
    system = {**lattice_trained, "checkpoint": checkpoint}
    proc = generate(system, "--lattice-table", lattice_trained["table"], "--lattice-k", 4, "--lattice-normalize",
                    "vocab", "--batch-size", 8)
    hypotheses = {line.split("\t")[0][2:]: line.split("\t")[2] for line in proc.stdout.splitlines()
                  if line.startswith("H-")}
    positional = {line.split("\t")[0][2:]: [float(v) for v in line.split("\t")[1].split()]
                  for line in proc.stdout.splitlines() if line.startswith("P-")}
    assert len(hypotheses) == len(positional) == 40

    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [checkpoint], arg_overrides={"data": os.path.join(lattice_trained["data"], "bin")})
    model = models[0].eval()
    assert model.decoder.markov_order == 2
    task.load_dataset("test")
    dataset = task.dataset("test")
    for key in ("0", "7", "23", "39"):
        tokens = task.target_dictionary.encode_line(hypotheses[key], add_if_not_exist=False, append_eos=True).long()
        net_input = dataset.collater([dataset[int(key)]])["net_input"]
        sample = {"net_input": {name: net_input[name] for name in ("src_tokens", "src_lengths")}}
        with torch.no_grad():
            expected = teacher_forced_scores(model, sample, 0, tokens) / math.log(2)
        assert positional[key] == pytest.approx(expected.tolist(), abs=2e-4), key


def test_fairseq_interactive_decodes_with_the_lattice(lattice_trained):
    data = lattice_trained["data"]
    with open(os.path.join(data, "tok", "test.src"), encoding="utf-8") as f:
        sources = [next(f).rstrip("\n") for _ in range(3)]
    proc = run("fairseq_cli.interactive", os.path.join(data, "bin"), "--user-dir",
               os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fairseq_plugins"),
               "--task", "lattice_translation", "--lattice-table", lattice_trained["table"],
               "--path", lattice_trained["checkpoint"], "--source-lang", "src", "--target-lang", "tgt",
               stdin="\n".join(sources) + "\n")
    hyps = [line.split("\t")[-1].split() for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == 3 and all(h[-1] == "▁." for h in hyps), proc.stdout[-800:]


@pytest.mark.parametrize("flags, message", [
    ([], "--lattice-table: lattice decoding needs the candidate table"),
    (["--lattice-table", "TABLE", "--lattice-mass", 1.5], "--lattice-mass 1.5: must be in (0, 1]"),
    (["--lattice-table", "TABLE", "--unkpen", 1], "--unkpen: not supported with lattice decoding"),
    (["--lattice-table", "TABLE", "--path", "BASELINE"], "decodes a lattice_transformer, not TransformerModel"),
    (["--lattice-table", "TABLE", "--lattice-scorer-precision", "int8", "--fp16"],
     "--lattice-scorer-precision int8: quantizes a float32 model, this one is torch.float16 (drop --fp16/--bf16)"),
    (["--lattice-table", "TABLE", "--lattice-scorer-precision", "int8", "--lattice-no-hoist"],
     "--lattice-scorer-precision int8 runs on the hoisted scorer: drop --lattice-no-hoist"),
])
def test_bad_generation_settings_are_clear_errors(lattice_trained, flags, message):
    flags = [lattice_trained["table"] if f == "TABLE" else lattice_trained["baseline"] if f == "BASELINE" else f
             for f in flags]
    proc = generate(lattice_trained, *flags, check=False)
    assert proc.returncode != 0 and message in proc.stderr


def test_bench_measures_lattice_decoding_against_the_baseline_transformer(lattice_trained, tmp_path):
    result_path = tmp_path / "lattice.json"
    plugins_cli("bench", "--method", "lattice", "--path", lattice_trained["checkpoint"], "--baseline-path",
                lattice_trained["baseline"], "--data", lattice_trained["data"], "--threads", 1, "--runs", 1,
                "--beam", 5, "--limit", 10, "--json", result_path, "--lattice-table", lattice_trained["table"])
    result = json.loads(result_path.read_text())
    stats = result["stats"]
    assert stats["sentences"] == 10 and stats["decoder_calls"] == 10 and 0 < stats["lattice_recall"] <= 1
    assert all(stats[f"{phase}_ms_per_sentence"] > 0 for phase in ("encoder", "lattice", "scoring", "viterbi"))
    # The baseline decoded in the same run; the tiny first-order model's own BLEU is low (it repeats words).
    assert result["baseline"]["bleu"] > 10 and result["baseline_checkpoint"] == os.path.abspath(lattice_trained["baseline"])
    # Batches of 4, with the no-repeat search against the plain baseline: the same hypotheses as one at a time.
    batched_path, single_path = tmp_path / "batched.json", tmp_path / "single.json"
    for batch, path in ((4, batched_path), (1, single_path)):
        plugins_cli("bench", "--method", "lattice", "--path", lattice_trained["checkpoint"], "--baseline-path",
                    lattice_trained["baseline"], "--data", lattice_trained["data"], "--threads", 1, "--runs", 1,
                    "--beam", 5, "--batch-size", batch, "--limit", 12, "--json", path, "--hypotheses",
                    str(path) + ".hyp", "--lattice-table", lattice_trained["table"], "--no-repeat-ngram-size", 2,
                    "--baseline-no-repeat-ngram-size", 0)
    batched, single = json.loads(batched_path.read_text()), json.loads(single_path.read_text())
    assert batched["batch_size"] == 4 and batched["stats"]["sentences"] >= 12 and batched["stats"]["batches"] >= 3
    assert batched["generator"]["no_repeat_ngram_size"] == 2 == single["stats"]["no_repeat_ngram_size"]
    assert batched["baseline"]["generator"]["no_repeat_ngram_size"] == 0
    assert (tmp_path / "batched.json.hyp").read_text() == (tmp_path / "single.json.hyp").read_text()
