"""Every method on a CUDA device, with tiny random models: incremental decoding equals the full forward pass,
each generator gives on the GPU what it gives on the CPU (or what its reference gives on the same device), and
the CPU-only int8 paths refuse a GPU model with their message.

Marked ``cuda``: where torch sees no CUDA device they are skipped with the reason (conftest.py). Each check is
a function of the device, so that the same code runs on the CPU (see ``decode_on``).
"""

import argparse

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

import fairseq_plugins  # noqa: F401  (registers the plugins)
from conftest import assert_same_hypotheses, decode_on, incremental_and_full, on_device, random_batch, word_dictionary
from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator
from fairseq_plugins.blockwise.generator import BlockwiseGenerator
from fairseq_plugins.common.textio import InputError
from fairseq_plugins.double_token.generator import DoubleTokenGenerator
from fairseq_plugins.fast_step.task import FastStepTranslationConfig, FastStepTranslationTask
from fairseq_plugins.lattice.generator import LatticeGenerator
from fairseq_plugins.rnn_fc.generator import RnnFcGenerator
from fairseq_plugins.rnn_fc.steppers import SPEEDUPS
from fairseq_plugins.rnn_fc.task import RnnFcTranslationConfig, RnnFcTranslationTask
from test_blockwise import HEADS, copying_heads
from test_blockwise import random_model as random_blockwise_model
from test_bytenet import _decode_full, _decode_incremental, _random_batch, build
from test_double_token import random_model as random_double_token_model
from test_fast_step import random_transformer
from test_lattice import tiny_model as tiny_lattice_model
from test_lattice import tiny_table
from test_rnn_fc import tiny_model as tiny_rnn_fc_model

pytestmark = pytest.mark.cuda

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# Scores of a GPU and a CPU decoding: float32 either side, other summation orders (these comparisons pass on the
# CPU with every weight of the second model moved by 1e-4 relative, far more than a device's rounding).
SCORES = 1e-3


@pytest.fixture(autouse=True)
def full_float32_products():
    """No TF32 in the GPU's matmuls and convolutions: float32 results then agree with the CPU's to rounding."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def device_of(model):
    return next(model.parameters()).device


# --- incremental decoding == the full forward pass --------------------------------------------------------------

def assert_incremental_is_full_and_cpus(model, dictionary, per_step=1):
    incremental, full = incremental_and_full(model, dictionary, CUDA, per_step)
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-4)
    _, cpu_full = incremental_and_full(model, dictionary, CPU, per_step)
    torch.testing.assert_close(full, cpu_full, rtol=1e-5, atol=1e-4)


def test_baseline_transformer_incremental_decoding_equals_the_full_forward_pass_on_cuda():
    """fairseq's transformer (the baseline): step by step through the incremental state, with the beams
    reordered, the GPU gives its full forward pass, which is the CPU's."""
    dictionary = word_dictionary()
    assert_incremental_is_full_and_cpus(random_transformer(dictionary), dictionary)


@pytest.mark.parametrize("order, per_step", [("bidir", 2), ("l2r", 1)])
def test_double_token_incremental_pair_decoding_equals_the_full_forward_pass_on_cuda(order, per_step):
    """The double-token decoder fed a pair a call (the step mask built on the GPU) gives its full forward pass."""
    model, dictionary, _ = random_double_token_model(order, per_step)
    assert_incremental_is_full_and_cpus(model, dictionary, per_step)


def bytenet_incremental_and_full(device):
    """bytenet_tiny (float32) on ``device``: decoded a character a call, the beams reordered at step 17, and in
    one full pass over the reordered targets; both on the CPU."""
    model = build("bytenet_tiny").float().to(device)
    source, lengths, target = (t.to(device) for t in _random_batch(model.decoder.dictionary, 4, 9, 40))
    new_order = torch.tensor([2, 0, 0, 3], device=device)
    with torch.no_grad():
        incremental, reordered_target = _decode_incremental(model, source, lengths, target, 17, new_order)
        full = _decode_full(model, source[new_order], lengths[new_order], reordered_target)
    return incremental.cpu(), full.cpu()


def test_bytenet_cached_decoding_equals_the_full_forward_pass_on_cuda():
    """ByteNet's cached convolution frames on the GPU (reordered with the beams) give its full forward pass."""
    incremental, full = bytenet_incremental_and_full(CUDA)
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-4)
    _, cpu_full = bytenet_incremental_and_full(CPU)
    torch.testing.assert_close(full, cpu_full, rtol=1e-5, atol=1e-4)


# --- the generators on the GPU -----------------------------------------------------------------------------------

def test_baseline_beam_search_on_cuda_gives_the_cpu_hypotheses():
    """fairseq's beam search (beam 4) over the baseline transformer: the GPU's n-best lists are the CPU's."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    sample = random_batch(dictionary, bsz=6)

    def stock(m):
        return SequenceGenerator([m], dictionary, beam_size=4, max_len_b=20)

    assert_same_hypotheses(decode_on(CUDA, stock, model, sample), decode_on(CPU, stock, model, sample),
                           atol=SCORES)


def blockwise_and_greedy(device, fast_step=False):
    """Exact blockwise decoding (4 heads that repeat p_1's guess, so blocks are accepted whole and cut at the
    maximum length) and stock greedy decoding of the same random model on ``device``."""
    model, dictionary = random_blockwise_model(layout="separate")
    copying_heads(model)
    with torch.no_grad():  # EOS only when forced at max_len: long outputs, many blocks
        model.decoder.embed_tokens.weight[dictionary.eos()] = 0.0
    sample = random_batch(dictionary, bsz=6)
    method = FastStepBlockwiseGenerator if fast_step else BlockwiseGenerator

    def blockwise(m):
        return method(m, dictionary, HEADS, max_len_b=25)

    def greedy(m):
        return SequenceGenerator([m], dictionary, beam_size=1, max_len_b=25)

    return decode_on(device, blockwise, model, sample), decode_on(device, greedy, model, sample)


@pytest.mark.parametrize("fast_step", [False, True], ids=["fairseq's decoder", "the fast step"])
def test_exact_blockwise_decoding_on_cuda_is_stock_greedy_on_cuda(fast_step):
    """Blockwise decoding on the GPU (block verification and cache rollback there) gives stock greedy
    decoding's tokens and scores on the GPU, and the CPU's."""
    blockwise, greedy = blockwise_and_greedy(CUDA, fast_step)
    assert_same_hypotheses(blockwise, greedy, atol=SCORES)
    assert_same_hypotheses(blockwise, blockwise_and_greedy(CPU, fast_step)[0], atol=SCORES)


def untied_table(dictionary):
    """The tiny table with its probabilities moved apart by up to 5% relative: counts over a tiny corpus tie
    (17 of 24 positions of this sample tie at the K-th candidate), and top-k breaks ties differently on the GPU
    than on the CPU, so the two would decode different lattices, not the same lattice differently."""
    table = tiny_table(dictionary)
    g = torch.Generator().manual_seed(3)
    table.lexical_probs = table.lexical_probs * (1 + 0.05 * torch.rand(table.lexical_probs.shape, generator=g))
    table.unigram_probs = table.unigram_probs * (1 + 0.05 * torch.rand(table.unigram_probs.shape, generator=g))
    return table


def lattice_decodings(device, order, normalization, no_repeat_ngram_size=0):
    """Lattice decoding (Viterbi, or the no-repeat beam search) of a random scorer of Markov ``order`` with its
    candidate table on ``device``: the three best paths of each sentence."""
    model, dictionary = tiny_lattice_model(order, layers=2)
    table = untied_table(dictionary)
    sample = random_batch(dictionary, 4, seed=6)

    def lattice(m):
        return LatticeGenerator([m], dictionary, table.to(device_of(m)), k=6, normalization=normalization, nbest=3,
                                no_repeat_ngram_size=no_repeat_ngram_size)

    return decode_on(device, lattice, model, sample)


@pytest.mark.parametrize("order, normalization", [(1, "lattice"), (2, "vocab")])
def test_lattice_viterbi_decoding_on_cuda_gives_the_cpu_paths(order, normalization):
    """Lattice scoring and the Viterbi search with the table on the GPU (the backtracking is on the CPU): the
    same paths, scores equal to float rounding."""
    assert_same_hypotheses(lattice_decodings(CUDA, order, normalization),
                           lattice_decodings(CPU, order, normalization), atol=SCORES)


@pytest.mark.parametrize("order", [1, 2])
def test_lattice_no_repeat_search_on_cuda_gives_the_cpu_paths(order):
    """The no-repeat beam search over a lattice scored on the GPU: the CPU's paths and scores."""
    assert_same_hypotheses(lattice_decodings(CUDA, order, "lattice", no_repeat_ngram_size=2),
                           lattice_decodings(CPU, order, "lattice", no_repeat_ngram_size=2), atol=SCORES)


def double_token_decodings(device):
    """Double-token (bidirectional, DoubleTopK beam 4) decoding of a random model on ``device``."""
    model, dictionary, eod = random_double_token_model("bidir", 2)
    sample = random_batch(dictionary, bsz=6)

    def double_token(m):
        return DoubleTokenGenerator(m, dictionary, eod, "bidir", beam_size=4, max_len_b=20)

    return decode_on(device, double_token, model, sample)


def test_double_token_generation_on_cuda_equals_the_cpu_generation():
    """DoubleTopK on the GPU: the natural-order n-best lists and positional scores of the CPU."""
    assert_same_hypotheses(double_token_decodings(CUDA), double_token_decodings(CPU), atol=SCORES)


def bytenet_decodings(device, decoding):
    """bytenet_tiny decoded by fairseq's beam search on ``device``: ``cached`` (its incremental state) or
    ``recompute`` (the whole prefix every step, as --bytenet-decoding recompute runs it)."""
    model = build("bytenet_tiny").float()
    dictionary = model.decoder.dictionary
    source, lengths, _ = _random_batch(dictionary, 4, 9, 2)
    sample = {"net_input": {"src_tokens": source, "src_lengths": lengths}}

    def stock(m):
        generator = SequenceGenerator([m], dictionary, beam_size=4, max_len_b=30)
        generator.model.has_incremental = decoding == "cached"
        return generator

    return decode_on(device, stock, model, sample)


def test_bytenet_cached_decoding_on_cuda_equals_the_cpu_and_the_full_recompute():
    """Beam search over ByteNet's cached frames on the GPU gives what recomputing the whole prefix every step
    gives there, and what the cached decoding gives on the CPU."""
    cached = bytenet_decodings(CUDA, "cached")
    assert_same_hypotheses(cached, bytenet_decodings(CUDA, "recompute"), atol=SCORES)
    assert_same_hypotheses(cached, bytenet_decodings(CPU, "cached"), atol=SCORES)


def rnn_fc_decodings(device, top, speedups):
    """rnn_fc decoding (fp32, the given exact speedups) of a random tiny model on ``device``."""
    dictionary = word_dictionary()
    model = tiny_rnn_fc_model(dictionary, top)
    sample = random_batch(dictionary, bsz=5, seed=3)

    def rnn_fc(m):
        return RnnFcGenerator([m], dictionary, beam=4, speedups=speedups, max_len_b=12, nbest=2)

    return decode_on(device, rnn_fc, model, sample)


@pytest.mark.parametrize("top, speedups", [("tanh", SPEEDUPS), ("gru", SPEEDUPS), ("gru", ())],
                         ids=["tanh, every speedup", "gru, every speedup", "gru, plain"])
def test_rnn_fc_fp32_decoding_on_cuda_equals_the_cpu_decoding(top, speedups):
    """rnn_fc's beam search (its exact speedups, or the plain decoder) on the GPU gives the CPU's n-best lists."""
    assert_same_hypotheses(rnn_fc_decodings(CUDA, top, speedups), rnn_fc_decodings(CPU, top, speedups),
                           atol=SCORES)


def build_rnn_fc_int8_generator(device):
    """The generator ``--task rnn_fc_translation --rnn-fc-precision int8`` builds for a model on ``device``."""
    dictionary = word_dictionary()
    model = tiny_rnn_fc_model(dictionary).to(device)
    task = RnnFcTranslationTask(RnnFcTranslationConfig(rnn_fc_precision="int8"), dictionary, dictionary)
    return task.build_generator([model], argparse.Namespace(beam=4))


def test_rnn_fc_int8_refuses_a_cuda_model_with_its_message():
    """--rnn-fc-precision int8 (fbgemm, CPU only) with a model on the GPU: the task says to add --cpu."""
    with pytest.raises(InputError, match=r"^--rnn-fc-precision int8: fbgemm's int8 kernels run on the CPU only, "
                                              r"the model is on cuda:\d+ \(add --cpu\)$"):
        build_rnn_fc_int8_generator(CUDA)


def fast_step_task(**flags):
    dictionary = word_dictionary()
    return FastStepTranslationTask(FastStepTranslationConfig(**flags), dictionary, dictionary), dictionary


def test_fast_step_int8_refuses_a_cuda_model_with_its_message():
    """--fast-step --fast-step-precision int8 with a model on the GPU: the task says to add --cpu."""
    task, dictionary = fast_step_task(fast_step=True, fast_step_precision="int8")
    model = random_transformer(dictionary).to(CUDA)
    with pytest.raises(InputError, match=r"^--fast-step-precision int8: the int8 kernels run on the CPU only, "
                                              r"the model is on cuda:\d+ \(add --cpu\)$"):
        task.build_generator([model], argparse.Namespace(beam=4))


def fast_step_and_stock(device, beam):
    """``--task fast_step_translation --fast-step`` (fp32) and the stock generator of the same task without
    --fast-step, each built by the task for a random transformer on ``device``."""
    fast, dictionary = fast_step_task(fast_step=True)
    stock, _ = fast_step_task()
    model = random_transformer(dictionary)
    sample = random_batch(dictionary, bsz=6, seed=2)
    args = argparse.Namespace(beam=beam, max_len_b=20)
    return (decode_on(device, lambda m: fast.build_generator([m], args), model, sample),
            decode_on(device, lambda m: stock.build_generator([m], args), model, sample))


@pytest.mark.parametrize("beam", [1, 4])
def test_fp32_fast_step_on_cuda_gives_the_stock_generators_hypotheses(beam):
    """The fast step's engine on the GPU (the torch-operations layer: the native kernels read CPU memory)
    gives the stock generator's n-best lists there."""
    fast, stock = fast_step_and_stock(CUDA, beam)
    assert_same_hypotheses(fast, stock, atol=SCORES)
