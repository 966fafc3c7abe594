"""The step rules the methods' own generators share (common/step_rules.py), against fairseq's SequenceGenerator."""

import argparse
import math

import pytest
import torch
from conftest import DictionaryTask, random_batch, word_dictionary
from fairseq.models.transformer import TransformerModel
from fairseq.sequence_generator import SequenceGenerator

from fairseq_plugins.baseline.model import baseline_transformer_tiny
from fairseq_plugins.common.step_rules import StepRules, nan_to_minus_inf_


def biased_transformer(dictionary, bias):
    """An untrained tiny transformer whose output logits get ``bias`` ({token: added logit}), so that a rule
    (no EOS before --min-len, --unkpen, EOS forced at the maximum length) decides the output."""
    args = argparse.Namespace()
    baseline_transformer_tiny(args)
    args.dropout = 0.0
    torch.manual_seed(0)
    model = TransformerModel.build_model(args, DictionaryTask(dictionary)).eval()
    plain = model.decoder.output_layer
    offset = torch.zeros(len(dictionary))
    for token, value in bias.items():
        offset[token] = value
    model.decoder.output_layer = lambda features: plain(features) + offset
    return model


def greedy_with_rules(model, sample, rules):
    """Greedy decoding one sentence at a time, recomputing the whole prefix, with only ``rules`` applied."""
    src_tokens, src_lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
    eos = rules.eos
    max_len = rules.max_len(src_tokens.size(1), model.max_decoder_positions() - 1)
    outputs = []
    for b in range(src_tokens.size(0)):
        encoder_out = model.encoder(src_tokens[b:b + 1], src_lengths[b:b + 1])
        prefix, scores = [eos], []
        for step in range(max_len + 1):
            logits, _ = model.decoder(torch.tensor([prefix]), encoder_out=encoder_out)
            lprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
            rules.apply(lprobs, step, max_len)
            score, token = lprobs.max(dim=-1)
            prefix.append(int(token))
            scores.append(score)
            if int(token) == eos:
                break
        positional = torch.stack(scores)
        outputs.append({"tokens": prefix[1:], "positional_scores": positional, "score": rules.score(positional)})
    return outputs


CASES = {  # name: (logit bias, generation flags); every case is decided by the rule it names
    "min-len": ("eos+8", {"min_len": 4}),
    "unk-penalty": ("unk+8", {"unk_penalty": 20.0, "max_len_b": 9}),
    "no-unk-penalty": ("unk+8", {"max_len_b": 9}),
    "max-len": ("eos-20", {"max_len_a": 0.0, "max_len_b": 5}),
    "max-len-a": ("eos-20", {"max_len_a": 0.5, "max_len_b": 1}),
    "len-penalty": ("", {"len_penalty": 0.6, "max_len_b": 9}),
    "unnormalized": ("", {"normalize_scores": False, "max_len_b": 9}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rules_give_sequence_generators_greedy_outputs_and_scores(case):
    bias_spec, flags = CASES[case]
    dictionary = word_dictionary()
    bias = {}
    if bias_spec:
        symbol, value = bias_spec[:3], float(bias_spec[3:])
        bias[dictionary.eos() if symbol == "eos" else dictionary.unk()] = value
    model = biased_transformer(dictionary, bias)
    sample = random_batch(dictionary, 4, seed=1)
    rules = StepRules(dictionary, **flags)
    stock = SequenceGenerator(
        [model], dictionary, beam_size=1, min_len=rules.min_len, max_len_a=rules.max_len_a,
        max_len_b=rules.max_len_b, unk_penalty=rules.unk_penalty, normalize_scores=rules.normalize_scores,
        len_penalty=rules.len_penalty)
    with torch.no_grad():
        theirs = [hypotheses[0] for hypotheses in stock.generate([model], sample)]
        ours = greedy_with_rules(model, sample, rules)
    for mine, stock_best in zip(ours, theirs, strict=True):
        assert mine["tokens"] == stock_best["tokens"].tolist()
        torch.testing.assert_close(mine["positional_scores"], stock_best["positional_scores"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mine["score"], stock_best["score"], rtol=1e-4, atol=1e-4)
    lengths = [len(h["tokens"]) for h in ours]
    unk = dictionary.unk()
    if case == "min-len":  # EOS is the favourite at every step: the output ends at the first allowed one
        assert lengths == [5] * 4
    elif case == "unk-penalty":
        assert not any(unk in h["tokens"] for h in ours)
    elif case == "no-unk-penalty":
        assert all(unk in h["tokens"] for h in ours)
    elif case.startswith("max-len"):  # EOS is never chosen: it is forced after max_len tokens
        assert lengths == [rules.max_len(sample["net_input"]["src_tokens"].size(1), 1000) + 1] * 4


def test_per_row_positions_and_candidate_columns_give_the_same_rules():
    dictionary = word_dictionary()
    eos, pad, unk = dictionary.eos(), dictionary.pad(), dictionary.unk()
    rules = StepRules(dictionary, min_len=2, unk_penalty=1.5)
    torch.manual_seed(0)
    lprobs = torch.log_softmax(torch.randn(3, 4, len(dictionary)), dim=-1)
    index = torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6], [5, 6, 7, 8]])  # rows reach --min-len and max_len 6
    per_row = rules.apply(lprobs.clone(), index, max_len=6)
    for b in range(3):
        for i in range(4):
            alone = rules.apply(lprobs[b, i].clone(), int(index[b, i]), max_len=6)
            torch.testing.assert_close(per_row[b, i], alone)
    assert math.isinf(per_row[0, 0, eos]) and per_row[0, 2, eos] > -math.inf  # before / at --min-len
    assert per_row[2, 1].isinf().sum() == len(dictionary) - 1 and per_row[2, 1, eos] > -math.inf  # at max_len
    assert math.isinf(per_row[1, 0, pad])

    # A candidate list (columns of vocabulary ids, here with pad, unk and EOS among them) gets the same rules.
    candidates = torch.tensor([[eos, 7, unk, 9, pad, 11]])  # (1, C), one sentence
    columns = {symbol: candidates.eq(symbol).unsqueeze(1) for symbol in (pad, unk, eos)}  # (1, 1, C)
    full = torch.log_softmax(torch.randn(1, 2, len(dictionary)), dim=-1)
    for step in (0, 3, 6, 7):
        listed = rules.apply(full[:, :, candidates[0]].clone(), step, 6, columns=columns)
        expected = rules.apply(full.clone(), step, 6)[:, :, candidates[0]]
        torch.testing.assert_close(listed, expected)


def test_a_min_len_above_the_maximum_length_is_refused_as_fairseq_does():
    rules = StepRules(word_dictionary(), min_len=30, max_len_b=10)
    with pytest.raises(ValueError, match="--min-len 30 is larger than the maximum output length 10"):
        rules.max_len(src_len=5, limit=100)


def test_nan_to_minus_inf_is_sequence_generators_nan_rule():
    """The one-pass replacement of SequenceGenerator's ``lprobs[lprobs != lprobs] = -inf``: NaN becomes -inf,
    everything else (infinities included) stays, in place."""
    g = torch.Generator().manual_seed(0)
    lprobs = torch.log_softmax(torch.randn(6, 50, generator=g), dim=-1)
    lprobs[torch.rand(6, 50, generator=g) < 0.2] = float("nan")
    lprobs[0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    expected = lprobs.clone()
    expected[expected != expected] = -math.inf
    result = nan_to_minus_inf_(lprobs)
    assert result is lprobs and torch.equal(lprobs, expected) and lprobs[0, 0] == float("inf")
