"""Blockwise parallel decoding: heads, cached block decoding, exactness against stock greedy, CLI errors."""

import argparse
import json
import os
import re

import pytest
import torch
from fairseq.models.transformer import TransformerModel
from fairseq.sequence_generator import SequenceGenerator

import fairseq_plugins  # noqa: F401  (registers the plugins)
from conftest import (BLOCKWISE_HEADS, BLOCKWISE_TRAIN_FLAGS, TRAIN_THREADS, DictionaryTask, plugins_cli, random_batch,
                      run, train_flags, word_dictionary)
from fairseq_plugins.blockwise.criterion import BlockwiseLabelSmoothedCrossEntropyCriterion
from fairseq_plugins.blockwise.fast_step import FastProposalHeads
from fairseq_plugins.blockwise.generator import BlockwiseGenerator
from fairseq_plugins.blockwise.model import (
    BlockwiseTransformerModel,
    ProposalHeads,
    blockwise_transformer_tiny,
)

HEADS = BLOCKWISE_HEADS  # the trained system's; the untrained models' too


def random_model(seed=0, heads=HEADS, learned_first_head=False, std=0.3, layout="joint"):
    """An untrained tiny blockwise model with large random weights, so its outputs vary from token to token."""
    dictionary = word_dictionary()
    args = argparse.Namespace(blockwise_heads=heads, blockwise_learned_first_head=learned_first_head,
                              blockwise_head_layout=layout)
    blockwise_transformer_tiny(args)
    args.dropout = 0.0
    torch.manual_seed(seed)
    model = BlockwiseTransformerModel.build_model(args, DictionaryTask(dictionary))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=std)
    return model.eval(), dictionary


def test_proposal_heads_keep_the_base_as_head_one_and_compute_any_subset():
    heads = ProposalHeads(embed_dim=8, ffn_dim_per_head=5, num_heads=4, learned_first_head=False, dropout=0.0)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter)
    x = torch.randn(3, 2, 8)
    every = heads(x)
    assert every.shape == (3, 2, 4, 8)
    assert torch.equal(every[..., 0, :], x)
    assert torch.allclose(heads(x, [3, 1]), every[..., [3, 1], :], atol=1e-6)
    assert heads.fc2.out_features == 3 * 8 and heads.fc1.out_features == 4 * 5  # k * d_ff hidden
    learned = ProposalHeads(8, 5, 4, learned_first_head=True, dropout=0.0)
    assert learned.fc2.out_features == 4 * 8


@pytest.mark.parametrize("learned_first_head", [False, True])
def test_separate_heads_read_only_their_own_weights(learned_first_head):
    heads = ProposalHeads(embed_dim=8, ffn_dim_per_head=5, num_heads=4, learned_first_head=learned_first_head,
                          dropout=0.0, layout="separate")
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter)
    learned = 4 if learned_first_head else 3
    assert heads.fc1.out_features == learned * 5 and heads.fc2_weight.shape == (learned, 8, 5)
    x = torch.randn(3, 2, 8)
    every = heads(x)
    assert every.shape == (3, 2, 4, 8)
    assert torch.allclose(heads(x, [3, 1]), every[..., [3, 1], :], atol=1e-6)
    assert torch.allclose(heads(x, [0, 1]), every[..., :2, :], atol=1e-6)
    # Head i is its own FFN: d -> d_ff -> d, added to the state.
    i = 2 - (0 if learned_first_head else 1)
    w1, b1 = heads.fc1.weight[i * 5:(i + 1) * 5], heads.fc1.bias[i * 5:(i + 1) * 5]
    expected = x + torch.relu(x @ w1.T + b1) @ heads.fc2_weight[i].T + heads.fc2_bias[i]
    assert torch.allclose(every[..., 2, :], expected, atol=1e-5)
    # A block of 2 (p_1 and head 2) cannot depend on the weights of heads 3 and 4.
    with torch.no_grad():
        heads.fc1.weight[(i + 1) * 5:] = float("nan")
        heads.fc2_weight[i + 1:] = float("nan")
    assert torch.isfinite(heads(x, [0, 1, 2])).all()


def test_a_frozen_base_trains_its_heads_without_dropout_in_the_base():
    dictionary = word_dictionary()
    args = argparse.Namespace(blockwise_heads=HEADS, blockwise_freeze_base=True)
    blockwise_transformer_tiny(args)
    model = BlockwiseTransformerModel.build_model(args, DictionaryTask(dictionary)).train()
    assert model.decoder.proposal_heads.training and model.decoder.proposal_heads.dropout.training
    assert not model.encoder.training and not any(layer.training for layer in model.decoder.layers)
    assert not model.decoder.dropout_module.training
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith("decoder.proposal_heads.") for name in trainable)
    args.blockwise_freeze_base = False
    unfrozen = BlockwiseTransformerModel.build_model(args, DictionaryTask(dictionary)).train()
    assert unfrozen.encoder.training and all(layer.training for layer in unfrozen.decoder.layers)


@pytest.mark.parametrize("learned_first_head", [False, True])
def test_ragged_block_decoding_with_rollback_equals_the_full_forward_pass(learned_first_head):
    """Feed blocks, keep a different number of tokens per sentence, feed more: the states of the kept
    tokens equal those of one full forward pass over each sentence's kept sequence."""
    model, dictionary = random_model(learned_first_head=learned_first_head)
    decoder = model.decoder
    sample = random_batch(dictionary, bsz=3)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    g = torch.Generator().manual_seed(1)
    bsz = 3
    state = {}
    kept = [[dictionary.eos()] for _ in range(bsz)]
    kept_features = [[] for _ in range(bsz)]
    start = torch.full((bsz, 1), dictionary.eos())
    first = decoder.block_features(start, torch.zeros_like(start), encoder_out, state)
    for b in range(bsz):
        kept_features[b].append(first[b, 0])
    cached = torch.ones(bsz, dtype=torch.long)
    for accept in ([3, 1, 2], [1, 1, 1], [2, 4, 1], [4, 4, 4]):
        block = torch.randint(dictionary.nspecial, len(dictionary), (bsz, 4), generator=g)
        physical = decoder.cached_length(state)
        features = decoder.block_features(block, cached.unsqueeze(1) + torch.arange(4), encoder_out, state)
        accepted = torch.tensor(accept)
        for b, n in enumerate(accept):
            kept[b] += block[b, :n].tolist()
            kept_features[b] += list(features[b, :n])
        decoder.rollback_cache(state, cached, accepted, physical)
        cached = cached + accepted
    for b in range(bsz):
        tokens = torch.tensor([kept[b]])
        one = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([b]))
        full, _ = decoder(tokens, encoder_out=one, features_only=True)
        assert torch.allclose(torch.stack(kept_features[b]), full[0], atol=1e-5), f"sentence {b}"
        # forward() gives p_1's logits whichever way p_1 is defined
        logits, _ = decoder(tokens, encoder_out=one)
        assert torch.allclose(logits, decoder.head_logits(full, [0]).squeeze(-2), atol=1e-5)


def copying_heads(model):
    """Heads that repeat p_1's guess (zero residual)."""
    for name, parameter in model.decoder.proposal_heads.named_parameters():
        if name.startswith("fc2"):
            torch.nn.init.zeros_(parameter)


@pytest.mark.parametrize("max_len_b", [3, 25])
@pytest.mark.parametrize("heads", ["random", "copying", "separate"])
def test_exact_acceptance_equals_stock_greedy_on_a_random_model(max_len_b, heads):
    model, dictionary = random_model(layout="separate" if heads == "separate" else "joint")
    if heads == "copying":
        # Heads that repeat p_1's guess: this random model repeats one token, so whole blocks are accepted
        # and cut by the forced EOS at max_len, exercising multi-token acceptance and rollback.
        copying_heads(model)
        with torch.no_grad():  # and EOS only when forced, so outputs run to max_len
            model.decoder.embed_tokens.weight[dictionary.eos()] = 0.0
    sample = random_batch(dictionary, bsz=8)
    stock = SequenceGenerator([model], dictionary, beam_size=1, max_len_b=max_len_b)
    expected = stock.generate([model], sample)
    for block_size in (1, 2, HEADS):
        generator = BlockwiseGenerator(model, dictionary, block_size, max_len_b=max_len_b)
        for got, want in zip(generator.generate([model], sample), expected):
            assert got[0]["tokens"].tolist() == want[0]["tokens"].tolist()
            assert torch.allclose(got[0]["positional_scores"], want[0]["positional_scores"], atol=1e-4)
            assert abs(float(got[0]["score"]) - float(want[0]["score"])) < 1e-4
        stats = generator.generation_stats()
        assert stats["sentences"] == 8 and stats["tokens"] == sum(len(h[0]["tokens"]) for h in expected)
        if heads == "copying" and block_size > 1 and max_len_b > 3:
            assert stats["mean_accepted_block_size"] > block_size - 1


@pytest.mark.parametrize("layout, learned_first_head", [("joint", False), ("separate", False), ("separate", True),
                                                        ("joint", True)])
def test_fast_proposal_heads_are_the_models_heads(layout, learned_first_head):
    model, _ = random_model(layout=layout, learned_first_head=learned_first_head)
    features = torch.randn(5, model.decoder.output_embed_dim)
    for heads in (range(1), range(2), range(HEADS), [0], range(1, HEADS), [2]):
        fast = FastProposalHeads(model.decoder.proposal_heads, heads, "fp32")
        with torch.no_grad():
            expected = model.decoder.proposal_heads(features, heads)
        torch.testing.assert_close(fast(features), expected, rtol=1e-5, atol=1e-5)  # (values ~10: large weights)


@pytest.mark.parametrize("heads, settings", [
    ("random", {}), ("copying", {}), ("separate", {}), ("copying", {"proposal_vocab": 20}),
    ("separate", {"adaptive_threshold": 0.3}), ("learned p_1", {}),
])
def test_exact_acceptance_on_the_fast_step_equals_stock_greedy(heads, settings):
    """The fast step's blocks (one block_step a decoder call for the whole batch, fairseq's decoder never
    called) give stock greedy decoding's tokens and scores."""
    from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator

    model, dictionary = random_model(layout="joint" if heads in ("random", "learned p_1") else "separate",
                                     learned_first_head=heads == "learned p_1")
    if heads.startswith("copying"):
        copying_heads(model)
    with torch.no_grad():  # EOS only when forced at max_len: long outputs, many blocks
        model.decoder.embed_tokens.weight[dictionary.eos()] = 0.0
    sample = random_batch(dictionary, bsz=6)
    expected = SequenceGenerator([model], dictionary, beam_size=1, max_len_b=25).generate([model], sample)
    for block_size in (1, 3, HEADS):
        generator = FastStepBlockwiseGenerator(model, dictionary, block_size, max_len_b=25, **settings)
        blocks, block_step = [], generator.engine.block_step
        generator.engine.block_step = lambda tokens: blocks.append(tuple(tokens.shape)) or block_step(tokens)
        head_rows, proposal_heads = [], generator.proposal_heads
        generator.proposal_heads = lambda x: head_rows.append(x.size(0)) or proposal_heads(x)
        model.decoder.forward = lambda *a, **k: pytest.fail("the fast step must not call fairseq's decoder")
        for got, want in zip(generator.generate([model], sample), expected):
            assert got[0]["tokens"].tolist() == want[0]["tokens"].tolist()
            torch.testing.assert_close(got[0]["positional_scores"], want[0]["positional_scores"], rtol=0,
                                       atol=1e-4)
        del model.decoder.forward
        stats = generator.generation_stats()
        assert stats["fast_step"] and stats["sentences"] == 6 and len(blocks) == stats["decoder_invocations"]
        # heads 2..k once a call, on each sentence's last accepted position only
        assert head_rows == ([rows for rows, _m in blocks] if block_size > 1 else [])
        assert blocks[0][0] == 6 and stats["tokens"] == sum(len(h[0]["tokens"]) for h in expected)
        if heads == "copying" and block_size > 1 and not settings:
            assert stats["mean_accepted_block_size"] > block_size - 1 and max(m for _rows, m in blocks) == block_size


@pytest.mark.parametrize("staged, settings", [(False, {}), (True, {}), (True, {"min_block_size": 2, "topk": 8})],
                         ids=["one product", "staged", "staged, min block 2"])
def test_inexact_acceptance_on_the_fast_step_is_fairseqs_steps(staged, settings):
    """Where acceptance is looser than greedy's, random heads get different numbers of tokens accepted in the
    sentences of a batch: the fast step's masked caches accept, token for token, what fairseq's decoder with
    its repacked caches accepts; so does p_1 verifying position by position over the sentences still
    accepting (staged), with fewer output rows than one product over every position."""
    from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator

    model, dictionary = random_model(layout="separate")
    sample = random_batch(dictionary, bsz=8)
    # topk of half the vocabulary: about half the proposals pass, row by row (with 2 forced, 8 keeps rows apart)
    acceptance = {"acceptance": "topk", "topk": len(dictionary) // 2, **settings}
    expected = BlockwiseGenerator(model, dictionary, HEADS, max_len_b=25, **acceptance).generate([model], sample)
    generator = FastStepBlockwiseGenerator(model, dictionary, HEADS, max_len_b=25, **acceptance,
                                           staged_verification_min_sentences=1 if staged else 100)
    kept, keep_block = [], generator.engine.keep_block
    generator.engine.keep_block = lambda start, accepted: kept.append(accepted.tolist()) or keep_block(start, accepted)
    first_head_rows, first_head = [], generator.first_head
    generator.first_head = lambda x: first_head_rows.append(x.size(0)) or first_head(x)
    got = generator.generate([model], sample)
    assert [h[0]["tokens"].tolist() for h in got] == [h[0]["tokens"].tolist() for h in expected]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g[0]["positional_scores"], e[0]["positional_scores"], rtol=0, atol=1e-4)
    assert sum(len(set(accepted)) > 1 for accepted in kept) >= 3  # ragged, more than once
    stats = generator.generation_stats()
    fed = stats["block_tokens_fed"] + 8  # (and the first call's BOS)
    if staged:  # p_1 only where every proposal before was accepted: at most the tokens kept, one more a call
        assert sum(first_head_rows) <= stats["tokens"] + stats["iterations"] < fed
    else:
        assert sum(first_head_rows) == fed


def test_int8_blockwise_on_the_fast_step_is_the_fast_steps_int8_greedy():
    """With exact acceptance, int8 blockwise decoding gives what int8 greedy decoding on the same fast step
    gives: a block's positions are rows of the same int8 products, each with its own activation scale."""
    from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator
    from fairseq_plugins.kernels.sequence_generator import FastStepSequenceGenerator

    model, dictionary = random_model(layout="separate")
    copying_heads(model)
    with torch.no_grad():
        model.decoder.embed_tokens.weight[dictionary.eos()] = 0.0
    sample = random_batch(dictionary, bsz=6)
    # the base transformer (p_1 is the identity head): its weights without the heads
    base = TransformerModel.build_model(model.args if hasattr(model, "args") else model.cfg, DictionaryTask(dictionary))
    missing, unexpected = base.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".proposal_heads." in name for name in unexpected)
    greedy = FastStepSequenceGenerator([base.eval()], dictionary, precision="int8", beam_size=1, max_len_b=25)
    expected = greedy.generate([base], sample)
    generator = FastStepBlockwiseGenerator(model, dictionary, HEADS, precision="int8", max_len_b=25)
    got = generator.generate([model], sample)
    assert [h[0]["tokens"].tolist() for h in got] == [h[0]["tokens"].tolist() for h in expected]
    assert generator.generation_stats()["mean_accepted_block_size"] > 1.5


def one_sentence_samples(sample):
    """Each sentence of ``sample`` as a sample of its own, unpadded (as fairseq batches one sentence)."""
    for tokens in sample["net_input"]["src_tokens"]:
        kept = tokens[tokens.ne(1)].unsqueeze(0)  # (pad is 1 in fairseq's dictionaries)
        yield {"net_input": {"src_tokens": kept, "src_lengths": torch.tensor([kept.size(1)])}}


BLOCK_STATS = ("sentences", "tokens", "iterations", "decoder_invocations", "block_tokens_fed", "blocks_fed")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("heads", ["random", "copying", "separate", "copying separate"])
@pytest.mark.parametrize("settings", [{}, {"proposal_vocab": 20}, {"unk_penalty": 0.5, "min_len": 3},
                                      {"max_len_b": 3}], ids=["plain", "proposal vocab", "rules", "short"])
def test_one_sentence_in_one_native_call_is_the_python_loop(precision, heads, settings):
    """At batch 1 the fast step's blockwise decoding runs in one native call (fp_blockwise_search): the same
    tokens, scores and statistics (iterations, decoder passes, tokens fed) as the Python loop on the same fast
    step, and no block through the engine's Python side."""
    from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator
    from fairseq_plugins.kernels import native

    if not native.available():
        pytest.skip("the native kernels are not built here")
    model, dictionary = random_model(layout="separate" if "separate" in heads else "joint")
    if heads.startswith("copying"):
        copying_heads(model)
        with torch.no_grad():  # EOS only when forced at max_len: long outputs, whole blocks accepted
            model.decoder.embed_tokens.weight[dictionary.eos()] = 0.0
    settings = {"max_len_b": 25, **settings}
    samples = list(one_sentence_samples(random_batch(dictionary, bsz=5)))
    for block_size in (2, 3, HEADS):
        native_loop = FastStepBlockwiseGenerator(model, dictionary, block_size, precision=precision, **settings)
        python_loop = FastStepBlockwiseGenerator(model, dictionary, block_size, precision=precision, **settings)
        assert native_loop.native_heads is not None
        python_loop.native_heads = None
        native_loop.engine.block_step = lambda tokens: pytest.fail("one native call decodes the whole sentence")
        for sample in samples:
            got, = native_loop.generate([model], sample)
            want, = python_loop.generate([model], sample)
            assert got[0]["tokens"].tolist() == want[0]["tokens"].tolist()
            torch.testing.assert_close(got[0]["positional_scores"], want[0]["positional_scores"], rtol=0, atol=1e-5)
            assert abs(float(got[0]["score"]) - float(want[0]["score"])) < 1e-5
        native_stats, python_stats = native_loop.generation_stats(), python_loop.generation_stats()
        assert {name: native_stats[name] for name in BLOCK_STATS} == {name: python_stats[name] for name in BLOCK_STATS}
        if heads.startswith("copying") and settings.keys() == {"max_len_b"} and settings["max_len_b"] > 3:
            # (the heads repeat p_1's raw guess: whole blocks accepted where no rule or word list overrules it)
            assert native_stats["mean_accepted_block_size"] > 1.5


def test_one_native_call_gives_greedy_decoding_of_the_base():
    """Exact acceptance in one native call gives fairseq's greedy decoding of the base transformer (float32)."""
    from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator

    model, dictionary = random_model(layout="separate")
    copying_heads(model)
    samples = list(one_sentence_samples(random_batch(dictionary, bsz=6, seed=3)))
    stock = SequenceGenerator([model], dictionary, beam_size=1, max_len_b=25)
    generator = FastStepBlockwiseGenerator(model, dictionary, HEADS, max_len_b=25)
    for sample in samples:
        got, = generator.generate([model], sample)
        want, = stock.generate([model], sample)
        assert got[0]["tokens"].tolist() == want[0]["tokens"].tolist()
        torch.testing.assert_close(got[0]["positional_scores"], want[0]["positional_scores"], rtol=0, atol=1e-4)
    assert generator.generation_stats()["decoder_invocations"] < generator.generation_stats()["tokens"]


def count_output_projections(decoder):
    """Wrap the decoder's output projections so that each call's input shape and vocabulary are recorded."""
    calls = []
    project = decoder.project

    def counted(x, vocab=0):
        calls.append((tuple(x.shape), vocab))
        return project(x, vocab)

    decoder.project = counted
    decoder.output_layer = lambda x: pytest.fail("blockwise decoding must use decoder.project")  # noqa: E731
    return calls


@pytest.mark.parametrize("block_size", [1, 3, HEADS])
def test_one_output_projection_per_decoder_call_for_verification_and_proposals(block_size):
    model, dictionary = random_model(layout="separate")
    calls = count_output_projections(model.decoder)
    generator = BlockwiseGenerator(model, dictionary, block_size, max_len_b=25)
    generator.generate([model], random_batch(dictionary, bsz=1))
    stats = generator.generation_stats()
    assert len(calls) == stats["decoder_invocations"] > 1
    # Each call projects p_1's row and the k - 1 heads' rows at every fed position together: (1, m, k, d).
    d = model.decoder.output_embed_dim
    assert calls[0] == ((1, 1, block_size, d), 0)
    assert all(c == ((1, block_size, block_size, d), 0) for c in calls[1:])


def test_a_proposal_vocabulary_keeps_greedy_output_and_proposes_only_frequent_tokens():
    model, dictionary = random_model(layout="separate")
    copying_heads(model)  # heads repeat p_1's guess: many proposals are accepted
    with torch.no_grad():
        model.decoder.embed_tokens.weight[dictionary.eos()] = 0.0
    sample = random_batch(dictionary, bsz=4)
    expected = SequenceGenerator([model], dictionary, beam_size=1, max_len_b=25).generate([model], sample)
    vocab = len(dictionary) // 2
    calls = count_output_projections(model.decoder)
    generator = BlockwiseGenerator(model, dictionary, HEADS, max_len_b=25, proposal_vocab=vocab)
    for got, want in zip(generator.generate([model], sample), expected):
        assert got[0]["tokens"].tolist() == want[0]["tokens"].tolist()
    # Per call: p_1's rows over the whole vocabulary once, the heads' rows over the first `vocab` entries.
    assert [v for _shape, v in calls] == [0, vocab] * generator.generation_stats()["decoder_invocations"]
    proposed = []
    original = generator._proposals
    generator._proposals = lambda logits: proposed.append(original(logits)[0]) or original(logits)
    generator.generate([model], sample)
    assert proposed and all(int(p.max()) < vocab for p in proposed)
    accepted_all = generator.generation_stats()["mean_accepted_block_size"]
    assert accepted_all > 1.0


@pytest.mark.parametrize("layout", ["joint", "separate"])
def test_adaptive_block_size_keeps_greedy_output_and_feeds_fewer_tokens(layout):
    model, dictionary = random_model(layout=layout)
    with torch.no_grad():  # EOS only when forced at max_len: long outputs
        model.decoder.embed_tokens.weight[dictionary.eos()] = 0.0
    sample = random_batch(dictionary, bsz=8)
    expected = SequenceGenerator([model], dictionary, beam_size=1, max_len_b=25).generate([model], sample)
    fed = {}
    thresholds = (0.0, 1e-12, 0.3, 0.99, 0.9999)
    for threshold in thresholds:
        generator = BlockwiseGenerator(model, dictionary, HEADS, max_len_b=25, adaptive_threshold=threshold)
        for got, want in zip(generator.generate([model], sample), expected):
            assert got[0]["tokens"].tolist() == want[0]["tokens"].tolist()
            assert torch.allclose(got[0]["positional_scores"], want[0]["positional_scores"], atol=1e-4)
        stats = generator.generation_stats()
        fed[threshold] = stats["mean_block_fed"]
    assert fed[0.0] == fed[1e-12] == HEADS  # every head clears a threshold of ~0
    # A higher threshold never feeds more; the strictest cuts blocks to p_1's token alone here.
    assert all(fed[a] >= fed[b] for a, b in zip(thresholds, thresholds[1:]))
    assert fed[0.9999] == 1.0


def test_min_block_size_and_approximate_acceptance_accept_more_per_iteration():
    model, dictionary = random_model()
    with torch.no_grad():  # EOS only when forced at max_len: long outputs
        model.decoder.embed_tokens.weight[dictionary.eos()] = 0.0
    sample = random_batch(dictionary, bsz=8)
    sizes = {}
    for name, kwargs in {"exact": {}, "min2": {"min_block_size": 2}, "topk": {"acceptance": "topk", "topk": 30},
                         "distance": {"acceptance": "distance", "distance": 1e9}}.items():
        generator = BlockwiseGenerator(model, dictionary, HEADS, max_len_b=25, **kwargs)
        hypotheses = generator.generate([model], sample)
        assert all(h[0]["tokens"][-1] == dictionary.eos() for h in hypotheses)
        assert all(len(h[0]["tokens"]) <= 26 for h in hypotheses)
        sizes[name] = generator.generation_stats()["mean_accepted_block_size"]
    assert sizes["min2"] > sizes["exact"]
    # Accepting everything the constraints allow: every iteration takes the whole block (but the last).
    assert sizes["topk"] > 3.0 and sizes["distance"] > 3.0


@pytest.mark.parametrize("vocab", [0, 8], ids=["whole vocabulary", "proposal vocabulary"])
def test_criterion_scores_each_head_against_the_target_shifted_by_its_offset(vocab):
    """Head i at position j is scored against target j + i - 1. With --blockwise-proposal-vocab N, heads 2..k's
    softmax runs over the first N tokens; a target outside them has no loss and counts as a miss; p_1 keeps the
    whole vocabulary. Training a frozen base with p_1 the identity skips p_1 (nothing to train)."""
    model, dictionary = random_model(std=0.05)
    criterion = BlockwiseLabelSmoothedCrossEntropyCriterion(DictionaryTask(dictionary), False, 0.0,
                                                            blockwise_proposal_vocab=vocab)
    target = torch.tensor([[5, 6, 9, 8, 2], [9, 10, 2, 1, 1]])  # 9 and 10: outside a proposal vocabulary of 8
    prev = torch.tensor([[2, 5, 6, 9, 8], [2, 9, 10, 2, 1]])
    sample = {"net_input": {**random_batch(dictionary, bsz=2)["net_input"], "prev_output_tokens": prev},
              "target": target, "ntokens": 8}
    loss, _, logs = criterion(model, sample)
    features, _ = model(**sample["net_input"], features_only=True)
    expected = 0.0
    for head in range(HEADS):
        restricted = vocab and head > 0
        logits = model.decoder.head_logits(features, [head]).squeeze(-2)
        lprobs = torch.log_softmax(logits[..., :vocab] if restricted else logits, -1)
        nll, count, correct = 0.0, 0, 0
        for b in range(2):
            for j in range(5):
                if j + head < 5 and target[b, j + head] != dictionary.pad():
                    wanted = int(target[b, j + head])
                    count += 1
                    correct += int(lprobs[b, j].argmax()) == wanted
                    if not restricted or wanted < vocab:
                        nll -= lprobs[b, j, wanted]
        assert logs[f"head{head + 1}_total"] == count and logs[f"head{head + 1}_n_correct"] == correct
        assert torch.allclose(logs[f"head{head + 1}_nll_loss"], torch.as_tensor(nll), atol=1e-4), head
        expected = expected + nll
    assert torch.allclose(loss, expected / HEADS, atol=1e-4)
    model.train()
    for name, parameter in model.named_parameters():
        parameter.requires_grad = ".proposal_heads." in name
    _, _, logs = criterion(model, sample)
    assert "head1_total" not in logs and logs["all_proposal_heads"] == 1 and f"head{HEADS}_total" in logs
    with pytest.raises(ValueError, match="--blockwise-proposal-vocab 100000: must be 0"):
        BlockwiseLabelSmoothedCrossEntropyCriterion(DictionaryTask(dictionary), False, 0.0,
                                                    blockwise_proposal_vocab=100000)


# --- through fairseq-train and fairseq-generate -------------------------------------------------------------

@pytest.fixture(scope="module")
def blockwise_trained(trained, blockwise_system):
    """The tiny baseline and its proposal heads (conftest.blockwise_system, trained once a session)."""
    return {**trained, "blockwise": blockwise_system["checkpoint"]}


def generate(data, checkpoint, *flags, check=True):
    return run("fairseq_cli.generate", os.path.join(data, "bin"), "--user-dir", fairseq_plugins.__path__[0],
               "--path", checkpoint, "--gen-subset", "test", "--beam", 1, *flags, check=check)


def hypotheses(output):
    lines = sorted(line.split("\t") for line in output.splitlines() if line.startswith("H-"))
    return [(head, text) for head, _score, text in lines], [float(score) for _head, score, _text in lines]


@pytest.mark.parametrize("batch_size", [1, 16])
def test_exact_blockwise_generate_is_stock_greedy_on_every_sentence(blockwise_trained, batch_size):
    data = blockwise_trained["data"]
    stock = generate(data, blockwise_trained["checkpoint"], "--task", "translation", "--batch-size", batch_size)
    ours = generate(data, blockwise_trained["blockwise"], "--task", "blockwise_translation",
                    "--batch-size", batch_size)
    (stock_hyps, stock_scores), (our_hyps, our_scores) = hypotheses(stock.stdout), hypotheses(ours.stdout)
    assert len(our_hyps) == 40 and our_hyps == stock_hyps
    assert max(abs(a - b) for a, b in zip(stock_scores, our_scores)) < 1e-3
    summary = re.search(r"mean accepted block size ([\d.]+), (\d+) decoder invocations", ours.stderr)
    assert summary, ours.stderr[-2000:]
    # Trained heads make blocks longer than one token; fewer calls than tokens.
    assert float(summary.group(1)) > 1.2


@pytest.mark.parametrize("batch_size", [1, 16])
def test_blockwise_on_the_fast_step_through_fairseq_generate(blockwise_trained, batch_size):
    data = blockwise_trained["data"]
    stock = generate(data, blockwise_trained["checkpoint"], "--task", "translation", "--batch-size", batch_size)
    fast = generate(data, blockwise_trained["blockwise"], "--task", "blockwise_translation", "--fast-step",
                    "--batch-size", batch_size)
    (stock_hyps, stock_scores), (fast_hyps, fast_scores) = hypotheses(stock.stdout), hypotheses(fast.stdout)
    assert len(fast_hyps) == 40 and fast_hyps == stock_hyps
    assert max(abs(a - b) for a, b in zip(stock_scores, fast_scores)) < 1e-3
    int8 = generate(data, blockwise_trained["blockwise"], "--task", "blockwise_translation", "--fast-step",
                    "--fast-step-precision", "int8", "--block-proposal-vocab", 20, "--batch-size", batch_size)
    int8_hyps = hypotheses(int8.stdout)[0]
    assert len(int8_hyps) == 40 and sum(a == b for a, b in zip(int8_hyps, stock_hyps)) >= 30  # int8 rounding
    assert "mean accepted block size" in int8.stderr


def test_a_learned_first_head_trains_and_decodes_exactly_through_fairseq_generate(blockwise_trained, tmp_path):
    """--blockwise-learned-first-head end to end: fairseq-train gives p_1 a head of its own on the frozen base,
    so the checkpoint's greedy output is no longer the base's; exact blockwise decoding (plain and on the fast
    step) through fairseq-generate is stock greedy on that checkpoint, sentence by sentence."""
    data = blockwise_trained["data"]
    run("fairseq_cli.train", os.path.join(data, "bin"), *BLOCKWISE_TRAIN_FLAGS, "--blockwise-heads", HEADS,
        "--blockwise-learned-first-head", "--blockwise-base-checkpoint", blockwise_trained["checkpoint"],
        "--blockwise-freeze-base", "--blockwise-head-layout", "separate", "--max-epoch", 2,
        "--save-dir", tmp_path, "--no-epoch-checkpoints", env={"OMP_NUM_THREADS": TRAIN_THREADS})
    checkpoint = str(tmp_path / "checkpoint_last.pt")
    base = hypotheses(generate(data, blockwise_trained["checkpoint"], "--task", "translation").stdout)
    stock_hyps, stock_scores = hypotheses(generate(data, checkpoint, "--task", "translation").stdout)
    assert len(stock_hyps) == 40 and (stock_hyps, stock_scores) != base  # p_1 is the learned head, not the base
    for extra in ((), ("--fast-step",)):
        ours = generate(data, checkpoint, "--task", "blockwise_translation", "--batch-size", 16, *extra)
        our_hyps, our_scores = hypotheses(ours.stdout)
        assert our_hyps == stock_hyps, extra
        assert max(abs(a - b) for a, b in zip(stock_scores, our_scores, strict=True)) < 1e-3
        assert "mean accepted block size" in ours.stderr


def test_blockwise_checkpoint_still_decodes_with_stock_beam_search(blockwise_trained):
    base = generate(blockwise_trained["data"], blockwise_trained["checkpoint"], "--task", "translation",
                    "--beam", 4)
    ours = generate(blockwise_trained["data"], blockwise_trained["blockwise"], "--task", "translation",
                    "--beam", 4)
    assert hypotheses(ours.stdout)[0] == hypotheses(base.stdout)[0]  # frozen base, p_1 = identity


def test_fine_tuning_trains_p1_every_batch_and_pulls_it_to_the_teacher(blockwise_trained):
    from fairseq import checkpoint_utils

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([blockwise_trained["blockwise"]])
    model = models[0]
    dictionary = task.target_dictionary
    target = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 1, 1]])
    prev = torch.tensor([[2, 5, 6, 7, 8], [2, 9, 10, 2, 1]])
    sample = {"net_input": {**random_batch(dictionary, bsz=2)["net_input"], "prev_output_tokens": prev},
              "target": target, "ntokens": 8}
    criterion = BlockwiseLabelSmoothedCrossEntropyCriterion(
        task, False, 0.0, blockwise_loss="sample", blockwise_teacher_checkpoint=blockwise_trained["checkpoint"],
        blockwise_teacher_weight=2.0)
    model.train()
    for parameter in model.parameters():  # fine-tuning: the base is trainable, so p_1 can change
        parameter.requires_grad = True
    model.freeze_base = False
    for _ in range(5):  # p_1 (head 0) and one proposal head, every batch
        heads = criterion.heads_to_train(model)
        assert heads[0] == 0 and len(heads) == 2 and 1 <= heads[1] < HEADS
    model.eval()
    # The teacher is the base the heads were trained on: p_1 = identity of it, so the KL is 0.
    _, _, logs = criterion(model, sample)
    assert abs(float(logs["teacher_kl"])) < 1e-4
    with torch.no_grad():  # move the student's p_1 away from the teacher
        model.decoder.layers[-1].fc2.bias.add_(torch.randn_like(model.decoder.layers[-1].fc2.bias))
    loss, _, logs = criterion(model, sample)
    student = torch.log_softmax(model(**sample["net_input"])[0], -1)
    teacher = torch.log_softmax(criterion._teacher[0](**sample["net_input"])[0], -1)
    mask = target.ne(dictionary.pad())
    expected = (teacher.exp() * (teacher - student)).sum(-1).masked_select(mask).sum()
    assert float(logs["teacher_kl"]) > 0.01 and torch.allclose(logs["teacher_kl"], expected, atol=1e-4)
    no_teacher = BlockwiseLabelSmoothedCrossEntropyCriterion(task, False, 0.0)
    plain, _, _ = no_teacher(model, sample)
    assert torch.allclose(loss, plain + 2.0 * expected, atol=1e-3)  # the KL is not divided by the head count
    assert trainable_parameters(criterion) == 0  # the teacher is neither trained nor saved


def trainable_parameters(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("which, flags, message", [
    ("blockwise", ["--block-size", 5], "--block-size 5: the model has 4 proposal heads"),
    ("blockwise", ["--block-acceptance", "topk", "--block-topk", 0], "--block-topk 0: must be at least 1"),
    ("blockwise", ["--min-block-size", 9], "--min-block-size 9: must be 1..4"),
    ("blockwise", ["--block-adaptive-threshold", 1.5], "--block-adaptive-threshold 1.5: must be in (0, 1)"),
    ("blockwise", ["--block-proposal-vocab", 100000],
     "--block-proposal-vocab 100000: must be 0 (the whole vocabulary) or 5.."),
    ("blockwise", ["--beam", 5], "--beam (blockwise decoding is greedy"),
    ("blockwise", ["--fast-step-precision", "int8"], "--fast-step-precision: only used with --fast-step"),
    ("checkpoint", [], "--path: the checkpoint holds a TransformerModel, not a blockwise_transformer"),
])
def test_bad_flags_and_checkpoints_are_clear_errors(blockwise_trained, which, flags, message):
    checkpoint = blockwise_trained["blockwise" if which == "blockwise" else "checkpoint"]
    proc = generate(blockwise_trained["data"], checkpoint, "--task", "blockwise_translation", *flags, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-1500:]


def test_warm_start_from_a_missing_or_mismatched_checkpoint_is_a_clear_error(trained, tmp_path):
    # 256-d: the tiny base does not fit
    flags = train_flags("blockwise_translation", "blockwise_transformer_multi30k",
                        criterion="blockwise_label_smoothed_cross_entropy")
    for base, message in ((trained["checkpoint"], "not a model this one can start from"),
                          (str(tmp_path / "none.pt"), "none.pt: no such file")):
        proc = run("fairseq_cli.train", os.path.join(trained["data"], "bin"), *flags, "--max-epoch", 1,
                   "--blockwise-base-checkpoint", base, "--save-dir", tmp_path, check=False)
        assert proc.returncode != 0 and f"--blockwise-base-checkpoint {base}" in proc.stderr
        assert message in proc.stderr


def test_bench_reports_block_statistics_and_identity(blockwise_trained, tmp_path):
    result_path = tmp_path / "bw.json"
    plugins_cli("bench", "--method", "blockwise", "--path", blockwise_trained["blockwise"],
                "--data", blockwise_trained["data"], "--threads", 1, "--runs", 1, "--beam", 1,
                "--limit", 20, "--json", result_path, "--block-size", 3)
    result = json.loads(result_path.read_text())
    assert result["stats"]["block_size"] == 3 and result["stats"]["sentences"] == 20
    assert result["stats"]["mean_accepted_block_size"] >= 1.0
    assert result["stats"]["outputs_identical_to_baseline"] == 1.0  # share of sentences
    # One call against one greedy step, timed on the same cached prefixes (10 sentences).
    stats = result["stats"]
    assert stats["call_cost_samples"] == 10 and stats["call_ms"] > 0 and stats["greedy_step_ms"] > 0
    assert stats["call_cost_batch_size"] == 1
    assert stats["call_cost_step"] == "fairseq"  # both timed on fairseq's decoder
    low, high = stats["call_cost_range"]
    assert 0 < low <= stats["call_cost_vs_greedy_step"] <= high


def test_bench_at_batch_8_decodes_what_stock_greedy_decodes_at_batch_8(blockwise_trained, tmp_path):
    result_path = tmp_path / "bw8.json"
    plugins_cli("bench", "--method", "blockwise", "--path", blockwise_trained["blockwise"],
                "--data", blockwise_trained["data"], "--threads", 1, "--runs", 1, "--beam", 1, "--batch-size", 8,
                "--limit", 24, "--json", result_path, "--block-size", 3)
    result = json.loads(result_path.read_text())
    assert result["batch_size"] == 8 and result["stats"]["sentences"] == 24
    assert result["stats"]["outputs_identical_to_baseline"] == 1.0 and result["bleu"] == result["baseline"]["bleu"]


@pytest.mark.parametrize("fast_step", [False, True], ids=["fairseq's step", "fast step"])
def test_call_cost_is_timed_on_every_row_of_a_batch(fast_step):
    """step_cost_figures times a call and a greedy step on every sentence of a batch (the bench passes batches
    of its --batch-size), on the step the generator decodes with, and leaves no statistics behind."""
    from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator

    model, dictionary = random_model(layout="separate")
    sample = random_batch(dictionary, bsz=20)
    sample["net_input"]["prev_output_tokens"] = torch.randint(dictionary.nspecial, len(dictionary), (20, 9))
    cls = FastStepBlockwiseGenerator if fast_step else BlockwiseGenerator
    generator = cls(model, dictionary, 3, max_len_b=25)
    rows = []
    block_features = generator._block_features
    generator._block_features = lambda block, *a: rows.append(tuple(block.shape)) or block_features(block, *a)
    if fast_step:
        first_head_rows, first_head = [], generator.first_head
        generator.first_head = lambda x: first_head_rows.append(x.size(0)) or first_head(x)
    figures = generator.step_cost_figures([sample], repeats=2)
    assert figures["call_cost_batch_size"] == 20 and figures["call_cost_samples"] == 1
    assert figures["call_cost_step"] == ("fast step" if fast_step else "fairseq")
    assert rows == [(20, 8)] + [(20, 3)] * 3  # the cached prefix, then a warm-up and 2 timed calls
    if fast_step:  # every position verified, in one product, when timed (not staged: 20 sentences)
        assert figures["call_cost_staged_verification"] is False and first_head_rows == [60] * 3
        assert generator.staged_verification_min_sentences == 16
    assert generator.generation_stats()["iterations"] == 0 and generator.generation_stats()["decoder_invocations"] == 0
