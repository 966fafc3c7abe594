"""The fast step's whole search in one native call (kernels/native/search.c: fp_greedy_search for a sentence,
fp_beam_search for a batch): at batch 1 and on batches of 4 and 8 sentences (padded sources of different lengths,
sentences that stop at different steps) it gives, on every sentence of the tiny trained model, the hypotheses of
the fast step's Python search (its greedy loop; fairseq's SequenceGenerator at beam > 1) token for token, every
n-best list in fairseq's order, with scores equal to float rounding; in float32 and in int8; and it is what
ran."""

import pytest
import torch

from fairseq_plugins.kernels import native
from fairseq_plugins.kernels.sequence_generator import FastStepSequenceGenerator
from test_fast_step import GENERATOR_SETTINGS, load

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels could not be built here")

# The fast step's settings against fairseq's (all but n-gram blocking, which the native search leaves to fairseq's
# search), and beams cut at the length limit, with length penalties, a minimum length and an unk penalty.
SETTINGS = {
    **{name: kwargs for name, kwargs in GENERATOR_SETTINGS.items() if "no_repeat_ngram_size" not in kwargs},
    "beam 2, length penalty 0.5": {"beam_size": 2, "len_penalty": 0.5},
    "beam 4 cut at 4 tokens": {"beam_size": 4, "max_len_a": 0, "max_len_b": 4},
    "beam 5, min length 12, unk penalty": {"beam_size": 5, "min_len": 12, "unk_penalty": 0.5},
    "beam 3, length penalty 2, 1.2 x source + 3": {"beam_size": 3, "len_penalty": 2.0, "max_len_a": 1.2,
                                                   "max_len_b": 3},
}


class Spy:
    """Counts the calls of a searcher and passes them on."""

    def __init__(self, searcher):
        self.searcher, self.calls = searcher, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.searcher(*args, **kwargs)


def decode(generator, model, batches):
    """Every sentence's n-best list, in the batches' sentence order."""
    with torch.no_grad():
        return [hypotheses for batch in batches for hypotheses in generator.generate([model], batch)]


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_native_search_gives_the_python_searchs_hypotheses(trained, setting, precision, batch_size):
    model, task, batches = load(trained["checkpoint"], batch_size)
    kwargs = SETTINGS[setting]
    native_side = FastStepSequenceGenerator([model], task.target_dictionary, precision=precision, **kwargs)
    python_side = FastStepSequenceGenerator([model], task.target_dictionary, precision=precision, **kwargs)
    python_side.model.engine.greedy_searcher = python_side.model.engine.beam_searcher = None
    engine = native_side.model.engine
    engine.greedy_searcher, engine.beam_searcher = Spy(engine.greedy_searcher), Spy(engine.beam_searcher)
    mine, theirs = decode(native_side, model, batches), decode(python_side, model, batches)
    # one native call a batch: a sentence's greedy search, or the batch's beam search (greedy on a batch: beam 1)
    searcher = engine.greedy_searcher if kwargs["beam_size"] == 1 and batch_size == 1 else engine.beam_searcher
    assert searcher.calls == len(batches) == 40 // batch_size
    assert len(mine) == len(theirs) == 40
    for sentence, (ours, reference) in enumerate(zip(mine, theirs)):
        assert [h["tokens"].tolist() for h in ours] == [h["tokens"].tolist() for h in reference], sentence
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a["positional_scores"], b["positional_scores"], rtol=0, atol=1e-5)
            torch.testing.assert_close(a["score"], b["score"], rtol=0, atol=1e-5)
    assert native_side.generation_stats()["sentences"] == 40


def test_a_batch_of_eight_padded_sentences(trained):
    """Eight sentences a batch (longer padding, more sentences stopping at different steps), beam 5, int8: the
    Python search's hypotheses."""
    model, task, batches = load(trained["checkpoint"], 8)
    native_side = FastStepSequenceGenerator([model], task.target_dictionary, precision="int8", beam_size=5)
    python_side = FastStepSequenceGenerator([model], task.target_dictionary, precision="int8", beam_size=5)
    python_side.model.engine.greedy_searcher = python_side.model.engine.beam_searcher = None
    assert any(bool((batch["net_input"]["src_tokens"] == task.source_dictionary.pad()).any()) for batch in batches)
    mine, theirs = decode(native_side, model, batches), decode(python_side, model, batches)
    for ours, reference in zip(mine, theirs):
        assert [h["tokens"].tolist() for h in ours] == [h["tokens"].tolist() for h in reference]
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a["score"], b["score"], rtol=0, atol=1e-5)


def test_what_the_native_search_does_not_do_falls_back(trained):
    """Rules it does not implement (n-gram blocking) and a beam wider than its arrays, at batch 1 and on a batch:
    fairseq's search, never a wrong native one."""
    model, task, batches = load(trained["checkpoint"], 4)
    for kwargs, batch in (({"beam_size": 2, "no_repeat_ngram_size": 2}, batches[0]),
                          ({"beam_size": 2, "no_repeat_ngram_size": 2}, load(trained["checkpoint"], 1)[2][0]),
                          ({"beam_size": native.MAX_NATIVE_BEAM + 1}, batches[0]),
                          ({"beam_size": native.MAX_NATIVE_BEAM + 1}, load(trained["checkpoint"], 1)[2][0])):
        generator = FastStepSequenceGenerator([model], task.target_dictionary, **kwargs)
        engine = generator.model.engine
        engine.greedy_searcher, engine.beam_searcher = Spy(engine.greedy_searcher), Spy(engine.beam_searcher)
        with torch.no_grad():
            generator.generate([model], batch)
        assert engine.greedy_searcher.calls == engine.beam_searcher.calls == 0, kwargs
