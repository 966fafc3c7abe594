"""The static decoder step (kernels/static_step.py, issue 57): fairseq's incremental log-probabilities at every
step, through beam reordering and finished sentences masked rather than removed; the CPU proxy for a step that
can be captured (``torch.compile(fullgraph=True, dynamic=False)``: a graph break or a host read fails it, and one
graph serves every position); its tensors in the model's half precision; on CUDA, no host synchronisation in a
step and CUDA graphs equal to the uncaptured step."""

import argparse
import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_hypotheses, decode_on, random_batch, word_dictionary
from fairseq.sequence_generator import SequenceGenerator
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_plugins.common.textio import InputError
from fairseq_plugins.fast_step.task import FastStepTranslationConfig, FastStepTranslationTask
from fairseq_plugins.kernels.decoder_step import FastDecoderStep
from fairseq_plugins.kernels.sequence_generator import FastStepSequenceGenerator
from fairseq_plugins.kernels.static_step import StaticDecoderStep
from test_fast_step import LAYOUTS, random_transformer

SENTENCES, BEAM, STEPS = 3, 2, 9
PERMUTE_AT, DROP_AT = 2, 5
# Beam reordering (sentence 0's beam 1 replaces beam 0, sentence 2's beams swap), then sentence 1 finishes.
PERMUTATION = torch.tensor([1, 1, 2, 3, 5, 4])
WITHOUT_SENTENCE_1 = torch.tensor([0, 1, 4, 5])


def beam_inputs(dictionary, seed=2):
    """Padded sources of SENTENCES sentences and random previous tokens (rows = SENTENCES x BEAM, STEPS)."""
    sample = random_batch(dictionary, SENTENCES, src_len=7, seed=1)
    prev = torch.randint(dictionary.nspecial, len(dictionary), (SENTENCES * BEAM, STEPS),
                         generator=torch.Generator().manual_seed(seed))
    prev[:, 0] = dictionary.eos()
    return sample, prev


def encoder_rows(model, sample, device=None):
    """The encoder output with BEAM rows a sentence, as fairseq's beam search starts."""
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    rows = torch.arange(SENTENCES, device=device).repeat_interleave(BEAM)
    return model.encoder.reorder_encoder_out(encoder_out, rows)


def incremental_lprobs(model, sample, prev, step):
    """Per step, the log-probabilities (rows, V) that ``step(state, prev, t)`` gives for the rows still decoded,
    after the beam reordering at PERMUTE_AT and sentence 1's end at DROP_AT (``reorder(state, order)``)."""
    outputs = []
    for t in range(STEPS):
        order = PERMUTATION if t == PERMUTE_AT else WITHOUT_SENTENCE_1 if t == DROP_AT else None
        if order is not None:
            order = order.to(prev.device)
            step.reorder(order)
            prev = prev[order]
        outputs.append(F.log_softmax(step(prev, t).float(), dim=-1))
    return outputs


class FairseqSteps:
    """fairseq's incremental decoder, as ``incremental_lprobs`` drives a step."""

    def __init__(self, model, encoder_out):
        self.model, self.encoder_out, self.state = model, encoder_out, {}

    def reorder(self, order):
        self.model.decoder.reorder_incremental_state_scripting(self.state, order)
        self.encoder_out = self.model.encoder.reorder_encoder_out(self.encoder_out, order)

    def __call__(self, prev, t):
        return self.model.decoder(prev[:, :t + 1], encoder_out=self.encoder_out, incremental_state=self.state)[0][:, -1]


class NoHostReads(TorchDispatchMode):
    """Refuses the operators that read a tensor's values on the host (``.item()``, ``int()``, ``bool()``: a Python
    branch on a value) or give a shape that depends on them: each a synchronisation on a GPU. (The CPU's
    ``.tolist()`` and ``.cpu()`` do not dispatch: on CUDA, ``set_sync_debug_mode("error")`` catches those.)"""

    REFUSED = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero", "aten::masked_select",
               "aten::_unique2", "aten::unique_consecutive"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.REFUSED:
            raise AssertionError(f"{func._schema.name} in a static step: the host waits for the device")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def never_waiting_on_the_host(device):
    """``NoHostReads``; on CUDA also the sync debug mode "error" (any synchronisation raises)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with NoHostReads():
            yield
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")


class StaticSteps:
    """The static step as ``incremental_lprobs`` drives a step; with ``watch``, its steps and reorders never
    wait on the host (``never_waiting_on_the_host``; a CUDA graph's capture synchronises, its replays not)."""

    def __init__(self, static, watch=True):
        self.static, self.watch = static, watch
        self.device = static.engine.embed_tokens.device

    def reorder(self, order):
        with never_waiting_on_the_host(self.device) if self.watch else contextlib.nullcontext():
            self.static.reorder(order)

    def __call__(self, prev, t):
        assert self.static.length == t
        tokens = prev[:, t]
        with never_waiting_on_the_host(self.device) if self.watch else contextlib.nullcontext():
            return self.static.step(tokens)


def static_step_of(model, encoder_out, **kwargs):
    static = StaticDecoderStep(FastDecoderStep(model.decoder, fused=False), **kwargs)
    static.start(encoder_out, max_steps=STEPS + 1)
    return static


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_static_step_gives_fairseqs_incremental_lprobs_at_every_step(layout):
    """Every layout the fast step takes: the static step (caches of the whole length, attention masked past the
    position, the finished sentence's rows masked rather than removed) gives fairseq's log-probabilities."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary, **LAYOUTS[layout])
    sample, prev = beam_inputs(dictionary)
    with torch.no_grad():
        encoder_out = encoder_rows(model, sample)
        expected = incremental_lprobs(model, sample, prev, FairseqSteps(model, encoder_out))
        static = static_step_of(model, encoder_out)
        got = incremental_lprobs(model, sample, prev, StaticSteps(static))
    assert static.buffers.keys[0].shape[0] == SENTENCES * BEAM  # the rows stay: the finished ones are masked
    for t, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine.shape == theirs.shape, t
        torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-5, msg=f"step {t}")


def test_static_step_compiles_to_one_graph_that_equals_the_eager_step():
    """``torch.compile(fullgraph=True, dynamic=False)`` (backend eager: what a capture needs, without the
    compiler's time) takes the step whole, and after the first position the same graph serves every other
    (a recompilation fails): the compiled steps give the eager step's logits and caches."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    sample, prev = beam_inputs(dictionary)
    torch._dynamo.reset()
    with torch.no_grad():
        encoder_out = encoder_rows(model, sample)
        eager, compiled = static_step_of(model, encoder_out), static_step_of(model, encoder_out)
        compiled_fn = torch.compile(compiled.group_fn, fullgraph=True, dynamic=False, backend="eager")
        for t in range(STEPS - 1):
            outputs = []
            for static, fn in ((eager, eager.group_fn), (compiled, compiled_fn)):
                buffers = static.buffers
                buffers.tokens_of(1).copy_(prev[:, t:t + 1])
                buffers.lengths.fill_(t)
                with contextlib.nullcontext() if t == 0 or fn is eager.group_fn else \
                        torch.compiler.set_stance("fail_on_recompile"):
                    outputs.append(fn(buffers.tokens_of(1), buffers.lengths, True, True))
            torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-6, msg=f"step {t}")
        torch.testing.assert_close(compiled.buffers.keys[-1], eager.buffers.keys[-1], rtol=0, atol=1e-6)


# Blockwise verification: blocks of BLOCK a row, each row then keeping its own number of them (ACCEPTED[call]);
# a row leaves after the second call (KEEP_ROWS). Double-token: pairs that see each other.
BLOCK = 3
ACCEPTED = [[1, 3, 2, 1, 2, 3], [3, 1, 1, 2, 2, 1], [2, 2, 3, 1, 1, 3]]
KEEP_ROWS = torch.tensor([0, 1, 2, 4, 5])


def group_calls(step, prev, causal):
    """Features of three group calls (BLOCK tokens a row, causal: blockwise's blocks with ``keep_block`` after
    each; else pairs, every row keeping both) on ``step`` (the engine or the static step), a row leaving
    after the second call."""
    m = BLOCK if causal else 2
    outputs, rows = [], torch.arange(prev.size(0))
    for call, accepted in enumerate(ACCEPTED):
        if call == 2:
            step.reorder(KEEP_ROWS)
            rows = rows[KEEP_ROWS]
        start = step.length
        outputs.append(step.group_step(prev[rows, call * m:(call + 1) * m], causal=causal))
        if causal:
            step.keep_block(start, torch.tensor(accepted)[rows])
    return outputs


@pytest.mark.parametrize("causal", [True, False], ids=["blockwise blocks", "double-token pairs"])
def test_static_group_calls_give_the_engines_features(causal):
    """Blocks that rows keep in different numbers (each row's prefix then its own length), and pairs: the static
    step's features are the engine's (FastDecoderStep, the fast step's reference), a row leaving between."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    sample, prev = beam_inputs(dictionary)
    with torch.no_grad():
        encoder_out = encoder_rows(model, sample)
        engine = FastDecoderStep(model.decoder, fused=False)
        engine.start(encoder_out, max_steps=STEPS + 1)
        expected = group_calls(engine, prev, causal)
        static = static_step_of(model, encoder_out)
        got = group_calls(static, prev, causal)
    for call, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine.shape == theirs.shape, call
        torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-5, msg=f"call {call}")
    if causal:  # each row's prefix: what it kept (the engine's cache ends after the longest block fed)
        kept = torch.tensor(ACCEPTED).sum(0)[KEEP_ROWS]
        assert static.buffers.lengths[:len(KEEP_ROWS)].tolist() == kept.tolist()
        assert static.length == int(kept.max()) < engine.length
    else:
        assert static.length == engine.length


@pytest.mark.parametrize("causal", [True, False], ids=["blockwise blocks", "double-token pairs"])
def test_static_group_calls_compile_to_one_graph(causal):
    """A block or pair call compiles whole, and the graph of the first call serves the later ones, whatever
    each row's prefix length (a recompilation fails): the eager call's outputs."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    sample, prev = beam_inputs(dictionary)
    m = BLOCK if causal else 2
    torch._dynamo.reset()
    with torch.no_grad():
        encoder_out = encoder_rows(model, sample)
        eager, compiled = static_step_of(model, encoder_out), static_step_of(model, encoder_out)
        compiled_fn = torch.compile(compiled.group_fn, fullgraph=True, dynamic=False, backend="eager")
        lengths = torch.zeros(prev.size(0), dtype=torch.long)
        for call, accepted in enumerate(ACCEPTED):
            outputs = []
            for static, fn in ((eager, eager.group_fn), (compiled, compiled_fn)):
                buffers = static.buffers
                buffers.tokens_of(m).copy_(prev[:, call * m:(call + 1) * m])
                buffers.lengths.copy_(lengths)
                with contextlib.nullcontext() if call == 0 or fn is eager.group_fn else \
                        torch.compiler.set_stance("fail_on_recompile"):
                    outputs.append(fn(buffers.tokens_of(m), buffers.lengths, causal, False))
            torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-6, msg=f"call {call}")
            lengths = lengths + (torch.tensor(accepted) if causal else m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_gives_its_half_precision_lprobs(dtype):
    """A model cast to bfloat16 or float16 (test_low_precision.py checks that its weights, caches and logits keep
    that dtype): the half-precision fairseq decoder's log-probabilities, to that precision."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary).to(dtype)
    sample, prev = beam_inputs(dictionary)
    with torch.no_grad():
        encoder_out = encoder_rows(model, sample)
        got = incremental_lprobs(model, sample, prev, StaticSteps(static_step_of(model, encoder_out)))
        expected = incremental_lprobs(model, sample, prev, FairseqSteps(model, encoder_out))
    for t, (mine, theirs) in enumerate(zip(got, expected)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0.1, msg=f"step {t}")


def test_the_static_step_refuses_what_it_cannot_run():
    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    with pytest.raises(ValueError, match=r"runs float matrices .*, not int8"):
        StaticDecoderStep(FastDecoderStep(model.decoder, "int8"))
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device, not cpu"):
        StaticDecoderStep(FastDecoderStep(model.decoder), cuda_graphs=True)
    with pytest.raises(ValueError, match="does not support this model: --cross-self-attention"):
        StaticDecoderStep(FastDecoderStep(random_transformer(dictionary, cross_self_attention=True).decoder))
    sample, prev = beam_inputs(dictionary)
    with torch.no_grad():
        static = static_step_of(model, encoder_rows(model, sample))
        with pytest.raises(ValueError, match="reorder to 7 rows: the static step holds 6"):
            static.reorder(torch.zeros(7, dtype=torch.long))
        static.block_step(prev[:, :2])
        with pytest.raises(ValueError, match=r"keep_block\(1, \[1, 1, 1, 1, 1, 1\]\): the last call fed 2 "
                                             r"positions after 0, to 6 live rows"):
            static.keep_block(1, torch.ones(6, dtype=torch.long))
        with pytest.raises(ValueError, match=r"keep_block\(0, \[3, 0, 0, 0, 0, 0\]\): the last call fed 2"):
            static.keep_block(0, torch.tensor([3, 0, 0, 0, 0, 0]))
        static.keep_block(0, torch.tensor([2, 1, 2, 2, 2, 2]))
        with pytest.raises(ValueError, match=r"truncate to 2: the rows' prefixes hold \[2, 1, 2, 2, 2, 2\]"):
            static.truncate(2)
        static.truncate(0)
        for t in range(static.buffers.slots.numel()):
            static.step(prev[:, t % STEPS])
        with pytest.raises(ValueError, match=r"holds 16 positions \(start's max_steps\)"):
            static.step(prev[:, 0])


def generator_outputs(device, beam, **fast_step):
    """Hypotheses of the stock generator and of the fast step's (``fast_step``: its keywords) for a random
    transformer on ``device``: 6 sentences whose outputs end at different steps (rows leave the batch)."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary, seed=3)
    sample = random_batch(dictionary, bsz=6, seed=2)
    stock = decode_on(device, lambda m: SequenceGenerator([m], dictionary, beam_size=beam, max_len_b=12), model,
                      sample)
    fast = decode_on(device, lambda m: FastStepSequenceGenerator([m], dictionary, beam_size=beam, max_len_b=12,
                                                                 **fast_step), model, sample)
    return fast, stock


@pytest.mark.parametrize("static_step", [True, False], ids=["static step", "fast step"])
@pytest.mark.parametrize("beam", [1, 4])
def test_the_fast_step_generator_on_the_static_step_gives_the_stock_hypotheses(beam, static_step):
    """fairseq's search (beam 4) and the greedy loop (beam 1) on the static step: the stock n-best lists, with
    sentences finishing at different steps (their rows masked, not removed); as on the fast step's engine."""
    fast, stock = generator_outputs(torch.device("cpu"), beam, static_step=static_step)
    assert len({len(hypos[0]["tokens"]) for hypos in stock}) > 1  # sentences end at different steps
    assert_same_hypotheses(fast, stock)


def fast_step_task(**flags):
    dictionary = word_dictionary()
    return FastStepTranslationTask(FastStepTranslationConfig(**flags), dictionary, dictionary), dictionary


@pytest.mark.parametrize("flags, message", [
    ({"fast_step_cuda_graphs": True}, "^--fast-step-cuda-graphs: only used with --fast-step"),
    ({"fast_step": True, "fast_step_cuda_graphs": True},
     r"^--fast-step-cuda-graphs: CUDA graphs need the model on a CUDA device, it is on cpu \(drop the flag"),
    ({"fast_step": True, "fast_step_cuda_graphs": True, "fast_step_early_stop": True},
     "^--fast-step-cuda-graphs: not with --fast-step-early-stop$"),
    ({"fast_step": True, "fast_step_cuda_graphs": True, "fast_step_precision": "int8"},
     "^--fast-step-cuda-graphs: not with --fast-step-precision int8$"),
])
def test_cuda_graph_flag_refusals_name_the_flag(flags, message):
    task, dictionary = fast_step_task(**flags)
    with pytest.raises(InputError, match=message):
        task.build_generator([random_transformer(dictionary)], argparse.Namespace(beam=4))


# --- on a CUDA device ------------------------------------------------------------------------------------------

def on_cuda():
    """A random transformer, its sources, previous tokens and encoder output (BEAM rows a sentence) on the GPU."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary).cuda()
    sample, prev = beam_inputs(dictionary)
    sample = {"net_input": {k: v.cuda() for k, v in sample["net_input"].items()}}
    with torch.no_grad():
        return model, sample, prev.cuda(), encoder_rows(model, sample, device="cuda")


@pytest.mark.cuda
def test_static_step_on_cuda_never_waits_on_the_host():
    """Steps and reorders on the GPU under ``set_sync_debug_mode("error")`` (``StaticSteps``: a host
    synchronisation raises) give fairseq's log-probabilities there."""
    model, sample, prev, encoder_out = on_cuda()
    with torch.no_grad():
        got = incremental_lprobs(model, sample, prev, StaticSteps(static_step_of(model, encoder_out)))
        expected = incremental_lprobs(model, sample, prev, FairseqSteps(model, encoder_out))
    for t, (mine, theirs) in enumerate(zip(got, expected)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4, msg=f"step {t}")


@pytest.mark.cuda
def test_cuda_graph_steps_equal_the_uncaptured_steps():
    """The step captured as a CUDA graph at its first call and replayed for every position (reorders and the
    masked rows in between) gives the uncaptured static step's log-probabilities; a second batch of the same
    shape replays the same graph, never waiting on the host."""
    model, sample, prev, encoder_out = on_cuda()
    with torch.no_grad():
        expected = incremental_lprobs(model, sample, prev, StaticSteps(static_step_of(model, encoder_out)))
        captured = static_step_of(model, encoder_out, cuda_graphs=True)
        for batch in range(2):
            if batch:
                captured.start(encoder_out, max_steps=STEPS + 1)
            got = incremental_lprobs(model, sample, prev, StaticSteps(captured, watch=batch > 0))
            for t, (mine, theirs) in enumerate(zip(got, expected)):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5, msg=f"batch {batch}, step {t}")
    assert len(captured.shapes) == 1 and list(next(iter(captured.shapes.values())).graphs) == [(1, True, True)]


@pytest.mark.cuda
@pytest.mark.parametrize("beam", [1, 4])
def test_cuda_graph_flag_gives_the_uncaptured_hypotheses(beam):
    """``--fast-step --fast-step-cuda-graphs`` built by the task on the GPU: the hypotheses of the task without
    the flag (the fast step uncaptured) on the same device."""
    captured, _ = fast_step_task(fast_step=True, fast_step_cuda_graphs=True)
    uncaptured, dictionary = fast_step_task(fast_step=True)
    model = random_transformer(dictionary, seed=3)
    sample = random_batch(dictionary, bsz=6, seed=2)
    args = argparse.Namespace(beam=beam, max_len_b=12)
    cuda = torch.device("cuda")
    assert_same_hypotheses(decode_on(cuda, lambda m: captured.build_generator([m], args), model, sample),
                           decode_on(cuda, lambda m: uncaptured.build_generator([m], args), model, sample),
                           atol=1e-4)


# --- the methods on the static step: blockwise's verification, double-token's pairs ---------------------------

def blockwise_decodings(device, acceptance, **static):
    """Blockwise decoding (all heads) of a random blockwise model on the fast step (``static``: its static-step
    keywords) on ``device``: 6 sentences; exact acceptance with heads that copy p_1's guess (whole blocks
    accepted), or topk of half the vocabulary (each sentence keeps its own
    number a call)."""
    from fairseq_plugins.blockwise.fast_step import FastStepBlockwiseGenerator
    from test_blockwise import HEADS, copying_heads
    from test_blockwise import random_model as random_blockwise_model

    model, dictionary = random_blockwise_model(layout="separate")
    settings = {}
    if acceptance == "exact":
        copying_heads(model)
    else:
        settings = {"acceptance": "topk", "topk": len(dictionary) // 2}
    sample = random_batch(dictionary, bsz=6, seed=3)
    generators = []

    widths = set()

    def blockwise(m):
        generator = FastStepBlockwiseGenerator(m, dictionary, HEADS, max_len_b=25, **settings, **static)
        block_step = generator.steps.block_step
        generator.steps.block_step = lambda tokens: widths.add(tokens.size(-1)) or block_step(tokens)
        generators.append(generator)
        return generator

    hypotheses = decode_on(device, blockwise, model, sample)
    return hypotheses, {**generators[0].generation_stats(), "block_widths": widths}


@pytest.mark.parametrize("acceptance", ["exact", "topk"])
def test_blockwise_on_the_static_step_gives_the_fast_steps_hypotheses(acceptance):
    """Blocks verified on the static step (each row's prefix its own length, rows leaving masked; calls of
    width 1 and of the block): the tokens and scores of blockwise decoding on the engine."""
    got, stats = blockwise_decodings(torch.device("cpu"), acceptance, static_step=True)
    expected, engine_stats = blockwise_decodings(torch.device("cpu"), acceptance)
    assert_same_hypotheses(got, expected)
    assert stats["static_step"] and not engine_stats["static_step"] and not stats["cuda_graphs"]
    assert stats["decoder_invocations"] == engine_stats["decoder_invocations"]
    assert stats["mean_accepted_block_size"] > 1.5  # blocks were accepted, in part or whole
    assert len(stats["block_widths"]) == 2  # two calls a shape: BOS's and the blocks' (two graphs with CUDA)


def double_token_decodings(device, **static):
    """Double-token (bidir-2, beam 4) decoding of a random model on the fast step on ``device``: 6 sentences,
    EOD's output row scaled up so that hypotheses end at different steps (rows leave the batch)."""
    from fairseq_plugins.double_token.generator import DoubleTokenGenerator
    from test_double_token import random_model as random_double_token_model

    model, dictionary, eod = random_double_token_model(std=0.5)
    with torch.no_grad():
        model.decoder.output_projection.weight[eod] *= 20
    sample = random_batch(dictionary, bsz=6, seed=4)

    def double_token(m):
        return DoubleTokenGenerator(m, dictionary, eod, "bidir", beam_size=4, max_len_b=14,
                                    fast_step_precision="fp32", **static)

    return decode_on(device, double_token, model, sample)


def test_double_token_on_the_static_step_gives_the_fast_steps_hypotheses():
    """Pairs on the static step (both slots of a hypothesis seeing each other, the output layer inside the call,
    finished sentences' rows masked): the n-best lists of double-token decoding on the engine."""
    got = double_token_decodings(torch.device("cpu"), static_step=True)
    expected = double_token_decodings(torch.device("cpu"))
    assert len({len(hypos[0]["tokens"]) for hypos in expected}) > 1  # sentences end at different steps
    assert_same_hypotheses(got, expected)


def method_task(task_name, **flags):
    """A blockwise or double-token task with ``flags``, and a random model it decodes."""
    if task_name == "blockwise":
        from fairseq_plugins.blockwise.task import BlockwiseTranslationConfig, BlockwiseTranslationTask
        from test_blockwise import random_model as random_blockwise_model

        model, dictionary = random_blockwise_model()
        return BlockwiseTranslationTask(BlockwiseTranslationConfig(**flags), dictionary, dictionary), model
    from fairseq_plugins.double_token.task import DoubleTokenTranslationConfig, DoubleTokenTranslationTask
    from test_double_token import random_model as random_double_token_model

    model, dictionary, _eod = random_double_token_model()
    config = DoubleTokenTranslationConfig(token_order="bidir", tokens_per_step=2, **flags)
    return DoubleTokenTranslationTask(config, dictionary, dictionary), model


@pytest.mark.parametrize("task_name", ["blockwise", "double_token"])
@pytest.mark.parametrize("flags, message", [
    ({"fast_step_cuda_graphs": True}, "^--fast-step-cuda-graphs: only used with --fast-step"),
    ({"fast_step": True, "fast_step_cuda_graphs": True},
     r"^--fast-step-cuda-graphs: CUDA graphs need the model on a CUDA device, it is on cpu \(drop the flag"),
    ({"fast_step": True, "fast_step_cuda_graphs": True, "fast_step_precision": "int8"},
     "^--fast-step-cuda-graphs: not with --fast-step-precision int8$"),
])
def test_the_methods_cuda_graph_flag_refusals_name_the_flag(task_name, flags, message):
    task, model = method_task(task_name, **flags)
    with pytest.raises(InputError, match=message):
        task.build_generator([model], argparse.Namespace(beam=1 if task_name == "blockwise" else 4))


@pytest.mark.cuda
@pytest.mark.parametrize("acceptance", ["exact", "topk"])
def test_blockwise_cuda_graphs_give_the_uncaptured_hypotheses(acceptance):
    """Blockwise's verify calls captured as CUDA graphs (a graph per block width): the hypotheses of the
    uncaptured fast step on the GPU, the same number of decoder calls."""
    cuda = torch.device("cuda")
    got, stats = blockwise_decodings(cuda, acceptance, cuda_graphs=True)
    expected, engine_stats = blockwise_decodings(cuda, acceptance)
    assert_same_hypotheses(got, expected)
    assert stats["cuda_graphs"] and stats["decoder_invocations"] == engine_stats["decoder_invocations"]


@pytest.mark.cuda
def test_double_token_cuda_graphs_give_the_uncaptured_hypotheses():
    """Double-token's pair steps captured as CUDA graphs: the uncaptured fast step's n-best lists on the GPU."""
    cuda = torch.device("cuda")
    assert_same_hypotheses(double_token_decodings(cuda, cuda_graphs=True), double_token_decodings(cuda))


@pytest.mark.cuda
@pytest.mark.parametrize("task_name", ["blockwise", "double_token"])
def test_the_methods_cuda_graph_flag_builds_a_captured_generator(task_name):
    """``--fast-step --fast-step-cuda-graphs`` on the blockwise and double-token tasks, the model on the GPU: a
    generator whose decoder calls are captured."""
    task, model = method_task(task_name, fast_step=True, fast_step_cuda_graphs=True)
    generator = task.build_generator([model.cuda()], argparse.Namespace(beam=1 if task_name == "blockwise" else 4))
    assert generator.generation_stats()["cuda_graphs"]
