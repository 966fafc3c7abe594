"""The fast step is built once per loaded model: a ``hub.translate`` call (fairseq asks the task for a generator
each time) reuses the generator built for the same settings, every other generator fairseq builds from the model
reuses the prepared weights, each gives what a generator built once gives; a changed model is prepared again."""

import os
import threading

import pytest
import torch

from fairseq.sequence_generator import EnsembleModel

from fairseq_plugins.kernels import decoder_step as engine_module
from fairseq_plugins.kernels import fast_step_flags
from fairseq_plugins.kernels import int8 as int8_linear


def load_hub(trained, precision):
    import fairseq_plugins
    from fairseq.models.transformer import TransformerModel

    return TransformerModel.from_pretrained(
        trained["save_dir"], checkpoint_file="checkpoint_best.pt",
        data_name_or_path=os.path.join(trained["data"], "bin"), user_dir=fairseq_plugins.user_dir(),
        bpe="sentencepiece", sentencepiece_model=os.path.join(trained["data"], "spm.model"),
        source_lang="src", target_lang="tgt", task="fast_step_translation", fast_step=True,
        fast_step_precision=precision)


def count_calls(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def counted(self, *args, **kwargs):
        calls.append(name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_second_translate_builds_nothing(trained, monkeypatch, precision):
    raw = os.path.join(trained["data"], "raw", "test.src")
    sentences = open(raw, encoding="utf-8").read().splitlines()[:6]
    hub = load_hub(trained, precision)
    engines = count_calls(monkeypatch, engine_module.FastDecoderStep, "__init__")
    quantised = count_calls(monkeypatch, int8_linear.Int8Matrix, "__init__")
    first = [hub.translate(sentence, beam=2) for sentence in sentences[:1]]
    assert len(engines) == 1 and (len(quantised) > 0) == (precision == "int8")
    built = len(quantised)
    checks = []
    check = fast_step_flags.unsupported_reason
    monkeypatch.setattr(fast_step_flags, "unsupported_reason", lambda *args: checks.append(1) or check(*args))
    ensembles = count_calls(monkeypatch, EnsembleModel, "__init__")
    rest = [hub.translate(sentence, beam=2) for sentence in sentences[1:]]
    assert len(engines) == 1 and len(quantised) == built  # nothing built again: no engine, no int8 matrix
    # nor checked again (the model passed with these parameters), nor a generator built: the first one is reused
    assert checks == [] and len(ensembles) == 0
    assert fast_step_flags._PASSED[hub.models[0]]
    # ... and the same translations as one generator built once decoding them all.
    assert first + rest == hub.translate(sentences, beam=2)
    # Other settings, another generator (on the same prepared weights); the same settings, the same generator.
    generator = hub.task.build_generator(hub.models, hub.cfg.generation)
    assert generator is hub.task.build_generator(hub.models, hub.cfg.generation)
    assert len(ensembles) == 1 and len(engines) == 1
    assert hub.translate(sentences[0], beam=3) and len(ensembles) == 2
    # A setting changed on the hub's own config (not a keyword of the call): a generator for it.
    from omegaconf import open_dict

    with open_dict(hub.cfg.generation):
        hub.cfg.generation.max_len_b = 3
    assert len(hub.generate(hub.encode(sentences[0]), beam=2)[0]["tokens"]) <= 3 + 1 and len(ensembles) == 3
    # Another thread: its own generator and engine caches (a generator holds a call's state).
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(hub.task.build_generator(hub.models,
                                                                                      hub.cfg.generation)))
    thread.start()
    thread.join()
    assert elsewhere[0] is not generator and elsewhere[0].model.engine is not generator.model.engine


def test_a_changed_model_is_prepared_again(trained, monkeypatch):
    hub = load_hub(trained, "fp32")
    sentence = open(os.path.join(trained["data"], "raw", "test.src"), encoding="utf-8").readline().strip()
    before = hub.translate(sentence, beam=1)
    engines = count_calls(monkeypatch, engine_module.FastDecoderStep, "__init__")
    with torch.no_grad():  # written in place, as a training step or load_state_dict would
        hub.models[0].decoder.output_projection.weight.mul_(-1)
    after = hub.translate(sentence, beam=1)
    assert len(engines) == 1 and after != before
    with torch.no_grad():
        hub.models[0].decoder.output_projection.weight.mul_(-1)
    assert hub.translate(sentence, beam=1) == before and len(engines) == 2
