"""The fast step's whole search of a sentence in one native call (kernels/native/search.c: fp_greedy_search,
fp_beam_search): at batch 1 it gives, on every sentence of the tiny trained model, the hypotheses of the fast step's Python
search (its greedy loop; fairseq's SequenceGenerator at beam > 1) token for token, every n-best list in
fairseq's order, with scores equal to float rounding; in float32 and in int8; and it is what ran."""

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
    with torch.no_grad():
        return [generator.generate([model], batch)[0] for batch in batches]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_native_search_gives_the_python_searchs_hypotheses(trained, setting, precision):
    model, task, batches = load(trained["checkpoint"], 1)
    kwargs = SETTINGS[setting]
    native_side = FastStepSequenceGenerator([model], task.target_dictionary, precision=precision, **kwargs)
    python_side = FastStepSequenceGenerator([model], task.target_dictionary, precision=precision, **kwargs)
    python_side.model.engine.greedy_searcher = python_side.model.engine.beam_searcher = None
    engine = native_side.model.engine
    engine.greedy_searcher, engine.beam_searcher = Spy(engine.greedy_searcher), Spy(engine.beam_searcher)
    mine, theirs = decode(native_side, model, batches), decode(python_side, model, batches)
    searcher = engine.greedy_searcher if kwargs["beam_size"] == 1 else engine.beam_searcher
    assert searcher.calls == len(batches) == 40  # one native call a sentence
    for sentence, (ours, reference) in enumerate(zip(mine, theirs)):
        assert [h["tokens"].tolist() for h in ours] == [h["tokens"].tolist() for h in reference], sentence
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a["positional_scores"], b["positional_scores"], rtol=0, atol=1e-5)
            torch.testing.assert_close(a["score"], b["score"], rtol=0, atol=1e-5)
    assert native_side.generation_stats()["sentences"] == 40


def test_what_the_native_search_does_not_do_falls_back(trained):
    """Batches of several sentences, candidate-free rules it does not implement (n-gram blocking), and a beam
    wider than its arrays: fairseq's search (or the Python greedy loop), never a wrong native one."""
    model, task, batches = load(trained["checkpoint"], 4)
    for kwargs, batch in (({"beam_size": 5}, batches[0]), ({"beam_size": 1}, batches[0]),
                          ({"beam_size": 2, "no_repeat_ngram_size": 2}, load(trained["checkpoint"], 1)[2][0]),
                          ({"beam_size": native.MAX_NATIVE_BEAM + 1}, load(trained["checkpoint"], 1)[2][0])):
        generator = FastStepSequenceGenerator([model], task.target_dictionary, **kwargs)
        engine = generator.model.engine
        engine.greedy_searcher, engine.beam_searcher = Spy(engine.greedy_searcher), Spy(engine.beam_searcher)
        with torch.no_grad():
            generator.generate([model], batch)
        assert engine.greedy_searcher.calls == engine.beam_searcher.calls == 0, kwargs
