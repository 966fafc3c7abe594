"""CUDA graphs of the lattice's encoder and scoring (kernels/cuda_graphs.py, --lattice-cuda-graphs, issue 57):
on the CPU, the captured function compiles whole (``torch.compile(fullgraph=True)``: no host read, no graph break)
and gives the scores of the uncaptured path; on CUDA, the captured generator gives the uncaptured one's paths and
replays a graph per shape. (The static decoder step's captures: tests/test_static_step.py.)"""

import argparse

import pytest
import torch
from conftest import assert_same_hypotheses, on_device, random_batch, word_dictionary

from fairseq_plugins.common.textio import InputError
from fairseq_plugins.lattice.generator import LatticeGenerator
from test_lattice import tiny_model as tiny_lattice_model
from test_lattice import tiny_table


@pytest.mark.parametrize("padded", [True, False], ids=["a padded batch", "one sentence"])
def test_the_capturable_encoder_gives_fairseqs_encoder_output(padded):
    """``capturable_encoder_out`` (the padding mask always passed, no host read): fairseq's encoder output on a
    padded batch and on one unpadded sentence, compiled whole (``fullgraph``) as well as eager."""
    from fairseq_plugins.kernels.cuda_graphs import capturable_encoder_out, encoder_unsupported_reason
    from test_fast_step import random_transformer

    dictionary = word_dictionary()
    model = random_transformer(dictionary).eval()
    sample = random_batch(dictionary, 4 if padded else 1, seed=5)
    src_tokens = sample["net_input"]["src_tokens"]
    if not padded:
        src_tokens = src_tokens[:, src_tokens.ne(dictionary.pad()).all(0)]
    assert bool(src_tokens.eq(dictionary.pad()).any()) == padded
    assert encoder_unsupported_reason(model.encoder) is None
    torch._dynamo.reset()
    compiled = torch.compile(capturable_encoder_out, fullgraph=True, dynamic=False, backend="eager")
    with torch.no_grad():
        expected = model.encoder.forward_torchscript({"src_tokens": src_tokens,
                                                      "src_lengths": src_tokens.ne(dictionary.pad()).sum(1)})
        for got in (capturable_encoder_out(model.encoder, src_tokens), compiled(model.encoder, src_tokens)):
            for key in ("encoder_out", "encoder_padding_mask", "encoder_embedding", "src_lengths"):
                torch.testing.assert_close(got[key][0], expected[key][0], rtol=0, atol=1e-5, msg=key)


def lattice_generator(model, dictionary, **kwargs):
    return LatticeGenerator([model], dictionary, tiny_table(dictionary).to(next(model.parameters()).device), k=6,
                            nbest=3, **kwargs)


def lattice_inputs(generator, sample):
    """What the generator hands its scoring for ``sample``: the lattice tokens and validity."""
    source, source_lengths = generator._source_content(sample["net_input"]["src_tokens"])
    estimate, _shortest, longest = generator._length_ranges(source_lengths)
    tokens, probs = generator.table.lattice(source, source_lengths, estimate, int(longest.max()) + 1, generator.k,
                                            generator.vocab_size, generator.excluded, generator.mass)
    return tokens, probs > 0


@pytest.mark.parametrize("order", [1, 2])
def test_the_captured_encoder_and_scoring_compile_whole_and_give_the_uncaptured_scores(order):
    """``_encode_and_score`` (what a CUDA graph captures: the encoder, every row scored, no row skipped on a host
    read) compiles to one graph, and a second sentence of the same shape reuses it (a recompilation fails);
    on every possible state its scores are those of the uncaptured path (impossible rows skipped)."""
    model, dictionary = tiny_lattice_model(order, layers=2)
    generator = lattice_generator(model, dictionary)
    sample = random_batch(dictionary, 1, seed=6)
    other = random_batch(dictionary, 1, seed=7)
    torch._dynamo.reset()
    compiled = torch.compile(generator._encode_and_score, fullgraph=True, dynamic=False, backend="eager")
    with torch.no_grad():
        for index, batch in enumerate((sample, other)):
            net_input = batch["net_input"]
            lattice_tokens, lattice_valid = lattice_inputs(generator, batch)
            if index:
                assert lattice_tokens.shape == first_shape  # (the same shape: the graph is reused)
            first_shape = lattice_tokens.shape
            with torch.compiler.set_stance("fail_on_recompile") if index else torch.no_grad():
                got = compiled(net_input["src_tokens"], lattice_tokens, lattice_valid)
            encoder_out = model.encoder.forward_torchscript(net_input)
            expected = generator._score(generator._scorer_features(), encoder_out, lattice_tokens, lattice_valid,
                                        skip_impossible=True)
            possible = expected[2]
            assert torch.equal(got[2], possible)
            for mine, theirs in zip(got[:2], expected[:2]):
                torch.testing.assert_close(mine[possible], theirs[possible], rtol=0, atol=1e-5)


class EagerCalls:
    """``CapturedCalls`` without CUDA: the same call, run eagerly, counting its shapes as captures."""

    def __init__(self, fn):
        self.fn, self.shapes = fn, set()

    @property
    def captures(self):
        return len(self.shapes)

    def __call__(self, *inputs):
        self.shapes.add(tuple(t.shape for t in inputs))
        return self.fn(*inputs)


@pytest.mark.parametrize("no_repeat_ngram_size", [0, 2])
def test_the_captured_path_pads_to_buckets_and_gives_the_uncaptured_paths(monkeypatch, no_repeat_ngram_size):
    """The lattice generator's captured path on the CPU, its call run eagerly (``EagerCalls``): the source padded
    on the left and the lattice on the right to their buckets of 16, every row scored, cut back: the
    uncaptured generator's paths, for a batch of 4 and sentence by sentence (shapes shared within a bucket); new
    weights make new graphs."""
    import fairseq_plugins.lattice.generator as lattice_module

    monkeypatch.setattr(lattice_module, "CapturedCalls", EagerCalls)
    model, dictionary = tiny_lattice_model(2, layers=2)
    plain = lattice_generator(model, dictionary, no_repeat_ngram_size=no_repeat_ngram_size)
    captured = lattice_generator(model, dictionary, no_repeat_ngram_size=no_repeat_ngram_size)
    captured.cuda_graphs = True  # (the constructor refuses the flag on the CPU)
    batch = random_batch(dictionary, 4, seed=6)
    sentences = [{"net_input": {k: v[i:i + 1] for k, v in batch["net_input"].items()}} for i in range(4)]
    with torch.no_grad():
        for sample in [batch] + sentences:
            assert_same_hypotheses(as_lists(captured.generate([model], sample)),
                                   as_lists(plain.generate([model], sample)), atol=1e-5)
        graphs = captured._captured
        assert {shape[0] for shape in graphs.shapes} == {(4, 16), (1, 16)}  # sources of 2..7 tokens: one bucket
        assert all(shape[1][1] == 16 for shape in graphs.shapes)
        model.decoder.output_projection.weight.add_(0.0)  # an in-place write: the weights' version moves on
        captured.generate([model], sentences[0])
    assert captured._captured is not graphs


@pytest.mark.parametrize("flags, message", [
    ({}, r"^--lattice-cuda-graphs: CUDA graphs need the model on a CUDA device, it is on cpu \(drop the flag"),
    ({"precision": "int8"}, "^--lattice-cuda-graphs: not with --lattice-scorer-precision int8$"),
    ({"hoist": False}, "^--lattice-cuda-graphs: not with --lattice-no-hoist$"),
])
def test_lattice_cuda_graph_refusals_name_the_flag(flags, message):
    model, dictionary = tiny_lattice_model(1)
    with pytest.raises(InputError, match=message):
        lattice_generator(model, dictionary, cuda_graphs=True, **flags)


def test_the_lattice_task_passes_its_cuda_graph_flag():
    from fairseq_plugins.lattice.task import LatticeTranslationConfig, LatticeTranslationTask

    model, dictionary = tiny_lattice_model(1)
    task = LatticeTranslationTask(LatticeTranslationConfig(lattice_cuda_graphs=True), dictionary, dictionary)
    task._table = tiny_table(dictionary)
    with pytest.raises(InputError, match="^--lattice-cuda-graphs: CUDA graphs need the model on a CUDA device"):
        task.build_generator([model], argparse.Namespace())


def as_lists(hypotheses):
    return [[{"tokens": h["tokens"].tolist(), "score": float(h["score"]),
              "positional_scores": h["positional_scores"].detach().cpu()} for h in sentence] for sentence in hypotheses]


@pytest.mark.cuda
@pytest.mark.parametrize("no_repeat_ngram_size", [0, 2])
def test_lattice_cuda_graphs_give_the_uncaptured_paths(no_repeat_ngram_size):
    """The captured encoder and scoring in a batch of 4, then sentence by sentence twice over (batch 1: a graph
    per shape, replayed for a shape already seen): the uncaptured generator's paths on the GPU."""
    model, dictionary = tiny_lattice_model(2, layers=2)
    model = model.cuda()
    batch = on_device(random_batch(dictionary, 4, seed=6), "cuda")
    sentences = [{"net_input": {k: v[i:i + 1] for k, v in batch["net_input"].items()}} for i in range(4)] * 2
    captured = lattice_generator(model, dictionary, no_repeat_ngram_size=no_repeat_ngram_size, cuda_graphs=True)
    plain = lattice_generator(model, dictionary, no_repeat_ngram_size=no_repeat_ngram_size)
    shapes = set()
    with torch.no_grad():
        for sample in [batch] + sentences:
            assert_same_hypotheses(as_lists(captured.generate([model], sample)),
                                   as_lists(plain.generate([model], sample)), atol=1e-4)
            shapes.add((sample["net_input"]["src_tokens"].shape, lattice_inputs(plain, sample)[0].shape))
    assert captured.generation_stats()["graphs_captured"] == len(shapes) < len(sentences) + 1


@pytest.mark.cuda
def test_a_captured_call_replays_its_graph_for_each_shape():
    """``CapturedCalls``: a graph per input shape, its inputs copied in at every call, the output of the call's
    own values; the least recently used beyond ``max_graphs`` dropped."""
    from fairseq_plugins.kernels.cuda_graphs import CapturedCalls

    calls = CapturedCalls(lambda x, y: (x @ y).relu() + 1, max_graphs=2)
    for shape in [(3, 4), (3, 4), (5, 4), (3, 4), (7, 4), (3, 4)]:
        x, y = torch.randn(*shape, device="cuda"), torch.randn(4, 2, device="cuda")
        torch.testing.assert_close(calls(x, y), (x @ y).relu() + 1)
    assert calls.captures == 3 and len(calls.graphs) == 2
