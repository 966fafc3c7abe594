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
        compiled_fn = torch.compile(compiled.step_fn, fullgraph=True, dynamic=False, backend="eager")
        for t in range(STEPS - 1):
            outputs = []
            for static, fn in ((eager, eager.step_fn), (compiled, compiled_fn)):
                buffers = static.buffers
                buffers.tokens.copy_(prev[:, t])
                buffers.position.fill_(t)
                if t == 0 or fn is eager.step_fn:
                    outputs.append(fn(buffers.tokens, buffers.position))
                else:
                    with torch.compiler.set_stance("fail_on_recompile"):
                        outputs.append(fn(buffers.tokens, buffers.position))
            torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-6, msg=f"step {t}")
        torch.testing.assert_close(compiled.buffers.keys[-1], eager.buffers.keys[-1], rtol=0, atol=1e-6)


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
    assert len(captured.shapes) == 1 and next(iter(captured.shapes.values())).graph is not None


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
