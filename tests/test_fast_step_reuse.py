"""The fast step is built once per loaded model: every generator fairseq builds from it (a ``hub.translate``
call builds one each time) reuses the prepared weights, and gives what a generator built once gives; a changed
model is prepared again."""

import os

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
    # nor checked again (the model passed with these parameters), one ensemble a generator (the fast step's)
    assert checks == [] and len(ensembles) == len(sentences) - 1
    assert fast_step_flags._PASSED[hub.models[0]]
    # ... and the same translations as one generator built once decoding them all.
    assert first + rest == hub.translate(sentences, beam=2)
    generator = hub.task.build_generator(hub.models, hub.cfg.generation)
    assert generator.model.engine is not hub.task.build_generator(hub.models, hub.cfg.generation).model.engine


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
