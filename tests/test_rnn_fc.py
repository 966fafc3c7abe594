"""Fast CPU decoding (Devlin 2017): the rnn_fc model, the exact speedups, candidate lists, int8, early stopping."""

import argparse
import json
import math
import os

import pytest
import torch

from conftest import DictionaryTask, plugins_cli, random_batch, run, train_flags, train_tiny, word_dictionary

from fairseq_plugins.tools.align import align_corpus, read_systran_probabilities
from fairseq_plugins.common.textio import InputError
from fairseq_plugins.kernels import native
from fairseq_plugins.kernels.int8 import Int8Linear
from fairseq_plugins.rnn_fc.generator import RnnFcGenerator
from fairseq_plugins.rnn_fc.model import RnnFcModel, rnn_fc_tiny
from fairseq_plugins.kernels.shortlist import Shortlist, read_lexical_table
from fairseq_plugins.common.beam_search import BeamSearch
from fairseq_plugins.rnn_fc.steppers import SPEEDUPS

USER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fairseq_plugins")


def tiny_model(dictionary, top="tanh", **overrides):
    args = argparse.Namespace(rnn_fc_top=top, **overrides)
    rnn_fc_tiny(args)
    torch.manual_seed(0)
    return RnnFcModel.build_model(args, DictionaryTask(dictionary)).eval()


# --- the model ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("top,encoder", [("tanh", "bigru"), ("gru", "bigru"), ("tanh", "transformer")])
def test_incremental_decoding_equals_the_full_forward_pass(top, encoder):
    dictionary = word_dictionary()
    model = tiny_model(dictionary, top, rnn_fc_encoder=encoder)
    sample = random_batch(dictionary, 3)
    src, lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
    prev = torch.randint(dictionary.nspecial, len(dictionary), (3, 6))
    prev[:, 0] = dictionary.eos()
    with torch.no_grad():
        full, _ = model(src, lengths, prev)
        encoder_out = model.encoder(src, lengths)
        state, steps = {}, []
        for t in range(prev.size(1)):
            steps.append(model.decoder(prev[:, :t + 1], encoder_out, incremental_state=state)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("encoder", ["bigru", "transformer"])
def test_left_and_right_padded_sources_encode_alike(encoder):
    dictionary = word_dictionary()
    model = tiny_model(dictionary, rnn_fc_encoder=encoder)
    sample = random_batch(dictionary, 4)
    src, lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
    with torch.no_grad():
        batched = model.encoder(src, lengths)
        for i in range(4):
            alone = model.encoder(src[i:i + 1, src.size(1) - int(lengths[i]):], lengths[i:i + 1])
            n, real = int(lengths[i]), ~batched["encoder_padding_mask"][0][i]
            # the BiGRU moves padding to the right; the transformer keeps fairseq's left padding
            assert int(real.sum()) == n and bool(real[:n].all() if encoder == "bigru" else real[-n:].all())
            torch.testing.assert_close(batched["encoder_out"][0][i, real], alone["encoder_out"][0][0], rtol=1e-5,
                                       atol=1e-5)
            torch.testing.assert_close(batched["decoder_init_state"][0][i], alone["decoder_init_state"][0][0],
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["residual", "paper"])
def test_weight_clipping_keeps_every_matrix_in_range_during_training(layout):
    dictionary = word_dictionary()
    model = tiny_model(dictionary, rnn_fc_weight_clip=0.05, rnn_fc_activation_clip=1.0, rnn_fc_fc_layout=layout).train()
    with torch.no_grad():
        for param in model.clipped_weights():
            param.mul_(10)
    sample = random_batch(dictionary, 2)
    prev = torch.full((2, 3), dictionary.eos())
    model(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"], prev)
    weights = list(model.clipped_weights())
    assert len(weights) > 10 and all(float(w.abs().max()) <= 0.05 + 1e-7 for w in weights)
    assert float(model.encoder.embed_tokens.weight.abs().max()) > 0.05  # embeddings are not clipped
    with torch.no_grad():
        features = model.decoder.fc_stack(torch.randn(4, 64) * 100, torch.randn(4, 128) * 100)
    assert float(features.abs().max()) <= 1.0


def test_weight_clipping_leaves_a_transformer_encoder_alone():
    """A transformer encoder comes from an unclipped training (--rnn-fc-base-checkpoint): clipping it would
    change the model it starts from. The decoder's matrices are still clipped, the first-state projection too."""
    dictionary = word_dictionary()
    model = tiny_model(dictionary, rnn_fc_encoder="transformer", rnn_fc_weight_clip=0.05).train()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(10)
    before = {name: param.clone() for name, param in model.encoder.named_parameters()}
    sample = random_batch(dictionary, 2)
    model(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"], torch.full((2, 3), dictionary.eos()))
    for name, param in model.encoder.named_parameters():
        if name.startswith("init_state.weight"):
            assert float(param.abs().max()) <= 0.05 + 1e-7
        else:
            assert torch.equal(param, before[name]), name
    clipped = list(model.clipped_weights())
    assert float(model.encoder.layers[0].fc1.weight.abs().max()) > 0.05
    assert len(clipped) > 5 and all(float(w.abs().max()) <= 0.05 + 1e-7 for w in clipped)


def multi30k_decoder(layout, layers, init="he"):
    from fairseq_plugins.rnn_fc.model import RnnFcDecoder, rnn_fc_multi30k

    args = argparse.Namespace(rnn_fc_fc_layout=layout, rnn_fc_fc_layers=layers, rnn_fc_fc_init=init)
    rnn_fc_multi30k(args)
    dictionary = word_dictionary()
    torch.manual_seed(0)
    return RnnFcDecoder(args, dictionary, torch.nn.Embedding(len(dictionary), args.decoder_embed_dim),
                        2 * args.encoder_hidden_size).eval()


def input_dependent_share(decoder):
    """The share of the top layer's output (second moment) that varies with the stack's input, over 1,000 random
    [h; c]."""
    generator = torch.Generator().manual_seed(1)
    state = torch.tanh(torch.randn(1000, 256, generator=generator))
    context = 0.5 * torch.randn(1000, 512, generator=generator)
    with torch.no_grad():
        out = torch.tanh(decoder.top_layer(decoder.fc_stack(state, context)))
    return float(out.var(0).mean() / out.pow(2).mean())


@pytest.mark.parametrize("layers", [4, 8])
def test_the_residual_fc_stack_passes_its_input_through_at_initialisation(layers):
    """The residual stack keeps the input-dependent share above 0.95; the paper's stack loses most of it with
    depth (ReLU outputs and skips that only add non-negative values), which is why it is not the default."""
    assert input_dependent_share(multi30k_decoder("residual", layers)) > 0.95
    assert input_dependent_share(multi30k_decoder("paper", layers)) < 0.5
    residual = multi30k_decoder("residual", layers)
    assert len(residual.fc_layers) == layers and residual.fc_input is not None
    assert all(float(layer.bias.abs().max()) == 0 for layer in residual.fc_layers)


def test_he_initialisation_keeps_the_paper_stack_sensitive_to_its_input():
    """--rnn-fc-fc-init torch (nn.Linear's default, the first models' initialisation) leaves 8 paper-layout
    layers' output 4 times less dependent on the input than He initialisation does (0.04 against 0.17), and
    its biases are not zero."""
    torch_init, he_init = multi30k_decoder("paper", 8, "torch"), multi30k_decoder("paper", 8, "he")
    assert input_dependent_share(torch_init) < 0.5 * input_dependent_share(he_init)
    assert all(float(layer.bias.abs().max()) > 0 for layer in torch_init.fc_layers)
    with pytest.raises(ValueError, match="--rnn-fc-fc-init"):
        multi30k_decoder("paper", 2, "xavier")


def reversal_batch(dictionary, size, generator, longest=6):
    """Random word sequences of 2..longest words (left-padded) and their reversals (right-padded), as
    src_tokens, src_lengths, prev_output_tokens, target."""
    pad, eos = dictionary.pad(), dictionary.eos()
    lengths = torch.randint(2, longest + 1, (size,), generator=generator)
    src = torch.full((size, longest), pad)
    target, prev = torch.full((size, longest + 1), pad), torch.full((size, longest + 1), pad)
    for i, n in enumerate(lengths.tolist()):
        words = torch.randint(dictionary.nspecial, len(dictionary), (n,), generator=generator)
        src[i, longest - n:] = words
        target[i, :n], target[i, n] = words.flip(0), eos
        prev[i, 0], prev[i, 1:n + 1] = eos, words.flip(0)
    return src, lengths, prev, target


def test_a_tiny_rnn_fc_learns_to_reverse_its_source_and_uses_it():
    """Behaviour, not just shapes: 150 Adam updates of 32 sequences teach rnn_fc_tiny (4 residual FC layers) to
    reverse a 20-word vocabulary's sequences (held-out NLL < 0.1 nats a token, measured 0.02); with each
    source swapped for another sentence's, the same targets cost > 3 nats a token (measured 6.2)."""
    dictionary = word_dictionary(20)
    model = tiny_model(dictionary, rnn_fc_fc_layers=4, dropout=0.0, rnn_fc_fc_dropout=0.0).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    pad = dictionary.pad()
    for _ in range(150):
        src, lengths, prev, target = reversal_batch(dictionary, 32, generator)
        logits, _ = model(src, lengths, prev)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=pad)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    src, lengths, prev, target = reversal_batch(dictionary, 200, torch.Generator().manual_seed(99))
    with torch.no_grad():
        own = torch.nn.functional.cross_entropy(model(src, lengths, prev)[0].transpose(1, 2), target, ignore_index=pad)
        swapped = model(src.roll(1, 0), lengths.roll(1, 0), prev)[0]
        other = torch.nn.functional.cross_entropy(swapped.transpose(1, 2), target, ignore_index=pad)
    assert float(own) < 0.1 and float(other) > 3.0


def test_checkpoints_from_before_the_residual_layout_load_with_the_papers_stack():
    dictionary = word_dictionary()
    args = argparse.Namespace(rnn_fc_top="tanh")
    rnn_fc_tiny(args)
    del args.rnn_fc_fc_layout  # what a checkpoint saved before the flag existed holds
    model = RnnFcModel.build_model(args, DictionaryTask(dictionary))
    assert model.decoder.layout == "paper" and model.decoder.fc_input is None
    assert [layer.in_features for layer in model.decoder.fc_layers] == [64 + 128, 128]


def test_a_frozen_transformer_encoder_warm_started_from_the_baseline(trained, tmp_path):
    """fairseq-train --rnn-fc-base-checkpoint --rnn-fc-freeze-encoder: the trained rnn_fc's encoder tensors are
    the baseline's, bit for bit, after training, and so are its encoder outputs; the decoder's embeddings started
    from the baseline's and moved; fairseq's generator and the fast one give the same translations."""
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator

    save_dir = train_tiny(os.path.join(trained["data"], "bin"), str(tmp_path / "checkpoints"),
                          train_flags("rnn_fc_translation", "rnn_fc_tiny"), "--rnn-fc-encoder", "transformer",
                          "--share-decoder-input-output-embed", "--rnn-fc-base-checkpoint", trained["checkpoint"],
                          "--rnn-fc-freeze-encoder", "--max-epoch", 2)
    base = checkpoint_utils.load_checkpoint_to_cpu(trained["checkpoint"])["model"]
    model, tgt_dict, _, batches = load(os.path.join(save_dir, "checkpoint_last.pt"))
    own = model.state_dict()
    encoder_keys = [key for key in own if key.startswith("encoder.") and not key.startswith("encoder.init_state.")]
    assert len(encoder_keys) > 20 and all(torch.equal(own[key], base[key]) for key in encoder_keys)
    assert not torch.equal(own["decoder.embed_tokens.weight"], base["decoder.embed_tokens.weight"])
    assert own["decoder.embed_tokens.weight"].shape == base["decoder.embed_tokens.weight"].shape
    baseline = load(trained["checkpoint"])[0]
    net_input = batches[0]["net_input"]
    with torch.no_grad():
        theirs = baseline.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
        ours = model.encoder(net_input["src_tokens"], net_input["src_lengths"])
    assert torch.equal(ours["encoder_out"][0], theirs["encoder_out"][0].transpose(0, 1))
    stock = SequenceGenerator([model], tgt_dict, beam_size=6)
    with torch.no_grad():
        expected = [h[0]["tokens"].tolist() for batch in batches for h in stock.generate([model], batch)]
    assert [h[0] for h in decode(RnnFcGenerator([model], tgt_dict, beam=6), model, batches)] == expected


@pytest.mark.parametrize("overrides,message", [
    ({}, "needs --rnn-fc-encoder transformer"),
    ({"rnn_fc_encoder": "transformer", "encoder_ffn_embed_dim": 96}, "shape mismatches"),
    ({"rnn_fc_encoder": "transformer", "encoder_layers": 1}, "parameters it has and this model lacks \\['encoder.layers.1"),
])
def test_a_base_checkpoint_that_does_not_fit_is_a_clear_error(trained, overrides, message):
    from fairseq.data import Dictionary

    dictionary = Dictionary.load(os.path.join(trained["data"], "bin", "dict.src.txt"))
    model = tiny_model(dictionary, **overrides)
    with pytest.raises(InputError, match=f"--rnn-fc-base-checkpoint {trained['checkpoint']}: .*{message}"):
        model.load_base_checkpoint(trained["checkpoint"], "--rnn-fc-base-checkpoint")


def test_table2_presets_are_the_fc_depth_and_top_layer_ladder():
    from fairseq.models import ARCH_CONFIG_REGISTRY

    expected = {"s1": (0, "tanh"), "s2": (0, "gru"), "s3": (3, "tanh"), "s4": (3, "gru"), "s5": (7, "tanh"),
                "s6": (7, "gru")}
    for name, (layers, top) in expected.items():
        args = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[f"rnn_fc_{name}"](args)
        assert (args.rnn_fc_fc_layers, args.rnn_fc_top, args.decoder_hidden_size) == (layers, top, 512)


# --- beam search and early stopping on constructed step models -------------------------------------------------

class TableStepModel:
    """A step model whose next-token log-probabilities depend only on the hypothesis prefix (a fixed table
    drawn per prefix), so that any search can be checked against another."""

    def __init__(self, vocab, seed=0, eos_bias=0.0, per_sentence=False):
        self.vocab, self.seed, self.eos_bias = vocab, seed, eos_bias
        self.per_sentence = per_sentence  # a different table for each sentence of the batch
        self.sentence = 0
        self.prefixes = None
        self.calls = 0

    def start(self, sample, candidates, candidate_valid=None):
        self.prefixes = [[()] for _ in range(sample["net_input"]["src_tokens"].size(0))]

    def distribution(self, prefix):
        g = torch.Generator().manual_seed(hash((self.seed, self.sentence if self.per_sentence else 0) + prefix)
                                          % (2 ** 31))
        logits = torch.randn(self.vocab, generator=g) * 2
        logits[2] += self.eos_bias * len(prefix)  # EOS (id 2) grows likelier with length
        return torch.log_softmax(logits, -1)

    def step(self, tokens, parents):
        self.calls += 1
        batch, k = tokens.shape
        new = []
        out = torch.empty(batch, k, self.vocab)
        for b in range(batch):
            self.sentence = b
            rows = []
            for j in range(k):
                parent = self.prefixes[b][0 if parents is None else int(parents[b, j])]
                prefix = parent + (int(tokens[b, j]),)
                rows.append(prefix)
                out[b, j] = self.distribution(prefix)
            new.append(rows)
        self.prefixes = new
        return out


def constructed_sample(batch=1):
    return {"net_input": {"src_tokens": torch.full((batch, 5), 7), "src_lengths": torch.full((batch,), 5)}}


def test_early_stopping_keeps_the_best_hypothesis_and_saves_steps():
    dictionary = word_dictionary(4)  # ids: 0 bos, 1 pad, 2 eos, 3 unk, 4..7 words

    class Constructed(TableStepModel):
        # Word 4 then EOS is the clear winner (-0.1 -0.1); every other path loses more than delta at once.
        def distribution(self, prefix):
            scores = torch.full((self.vocab,), -8.0)
            if prefix == (2,):
                scores[4], scores[5] = -0.1, -9.0
            elif prefix == (2, 4):
                scores[2] = -0.1
            else:
                scores[6] = -0.5
            return scores

    outputs, steps = {}, {}
    for delta in (None, 3.0):
        search = BeamSearch(dictionary, beam=3, max_len_b=12, early_stop_delta=delta)
        model = Constructed(len(dictionary))
        outputs[delta] = search.search(model, constructed_sample())[0]
        steps[delta] = search.steps
    assert outputs[3.0][0]["tokens"].tolist() == outputs[None][0]["tokens"].tolist() == [4, 2]
    assert outputs[3.0][0]["score"] == pytest.approx(outputs[None][0]["score"])
    assert steps[3.0] == 2 < steps[None]  # stopped right after the winner finished


def test_early_stopping_within_delta_waits_for_a_hypothesis_that_wins_later():
    dictionary = word_dictionary(4)

    class Constructed(TableStepModel):
        # "4 EOS" finishes first at -1.1 (normalised -0.55). "5 6" is then behind by 0.1 (< delta) but goes on
        # to "5 6 6 EOS" at -1.3 over 4 tokens (normalised -0.325), which must win.
        def distribution(self, prefix):
            scores = torch.full((self.vocab,), -20.0)
            scores[2] = -50.0
            table = {(2,): {4: -0.2, 5: -0.9}, (2, 4): {2: -0.9}, (2, 5): {6: -0.3}, (2, 5, 6): {6: -0.05},
                     (2, 5, 6, 6): {2: -0.05}}
            for token, score in table.get(prefix, {}).items():
                scores[token] = score
            return scores

    search = BeamSearch(dictionary, beam=2, max_len_b=12, early_stop_delta=3.0)
    best = search.search(Constructed(len(dictionary)), constructed_sample())[0][0]
    assert best["tokens"].tolist() == [5, 6, 6, 2]
    # With a margin of 0 it would have stopped at the first finished hypothesis.
    eager = BeamSearch(dictionary, beam=2, max_len_b=12, early_stop_delta=0.0)
    assert eager.search(Constructed(len(dictionary)), constructed_sample())[0][0]["tokens"].tolist() == [4, 2]


@pytest.mark.parametrize("delta", [0.0, 0.5, 1.0])
def test_unnormalized_early_stopping_never_changes_the_best_hypothesis(delta):
    dictionary = word_dictionary(6)
    stopped = 0
    for seed in range(20):
        results = []
        for stop in (None, delta):
            search = BeamSearch(dictionary, beam=4, max_len_b=9, normalize_scores=False, early_stop_delta=stop)
            model = TableStepModel(len(dictionary), seed, eos_bias=0.7, per_sentence=True)
            results.append(search.search(model, constructed_sample(3)))
        stopped += search.stopped_early
        assert [[h["tokens"].tolist() for h in r] for r in results[0]] != [[]] * 3
        for b in range(3):
            assert results[0][b][0]["tokens"].tolist() == results[1][b][0]["tokens"].tolist()
            assert results[0][b][0]["score"] == pytest.approx(results[1][b][0]["score"])
        # The three sentences have their own tables, so the test is not one sentence three times.
        assert len({tuple(results[0][b][0]["tokens"].tolist()) for b in range(3)}) > 1 or seed != 0
    assert stopped >= 10, stopped  # early stopping did trigger (of 60 sentences)


def test_beam_search_equals_fairseq_sequence_generator_on_a_fixed_model():
    """The search itself (no model switches) reproduces fairseq's SequenceGenerator, hypothesis by hypothesis."""
    from fairseq.sequence_generator import SequenceGenerator

    dictionary = word_dictionary()
    model = tiny_model(dictionary, "gru")
    sample = random_batch(dictionary, 5, seed=3)
    ours = RnnFcGenerator([model], dictionary, beam=4, speedups=(), max_len_b=12, nbest=4)
    stock = SequenceGenerator([model], dictionary, beam_size=4, max_len_b=12)
    with torch.no_grad():
        mine, theirs = ours.generate([model], sample), stock.generate([model], sample)
    for a, b in zip(mine, theirs, strict=True):
        assert [h["tokens"].tolist() for h in a] == [h["tokens"].tolist() for h in b[:4]]
        torch.testing.assert_close(torch.tensor([h["score"] for h in a]), torch.stack([h["score"] for h in b[:4]]),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a[0]["positional_scores"], b[0]["positional_scores"], rtol=1e-4, atol=1e-5)


# --- candidate lists -----------------------------------------------------------------------------------------

def write_table(path, rows):
    path.write_text("".join(f"{s}\t{t}\t{p}\n" for s, t, p in rows), encoding="utf-8")
    return str(path)


def test_candidate_list_holds_every_word_it_is_defined_to_hold(tmp_path):
    src, tgt = word_dictionary(10), word_dictionary(12)
    for i in range(12):  # counts make w11 the most frequent, then w10, ...
        tgt.count[tgt.index(f"w{i}")] = 100 + i
    rows = [("w0", f"w{j}", math.log(p)) for j, p in ((1, 0.5), (2, 0.3), (3, 0.15), (4, 0.05))]
    rows += [("w1", "w5", -0.1), ("w1", "w6", -0.1), ("w1", "w7", -3.0), ("w1", "not-a-word", -0.01)]
    rows += [("<eps>", "w9", -0.01), ("unseen", "w8", -0.01)]
    table = read_lexical_table(write_table(tmp_path / "lex.txt", rows))
    shortlist = Shortlist.build(table, src, tgt, top=2, frequent=2)
    idx = tgt.index
    assert shortlist.translations[src.index("w0")].tolist() == [idx("w1"), idx("w2")]  # the two most probable
    assert shortlist.translations[src.index("w1")].tolist() == [idx("w5"), idx("w6")]  # tie: by word; unknown skipped
    assert shortlist.translations[src.index("w2")].tolist() == [-1, -1]
    assert sorted(shortlist.frequent.tolist()) == [idx("w10"), idx("w11")]
    assert shortlist.meta["target_words_not_in_dictionary"] == 1 and shortlist.meta["source_words_not_in_dictionary"] == 1
    sentences = torch.tensor([[src.pad(), src.index("w0"), src.index("w2"), src.eos()],
                              [src.index("w1"), src.index("w0"), src.index("w1"), src.eos()]])
    candidates, valid = shortlist.candidates(sentences)
    lists = [set(c[v].tolist()) for c, v in zip(candidates, valid)]
    always = {tgt.eos(), tgt.unk(), idx("w10"), idx("w11")}
    assert lists[0] == always | {idx("w1"), idx("w2")}
    assert lists[1] == always | {idx("w1"), idx("w2"), idx("w5"), idx("w6")}
    assert all(c[v].tolist() == sorted(c[v].tolist()) for c, v in zip(candidates, valid))  # ascending ids
    # Saved and loaded: the same lists; with another dictionary: refused, naming the file.
    shortlist.save(str(tmp_path / "list.pt"))
    loaded = Shortlist.load(str(tmp_path / "list.pt"), src, tgt)
    assert torch.equal(loaded.candidates(sentences)[0], candidates)
    with pytest.raises(InputError, match="list.pt: built with another target dictionary"):
        Shortlist.load(str(tmp_path / "list.pt"), src, word_dictionary(13))


@pytest.mark.parametrize("line, message", [
    ("w0\tw1\n", "lex.txt:2: expected 'source<TAB>target<TAB>log-probability', got 2 field"),
    ("w0\tw1\tx\n", "lex.txt:2: 'x' is not a log-probability"),
    ("w0\tw1\t0.5\n", "lex.txt:2: 0.5 is not a log-probability"),
])
def test_bad_lexical_tables_are_clear_errors(tmp_path, line, message):
    path = tmp_path / "lex.txt"
    path.write_text("w0\tw2\t-1.0\n" + line, encoding="utf-8")
    with pytest.raises(InputError, match=message):
        read_lexical_table(str(path))


def test_systran_lexical_table_is_fast_aligns_probability_table(tmp_path):
    from fairseq_plugins.tools.synthetic import write_corpus

    out = write_corpus(str(tmp_path / "corpus"), sizes={"train": 300})
    source, target = os.path.join(out, "train.src"), os.path.join(out, "train.tgt")
    table_path = str(tmp_path / "lex.txt")
    align_corpus(source, target, lexical_table=table_path)
    table = read_lexical_table(table_path)
    for word in ("dog", "cat", "horse"):  # the synthetic lexicon: reversed word + "o"
        best = max(table[word])
        assert best[1] == word[::-1] + "o" and best[0] > math.log(0.5)
    for entries in table.values():  # conditional distributions (fast_align prunes its smallest entries)
        assert sum(math.exp(p) for p, _ in entries) <= 1 + 1e-4
    with pytest.raises(RuntimeError, match="not a systran-align probabilities file"):
        list(read_systran_probabilities(write_table(tmp_path / "bad.probs", [("a", "b", 0)])))


# --- a trained tiny rnn_fc: every switch against the plain decoder --------------------------------------------

@pytest.fixture(scope="module")
def rnn_fc_model(rnn_fc_system, tmp_path_factory):
    """A tiny rnn_fc trained with fairseq-train on the synthetic corpus (conftest's session system): (a work
    folder of this module's own, its checkpoint)."""
    return tmp_path_factory.mktemp("rnn_fc"), rnn_fc_system["checkpoint"]


@pytest.fixture(scope="module")
def rnn_fc_trained(prepared, trained, rnn_fc_model):
    """The tiny rnn_fc and its candidate lists (the alignment needs systran-align or a fast_align binary)."""
    work, checkpoint = rnn_fc_model
    tok = os.path.join(prepared, "tok")
    plugins_cli("align", "--source", os.path.join(tok, "train.src"), "--target", os.path.join(tok, "train.tgt"),
                "--output", work / "train.align", "--lexical-table", work / "lex.txt")
    plugins_cli("shortlist", "--lexical-table", work / "lex.txt", "--data-bin", os.path.join(prepared, "bin"),
                "-s", "src", "-t", "tgt", "--top", 20, "--frequent", 20, "--output", work / "list.pt")
    plugins_cli("shortlist", "--lexical-table", work / "lex.txt", "--data-bin", os.path.join(prepared, "bin"),
                "-s", "src", "-t", "tgt", "--top", 1000, "--frequent", 1000, "--output", work / "everything.pt")
    return {"data": prepared, "work": work, "checkpoint": checkpoint,
            "baseline": trained["checkpoint"], "shortlist": str(work / "list.pt"),
            "everything": str(work / "everything.pt")}


def load(checkpoint, batch_size=8):
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint])
    task.load_dataset("test", task_cfg=cfg.task)
    dataset = task.dataset("test")
    batches = [dataset.collater([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
               for start in range(0, len(dataset), batch_size)]
    return models[0].eval(), task.target_dictionary, task.source_dictionary, batches


def decode(generator, model, batches):
    with torch.no_grad():
        return [[h["tokens"].tolist() for h in hyps] for batch in batches for hyps in generator.generate([model], batch)]


@pytest.mark.parametrize("speedups", [(name,) for name in SPEEDUPS] + [SPEEDUPS])
def test_each_exact_speedup_gives_the_plain_decoders_output(rnn_fc_trained, speedups):
    model, tgt_dict, _, batches = load(rnn_fc_trained["checkpoint"])
    batches = batches[:2]  # 16 sentences: the plain decoder runs one hypothesis at a time
    plain = RnnFcGenerator([model], tgt_dict, beam=6, speedups=(), nbest=6)
    fast = RnnFcGenerator([model], tgt_dict, beam=6, speedups=speedups, nbest=6, precompute_words=40)
    assert decode(fast, model, batches) == decode(plain, model, batches)  # every n-best list, token for token
    if "embeddings" in speedups:
        assert fast.stepper.precomputed_words == 40  # the rest of the vocabulary still takes the matmul


def test_plain_and_fast_decoders_equal_fairseqs_generator(rnn_fc_trained):
    from fairseq.sequence_generator import SequenceGenerator

    model, tgt_dict, _, batches = load(rnn_fc_trained["checkpoint"])
    stock = SequenceGenerator([model], tgt_dict, beam_size=6)
    fast = RnnFcGenerator([model], tgt_dict, beam=6)
    with torch.no_grad():
        theirs = [h[0]["tokens"].tolist() for batch in batches for h in stock.generate([model], batch)]
    assert [h[0] for h in decode(fast, model, batches)] == theirs


@pytest.mark.parametrize("system", ["checkpoint", "baseline"])
def test_a_list_holding_the_whole_vocabulary_changes_nothing(rnn_fc_trained, system):
    model, tgt_dict, src_dict, batches = load(rnn_fc_trained[system])
    everything = Shortlist.load(rnn_fc_trained["everything"], src_dict, tgt_dict)
    # Lists never hold BOS and padding, whose (tiny) probabilities the full softmax's normaliser counts: add them
    # here so that the lists are the whole vocabulary and only the sliced output layer differs.
    everything.always = torch.arange(tgt_dict.nspecial)
    assert bool(everything.membership(batches[0]["net_input"]["src_tokens"]).all())
    full = RnnFcGenerator([model], tgt_dict, beam=6)
    listed = RnnFcGenerator([model], tgt_dict, beam=6, shortlist=everything)
    assert decode(listed, model, batches) == decode(full, model, batches)


def test_the_generic_path_reproduces_fairseq_on_the_baseline_transformer(rnn_fc_trained):
    from fairseq.sequence_generator import SequenceGenerator

    model, tgt_dict, _, batches = load(rnn_fc_trained["baseline"])
    stock = SequenceGenerator([model], tgt_dict, beam_size=6)
    ours = RnnFcGenerator([model], tgt_dict, beam=6)
    with torch.no_grad():
        theirs = [h[0]["tokens"].tolist() for batch in batches for h in stock.generate([model], batch)]
    assert [h[0] for h in decode(ours, model, batches)] == theirs
    with pytest.raises(ValueError, match="the exact speedups are rnn_fc's own"):
        RnnFcGenerator([model], tgt_dict, speedups=("batched",))


def scored_by_id(generator, model, batches):
    """n-best (tokens, score) lists in sentence-id order."""
    by_id = {}
    with torch.no_grad():
        for batch in batches:
            for sentence, hyps in zip(batch["id"].tolist(), generator.generate([model], batch)):
                by_id[sentence] = [(h["tokens"].tolist(), float(h["score"])) for h in hyps]
    return [by_id[sentence] for sentence in sorted(by_id)]


def assert_same_up_to_float_ties(together, alone, tolerance):
    """The same n-best lists, except that hypotheses whose scores are within ``tolerance`` may trade places
    (the float32 encoder's sums depend on the batch's padding and thread split at the last bit, which may
    reorder a near-tie); the scores at every rank agree within ``tolerance``."""
    for sentence, (mine, theirs) in enumerate(zip(together, alone)):
        assert len(mine) == len(theirs), sentence
        for rank, ((tokens, score), (their_tokens, their_score)) in enumerate(zip(mine, theirs)):
            assert abs(score - their_score) < tolerance, (sentence, rank, score, their_score)
            if tokens != their_tokens:  # only a near-tie may swap: the same hypothesis at a tied score
                ties = [s for t, s in theirs if t == tokens] or [theirs[-1][1]]  # (or pushed out of the beam)
                assert abs(ties[0] - score) < tolerance, (sentence, rank, tokens, their_tokens)


@pytest.mark.parametrize("backend", native.BACKENDS)
@pytest.mark.parametrize("system", ["checkpoint", "baseline"])
def test_outputs_do_not_depend_on_the_batch_with_int8_or_candidate_lists(rnn_fc_trained, system, backend,
                                                                          monkeypatch):
    # int8 has per-row activation scales, and a list padded to its batch's longest list gives the padding no
    # probability: a sentence's translation is the same at batch 8 and batch 1. Exactly the same only up to
    # rounding: the float32 encoder's sums differ at the last bit between batch 8 and batch 1, and now and then
    # such a difference flips an activation's int8 rounding. On either kernel that moves a score by up to a few
    # 1e-3 (measured: fbgemm 1.4e-4 on one trained model, 1.7e-3 on another; native up to 3.6e-3), and 37-40
    # of 40 n-best lists stay identical. One scale per call instead moved scores by up to 0.05 and changed 12
    # of 40 best outputs: that is what this test catches. (The kernels' rows are exactly independent of each
    # other: tests/test_int8.py.)
    monkeypatch.setenv(native.BACKEND_VARIABLE, backend)
    if native.backend() != backend:
        pytest.skip(f"the {backend} int8 kernel is not available here")
    model, tgt_dict, src_dict, batches = load(rnn_fc_trained[system])
    _, _, _, singles = load(rnn_fc_trained[system], batch_size=1)
    shortlist = Shortlist.load(rnn_fc_trained["shortlist"], src_dict, tgt_dict)
    for precision, lists in (("int8", None), ("fp32", shortlist), ("int8", shortlist)):
        generator = RnnFcGenerator([model], tgt_dict, beam=6, nbest=6, precision=precision, shortlist=lists)
        together, alone = scored_by_id(generator, model, batches), scored_by_id(generator, model, singles)
        assert len(together) == len(alone) == 40 and all(len(n_best) == 6 for n_best in together)
        if precision == "fp32":
            assert_same_up_to_float_ties(together, alone, tolerance=1e-3)
        else:  # the same n-best list: the same scores up to a few flipped roundings
            for mine, theirs in zip(together, alone):
                if [t for t, _ in mine] == [t for t, _ in theirs]:
                    assert max(abs(s - their) for (_, s), (_, their) in zip(mine, theirs)) < 1e-2
        identical = sum([t for t, _ in mine] == [t for t, _ in theirs] for mine, theirs in zip(together, alone))
        assert identical >= 36, (precision, lists is not None, identical)  # near-ties are rare
        if precision == "int8":  # int8 ran, not float32
            assert any(isinstance(m, Int8Linear) for m in generator.stepper.model.modules())


def generate(system, *flags, check=True):
    return run("fairseq_cli.generate", os.path.join(system["data"], "bin"), "--user-dir", USER_DIR,
               "--task", "rnn_fc_translation", "--path", system["checkpoint"], "--gen-subset", "test",
               "--beam", 6, "--batch-size", 8, *flags, check=check)


def bleu_of(stdout):
    return float(stdout.strip().splitlines()[-1].split("BLEU = ")[1].split()[0])


def test_fairseq_generate_with_every_switch(rnn_fc_trained):
    hypotheses = lambda out: sorted(line.split("\t")[::2] for line in out.splitlines() if line.startswith("H-"))  # noqa: E731
    plain = generate(rnn_fc_trained, "--rnn-fc-speedups", "none", "--scoring", "sacrebleu")
    fast = generate(rnn_fc_trained, "--scoring", "sacrebleu")
    assert hypotheses(plain.stdout) == hypotheses(fast.stdout) and len(hypotheses(fast.stdout)) == 40
    assert "rnn_fc decoding: 40 sentences" in fast.stderr
    assert bleu_of(fast.stdout) > 15, fast.stdout[-1500:]  # a tiny GRU trained for a minute (~35-40 here)
    everything = generate(rnn_fc_trained, "--rnn-fc-shortlist", rnn_fc_trained["shortlist"], "--rnn-fc-precision",
                          "int8", "--rnn-fc-early-stop", "--scoring", "sacrebleu")
    assert len(hypotheses(everything.stdout)) == 40 and "candidates a sentence" in everything.stderr
    assert bleu_of(everything.stdout) > 5  # runs end to end; the benchmarks measure the BLEU change
    interactive = run("fairseq_cli.interactive", os.path.join(rnn_fc_trained["data"], "bin"), "--user-dir", USER_DIR,
                      "--task", "rnn_fc_translation", "--path", rnn_fc_trained["checkpoint"], "--source-lang", "src",
                      "--target-lang", "tgt", "--beam", 6, stdin="▁the ▁dog ▁.\n")
    assert sum(line.startswith("H-") for line in interactive.stdout.splitlines()) == 1


def n_best_by_id(stdout):
    """fairseq-generate's H- lines: {sentence id: [(score, text), ...] in the order printed (best first)}."""
    by_id = {}
    for line in stdout.splitlines():
        if line.startswith("H-"):
            sentence, score, text = line.split("\t")
            by_id.setdefault(int(sentence[2:]), []).append((float(score), text))
    return by_id


@pytest.fixture(scope="module")
def plain_n_best(rnn_fc_trained):
    """The plain decoder's (--rnn-fc-speedups none) 6-best lists of the test set through fairseq-generate."""
    proc = generate(rnn_fc_trained, "--nbest", 6, "--rnn-fc-speedups", "none")
    assert "speedups=[]" in proc.stderr, proc.stderr[-1500:]
    return n_best_by_id(proc.stdout)


@pytest.mark.parametrize("speedup", SPEEDUPS)
def test_each_exact_speedup_alone_through_fairseq_generate_gives_the_plain_n_best(rnn_fc_trained, plain_n_best,
                                                                                  speedup):
    proc = generate(rnn_fc_trained, "--nbest", 6, "--rnn-fc-speedups", speedup)
    assert f"speedups=['{speedup}']" in proc.stderr, proc.stderr[-1500:]  # this switch ran, and only it
    fast = n_best_by_id(proc.stdout)
    assert sorted(fast) == sorted(plain_n_best) == list(range(40))
    for sentence, plain in plain_n_best.items():
        assert len(fast[sentence]) == len(plain) == 6, sentence
        # Every H- line: the same text at every rank, the same score up to float rounding.
        assert [text for _, text in fast[sentence]] == [text for _, text in plain], sentence
        for rank, ((score, _), (plain_score, _)) in enumerate(zip(fast[sentence], plain)):
            assert abs(score - plain_score) < 1e-3, (sentence, rank, score, plain_score)


@pytest.mark.parametrize("flags, message", [
    (["--rnn-fc-speedups", "batched,fast"], "--rnn-fc-speedups batched,fast: give all, none, or a comma-separated"),
    (["--rnn-fc-shortlist", "/nonexistent/list.pt"], "/nonexistent/list.pt: no such candidate list"),
    (["--rnn-fc-precision", "int16"], "--rnn-fc-precision"),
    (["--rnn-fc-early-stop", "--rnn-fc-delta", "-1"], "--rnn-fc-delta -1.0: must not be negative"),
    (["--path", "BASELINE", "--rnn-fc-speedups", "batched"], "the exact speedups are rnn_fc's own"),
    (["--no-repeat-ngram-size", 2], "--no-repeat-ngram-size: not supported with rnn_fc decoding"),
])
def test_bad_generation_settings_are_clear_errors(rnn_fc_trained, flags, message):
    flags = [rnn_fc_trained["baseline"] if f == "BASELINE" else f for f in flags]
    proc = generate(rnn_fc_trained, *flags, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-1500:]


def test_bench_of_the_exact_switches_matches_the_stock_generator(rnn_fc_trained, tmp_path):
    result_path = tmp_path / "rnn_fc.json"
    plugins_cli("bench", "--method", "rnn_fc", "--path", rnn_fc_trained["checkpoint"], "--data",
                rnn_fc_trained["data"], "--threads", 1, "--runs", 1, "--beam", 6, "--limit", 10,
                "--json", result_path)
    result = json.loads(result_path.read_text())
    # The stock generator decodes the same rnn_fc model: the exact switches must give its outputs.
    assert result["stats"]["outputs_identical_to_baseline"] == 1.0
    assert result["stats"]["model_calls_per_step"] == 1.0 and result["words_per_s"] > 0
    assert result["generator"]["task_flags"]["rnn_fc_speedups"] == "all"
    batched = tmp_path / "rnn_fc_batch4.json"
    plugins_cli("bench", "--method", "rnn_fc", "--path", rnn_fc_trained["checkpoint"], "--data",
                rnn_fc_trained["data"], "--threads", 1, "--runs", 1, "--beam", 6, "--limit", 10, "--batch-size", 4,
                "--json", batched)
    batched = json.loads(batched.read_text())
    assert batched["batch_size"] == 4 and batched["stats"]["outputs_identical_to_baseline"] == 1.0
    baseline = tmp_path / "baseline.json"
    plugins_cli("bench", "--method", "rnn_fc", "--path", rnn_fc_trained["baseline"], "--data", rnn_fc_trained["data"],
                "--threads", 1, "--runs", 1, "--beam", 6, "--limit", 10, "--json", baseline,
                "--rnn-fc-shortlist", rnn_fc_trained["shortlist"], "--rnn-fc-precision", "int8")
    result = json.loads(baseline.read_text())
    assert result["stats"]["candidates_per_sentence"] > 0 and result["stats"]["precision"] == "int8"


@pytest.mark.cuda
def test_cuda_decoding_equals_cpu_decoding(rnn_fc_model):
    """Beam 6 on the GPU: the CPU's hypotheses. Needs no alignment tool (none is built for the GPU's Python)."""
    model, tgt_dict, _, batches = load(rnn_fc_model[1])
    cpu = decode(RnnFcGenerator([model], tgt_dict, beam=6), model, batches[:2])
    model = model.cuda()
    from fairseq import utils

    gpu = decode(RnnFcGenerator([model], tgt_dict, beam=6), model, [utils.move_to_cuda(b) for b in batches[:2]])
    assert gpu == cpu


def test_the_ablation_recipe_adds_one_fix_a_step_and_times_the_lstm_to_the_last(prepared, tmp_path):
    """examples/rnn_fc/ablation.sh on the tiny corpus, 8 updates a step: the first step trains with the first
    models' settings, +noclip with today's defaults, and fairseq's lstm for +noclip's wall time; the curves are
    summarised per step. An unknown step stops it before any training."""
    import subprocess

    from test_gpu_kit import kit_env

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = kit_env(EPOCHS="1", SRC="src", TGT="tgt", TRAIN_FLAGS="--max-update 8")
    script = os.path.join(repo, "examples", "rnn_fc", "ablation.sh")
    base, work = os.path.dirname(prepared), tmp_path / "ablation"
    wrong = subprocess.run(["bash", script, base, str(work)], env={**env, "STEPS": "first +bogus"},
                           capture_output=True, text=True)
    assert wrong.returncode == 2 and "unknown step '+bogus'" in wrong.stderr and not work.exists()
    done = subprocess.run(["bash", script, base, str(work)], env={**env, "STEPS": "first +noclip lstm"},
                          capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr[-3000:]
    first = (work / "first" / "fc4-tanh" / "train.log").read_text()
    assert "rnn_fc_fc_init='torch'" in first and "rnn_fc_fc_layout='paper'" in first
    assert "'warmup_updates': 400" in first and "'clip_norm': 1.0" in first
    noclip = (work / "noclip" / "fc4-tanh" / "train.log").read_text()
    assert "rnn_fc_fc_init='he'" in noclip and "rnn_fc_fc_layout='residual'" in noclip
    assert "'warmup_updates': 150" in noclip and "'clip_norm': 0.0" in noclip
    runs = json.load(open(work / "results" / "rnn_fc_ablation.json"))["runs"]
    assert list(runs) == ["first", "+noclip", "lstm"]
    noclip_wall = runs["+noclip"]["curve"][-1]["wall_seconds"]
    assert noclip_wall is not None and all(run["curve"] for run in runs.values())
    lstm = (work / "lstm" / "train.log").read_text()
    assert "arch='lstm'" in lstm and f"'stop_time_hours': {noclip_wall / 3600}" in lstm
