"""Double-token decoding: folding, the step mask, incremental pair decoding, DoubleTopK, the CLI end to end."""

import argparse
import json
import math
import os
import re

import pytest
import torch
from fairseq.data import LanguagePairDataset
from hypothesis import given, settings
from hypothesis import strategies as st

import fairseq_plugins  # noqa: F401  (registers the plugins)
from conftest import (DictionaryTask, incremental_and_full, plugins_cli, random_batch, run, train_double_token,
                      word_dictionary)
from fairseq_plugins.double_token.folding import FoldedTargetDataset, fold, unfold, unfold_indices
from fairseq_plugins.double_token.generator import DoubleTokenGenerator
from fairseq_plugins.double_token.model import DoubleTokenTransformerModel, double_token_transformer_tiny
from fairseq_plugins.double_token.ngram import span_precision

EOD = 1000  # never a token of these tests
SYSTEMS = [("l2r", 1), ("r2l", 1), ("l2r", 2), ("r2l", 2), ("bidir", 2)]


# --- folding -------------------------------------------------------------------------------------------------

def check_folded(tokens, folded, order, per_step):
    assert unfold(folded, order, per_step, EOD) == tokens
    if per_step == 1:
        assert len(folded) == len(tokens)
        return
    eods = [i for i, t in enumerate(folded) if t == EOD]
    assert len(folded) % 2 == 0 and len(eods) == (2 if len(tokens) % 2 == 0 else 1)
    assert all(i >= len(folded) - 2 for i in eods), "EODs only in the last pair"


@pytest.mark.parametrize("order, per_step", SYSTEMS)
def test_fold_unfold_round_trip_for_every_length_up_to_200(order, per_step):
    for n in range(201):
        tokens = list(range(10, 10 + n))
        check_folded(tokens, fold(tokens, order, per_step, EOD), order, per_step)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(4, 60), max_size=120), st.sampled_from(SYSTEMS))
def test_fold_unfold_round_trip_on_random_sequences(tokens, system):
    order, per_step = system
    check_folded(tokens, fold(tokens, order, per_step, EOD), order, per_step)


def test_fold_layouts_and_eod_in_either_slot():
    y = [1, 2, 3, 4, 5]
    assert fold(y, "bidir", 2, EOD) == [1, 5, 2, 4, 3, EOD]           # odd: middle token, then EOD
    assert fold(y[:4], "bidir", 2, EOD) == [1, 4, 2, 3, EOD, EOD]      # even: two EODs
    assert fold(y, "l2r", 2, EOD) == [1, 2, 3, 4, 5, EOD]
    assert fold(y, "r2l", 2, EOD) == [5, 4, 3, 2, 1, EOD]
    assert fold(y[:2], "r2l", 2, EOD) == [2, 1, EOD, EOD]
    assert fold([], "bidir", 2, EOD) == [EOD, EOD] and fold([7], "bidir", 2, EOD) == [7, EOD]
    assert fold(y, "r2l", 1, EOD) == [5, 4, 3, 2, 1]
    # Decoded sequences: an EOD in the first slot puts the second slot's real token in the middle.
    assert unfold([1, 5, 2, 4, EOD, 3], "bidir", 2, EOD) == [1, 2, 3, 4, 5]
    assert unfold([1, 5, 2, 4, 3, EOD], "bidir", 2, EOD) == [1, 2, 3, 4, 5]
    assert unfold([1, 5, EOD, EOD, 2, 4], "bidir", 2, EOD) == [1, 5]   # nothing after the first EOD pair
    assert unfold([1, 5, 2, 4], "bidir", 2, EOD) == [1, 2, 4, 5]       # no EOD (cut at the maximum length)
    assert unfold([1, 2, EOD, 3], "l2r", 2, EOD) == [1, 2]
    assert unfold_indices([5, 4, 3, EOD], "r2l", 2, EOD) == [2, 1, 0]


def language_pair_dataset(targets, dictionary):
    sources = [torch.tensor([dictionary.index("w1"), dictionary.eos()]) for _ in targets]
    targets = [torch.tensor(t + [dictionary.eos()]) for t in targets]
    return LanguagePairDataset(sources, [2] * len(sources), dictionary, targets, [len(t) for t in targets],
                               dictionary, shuffle=False)


@pytest.mark.parametrize("order, per_step", SYSTEMS)
def test_dataset_folds_targets_of_length_0_1_and_more_and_keeps_the_natural_one(order, per_step):
    dictionary = word_dictionary()
    eod, eos, pad = dictionary.add_symbol("<eod>"), dictionary.eos(), dictionary.pad()
    natural = [[], [10], [10, 11], [10, 11, 12, 13, 14]]
    dataset = FoldedTargetDataset(language_pair_dataset(natural, dictionary), order, per_step, eos, eod)
    batch = dataset.collater([dataset[i] for i in range(len(natural))])
    for row, sid in enumerate(batch["id"].tolist()):
        expected = fold(natural[sid], order, per_step, eod) + ([eos] if per_step == 1 else [])
        folded = [t for t in batch["folded_target"][row].tolist() if t != pad]
        assert folded == expected
        assert [t for t in batch["target"][row].tolist() if t != pad] == natural[sid] + [eos]
        prev = [t for t in batch["net_input"]["prev_output_tokens"][row].tolist() if t != pad]
        assert prev == [eos] * per_step + expected[:-per_step]
    assert batch["folded_ntokens"] == sum(len(fold(t, order, per_step, eod)) + (per_step == 1) for t in natural)


# --- model ---------------------------------------------------------------------------------------------------

def random_model(order="bidir", per_step=2, seed=0, std=0.3):
    """An untrained tiny model with large random weights, so its outputs vary from token to token."""
    dictionary = word_dictionary()
    eod = dictionary.add_symbol("<eod>")
    args = argparse.Namespace(token_order=order, tokens_per_step=per_step)
    double_token_transformer_tiny(args)
    args.dropout = 0.0
    torch.manual_seed(seed)
    model = DoubleTokenTransformerModel.build_model(args, DictionaryTask(dictionary))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=std)
    return model.eval(), dictionary, eod


def test_step_mask_lets_both_slots_of_a_step_see_each_other_and_nothing_later():
    model, _, _ = random_model()
    mask = model.decoder.buffered_future_mask(torch.zeros(6, 1, 4))
    allowed = (mask == 0).int().tolist()
    assert allowed == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    single, _, _ = random_model("l2r", 1)
    assert torch.equal(single.decoder.buffered_future_mask(torch.zeros(5, 1, 4)),
                       torch.triu(torch.full((5, 5), float("-inf")), 1))


@pytest.mark.parametrize("order, per_step", SYSTEMS)
def test_incremental_decoding_with_a_reordered_cache_equals_the_full_forward_pass(order, per_step):
    model, dictionary, _ = random_model(order, per_step)
    # Two sentences with two beams each, reordered mid-sequence as beam search reorders them.
    incremental, full = incremental_and_full(model, dictionary, "cpu", per_step)
    assert (incremental - full).abs().max() < 1e-5


@pytest.mark.parametrize("fused", [True, False], ids=["native layer", "torch operations"])
@pytest.mark.parametrize("order", ["l2r", "r2l", "bidir"])
def test_the_fast_steps_pairs_give_the_full_forward_passs_logits(order, fused):
    """--fast-step: a step's pairs through FastDecoderStep.group_step(causal=False) (both slots of a hypothesis
    see each other, as the step mask lets them) give the logits of the model's full forward pass, also after
    beam search reorders the rows (two sentences with two beams each)."""
    from fairseq_plugins.kernels import native
    from fairseq_plugins.kernels.decoder_step import FastDecoderStep

    if fused and not native.available():
        pytest.skip("the native kernels could not be built here")
    model, dictionary, _ = random_model(order, 2)
    batch = random_batch(dictionary, bsz=2)
    prev = torch.randint(dictionary.nspecial, len(dictionary), (4, 8), generator=torch.Generator().manual_seed(1))
    prev[:, :2] = dictionary.eos()
    reorder = torch.tensor([1, 1, 3, 2])  # beam 1 of sentence 0 replaces beam 0; sentence 1 swaps
    engine = FastDecoderStep(model.decoder, fused=fused)
    assert (engine.native_layers is not None) == fused
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(batch["net_input"])
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([0, 0, 1, 1]))
        engine.start(encoder_out, max_steps=3)  # 8 positions: the caches grow inside a pair
        steps = []
        for start in range(0, 8, 2):
            if start == 4:
                engine.reorder(reorder)
                prev, steps = prev[reorder], [step[reorder] for step in steps]
            steps.append(engine.logits(engine.group_step(prev[:, start:start + 2], causal=False)).view(4, 2, -1))
        full, _ = model.decoder(prev, encoder_out=model.encoder.reorder_encoder_out(encoder_out, reorder))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=2e-5)


def test_future_pairs_never_change_earlier_outputs():
    model, dictionary, _ = random_model()
    batch = random_batch(dictionary, bsz=2)
    prev = torch.randint(dictionary.nspecial, len(dictionary), (2, 8), generator=torch.Generator().manual_seed(3))
    changed = prev.clone()
    changed[:, 4:] = dictionary.nspecial  # steps 2 and 3 differ
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(batch["net_input"])
        a, _ = model.decoder(prev, encoder_out=encoder_out)
        b, _ = model.decoder(changed, encoder_out=encoder_out)
    assert torch.equal(a[:, :4], b[:, :4]) and not torch.allclose(a[:, 4:], b[:, 4:])
    # ... and the second slot of a step does see the first (same step, not causal inside the pair).
    changed = prev.clone()
    changed[:, 2] = (prev[:, 2] + 1 - dictionary.nspecial) % (len(dictionary) - dictionary.nspecial) + dictionary.nspecial
    with torch.no_grad():
        c, _ = model.decoder(changed, encoder_out=encoder_out)
    assert torch.equal(a[:, :2], c[:, :2]) and not torch.allclose(a[:, 3], c[:, 3])


# --- the generator -------------------------------------------------------------------------------------------

def natural_order(pairs, order, eod):
    """The real (token, slot score) entries of a finished hypothesis' pairs, in natural order.

    Written from the method's definition, not with the package's unfolding: every slot writes its token at
    one end of the sentence being built (bidir: the first slot appends to the left half, the second prepends
    to the right half; l2r: both append on the left; r2l: both prepend on the right); EOD writes nothing.
    """
    left, right = [], []
    for pair in pairs:
        for slot, (token, score) in enumerate(pair):
            if token == eod:
                continue
            if order == "l2r" or (order == "bidir" and slot == 0):
                left.append((token, score))
            else:
                right.insert(0, (token, score))
    return left + right


def reference_double_topk(model, net_input, dictionary, eod, order, beam, left_width, pair_width, max_len_b,
                          min_len=1):
    """Algorithm 1 one sentence at a time, hypothesis by hypothesis, full forward passes, Python lists.

    Returns the finished hypotheses, best first, as (natural tokens, positional scores, score): the positional
    scores are the kept tokens' slot log-probabilities, then the EOS's (the sum of the EOD slots').
    """
    eos, pad = dictionary.eos(), dictionary.pad()
    vocab = range(len(dictionary))
    max_len = min(max_len_b, model.max_decoder_positions() - 3)
    encoder_out = model.encoder.forward_torchscript(net_input)
    live = [([], 0.0)]  # (pairs of (token, slot score), cumulative score)
    finished = []
    step = 0
    while True:
        scored = []  # per live hypothesis: its two slots' log-probabilities under the length rules
        for pairs, _ in live:
            inputs = [eos, eos] + [token for pair in pairs for token, _ in pair]
            enc = model.encoder.reorder_encoder_out(encoder_out, torch.zeros(1, dtype=torch.long))
            logits, _ = model.decoder(torch.tensor([inputs]), encoder_out=enc)
            lp = torch.log_softmax(logits[0, -2:].float(), dim=-1)
            lp[:, pad] = lp[:, eos] = -math.inf
            for slot, length in ((0, 2 * step), (1, 2 * step + 1)):  # the natural length if this slot is EOD
                if length < min_len:
                    lp[slot, eod] = -math.inf
                elif length >= max_len:
                    keep = lp[slot, eod].item()
                    lp[slot] = -math.inf
                    lp[slot, eod] = keep
            scored.append(lp.tolist())
        # DoubleTopK: every (hypothesis, first-slot token), the best left_width by cumulative score; each with
        # every second-slot token of its own hypothesis (only EOD after a first-slot EOD); the best pair_width.
        lefts = []
        for h, (_, total) in enumerate(live):
            for left in vocab:
                lefts.append((total + scored[h][0][left], h, left))
        lefts = sorted(lefts, key=lambda c: -c[0])[:left_width]
        candidates = []
        for left_score, h, left in lefts:
            for right in ([eod] if left == eod else vocab):
                candidates.append((left_score + scored[h][1][right], h, left, right))
        candidates = sorted(candidates, key=lambda c: -c[0])[:pair_width]
        for score, h, left, right in candidates[:beam]:  # FINALIZE: an EOD among the W best
            if (left == eod or right == eod) and score > -math.inf and len(finished) < beam:
                pairs = live[h][0] + [((left, scored[h][0][left]), (right, scored[h][1][right]))]
                kept = natural_order(pairs, order, eod)
                every_slot = sum(s for pair in pairs for _, s in pair)
                positional = [s for _, s in kept] + [every_slot - sum(s for _, s in kept)]
                finished.append(([t for t, _ in kept], positional, every_slot / (len(kept) + 1)))
        if len(finished) >= beam or 2 * step >= max_len:
            break
        # EXPANDBEAM: the W best without EOD, padded with impossible hypotheses as a beam of W.
        continuing = [c for c in candidates if c[2] != eod and c[3] != eod][:beam]
        continuing += [(-math.inf, 0, dictionary.unk(), dictionary.unk())] * (beam - len(continuing))
        live = [(live[h][0] + [((left, scored[h][0][left]), (right, scored[h][1][right]))], score)
                for score, h, left, right in continuing]
        step += 1
    return sorted(finished, key=lambda f: -f[2])


def make_the_outputs_vary(model, eod, eod_bias, seed=0):
    """Add to each position's logits a fixed random row picked by the position and its input token, and
    ``eod_bias`` to EOD's logit, in full and incremental passes alike.

    The random model alone barely looks at its inputs (its saturated attention makes one token the best
    everywhere): its hypotheses would repeat one token, in which no token order shows.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = model.decoder.output_projection.out_features
    table = 3 * torch.randn(16, vocab, vocab, generator=g)  # (position, input token) -> added logits
    table[..., eod] += eod_bias

    def hook(decoder, args, kwargs, output):
        inputs, logits = args[0], output[0]  # an incremental call returns the newest positions only
        positions = torch.arange(inputs.size(1) - logits.size(1), inputs.size(1))
        return (logits + table[positions, inputs[:, positions]],) + tuple(output[1:])

    model.decoder.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("order", ["bidir", "l2r", "r2l"])
@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("eod_bias", [0.0, 5.5])
def test_batched_double_topk_equals_a_one_hypothesis_at_a_time_reference(order, beam, eod_bias):
    # Without a bias no hypothesis picks EOD: all are cut at the maximum length 9, an odd length that ends with
    # (middle token, forced EOD). With EOD raised they also end early, at odd and even lengths (EOD in either
    # slot), so the natural order of every kind of ending is checked.
    model, dictionary, eod = random_model(order, 2, std=0.5)
    make_the_outputs_vary(model, eod, eod_bias)
    batch = random_batch(dictionary, bsz=4)
    generator = DoubleTokenGenerator(model, dictionary, eod, order, beam_size=beam, left_candidates=2 * beam,
                                     pair_candidates=3 * beam, max_len_b=9)
    hypotheses = generator.generate([model], batch)
    for i in range(4):
        net_input = {k: v[i:i + 1] for k, v in batch["net_input"].items()}
        expected = reference_double_topk(model, net_input, dictionary, eod, order, beam, 2 * beam, 3 * beam, 9)
        ours = hypotheses[i]
        assert len(ours) == len(expected) == beam
        for hypo, (tokens, positional, score) in zip(ours, expected):
            assert hypo["tokens"].tolist() == tokens + [dictionary.eos()]
            assert hypo["positional_scores"].tolist() == pytest.approx(positional, abs=1e-4)
            assert abs(float(hypo["score"]) - score) < 1e-4


def test_batched_decoding_equals_decoding_one_sentence_at_a_time():
    model, dictionary, eod = random_model(std=0.5)
    batch = random_batch(dictionary, bsz=6, seed=4)
    generator = DoubleTokenGenerator(model, dictionary, eod, "bidir", beam_size=4, left_candidates=8,
                                     pair_candidates=12, max_len_b=12)
    together = generator.generate([model], batch)
    for i in range(6):
        alone = generator.generate([model], {"net_input": {k: v[i:i + 1] for k, v in batch["net_input"].items()}})
        # Padding changes the encoder output in the last bits, which may swap hypotheses whose scores tie
        # (this random model has many): ranks must agree on scores, and on tokens where a score is unique.
        scores = [float(h["score"]) for h in alone[0]]
        assert len(alone[0]) == len(together[i]) == 4 and len(together) == 6  # W finished hypotheses each
        assert all(abs(a - float(b["score"])) < 1e-4 for a, b in zip(scores, together[i]))
        for rank, (a, b) in enumerate(zip(alone[0], together[i])):
            if sum(abs(scores[rank] - other) < 1e-4 for other in scores) == 1:
                assert a["tokens"].tolist() == b["tokens"].tolist()


class FixedTableModel(torch.nn.Module):
    """Decoder emits fixed log-probabilities per step: table[step] = (slot-0 lprobs, slot-1 lprobs)."""

    def __init__(self, table, vocab):
        super().__init__()
        self.table, self.vocab = table, vocab
        self.encoder = self
        self.decoder = self
        self.tokens_per_step = 2
        self.calls = 0

    def max_decoder_positions(self):
        return 1024

    def forward_torchscript(self, net_input):
        return {"rows": net_input["src_tokens"]}

    def reorder_encoder_out(self, encoder_out, new_order):
        return {"rows": encoder_out["rows"].index_select(0, new_order)}

    def reorder_incremental_state_scripting(self, state, new_order):
        pass

    def forward(self, tokens, encoder_out=None, incremental_state=None):
        step = tokens.size(1) // 2 - 1
        self.calls += 1
        logits = torch.full((tokens.size(0), 2, self.vocab), -30.0)  # e^-30: nil, yet exact in float32
        for slot, probabilities in enumerate(self.table[min(step, len(self.table) - 1)]):
            for token, p in probabilities.items():
                logits[:, slot, token] = math.log(p)
        return logits, None


@pytest.mark.parametrize("eod_slot", ["left", "right"])
def test_eod_in_either_slot_finalizes_with_the_right_length(eod_slot):
    dictionary = word_dictionary(8)
    eod = dictionary.add_symbol("<eod>")
    a, b, c, d = (dictionary.index(f"w{i}") for i in range(4))
    last = ({eod: 0.9, c: 0.1}, {eod: 0.8, d: 0.2}) if eod_slot == "left" else ({c: 0.9, eod: 0.1}, {eod: 0.7, d: 0.3})
    model = FixedTableModel([({a: 0.6, b: 0.4}, {b: 0.6, d: 0.4}), last], len(dictionary))
    batch = {"net_input": {"src_tokens": torch.tensor([[a, dictionary.eos()]]), "src_lengths": torch.tensor([2])}}
    generator = DoubleTokenGenerator(model, dictionary, eod, "bidir", beam_size=1, left_candidates=2,
                                     pair_candidates=3)
    best = generator.generate([model], batch)[0][0]
    if eod_slot == "left":  # (a, b) then (EOD, EOD): 2 tokens; the second slot's EOD is forced
        assert best["tokens"].tolist() == [a, b, dictionary.eos()]
        expected = [math.log(0.6), math.log(0.6), math.log(0.9) + math.log(0.8)]
    else:  # (a, b) then (c, EOD): c is the middle token
        assert best["tokens"].tolist() == [a, c, b, dictionary.eos()]
        expected = [math.log(0.6), math.log(0.9), math.log(0.6), math.log(0.7)]
    assert torch.allclose(best["positional_scores"], torch.tensor(expected), atol=1e-5)
    assert abs(float(best["score"]) - sum(expected) / len(expected)) < 1e-5
    assert model.calls == 2  # two tokens a call


def test_a_forced_second_slot_eod_scores_its_model_probability_or_one_as_the_authors_do():
    dictionary = word_dictionary(8)
    eod = dictionary.add_symbol("<eod>")
    a, b, c, d = (dictionary.index(f"w{i}") for i in range(4))
    # After (a, b): ending now is EOD (0.5) in the first slot, which forces the second slot's EOD, to which the
    # model gives 0.1; going on is (c, d) at 0.5 x 0.9.
    model = FixedTableModel([({a: 0.6, b: 0.4}, {b: 0.6, d: 0.4}), ({eod: 0.5, c: 0.5}, {eod: 0.1, d: 0.9})],
                            len(dictionary))
    batch = {"net_input": {"src_tokens": torch.tensor([[a, dictionary.eos()]]), "src_lengths": torch.tensor([2])}}

    def best(forced_eod_score):
        generator = DoubleTokenGenerator(model, dictionary, eod, "bidir", beam_size=1, left_candidates=2,
                                         pair_candidates=3, max_len_b=6, forced_eod_score=forced_eod_score)
        return generator.generate([model], batch)[0][0]

    # The model's probability: log 0.5 + log 0.1 < log 0.5 + log 0.9, so it goes on to the maximum length.
    assert len(best("model")["tokens"]) == 7
    # Probability 1 (the authors' code): log 0.5 + 0 > log 0.5 + log 0.9, so it ends after (a, b).
    certain = best("one")
    assert certain["tokens"].tolist() == [a, b, dictionary.eos()]
    expected = [math.log(0.6), math.log(0.6), math.log(0.5)]
    assert torch.allclose(certain["positional_scores"], torch.tensor(expected), atol=1e-5)
    with pytest.raises(ValueError, match="--forced-eod-score sometimes: one of model, one"):
        DoubleTokenGenerator(model, dictionary, eod, "bidir", forced_eod_score="sometimes")


def test_min_len_forbids_an_early_eod_and_max_len_forces_one():
    dictionary = word_dictionary(8)
    eod = dictionary.add_symbol("<eod>")
    a, b = dictionary.index("w0"), dictionary.index("w1")
    model = FixedTableModel([({eod: 0.9, a: 0.1}, {eod: 0.9, b: 0.1})], len(dictionary))
    batch = {"net_input": {"src_tokens": torch.tensor([[a, dictionary.eos()]]), "src_lengths": torch.tensor([2])}}
    # min_len 3: EOD is barred until the first slot of step 1 would end at 2 tokens (too few): the earliest
    # allowed end is the second slot of step 1 (3 tokens).
    generator = DoubleTokenGenerator(model, dictionary, eod, "bidir", beam_size=1, min_len=3)
    assert generator.generate([model], batch)[0][0]["tokens"].tolist() == [a, a, b, dictionary.eos()]
    # A model that never ends is cut at max_len (5 tokens: the second slot of step 2 is forced to EOD).
    never = FixedTableModel([({a: 0.9, b: 0.1}, {b: 0.9, a: 0.1})], len(dictionary))
    generator = DoubleTokenGenerator(never, dictionary, eod, "bidir", beam_size=2, max_len_b=5)
    best = generator.generate([never], batch)[0][0]
    assert best["tokens"].tolist() == [a, a, a, b, b, dictionary.eos()]


# --- ngram precision -----------------------------------------------------------------------------------------

def test_span_precision_counts_clipped_ngrams_in_the_first_and_last_tokens():
    hypotheses = [["a", "b", "c", "d", "x", "a"]]
    references = [["a", "b", "c", "d", "e", "f"]]
    assert span_precision(hypotheses, references, 3, 1, "first") == {"matched": 3, "total": 3, "precision": 100.0}
    assert span_precision(hypotheses, references, 3, 1, "last")["matched"] == 2  # d, a (x is not in the ref)
    assert span_precision(hypotheses, references, 4, 2, "first")["matched"] == 3
    assert span_precision([["a", "a", "a"]], [["a", "b"]], 3, 1, "first")["matched"] == 1  # clipped


def test_ngram_precision_cli_table_and_errors(tmp_path):
    ref, left, right = tmp_path / "ref.txt", tmp_path / "l2r.txt", tmp_path / "r2l.txt"
    ref.write_text("a b c d e f g h\n")
    left.write_text("a b c d x y z h\n")
    right.write_text("q r c d e f g h\n")
    out = tmp_path / "table.json"
    proc = plugins_cli("ngram-precision", "--reference", ref, "--hypotheses", left, right, "--labels", "l2r", "r2l",
                       "--span", 4, "--json", out)
    table = json.loads(out.read_text())["precision"]
    assert table["l2r"]["first4_1gram"]["precision"] == 100.0 and table["l2r"]["last4_1gram"]["precision"] == 25.0
    assert table["r2l"]["first4_4gram"]["precision"] == 0.0 and table["r2l"]["last4_4gram"]["precision"] == 100.0
    assert "| l2r |" in proc.stdout
    short = tmp_path / "short.txt"
    short.write_text("a\nb\n")
    proc = plugins_cli("ngram-precision", "--reference", ref, "--hypotheses", short, check=False)
    assert proc.returncode == 2 and f"{short} has 2 lines but --reference {ref} has 1" in proc.stderr


# --- end to end through fairseq-train / fairseq-generate ------------------------------------------------------

@pytest.fixture(scope="module")
def double_token_trained(prepared, double_token_bidir_system, tmp_path_factory):
    """Three tiny systems: the paper's bidirectional one (conftest's, trained once a session), single-token R2L
    and single-token L2R (stock)."""
    r2l, _ = train_double_token(prepared, str(tmp_path_factory.mktemp("r2l")), "r2l", 1)
    l2r, _ = train_double_token(prepared, str(tmp_path_factory.mktemp("l2r")), "l2r", 1)
    with open(double_token_bidir_system["log"], encoding="utf-8") as f:
        bidir_log = f.read()
    return {"data": prepared, "bidir": double_token_bidir_system["checkpoint"], "bidir_log": bidir_log, "r2l": r2l,
            "l2r": l2r}


def generate(data, checkpoint, *flags, check=True):
    return run("fairseq_cli.generate", os.path.join(data, "bin"), "--user-dir", fairseq_plugins.__path__[0],
               "--task", "double_token_translation", "--path", checkpoint, "--gen-subset", "test", *flags,
               check=check)


@pytest.mark.parametrize("system, flags", [
    ("bidir", ["--beam", 5, "--batch-size", 16]),
    ("bidir", ["--beam", 1, "--batch-size", 1]),
    ("r2l", ["--token-order", "r2l", "--tokens-per-step", 1, "--beam", 5, "--batch-size", 16]),
])
def test_trained_models_decode_natural_order_through_fairseq_generate(double_token_trained, system, flags):
    proc = generate(double_token_trained["data"], double_token_trained[system], *flags, "--nbest", 2)
    pairs = {}
    for line in proc.stdout.splitlines():
        field = line.split("\t")
        if line.startswith(("T-", "H-")):
            pairs.setdefault(field[0][2:], {}).setdefault(field[0][0], field[-1])
    assert len(pairs) == 40
    # T- lines are the references in natural order (the task folds targets for training only).
    with open(os.path.join(double_token_trained["data"], "tok", "test.tgt"), encoding="utf-8") as f:
        references = [line.rstrip("\n") for line in f]
    assert all(p["T"] == references[int(i)] for i, p in pairs.items()), list(pairs.items())[:2]
    hyps = [p["H"].split() for p in pairs.values()]
    # Every synthetic target ends with its full stop; outputs reversed or folded would not.
    assert sum(h[-1:] == ["▁."] for h in hyps) >= 38
    bleu = float(re.search(r"BLEU4 = ([\d.]+)", proc.stdout).group(1))
    assert bleu > 25, proc.stdout[-500:]
    beam = flags[flags.index("--beam") + 1]
    assert len([line for line in proc.stdout.splitlines() if line.startswith("H-")]) == 40 * min(beam, 2)  # --nbest 2


def hypotheses_and_scores(stdout):
    """{sentence id: (hypothesis, score)} of fairseq-generate's H- lines."""
    lines = [line.split("\t") for line in stdout.splitlines() if line.startswith("H-")]
    return {fields[0]: (fields[2], float(fields[1])) for fields in lines}


@pytest.mark.parametrize("system, flags", [
    ("bidir", ["--beam", 1, "--batch-size", 1]),
    ("bidir", ["--beam", 5, "--batch-size", 16]),
    ("l2r", ["--token-order", "l2r", "--tokens-per-step", 1, "--beam", 5, "--batch-size", 16]),
    ("r2l", ["--token-order", "r2l", "--tokens-per-step", 1, "--beam", 1, "--batch-size", 1]),
])
def test_fast_step_gives_the_stock_hypotheses_of_every_system(double_token_trained, system, flags):
    """--fast-step in float32: on every test sentence the hypothesis of the model's own decoder, its score to
    float rounding (two-token steps through group_step; one-token systems through the fast step's generator)."""
    data, checkpoint = double_token_trained["data"], double_token_trained[system]
    stock = hypotheses_and_scores(generate(data, checkpoint, *flags).stdout)
    fast = hypotheses_and_scores(generate(data, checkpoint, *flags, "--fast-step").stdout)
    assert len(stock) == 40 and fast.keys() == stock.keys()
    assert all(fast[i][0] == stock[i][0] and abs(fast[i][1] - stock[i][1]) < 1e-4 for i in stock), \
        [(stock[i], fast[i]) for i in stock if fast[i][0] != stock[i][0]][:3]


def test_int8_pairs_of_a_row_do_not_depend_on_the_other_rows():
    """--fast-step-precision int8 quantizes each slot's activations with its own scale: a hypothesis' pair
    logits are the same decoded among other rows or alone (given the same encoder output)."""
    from fairseq_plugins.kernels.decoder_step import FastDecoderStep

    model, dictionary, _ = random_model("bidir", 2)
    batch = random_batch(dictionary, bsz=3)
    prev = torch.randint(dictionary.nspecial, len(dictionary), (3, 6), generator=torch.Generator().manual_seed(1))
    engine = FastDecoderStep(model.decoder, "int8")
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(batch["net_input"])

        def pairs(rows):
            engine.start(model.encoder.reorder_encoder_out(encoder_out, rows))
            return torch.stack([engine.logits(engine.group_step(prev[rows, s:s + 2], causal=False))
                                for s in range(0, 6, 2)])

        together = pairs(torch.arange(3))
        alone = torch.cat([pairs(torch.tensor([row])) for row in range(3)], dim=1)
        fp32 = FastDecoderStep(model.decoder)
        fp32.start(encoder_out)
        first = fp32.logits(fp32.group_step(prev[:, :2], causal=False))
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    assert 0 < (together[0] - first).abs().max() < 0.5  # int8 arithmetic ran, close to float32's


def test_int8_fast_step_decodes_mostly_float32s_hypotheses(double_token_trained):
    data, checkpoint = double_token_trained["data"], double_token_trained["bidir"]
    int8 = hypotheses_and_scores(generate(data, checkpoint, "--beam", 4, "--batch-size", 16, "--fast-step",
                                          "--fast-step-precision", "int8").stdout)
    fp32 = hypotheses_and_scores(generate(data, checkpoint, "--beam", 4, "--batch-size", 16).stdout)
    assert len(fp32) == 40 and int8.keys() == fp32.keys()
    assert sum(int8[i][0] == fp32[i][0] for i in fp32) >= 30  # 35 of 40 when written
    assert any(int8[i][1] != fp32[i][1] for i in fp32)


def test_fairseq_interactive_decodes_raw_lines_in_natural_order(double_token_trained):
    data = double_token_trained["data"]
    with open(os.path.join(data, "tok", "test.src"), encoding="utf-8") as f:
        sources = [next(f).rstrip("\n") for _ in range(3)]
    proc = run("fairseq_cli.interactive", os.path.join(data, "bin"), "--user-dir", fairseq_plugins.__path__[0],
               "--task", "double_token_translation", "--path", double_token_trained["bidir"], "--beam", 4,
               "--source-lang", "src", "--target-lang", "tgt", stdin="\n".join(sources) + "\n")
    hyps = [line.split("\t")[-1].split() for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == 3 and all(h[-1] == "▁." for h in hyps), proc.stdout[-800:]


def test_eval_bleu_during_training_equals_fairseq_generate_on_the_same_checkpoint(double_token_trained):
    # --eval-bleu decodes the validation set with the task's generator against the natural-order target,
    # as fairseq-generate does (sacreBLEU 13a on detokenised words; against folded references, or with
    # folded hypotheses, both would differ).
    scores = re.findall(r"valid on 'valid' subset .*?\| bleu ([\d.]+)", double_token_trained["bidir_log"])
    last = os.path.join(os.path.dirname(double_token_trained["bidir"]), "checkpoint_last.pt")
    proc = generate(double_token_trained["data"], last, "--gen-subset", "valid", "--beam", 5, "--batch-size", 32,
                    "--scoring", "sacrebleu", "--remove-bpe", "sentencepiece")
    generated = float(re.search(r"BLEU = ([\d.]+)", proc.stdout).group(1))
    assert scores and abs(float(scores[-1]) - generated) < 0.5, (scores, generated)
    state = torch.load(double_token_trained["bidir"], map_location="cpu", weights_only=False)
    assert state["cfg"]["model"].token_order == "bidir" and state["cfg"]["model"].tokens_per_step == 2


@pytest.mark.parametrize("system, flags, message", [
    ("bidir", ["--token-order", "l2r"], "the checkpoint was trained with --token-order bidir --tokens-per-step 2"),
    ("r2l", [], "the checkpoint was trained with --token-order r2l --tokens-per-step 1"),
    ("bidir", ["--tokens-per-step", 1], "--token-order bidir needs --tokens-per-step 2"),
    ("bidir", ["--tokens-per-step", 3], "--tokens-per-step 3: must be 1 or 2"),
    ("bidir", ["--beam", 4, "--pair-candidates", 3], "--pair-candidates 3: must be at least --beam 4"),
    ("bidir", ["--sampling", "--beam", 2, "--nbest", 2], "--sampling: not supported with --tokens-per-step 2"),
    ("bidir", ["--left-candidates", -1], "--left-candidates -1: must be at least 1 (0: 2 x --beam)"),
    ("bidir:bidir", [], "--path: double-token decoding runs one model, not an ensemble"),
    ("bidir:bidir", ["--fast-step"], "--fast-step: runs one model, not an ensemble (give one --path)"),
    ("bidir", ["--fast-step-precision", "int8"],
     "--fast-step-precision: only used with --fast-step (add it, or drop --fast-step-precision)"),
    *[("r2l", ["--token-order", "r2l", "--tokens-per-step", 1, *flag],
       "--prefix-size/--constraints/--print-alignment: not supported with --token-order r2l --tokens-per-step 1")
      for flag in (["--prefix-size", 1], ["--constraints"], ["--print-alignment"])],
])
def test_mismatched_order_and_bad_flags_are_clear_errors(double_token_trained, system, flags, message):
    path = ":".join(double_token_trained[name] for name in system.split(":"))  # a:b is an ensemble
    proc = generate(double_token_trained["data"], path, *flags, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-1500:]


def test_a_model_that_is_not_a_double_token_transformer_is_refused(double_token_trained, trained):
    message = ("--path: the checkpoint holds a TransformerModel, not a double_token_transformer "
               "(train with --task double_token_translation --arch double_token_transformer*)")
    # Through fairseq-generate: refused when the task builds the model, before fairseq loads its weights (a
    # plain model's embeddings lack EOD's row: fairseq's own size-mismatch error otherwise)
    proc = generate(double_token_trained["data"], trained["checkpoint"], check=False)
    assert proc.returncode != 0 and message in proc.stderr and "size mismatch" not in proc.stderr, proc.stderr[-1500:]
    # The generator's own check, for a model built in Python
    from fairseq.models.transformer import TransformerModel
    from fairseq_plugins.baseline.model import baseline_transformer_tiny
    from fairseq_plugins.double_token.task import DoubleTokenTranslationConfig, DoubleTokenTranslationTask

    dictionary = word_dictionary()
    args = argparse.Namespace()
    baseline_transformer_tiny(args)
    plain = TransformerModel.build_model(args, DictionaryTask(dictionary)).eval()
    task = DoubleTokenTranslationTask(DoubleTokenTranslationConfig(), dictionary, dictionary)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        task.build_generator([plain], argparse.Namespace(beam=5))
    double, _, _ = random_model()  # the same call with a double-token model builds its generator
    assert isinstance(task.build_generator([double], argparse.Namespace(beam=5)), DoubleTokenGenerator)


def bench_bidir_against(double_token_trained, baseline_path, result_path, batch_size=1):
    """bench of the tiny bidir-2 system against ``baseline_path`` (beam 3, the first 10 sentences, 1 run)."""
    plugins_cli("bench", "--method", "double_token", "--path", double_token_trained["bidir"],
                "--baseline-path", baseline_path, "--data", double_token_trained["data"],
                "--threads", 1, "--runs", 1, "--beam", 3, "--limit", 10, "--json", result_path,
                "--batch-size", batch_size, "--token-order", "bidir", "--tokens-per-step", 2)
    return json.loads(result_path.read_text())


def test_bench_compares_against_another_checkpoint_in_the_same_run(double_token_trained, tmp_path):
    result = bench_bidir_against(double_token_trained, double_token_trained["l2r"], tmp_path / "dt.json")
    assert result["baseline_checkpoint"] == os.path.abspath(double_token_trained["l2r"])
    assert result["stats"]["sentences"] == 10 and result["stats"]["decoder_invocations"] > 0
    # Both decoded in natural order (reversed or folded outputs score about 0; the tiny models score ~13 here).
    assert result["bleu"] > 5 and result["baseline"]["bleu"] > 5
    # At batch 4 both sides decode the same sentences as at batch 1 (DoubleTopK batches exactly).
    batched = bench_bidir_against(double_token_trained, double_token_trained["l2r"], tmp_path / "dt4.json", 4)
    assert batched["batch_size"] == 4 and batched["stats"]["sentences"] == 10
    assert (batched["bleu"], batched["baseline"]["bleu"]) == (result["bleu"], result["baseline"]["bleu"])


def test_bench_compares_against_the_plain_transformer_whose_dictionaries_lack_eod(double_token_trained, trained,
                                                                                 tmp_path):
    """A warm-started system is measured against the transformer it changes: the baseline is loaded with its own
    task (no EOD in its dictionaries) and must score exactly as fairseq-generate scores it."""
    result = bench_bidir_against(double_token_trained, trained["checkpoint"], tmp_path / "dt-vs-transformer.json")
    stock_alone = tmp_path / "transformer.json"
    plugins_cli("bench", "--method", "baseline", "--path", trained["checkpoint"], "--data", trained["data"],
                "--threads", 1, "--runs", 1, "--beam", 3, "--limit", 10, "--json", stock_alone)
    assert result["baseline"]["bleu"] == json.loads(stock_alone.read_text())["bleu"] > 5
    assert result["bleu"] > 5
