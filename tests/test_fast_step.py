"""The fast decoder step (kernels/decoder_step.py, task fast_step_translation): fairseq's logits for every
decoder layout it accepts, fairseq's hypotheses through the stock beam search and the greedy loop, a clear
refusal of every layout it does not implement, and the task flags through fairseq-generate."""

import argparse
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
import conftest
from conftest import USER_DIR, DictionaryTask, decode_on, plugins_cli, random_batch, run, word_dictionary
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.sequence_generator import SequenceGenerator

from fairseq_plugins.fast_step.generator import FastStepEarlyStoppingGenerator
from fairseq_plugins.kernels.decoder_step import FastDecoderStep, unsupported_reason
from fairseq_plugins.kernels.sequence_generator import FastStepSequenceGenerator
from fairseq_plugins.kernels.shortlist import Shortlist


def random_transformer(dictionary, seed=0, input_dim=None, **overrides):
    """A 2+2-layer, 32-d fairseq transformer with random weights and the given architecture flags (and, with
    ``input_dim``, target embeddings of that size projected in, as fairseq builds a decoder given them)."""
    torch.manual_seed(seed)
    args = argparse.Namespace(encoder_layers=2, decoder_layers=2, encoder_embed_dim=32, decoder_embed_dim=32,
                              encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                              decoder_attention_heads=4, max_source_positions=64, max_target_positions=64,
                              dropout=0.0, **overrides)
    base_architecture(args)
    model = TransformerModel.build_model(args, DictionaryTask(dictionary)).eval()
    if input_dim is not None:
        from fairseq.models.transformer import Embedding, Linear

        model.decoder.embed_tokens = Embedding(len(dictionary), input_dim, dictionary.pad())
        model.decoder.project_in_dim = Linear(input_dim, args.decoder_embed_dim, bias=False)
    with torch.no_grad():  # biases and norms away from their initial 0/1, so a dropped term shows
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name or "layernorm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


LAYOUTS = {
    "post-norm, sinusoidal, shared output": {"share_decoder_input_output_embed": True},
    "pre-norm": {"decoder_normalize_before": True, "encoder_normalize_before": True},
    "learned positions, separate output": {"decoder_learned_pos": True, "encoder_learned_pos": True},
    "embedding layer norm, no embedding scale": {"layernorm_embedding": True, "no_scale_embedding": True},
    "input/output projections": {"input_dim": 24, "decoder_output_dim": 24},
    "no positions": {"no_token_positional_embeddings": True},
    "gelu": {"activation_fn": "gelu", "decoder_normalize_before": True},
}


@pytest.mark.parametrize("fused", [True, False], ids=["native layer", "torch operations"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_engine_logits_are_fairseqs_for_every_supported_layout(layout, fused):
    from fairseq_plugins.kernels import native

    dictionary = word_dictionary()
    model = random_transformer(dictionary, **LAYOUTS[layout])
    assert unsupported_reason(model.decoder) is None
    if layout == "input/output projections":
        assert model.decoder.project_in_dim is not None and model.decoder.project_out_dim is not None
    sample = random_batch(dictionary, 3, src_len=7, seed=1)  # padded sources: the attention mask is used
    if fused and not native.available():
        pytest.skip("the native kernels could not be built here")
    engine = FastDecoderStep(model.decoder, fused=fused)
    assert (engine.native_layers is not None) == fused
    prefix = torch.randint(dictionary.nspecial, len(dictionary), (3, 9), generator=torch.Generator().manual_seed(2))
    prefix[:, 0] = dictionary.eos()
    with torch.no_grad():
        encoder_out = model.encoder(**sample["net_input"])
        expected = model.decoder(prefix, encoder_out=encoder_out)[0]  # the full forward, all positions at once
        engine.start(encoder_out, max_steps=4)  # 9 steps: the caches grow twice
        for t in range(prefix.size(1)):
            logits = engine.logits(engine.step(prefix[:, t]))
            torch.testing.assert_close(logits, expected[:, t], rtol=0, atol=2e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["native layer", "torch operations"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_blocks_of_positions_and_rollback_give_fairseqs_logits(layout, fused):
    """block_step (blockwise decoding's verification: several positions of one sentence in one pass) gives at
    every position the logits of fairseq's full forward, also after a rejected tail is taken back; the
    capacity grows inside a block."""
    from fairseq_plugins.kernels import native

    if fused and not native.available():
        pytest.skip("the native kernels could not be built here")
    dictionary = word_dictionary()
    model = random_transformer(dictionary, **LAYOUTS[layout])
    sample = random_batch(dictionary, 1, src_len=7, seed=1)
    sample["net_input"]["src_tokens"][0, :2] = dictionary.pad()  # left padding: the source mask is used
    sample["net_input"]["src_lengths"][0] = 5
    prefix = torch.randint(dictionary.nspecial, len(dictionary), (1, 12), generator=torch.Generator().manual_seed(2))
    prefix[:, 0] = dictionary.eos()
    wrong = (prefix + 1) % len(dictionary)  # a tail that will be taken back
    engine = FastDecoderStep(model.decoder, fused=fused)
    assert (engine.native_layers is not None) == fused
    with torch.no_grad():
        encoder_out = model.encoder(**sample["net_input"])
        expected = model.decoder(prefix, encoder_out=encoder_out)[0][0]
        engine.start(encoder_out, max_steps=3)
        position = 0
        for size, accepted in ((1, 1), (4, 2), (5, 5), (3, 1), (2, 2)):  # 11 positions; then one step
            block = torch.cat([prefix[0, position:position + accepted], wrong[0, position + accepted:
                                                                               position + size]])
            logits = engine.logits(engine.block_step(block))
            assert engine.length == position + size
            torch.testing.assert_close(logits[:accepted], expected[position:position + accepted], rtol=0, atol=2e-5)
            position += accepted
            engine.truncate(position)
        torch.testing.assert_close(engine.logits(engine.step(prefix[:, position]))[0], expected[position],
                                   rtol=0, atol=2e-5)
        with pytest.raises(ValueError, match="truncate to 13: the prefix has 12 positions"):
            engine.truncate(13)


@pytest.mark.parametrize("fused", [True, False], ids=["native layer", "torch operations"])
def test_rows_that_keep_different_parts_of_their_blocks_get_fairseqs_logits(fused):
    """A batch whose sentences keep different numbers of their blocks (blockwise decoding's acceptance,
    ``keep_block``): every row's logits stay those of fairseq's full forward on that row's own prefix, through
    a dropped row, the caches' growth and a plain step after; ``truncate`` then refuses."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    sample = random_batch(dictionary, 3, src_len=7, seed=1)
    sample["net_input"]["src_tokens"][1, :2] = dictionary.pad()  # left padding: the source mask is used
    sample["net_input"]["src_lengths"][1] = 5
    prefix = torch.randint(dictionary.nspecial, len(dictionary), (3, 16), generator=torch.Generator().manual_seed(2))
    prefix[:, 0] = dictionary.eos()
    wrong = (prefix + 1) % len(dictionary)
    engine = FastDecoderStep(model.decoder, fused=fused)
    masked_native_calls = []
    if fused:
        from fairseq_plugins.kernels import native

        if not native.available():
            pytest.skip("the native kernels could not be built here")
        layer_step = engine.layer_step
        engine.layer_step = lambda *a, **k: masked_native_calls.append(k["self_attend"] is not None) or layer_step(
            *a, **k)
    with torch.no_grad():
        encoder_out = model.encoder(**sample["net_input"])
        expected = model.decoder(prefix, encoder_out=encoder_out)[0]  # (3, 16, V)
        engine.start(encoder_out, max_steps=4)
        rows = [0, 1, 2]  # the sentence of each engine row
        position = torch.zeros(3, dtype=torch.long)  # each sentence's kept prefix
        # (block size, positions each live row keeps); sentence 1 leaves after the fourth block
        for call, (size, keeps) in enumerate(((1, [1, 1, 1]), (3, [1, 3, 2]), (4, [4, 1, 2]), (2, [2, 2, 1]),
                                              (5, [2, 5]), (3, [3, 1]))):
            block = torch.stack([torch.cat([prefix[r, position[r]:position[r] + k],
                                            wrong[r, position[r] + k:position[r] + size]])
                                 for r, k in zip(rows, keeps)])
            start = engine.length
            logits = engine.logits(engine.block_step(block)).view(len(rows), size, -1)
            for i, (r, k) in enumerate(zip(rows, keeps)):
                torch.testing.assert_close(logits[i, :k], expected[r, position[r]:position[r] + k], rtol=0, atol=2e-5)
                position[r] += k
            engine.keep_block(start, torch.tensor(keeps))
            assert engine.length == start + max(keeps)
            if call == 3:
                engine.reorder(torch.tensor([0, 2]))
                rows = [0, 2]
        assert engine.row_lengths.tolist() == position[rows].tolist()
        steps = engine.logits(engine.step(prefix[rows, position[rows]]))
        for i, r in enumerate(rows):
            torch.testing.assert_close(steps[i], expected[r, position[r]], rtol=0, atol=2e-5)
        assert any(masked_native_calls) == fused  # the native layer ran on rows with masks (12 rows at most)
        with pytest.raises(ValueError, match="the rows' prefixes differ in length"):
            engine.truncate(3)
        with pytest.raises(ValueError, match=r"keep_block\(0, \[1\]\): the engine holds 2 rows"):
            engine.keep_block(0, torch.tensor([1]))


def test_a_block_of_the_int8_engine_is_its_steps():
    """int8: a block's positions are the rows of one product, each with its own activation scale, so the
    block gives what the same positions one step at a time give."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    sample = random_batch(dictionary, 1, src_len=7, seed=1)
    prefix = torch.randint(dictionary.nspecial, len(dictionary), (1, 8), generator=torch.Generator().manual_seed(5))
    engine = FastDecoderStep(model.decoder, "int8")
    with torch.no_grad():
        encoder_out = model.encoder(**sample["net_input"])
        engine.start(encoder_out)
        steps = torch.cat([engine.logits(engine.step(prefix[:, t])) for t in range(8)])
        engine.start(encoder_out)
        blocks = torch.cat([engine.logits(engine.block_step(prefix[0, :3])),
                            engine.logits(engine.block_step(prefix[0, 3:]))])
    torch.testing.assert_close(blocks, steps, rtol=0, atol=1e-4)


def test_a_padded_sentence_alone_gets_the_stock_greedy_output():
    """Batch 1 with the sentence left-padded (as ``random_batch`` pads it): the fast step's greedy decoding masks
    the padding (the native one-call greedy search, which attends over every source position, is not taken)."""
    dictionary = word_dictionary()
    model = random_transformer(dictionary, seed=3)
    for seed in range(3):
        sample = random_batch(dictionary, bsz=1, seed=seed)
        assert sample["net_input"]["src_lengths"][0] < sample["net_input"]["src_tokens"].size(1)  # padded

        def generator(cls):
            return lambda m: cls([m], dictionary, beam_size=1, max_len_b=12)

        cpu = torch.device("cpu")
        conftest.assert_same_hypotheses(decode_on(cpu, generator(FastStepSequenceGenerator), model, sample),
                                        decode_on(cpu, generator(SequenceGenerator), model, sample))


def test_reorder_keeps_the_named_rows_and_their_sources():
    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    sample = random_batch(dictionary, 4, seed=3)
    prefix = torch.randint(dictionary.nspecial, len(dictionary), (4, 6), generator=torch.Generator().manual_seed(4))
    prefix[:, 0] = dictionary.eos()
    engine = FastDecoderStep(model.decoder)
    order = torch.tensor([2, 0])  # sentences 2 and 0 stay, in that order
    with torch.no_grad():
        encoder_out = model.encoder(**sample["net_input"])
        kept = model.encoder.reorder_encoder_out(encoder_out, order)
        expected = model.decoder(prefix[order], encoder_out=kept)[0]
        engine.start(encoder_out)
        for t in range(3):
            engine.step(prefix[:, t])
        engine.reorder(order)
        for t in range(3, 6):
            logits = engine.logits(engine.step(prefix[order, t]))
            torch.testing.assert_close(logits, expected[:, t], rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_fused_int8_layer_is_the_int8_layer_of_torch_operations(layout):
    """The native whole-layer step (layer_step.c) against the same int8 matrices between torch operations,
    through a reorder that drops and permutes rows. Its float sums run in another order, so a product input within 1e-7 of a
    rounding boundary may round the other way: rarely, a row differs by about one int8 step (~1e-2 here; it
    happens as often with the torch path's own input perturbed by 1e-6). A wrong layer (a norm in the wrong
    place, a cache slot off by one, a mask ignored) differs in every row."""
    from fairseq_plugins.kernels import native

    if native.backend() != "native":
        pytest.skip("the native int8 kernel is not available")
    dictionary = word_dictionary()
    model = random_transformer(dictionary, **LAYOUTS[layout])
    sample = random_batch(dictionary, 4, src_len=7, seed=1)
    fused, torch_ops = FastDecoderStep(model.decoder, "int8"), FastDecoderStep(model.decoder, "int8", fused=False)
    assert fused.native_layers is not None and torch_ops.native_layers is None
    prefix = torch.randint(dictionary.nspecial, len(dictionary), (4, 10), generator=torch.Generator().manual_seed(2))
    prefix[:, 0] = dictionary.eos()
    order, rows = torch.tensor([3, 1, 1]), torch.arange(4)
    differences = []
    with torch.no_grad():
        encoder_out = model.encoder(**sample["net_input"])
        for engine in (fused, torch_ops):
            engine.start(encoder_out, max_steps=4)  # the caches grow
        for t in range(prefix.size(1)):
            if t == 5:
                for engine in (fused, torch_ops):
                    engine.reorder(order)
                rows = order
            features = [engine.step(prefix[rows, t]) for engine in (fused, torch_ops)]
            differences += (features[0] - features[1]).abs().amax(1).tolist()
    close = sum(d < 1e-5 for d in differences)
    assert close >= 0.9 * len(differences) and max(differences) < 0.1, differences


def test_a_layer_the_fused_kernel_does_not_implement_runs_as_torch_operations():
    model = random_transformer(word_dictionary(), activation_fn="tanh")
    engine = FastDecoderStep(model.decoder, "int8")
    assert engine.native_layers is None and engine.layers[0].native is None
    assert FastDecoderStep(model.decoder, "fp32").native_layers is None


@pytest.mark.parametrize("overrides, reason", [
    ({"cross_self_attention": True}, "--cross-self-attention"),
    ({"no_decoder_final_norm": False, "scale_attn": True}, "NormFormer"),
    ({"adaptive_softmax_cutoff": "10", "criterion": "adaptive_loss"}, "adaptive softmax"),
])
def test_unsupported_layouts_are_named(overrides, reason):
    model = random_transformer(word_dictionary(), **overrides)
    assert reason in unsupported_reason(model.decoder)
    with pytest.raises(ValueError, match="does not support this model: .*" + reason):
        FastDecoderStep(model.decoder)


def test_a_decoder_that_is_not_a_transformer_is_refused():
    from fairseq.models.lstm import LSTMDecoder

    decoder = LSTMDecoder(word_dictionary(), embed_dim=8, hidden_size=8, out_embed_dim=8, encoder_output_units=8)
    assert "is not a fairseq TransformerDecoder" in unsupported_reason(decoder)


def test_the_int8_encoder_names_what_it_cannot_convert():
    from fairseq.models.lstm import LSTMEncoder

    from fairseq_plugins.kernels.int8 import int8_encoder, int8_encoder_unsupported_reason

    model = random_transformer(word_dictionary())
    assert int8_encoder_unsupported_reason(model.encoder) is None
    model.encoder.layers[1].self_attn.add_zero_attn = True
    reason = int8_encoder_unsupported_reason(model.encoder)
    assert reason.startswith("encoder layer 1 (TransformerEncoderLayer") and "--add-zero-attn" in reason, reason
    with pytest.raises(ValueError, match=r"int8 encoder: encoder layer 1 .*--add-zero-attn"):
        int8_encoder(model.encoder)
    lstm = LSTMEncoder(word_dictionary(), embed_dim=8, hidden_size=8)
    assert int8_encoder_unsupported_reason(lstm) == "LSTMEncoder has no transformer encoder layers"


# ---- the trained tiny baseline: hypotheses through fairseq's generators ---------------------------------------

def load(checkpoint, batch_size):
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint])
    task.load_dataset("test", task_cfg=cfg.task)
    dataset = task.dataset("test")
    batches = [dataset.collater([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
               for start in range(0, len(dataset), batch_size)]
    return models[0].eval(), task, batches


def hypotheses_by_id(generator, model, batches):
    by_id = {}
    with torch.no_grad():
        for batch in batches:
            for sentence, hyps in zip(batch["id"].tolist(), generator.generate([model], batch)):
                by_id[sentence] = [(h["tokens"].tolist(), float(h["score"]), h["positional_scores"]) for h in hyps]
    return [by_id[sentence] for sentence in sorted(by_id)]


def assert_same_hypotheses(fast, stock, scores=True):
    assert len(fast) == len(stock) == 40
    for sentence, (mine, theirs) in enumerate(zip(fast, stock)):
        assert [h[0] for h in mine] == [h[0] for h in theirs], sentence  # every n-best list, token for token
        if not scores:
            continue
        for (_, score, positional), (_, their_score, their_positional) in zip(mine, theirs):
            assert abs(score - their_score) < 1e-4, sentence
            torch.testing.assert_close(positional, their_positional, rtol=0, atol=1e-4)


GENERATOR_SETTINGS = {
    "greedy": {"beam_size": 1},
    "greedy, min/max length, unk penalty, length penalty": {"beam_size": 1, "min_len": 3, "max_len_b": 6,
                                                            "max_len_a": 0, "unk_penalty": 0.5, "len_penalty": 0.5},
    "greedy, no-repeat bigrams (fairseq's beam search)": {"beam_size": 1, "no_repeat_ngram_size": 2},
    "beam 5": {"beam_size": 5},
    "beam 5, unnormalized scores": {"beam_size": 5, "normalize_scores": False},
}


@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("setting", sorted(GENERATOR_SETTINGS))
def test_fast_step_gives_the_stock_generators_hypotheses(trained, setting, batch_size):
    model, task, batches = load(trained["checkpoint"], batch_size)
    kwargs = GENERATOR_SETTINGS[setting]
    stock = SequenceGenerator([model], task.target_dictionary, **kwargs)
    fast = FastStepSequenceGenerator([model], task.target_dictionary, **kwargs)
    assert_same_hypotheses(hypotheses_by_id(fast, model, batches), hypotheses_by_id(stock, model, batches))
    assert fast.generation_stats()["sentences"] == 40 and fast.generation_stats()["decoder_calls"] > len(batches)


def test_greedy_loop_is_taken_only_where_it_is_fairseqs_search(trained):
    model, task, _ = load(trained["checkpoint"], 1)
    plain = FastStepSequenceGenerator([model], task.target_dictionary, beam_size=1)
    assert plain._plain_greedy(None, None, None)
    for kwargs in ({"beam_size": 5}, {"beam_size": 1, "no_repeat_ngram_size": 2}, {"beam_size": 1, "match_source_len": True}):
        assert not FastStepSequenceGenerator([model], task.target_dictionary, **kwargs)._plain_greedy(None, None, None)
    assert not plain._plain_greedy(torch.ones(1, 1, dtype=torch.long), None, None)  # --prefix-size


@pytest.fixture(scope="module")
def lists(trained, tmp_path_factory):
    """Candidate lists of the tiny baseline: top 20 (+ 20 frequent), and lists that hold every word."""
    work = tmp_path_factory.mktemp("fast_step_lists")
    data = trained["data"]
    tok = os.path.join(data, "tok")
    run("fairseq_plugins.cli", "align", "--source", os.path.join(tok, "train.src"), "--target",
        os.path.join(tok, "train.tgt"), "--output", work / "train.align", "--lexical-table", work / "lex.txt")
    paths = {}
    for name, size in (("top20", 20), ("everything", 1000)):
        paths[name] = str(work / f"{name}.pt")
        run("fairseq_plugins.cli", "shortlist", "--lexical-table", work / "lex.txt", "--data-bin",
            os.path.join(data, "bin"), "-s", "src", "-t", "tgt", "--top", size, "--frequent", size, "--output", paths[name])
    return paths


def test_lists_that_hold_every_word_give_the_full_softmaxs_greedy_output(trained, lists):
    model, task, batches = load(trained["checkpoint"], 16)
    everything = Shortlist.load(lists["everything"], task.source_dictionary, task.target_dictionary)
    fast = FastStepSequenceGenerator([model], task.target_dictionary, beam_size=1, shortlist=everything)
    stock = SequenceGenerator([model], task.target_dictionary, beam_size=1)
    # The same argmax at every step, so the same output; not the same scores, since a list leaves out the
    # symbols no translation is (<s>, <pad>, the dictionary's padding words), whose probabilities the full
    # softmax includes. (At beam > 1 that changes how hypotheses rank, so only greedy is compared.)
    assert_same_hypotheses(hypotheses_by_id(fast, model, batches), hypotheses_by_id(stock, model, batches),
                           scores=False)


@pytest.mark.parametrize("setting", ["greedy", "greedy, min/max length, unk penalty, length penalty", "beam 5"])
def test_a_list_of_every_symbol_gives_the_full_softmaxs_hypotheses_and_scores(trained, lists, setting):
    """At beam 1 the greedy loop works in the lists' columns (its own pad/unk/EOS and length rules): with a
    list of every symbol it must be the stock generator over the whole vocabulary."""
    model, task, batches = load(trained["checkpoint"], 16)
    built = Shortlist.load(lists["everything"], task.source_dictionary, task.target_dictionary)
    every_symbol = Shortlist(built.translations, built.frequent, torch.arange(len(task.target_dictionary)),
                             built.source_fingerprint, built.target_fingerprint, built.target_size, built.meta)
    settings = GENERATOR_SETTINGS[setting]
    fast = FastStepSequenceGenerator([model], task.target_dictionary, shortlist=every_symbol, **settings)
    stock = SequenceGenerator([model], task.target_dictionary, **settings)
    assert_same_hypotheses(hypotheses_by_id(fast, model, batches), hypotheses_by_id(stock, model, batches))


@pytest.mark.parametrize("beam", [1, 5])
def test_int8_and_short_lists_do_not_depend_on_the_batch(trained, lists, beam):
    model, task, batches = load(trained["checkpoint"], 16)
    _, _, singles = load(trained["checkpoint"], 1)
    top20 = Shortlist.load(lists["top20"], task.source_dictionary, task.target_dictionary)
    generator = FastStepSequenceGenerator([model], task.target_dictionary, beam_size=beam, precision="int8",
                                          shortlist=top20)
    fp32 = FastDecoderStep(model.decoder)
    with torch.no_grad():  # int8 arithmetic ran: the first step's logits differ from float32's, a little
        encoder_out = model.encoder.forward_torchscript(batches[0]["net_input"])
        start = torch.full((16,), task.target_dictionary.eos())
        logits = [engine.start(encoder_out) or engine.logits(engine.step(start)) for engine in (generator.model.engine, fp32)]
    assert 0 < (logits[0] - logits[1]).abs().max() < 0.5
    together, alone = hypotheses_by_id(generator, model, batches), hypotheses_by_id(generator, model, singles)
    assert [[h[0] for h in n_best] for n_best in together] == [[h[0] for h in n_best] for n_best in alone]
    stats = generator.generation_stats()
    assert stats["precision"] == "int8" and 20 <= stats["candidates_per_sentence"] < len(task.target_dictionary)


# ---- early stopping: the project's beam search over the fast step -------------------------------------------

@pytest.mark.parametrize("batch_size", [1, 16])
def test_early_stopping_with_an_infinite_delta_gives_the_stock_beam_search(trained, batch_size):
    model, task, batches = load(trained["checkpoint"], batch_size)
    stock = SequenceGenerator([model], task.target_dictionary, beam_size=5)
    fast = FastStepEarlyStoppingGenerator([model], task.target_dictionary, beam=5, early_stop_delta=math.inf, nbest=5)
    assert_same_hypotheses(hypotheses_by_id(fast, model, batches), hypotheses_by_id(stock, model, batches))
    assert fast.generation_stats()["stopped_early"] == 0


@pytest.mark.parametrize("delta", [0.0, 1.0])
def test_early_stopping_on_the_fast_step_is_the_same_search_as_on_fairseqs_decoder(trained, delta):
    """The fast step changes how a step is computed, not the search: its early-stopped hypotheses are those of
    the same search over fairseq's own incremental decoder (rnn_fc's generic path), sentence by sentence."""
    from fairseq_plugins.rnn_fc.generator import RnnFcGenerator

    model, task, batches = load(trained["checkpoint"], 1)
    fast = FastStepEarlyStoppingGenerator([model], task.target_dictionary, beam=5, early_stop_delta=delta, nbest=5)
    fairseq_steps = RnnFcGenerator([model], task.target_dictionary, beam=5, early_stop_delta=delta, nbest=5)
    assert_same_hypotheses(hypotheses_by_id(fast, model, batches), hypotheses_by_id(fairseq_steps, model, batches))
    stopped = fast.generation_stats()["stopped_early"]
    assert stopped == fairseq_steps.generation_stats()["stopped_early"] and stopped > 0


# ---- fairseq-generate --task fast_step_translation ------------------------------------------------------------

def generate(trained, *flags, check=True):
    return run("fairseq_cli.generate", os.path.join(trained["data"], "bin"), "--user-dir", USER_DIR,
               "--path", trained["checkpoint"], "--gen-subset", "test", "--batch-size", 8, *flags, check=check)


def hypothesis_lines(stdout):
    """H-, D- and P- lines as (line id, scores, text), in id order."""
    def parsed(line):
        fields = line.split("\t")
        if line.startswith("P-"):
            return fields[0], [float(x) for x in fields[1].split()], ""
        return fields[0], [float(fields[1])], fields[2]
    return sorted((parsed(line) for line in stdout.splitlines() if line[:2] in ("H-", "D-", "P-")),
                  key=lambda line: line[0])


def assert_same_lines(fast, stock):
    """The same texts; scores equal to float32 rounding (fairseq prints P- scores to 4 decimals, so one may
    round the other way: one unit of the last printed digit)."""
    assert [(key, len(scores), text) for key, scores, text in fast] == [(key, len(scores), text) for key, scores, text in stock]
    for (key, scores, _), (_, their_scores, _) in zip(fast, stock):
        assert max(abs(a - b) for a, b in zip(scores, their_scores)) < 1.5e-4, key


@pytest.mark.parametrize("beam", [1, 5])
def test_fairseq_generate_with_fast_step_prints_the_stock_output(trained, beam):
    stock = generate(trained, "--task", "translation", "--beam", beam)
    fast = generate(trained, "--task", "fast_step_translation", "--fast-step", "--beam", beam)
    assert len(hypothesis_lines(stock.stdout)) == 120
    assert_same_lines(hypothesis_lines(fast.stdout), hypothesis_lines(stock.stdout))


def test_fairseq_generate_with_int8_lists_and_early_stopping(trained, lists):
    """The fast CPU decoder for any fairseq transformer, every switch on, through fairseq-generate: the beam-5
    search ends sentences early and each sentence's output stays within its candidate list."""
    result = generate(trained, "--task", "fast_step_translation", "--fast-step", "--fast-step-precision", "int8",
                      "--fast-step-shortlist", lists["top20"], "--fast-step-early-stop", "--beam", 5)
    assert len([line for line in result.stdout.splitlines() if line.startswith("H-")]) == 40
    summary = [line for line in result.stderr.splitlines() if "fast step decoding: 40 sentences" in line]
    assert summary and "precision=int8" in summary[0] and "early_stop_delta=3.0" in summary[0], result.stderr[-1500:]


@pytest.mark.parametrize("flags, message", [
    (["--fast-step-precision", "int8"], "--fast-step-precision: only used with --fast-step"),
    (["--fast-step-shortlist", "list.pt"], "--fast-step-shortlist: only used with --fast-step"),
    (["--fast-step", "--print-alignment"], "--print-alignment: not supported with --fast-step"),
    (["--fast-step", "--fast-step-shortlist", "/nonexistent/list.pt"], "/nonexistent/list.pt"),
    (["--fast-step-early-stop"], "--fast-step-early-stop: only used with --fast-step"),
    (["--fast-step", "--fast-step-early-stop", "--fast-step-early-stop-delta", "-1"],
     "--fast-step-early-stop-delta -1.0: must be >= 0"),
    (["--fast-step", "--fast-step-early-stop", "--no-repeat-ngram-size", "2"],
     "--no-repeat-ngram-size: not supported with --fast-step-early-stop"),
])
def test_fairseq_generate_refuses_what_the_fast_step_cannot_do(trained, flags, message):
    result = generate(trained, "--task", "fast_step_translation", *flags, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-1500:]


# ---- bench --method fast_step ---------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [1, 8])
def test_bench_of_the_fast_step_decodes_what_the_stock_generator_decodes(trained, tmp_path, batch_size):
    """bench --method fast_step (fp32, beam 5) against the stock generator on the same model: every sentence's
    output the stock one, at batch 1 and batch 8; the statistics count the timed sentences once."""
    result_path = tmp_path / "fast_step.json"
    plugins_cli("bench", "--method", "fast_step", "--path", trained["checkpoint"], "--data", trained["data"],
                "--threads", 1, "--runs", 1, "--beam", 5, "--batch-size", batch_size, "--limit", 16,
                "--json", result_path, "--fast-step")
    result = json.loads(result_path.read_text())
    assert result["batch_size"] == batch_size and result["sentences"] == 16
    assert result["stats"]["outputs_identical_to_baseline"] == 1.0 and result["bleu"] == result["baseline"]["bleu"]


@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_linear_runs_few_rows_on_the_native_kernel_and_equals_f_linear(with_bias, monkeypatch):
    """Up to NATIVE_MAX_ROWS rows go through the native float kernel (faster there than oneDNN or MKL between a
    step's other products), more through oneDNN's packed weight; every row count, also as (1, m, d) blocks,
    gives F.linear's values up to summation order."""
    from fairseq_plugins.kernels import native
    from fairseq_plugins.kernels import packed_linear
    from fairseq_plugins.kernels.packed_linear import NATIVE_MAX_ROWS, PackedLinear

    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(37, 20, generator=generator), torch.randn(37, generator=generator)
    linear = PackedLinear(weight, bias if with_bias else None)
    if linear.packed is None or not linear.native:
        pytest.skip("oneDNN or the native kernels are missing here")
    native_rows = []
    product = native.float_product
    monkeypatch.setattr(packed_linear.native, "float_product",
                        lambda x, w, b: native_rows.append(x.size(0)) or product(x, w, b))
    for rows in range(1, 8):
        x = torch.randn(1, rows, 20, generator=generator)
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias if with_bias else None), rtol=0, atol=1e-5)
        torch.testing.assert_close(linear(x[0]), F.linear(x[0], weight, bias if with_bias else None), rtol=0,
                                   atol=1e-5)
    assert native_rows == [rows for rows in range(1, NATIVE_MAX_ROWS + 1) for _ in range(2)]
    with pytest.raises(ValueError, match="fp_float_gemm"):
        product(torch.randn(2, 21), weight, None)
