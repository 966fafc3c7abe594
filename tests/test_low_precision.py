"""bfloat16 decoding on the CPU, so that dtype bugs of the half-precision paths show up without a GPU: every
method's generator decodes a tiny random model cast to bfloat16 without a dtype error, its outputs are well
formed (each ends with EOS, within the maximum length, finite log-probabilities, the score their normalised
sum), and its positional scores are the model's own: the log-probabilities that the full forward pass of the
same bfloat16 weights (computed in float32) gives the output's tokens, to bfloat16's precision.
"""

import copy
import math

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

import fairseq_plugins  # noqa: F401  (registers the plugins)
from conftest import decode_on, random_batch, word_dictionary
from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator
from fairseq_plugins.blockwise.generator import BlockwiseGenerator
from fairseq_plugins.double_token.folding import fold
from fairseq_plugins.double_token.generator import DoubleTokenGenerator
from fairseq_plugins.fast_step.generator import FastStepEarlyStoppingGenerator
from fairseq_plugins.kernels.decoder_step import FastDecoderStep
from fairseq_plugins.kernels.sequence_generator import FastStepSequenceGenerator
from fairseq_plugins.kernels.static_step import StaticDecoderStep
from fairseq_plugins.lattice.generator import LatticeGenerator
from fairseq_plugins.rnn_fc.generator import RnnFcGenerator
from fairseq_plugins.rnn_fc.steppers import SPEEDUPS
from test_blockwise import HEADS
from test_blockwise import random_model as random_blockwise_model
from test_bytenet import _random_batch, build
from test_double_token import natural_order
from test_double_token import random_model as random_double_token_model
from test_fast_step import random_transformer
from test_lattice import tiny_model as tiny_lattice_model
from test_lattice import tiny_table
from test_rnn_fc import tiny_model as tiny_rnn_fc_model

BF16 = torch.bfloat16
MAX_LEN = 12  # --max-len-b of every decoding here
# A positional score of a bfloat16 decoding against the float32 forward pass of the same weights: bfloat16
# keeps 8 bits of mantissa (activations and logits carry relative errors of about 0.4%); at most 0.02 measured
# on these models, 0.1 allowed.
BF16_SCORES = 0.1


def decode_in_bfloat16(make_generator, model, sample):
    return decode_on(torch.device("cpu"), make_generator, model, sample, dtype=BF16)


def assert_well_formed(hypotheses, dictionary, sentences, never=()):
    """Every sentence has hypotheses; each ends with its only EOS within MAX_LEN + 1 tokens, holds no padding
    (nor a token of ``never``), and has finite log-probabilities as positional scores, one a token, whose mean
    is its score (fairseq's normalisation, --lenpen 1)."""
    eos, pad = dictionary.eos(), dictionary.pad()
    assert len(hypotheses) == sentences
    for sentence, hypos in enumerate(hypotheses):
        assert hypos, sentence
        for h in hypos:
            tokens, positional = h["tokens"], h["positional_scores"]
            assert tokens[-1] == eos and eos not in tokens[:-1] and len(tokens) <= MAX_LEN + 1, (sentence, tokens)
            assert pad not in tokens and not set(tokens) & set(never) and max(tokens) < len(dictionary), tokens
            assert positional.is_floating_point() and positional.shape == (len(tokens),)
            assert torch.isfinite(positional).all() and (positional <= 0).all(), positional
            assert math.isfinite(h["score"])
            assert h["score"] == pytest.approx(float(positional.double().sum()) / len(tokens), abs=1e-4)


def forward_lprobs(model, net_input, sentence, prev):
    """log-softmax (float32) of ``model``'s full forward pass for sentence ``sentence`` of ``net_input`` (alone,
    its left padding stripped) given the target inputs ``prev`` (1-D)."""
    length = net_input["src_lengths"][sentence:sentence + 1]
    source = net_input["src_tokens"][sentence:sentence + 1, net_input["src_tokens"].size(1) - int(length):]
    with torch.no_grad():
        encoder_out = model.encoder(source, length)
        logits, _ = model.decoder(prev.unsqueeze(0), encoder_out=encoder_out)
    return torch.log_softmax(logits.float(), dim=-1)[0]


def float32_of(model):
    """The model's bfloat16 weights, exactly, in a float32 model."""
    return copy.deepcopy(model).to(BF16).float().eval()


def assert_scores_are_the_models(hypotheses, model, sample, eos):
    """Each hypothesis' positional scores are the log-probabilities of its tokens (EOS last) under the full
    forward pass of the bfloat16 weights in float32, each token after EOS and the tokens before it."""
    reference = float32_of(model)
    for sentence, hypos in enumerate(hypotheses):
        for h in hypos:
            tokens = torch.tensor(h["tokens"])
            prev = torch.cat([tokens.new_tensor([eos]), tokens[:-1]])
            expected = forward_lprobs(reference, sample["net_input"], sentence, prev)
            expected = expected.gather(1, tokens.unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(h["positional_scores"].float(), expected, rtol=0, atol=BF16_SCORES)


# --- the baseline transformer and the fast step --------------------------------------------------------------

@pytest.mark.parametrize("search", [
    lambda m, d: SequenceGenerator([m], d, beam_size=4, max_len_b=MAX_LEN),
    lambda m, d: RnnFcGenerator([m], d, beam=4, max_len_b=MAX_LEN),  # rnn_fc's search over any fairseq model
], ids=["fairseq's beam search", "rnn_fc's search"])
def test_beam_search_decodes_a_bfloat16_transformer(search):
    """The baseline transformer in bfloat16, through fairseq's generator and through rnn_fc's generic search."""
    dictionary = word_dictionary()
    model, sample = random_transformer(dictionary), random_batch(dictionary, bsz=4)
    hypotheses = decode_in_bfloat16(lambda m: search(m, dictionary), model, sample)
    assert_well_formed(hypotheses, dictionary, 4)
    assert_scores_are_the_models(hypotheses, model, sample, dictionary.eos())


FAST_STEP_GENERATORS = {
    "greedy": lambda m, d: FastStepSequenceGenerator([m], d, beam_size=1, max_len_b=MAX_LEN),
    "beam 4": lambda m, d: FastStepSequenceGenerator([m], d, beam_size=4, max_len_b=MAX_LEN),
    "beam 4, early stopping": lambda m, d: FastStepEarlyStoppingGenerator([m], d, beam=4, max_len_b=MAX_LEN,
                                                                          nbest=4),
}


@pytest.mark.parametrize("search", sorted(FAST_STEP_GENERATORS))
def test_fp32_fast_step_decodes_a_bfloat16_transformer_in_bfloat16(search):
    """--fast-step (fp32: float matrices, not int8) takes a bfloat16 model: its engine runs the layers as torch
    operations in the model's dtype (the native kernels read float32 only), its caches in that dtype too."""
    dictionary = word_dictionary()
    model, sample = random_transformer(dictionary), random_batch(dictionary, bsz=4)
    hypotheses = decode_in_bfloat16(lambda m: FAST_STEP_GENERATORS[search](m, dictionary), model, sample)
    assert_well_formed(hypotheses, dictionary, 4)
    assert_scores_are_the_models(hypotheses, model, sample, dictionary.eos())


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("static", [False, True], ids=["fast step", "static step"])
def test_the_fast_steps_of_a_half_precision_model_compute_in_its_dtype(dtype, static):
    """A model cast to bfloat16 or float16 (what fairseq's --fp16 does): the fast step's and the static step's
    (issue 57) weights, caches and logits are in that dtype, no float32 copy in between (the native kernels,
    float32 only, are not used)."""
    dictionary = word_dictionary()
    model, sample = random_transformer(dictionary).to(dtype), random_batch(dictionary, bsz=3)
    engine = FastDecoderStep(model.decoder)
    assert engine.native_layers is None
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        step = StaticDecoderStep(engine) if static else engine
        step.start(encoder_out, max_steps=4)
        tokens = torch.full((3,), dictionary.eos())
        logits = step.step(tokens) if static else engine.logits(engine.step(tokens))
    caches = step.buffers if static else engine
    weights = [engine.embed_tokens, engine.output.weight] + [matrix.weight for layer in engine.layers for matrix in (
        layer.qkv, layer.self_out, layer.cross_q, layer.cross_k, layer.cross_v, layer.cross_out, layer.fc1, layer.fc2)]
    assert {w.dtype for w in weights} == {dtype}
    assert {c.dtype for c in caches.keys + caches.values + caches.cross_keys + caches.cross_values} == {dtype}
    assert logits.dtype == dtype and logits.shape == (3, len(dictionary))


# --- the methods -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", [BlockwiseGenerator, FastStepBlockwiseGenerator],
                         ids=["fairseq's decoder", "the fast step"])
def test_blockwise_decodes_a_bfloat16_model(method):
    """Blocks of 4 verified and rolled back in bfloat16; the scores are p_1's (the model's forward pass)."""
    model, dictionary = random_blockwise_model(layout="separate")
    sample = random_batch(dictionary, bsz=4)
    hypotheses = decode_in_bfloat16(lambda m: method(m, dictionary, HEADS, max_len_b=MAX_LEN), model, sample)
    assert_well_formed(hypotheses, dictionary, 4)
    assert_scores_are_the_models(hypotheses, model, sample, dictionary.eos())


def test_double_token_decodes_a_bfloat16_model():
    """Pairs decoded in bfloat16; each natural-order positional score is its slot's log-probability under the
    forward pass over the output's folded pairs (the EOS's: its EOD slots' sum)."""
    model, dictionary, eod = random_double_token_model("bidir", 2)
    sample = random_batch(dictionary, bsz=4)
    # (at most MAX_LEN - 1 tokens: an odd length, whose last pair is its middle token and EOD)
    hypotheses = decode_in_bfloat16(
        lambda m: DoubleTokenGenerator(m, dictionary, eod, "bidir", beam_size=3, max_len_b=MAX_LEN - 1), model,
        sample)
    assert_well_formed(hypotheses, dictionary, 4, never=[eod])
    reference, eos = float32_of(model), dictionary.eos()
    for sentence, hypos in enumerate(hypotheses):
        for h in hypos:
            # The generator ends a pair with EOD in the first slot only with EOD in the second: fold's layout
            folded = torch.tensor(fold(h["tokens"][:-1], "bidir", 2, eod))
            prev = torch.cat([folded.new_tensor([eos, eos]), folded[:-2]])
            slots = forward_lprobs(reference, sample["net_input"], sentence, prev)
            slots = slots.gather(1, folded.unsqueeze(1)).squeeze(1).tolist()
            pairs = [list(zip(folded.tolist(), slots))[i:i + 2] for i in range(0, len(slots), 2)]
            kept = natural_order(pairs, "bidir", eod)
            assert [token for token, _ in kept] == h["tokens"][:-1]
            eod_scores = sum(score for token, score in zip(folded.tolist(), slots) if token == eod)
            expected = torch.tensor([score for _, score in kept] + [eod_scores])
            torch.testing.assert_close(h["positional_scores"].float(), expected, rtol=0, atol=BF16_SCORES)


@pytest.mark.parametrize("order, normalization", [(1, "lattice"), (2, "vocab")])
def test_lattice_decodes_a_bfloat16_scorer(order, normalization):
    """The lattice scored in bfloat16 and searched by Viterbi; with --lattice-normalize vocab the scores are the
    scorer's forward pass (over the lattice's candidates they are normalised otherwise)."""
    model, dictionary = tiny_lattice_model(order, layers=2)
    table, sample = tiny_table(dictionary), random_batch(dictionary, 4, seed=6)
    hypotheses = decode_in_bfloat16(
        lambda m: LatticeGenerator([m], dictionary, table, k=6, normalization=normalization, nbest=3,
                                   max_len_b=MAX_LEN), model, sample)
    assert_well_formed(hypotheses, dictionary, 4)
    if normalization == "vocab":
        assert_scores_are_the_models(hypotheses, model, sample, dictionary.eos())


@pytest.mark.parametrize("top, speedups", [("tanh", SPEEDUPS), ("gru", SPEEDUPS), ("gru", ())],
                         ids=["tanh, every speedup", "gru, every speedup", "gru, plain"])
def test_rnn_fc_fp32_path_decodes_a_bfloat16_model(top, speedups):
    dictionary = word_dictionary()
    model, sample = tiny_rnn_fc_model(dictionary, top), random_batch(dictionary, bsz=4, seed=3)
    hypotheses = decode_in_bfloat16(
        lambda m: RnnFcGenerator([m], dictionary, beam=4, speedups=speedups, max_len_b=MAX_LEN, nbest=2),
        model, sample)
    assert_well_formed(hypotheses, dictionary, 4)
    assert_scores_are_the_models(hypotheses, model, sample, dictionary.eos())


@pytest.mark.parametrize("decoding", ["cached", "recompute"])
def test_bytenet_decodes_a_bfloat16_model(decoding):
    """ByteNet's cached convolution frames (or the whole prefix recomputed each step) in bfloat16."""
    model = build("bytenet_tiny").float()
    dictionary = model.decoder.dictionary
    source, lengths, _ = _random_batch(dictionary, 4, 9, 2)
    sample = {"net_input": {"src_tokens": source, "src_lengths": lengths}}

    def stock(m):
        generator = SequenceGenerator([m], dictionary, beam_size=4, max_len_b=MAX_LEN)
        generator.model.has_incremental = decoding == "cached"
        return generator

    hypotheses = decode_in_bfloat16(stock, model, sample)
    assert_well_formed(hypotheses, dictionary, 4)
    assert_scores_are_the_models(hypotheses, model, sample, dictionary.eos())


def test_the_int8_paths_refuse_a_bfloat16_model_by_flag():
    """int8 quantizes float32 weights: a bfloat16 model is refused by the flag's name, not a dtype error inside."""
    import argparse

    from fairseq_plugins.common.textio import InputError
    from test_cuda import build_rnn_fc_int8_generator, fast_step_task

    message = r"int8: quantizes a float32 model, this one is torch.bfloat16 \(drop --fp16/--bf16\)$"
    with pytest.raises(InputError, match="^--rnn-fc-precision " + message):
        build_rnn_fc_int8_generator(torch.bfloat16)
    task, dictionary = fast_step_task(fast_step=True, fast_step_precision="int8")
    with pytest.raises(InputError, match="^--fast-step-precision " + message):
        task.build_generator([random_transformer(dictionary).to(torch.bfloat16)], argparse.Namespace(beam=4))
