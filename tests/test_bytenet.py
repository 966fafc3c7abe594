"""ByteNet: causality, incremental == full forward (with beam reordering), unfolding, receptive field,
and a tiny character model trained and decoded through fairseq's own entry points."""

import argparse
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

from conftest import REPO, TRAIN_THREADS, USER_DIR, DictionaryTask, plugins_cli, recipe_bin, run
from fairseq_plugins.bytenet import model as bytenet_model
from fairseq_plugins.bytenet.layers import DilatedConv1d
from fairseq_plugins.common.textio import InputError

TRANSLATION_PRESETS = ["bytenet", "bytenet_multi30k_char", "bytenet_tiny"]
LM_PRESETS = ["bytenet_lm", "bytenet_lm_shakespeare", "bytenet_lm_tiny"]
# The paper-sized presets are 170M and 220M parameters; their layer layout (blocks, dilations, kernel,
# block type, unfolding) is tested at this width instead.
NARROW = 16


def _dictionary(symbols="abcdefghijklmnop"):
    dictionary = Dictionary()
    for symbol in symbols:
        dictionary.add_symbol(symbol)
    return dictionary


def build(preset, narrow=False, **overrides):
    """A model of ``preset``'s layout (optionally narrowed), random weights, eval mode, float64 for exactness."""
    args = argparse.Namespace(**overrides)
    if narrow:
        for side in ("encoder", "decoder"):
            setattr(args, f"{side}_embed_dim", NARROW)
            setattr(args, f"{side}_hidden_dim", NARROW)
        args.output_hidden_dim = NARROW
    ARCH_CONFIG_REGISTRY[preset](args)
    torch.manual_seed(0)
    model = ARCH_MODEL_REGISTRY[preset].build_model(args, DictionaryTask(_dictionary()))
    return model.double().eval()


def _random_batch(dictionary, batch, source_len, target_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    low, high = dictionary.nspecial, len(dictionary)
    source = torch.randint(low, high, (batch, source_len), generator=generator)
    source[:, -1] = dictionary.eos()
    # fairseq left-pads sources: give sentence i i padding tokens at the front.
    for i in range(min(batch, source_len - 2)):
        source[i, :i] = dictionary.pad()
    target = torch.randint(low, high, (batch, target_len), generator=generator)
    target[:, 0] = dictionary.eos()
    return source, source.ne(dictionary.pad()).sum(1), target


def _decode_full(model, source, lengths, target):
    if isinstance(model, bytenet_model.ByteNetModel):
        return model.decoder(target, model.encoder(source, lengths))[0]
    return model.decoder(target)[0]


def _decode_incremental(model, source, lengths, target, reorder_at=None, new_order=None):
    """Step by step; at step ``reorder_at`` permute the hypotheses the way beam search does."""
    encoder_out = model.encoder(source, lengths) if isinstance(model, bytenet_model.ByteNetModel) else None
    state, steps = {}, []
    for t in range(target.size(1)):
        if t == reorder_at:
            model.decoder.reorder_incremental_state_scripting(state, new_order)
            target = target.index_select(0, new_order)
            steps = [step.index_select(0, new_order) for step in steps]
            if encoder_out is not None:
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
        steps.append(model.decoder(target[:, : t + 1], encoder_out, incremental_state=state)[0])
    return torch.cat(steps, dim=1), target


# A beam permutation with a duplicated hypothesis; the unchanged order (skipped by the decoder); the batch
# shrinking to its first rows as finished sentences leave it (the order's values are those of an identity,
# but the state's other rows must go).
NEW_ORDERS = {"permuted": [2, 0, 0, 3], "unchanged": [0, 1, 2, 3], "shrunk": [0, 1]}


@pytest.mark.parametrize("order", NEW_ORDERS)
@pytest.mark.parametrize("preset", TRANSLATION_PRESETS + LM_PRESETS)
def test_incremental_decoding_equals_the_full_forward_pass_under_beam_reordering(preset, order):
    narrow = preset in ("bytenet", "bytenet_lm", "bytenet_multi30k_char")
    model = build(preset, narrow=narrow).float()  # the precision decoding runs in
    dictionary = model.decoder.dictionary
    source, lengths, target = _random_batch(dictionary, batch=4, source_len=9, target_len=40)
    new_order = torch.tensor(NEW_ORDERS[order])
    with torch.no_grad():
        incremental, reordered_target = _decode_incremental(model, source, lengths, target, 17, new_order)
        full = _decode_full(model, source.index_select(0, new_order), lengths.index_select(0, new_order),
                            reordered_target)
    assert full.shape == incremental.shape
    assert torch.allclose(full, incremental, atol=1e-5, rtol=0), (full - incremental).abs().max()


@pytest.mark.parametrize("preset", ["bytenet_tiny", "bytenet_lm_tiny"])
def test_a_prefix_of_several_frames_then_one_at_a_time_equals_the_full_forward_pass(preset):
    """A first call with a forced prefix runs the blocks' convolutions over several frames; the steps after it
    run the one-frame path on the frames that call kept."""
    model = build(preset)
    dictionary = model.decoder.dictionary
    source, lengths, target = _random_batch(dictionary, batch=3, source_len=7, target_len=30)
    with torch.no_grad():
        encoder_out = model.encoder(source, lengths) if isinstance(model, bytenet_model.ByteNetModel) else None
        state = {}
        steps = [model.decoder(target[:, :12], encoder_out, incremental_state=state)[0]]
        steps += [model.decoder(target[:, : t + 1], encoder_out, incremental_state=state)[0] for t in range(12, 30)]
        full = _decode_full(model, source, lengths, target)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-10, rtol=0)


def test_a_decode_after_a_change_of_precision_reads_the_converted_parameters():
    """The one-frame steps take the parameters as built at the start of each decode: after a conversion that
    replaces them (here double to float, as ``half()`` would) the next decode must not read the old ones."""
    model = build("bytenet_lm_tiny")
    target = _random_batch(model.decoder.dictionary, batch=2, source_len=1, target_len=6)[2]
    with torch.no_grad():
        _decode_incremental(model, None, None, target)
        model.float()
        incremental, _ = _decode_incremental(model, None, None, target)
        assert incremental.dtype == torch.float32
        assert torch.allclose(incremental, _decode_full(model, None, None, target), atol=1e-5, rtol=0)

@pytest.mark.parametrize("preset", ["bytenet_multi30k_char", "bytenet_tiny"])
def test_the_native_step_of_relu_blocks_equals_the_torch_frame_steps(preset):
    """A stack of ReLU blocks in float32 on the CPU steps one frame in one native call (bytenet_step.c): the same
    outputs as the torch frame steps to float32 rounding, and the same kept frames, after a forced prefix (whose
    kept frames are views) and a beam reordering; above NATIVE_MAX_ROWS rows the torch steps run."""
    from fairseq_plugins.kernels import native

    if not native.available():
        pytest.skip("the native kernels could not be built here")
    model = build(preset, narrow=preset == "bytenet_multi30k_char").float()
    source, lengths, target = _random_batch(model.decoder.dictionary, batch=4, source_len=9, target_len=30)
    new_order = torch.tensor(NEW_ORDERS["permuted"])
    stack, results = model.decoder.stack, {}
    with torch.no_grad():
        for native_steps, max_rows in ((True, 12), (False, 12), ("too many rows", 3)):
            stack.native_frame_steps, stack.NATIVE_MAX_ROWS = bool(native_steps), max_rows
            encoder_out, state, tokens = model.encoder(source, lengths), {}, target
            steps = [model.decoder(tokens[:, :5], encoder_out, incremental_state=state)[0]]
            for t in range(5, 30):
                if t == 17:
                    model.decoder.reorder_incremental_state_scripting(state, new_order)
                    encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
                    tokens = tokens.index_select(0, new_order)
                    steps = [step.index_select(0, new_order) for step in steps]
                steps.append(model.decoder(tokens[:, : t + 1], encoder_out, incremental_state=state)[0])
                assert (stack._native_stepper is not None) == bool(native_steps)
            results[native_steps] = torch.cat(steps, dim=1), stack.get_incremental_state(state, "frames")
    (native_out, native_frames), (torch_out, torch_frames) = results[True], results[False]
    assert torch.equal(results["too many rows"][0], torch_out)
    assert torch.allclose(native_out, torch_out, atol=1e-5, rtol=0), (native_out - torch_out).abs().max()
    assert native_frames.keys() == torch_frames.keys()
    assert all(torch.allclose(native_frames[name], torch_frames[name], atol=1e-5, rtol=0) for name in torch_frames)


def test_the_native_step_refuses_tensors_it_would_misread():
    from fairseq_plugins.kernels import native

    if not native.available():
        pytest.skip("the native kernels could not be built here")
    blocks = list(build("bytenet_tiny").float().decoder.stack.blocks)
    stepper = native.ReLUBlocksStepper(blocks)
    x = torch.zeros(2, blocks[0].reduce.in_features)
    pasts = [torch.zeros(2, block.conv.history, block.reduce.out_features) for block in blocks]
    stepper(x, pasts)  # the right shapes
    for bad_x, bad_pasts in ((x.double(), pasts), (x[:, :-1], pasts), (x, pasts[:-1]), (x, [p[:1] for p in pasts]),
                             (x, [p.transpose(1, 2) for p in pasts])):
        with pytest.raises(ValueError, match="fp_relu_blocks_frame_step: tensors of unexpected shapes"):
            stepper(bad_x, bad_pasts)


def test_cached_torch_decoding_steps_in_torch_operations_for_that_call_only():
    """--bytenet-decoding cached-torch: the torch frame steps for its own generator's calls; the bench's stock
    generator, decoding the same model objects, keeps the native step."""
    from fairseq_plugins.bytenet.task import ByteNetTranslationConfig, ByteNetTranslationTask

    model = build("bytenet_tiny").float()
    dictionary = model.decoder.dictionary
    task = ByteNetTranslationTask(ByteNetTranslationConfig(bytenet_decoding="cached-torch"), dictionary, dictionary)

    class Generator:
        def generate(self, models, sample, **kwargs):
            return [model.decoder.stack.native_frame_steps for model in models]

    assert task.inference_step(Generator(), [model], {}) == [False]
    assert model.decoder.stack.native_frame_steps is True


@pytest.mark.parametrize("preset", ["bytenet_tiny", "bytenet_lm_tiny"])
def test_changing_future_targets_never_changes_earlier_outputs(preset):
    model = build(preset)
    dictionary = model.decoder.dictionary
    source, lengths, target = _random_batch(dictionary, batch=2, source_len=6, target_len=30)
    with torch.no_grad():
        reference = _decode_full(model, source, lengths, target)
        for t in (1, 7, 29):
            changed = target.clone()
            changed[:, t:] = torch.randint(dictionary.nspecial, len(dictionary), changed[:, t:].shape)
            changed[:, t] = (target[:, t] - dictionary.nspecial + 1) % (len(dictionary) - dictionary.nspecial) \
                + dictionary.nspecial  # certainly different at t
            output = _decode_full(model, source, lengths, changed)
            assert torch.equal(output[:, :t], reference[:, :t])
            assert not torch.allclose(output[:, t], reference[:, t])  # and the inputs do reach step t


@pytest.mark.parametrize("kernel_size, dilation", [(3, 1), (3, 4), (2, 16), (5, 2)])
def test_every_masked_convolution_is_causal(kernel_size, dilation):
    conv = DilatedConv1d(3, 2, kernel_size, dilation, masked=True).double()
    x = torch.randn(1, 60, 3, dtype=torch.float64, requires_grad=True)
    for t in range(0, 60, 7):
        (grad,) = torch.autograd.grad(conv(x)[0, t].sum(), x)
        depends = grad[0].abs().sum(-1).nonzero().flatten().tolist()
        # exactly the taps t, t - r, ..., t - (k-1)r that exist: the current frame and past ones only
        assert depends == sorted(t - j * dilation for j in range(kernel_size) if t - j * dilation >= 0)


def _measured_receptive_field(decoder, length):
    """How many input frames the last output depends on (gradient of the output w.r.t. the embeddings)."""
    tokens = torch.full((1, length), decoder.dictionary.nspecial, dtype=torch.long)
    embedded = decoder.embed_tokens(tokens).detach().requires_grad_(True)
    features = decoder.stack(embedded)
    # (a plain sum of a layer-normalised vector is constant: weight the channels randomly)
    weights = torch.randn(features.size(-1), dtype=features.dtype, generator=torch.Generator().manual_seed(0))
    (grad,) = torch.autograd.grad((features[0, -1] * weights).sum(), embedded)
    depends = grad[0].abs().sum(-1).nonzero().flatten()
    return length - int(depends.min())


def test_receptive_field_of_the_paper_lm_preset():
    # Six sets of five residual multiplicative blocks, dilations 1..16, 3-tap masked convolutions, two per
    # block (one in each multiplicative unit): 1 + 2 * 2 * 6 * (1 + 2 + 4 + 8 + 16) = 745 characters.
    # The paper states 315 for this network; its description does not give that number under any reading
    # (a single 3-tap convolution per block gives 373; 315 = 5 x 63, five sets of one set's 63).
    decoder = build("bytenet_lm", narrow=True).decoder
    assert decoder.receptive_field() == 745
    assert _measured_receptive_field(decoder, 800) == 745
    assert build("bytenet_lm", narrow=True, decoder_block_type="relu").decoder.receptive_field() == 373


def test_unfolded_length_and_source_frames_beyond_it():
    lengths = torch.tensor([1, 5, 10, 17])
    assert bytenet_model.unfolded_length(lengths, 1.2, 0).tolist() == [1, 6, 12, 20]
    assert bytenet_model.unfolded_length(lengths, 1.0, 3).tolist() == [4, 8, 13, 20]
    assert bytenet_model.unfolded_length(lengths, 0.5, 0).tolist() == [1, 2, 5, 8]
    model = build("bytenet_tiny", unfold_a=1.5, unfold_b=2.0)
    source, lengths, _ = _random_batch(model.decoder.dictionary, batch=3, source_len=8, target_len=2)
    with torch.no_grad():
        out = model.encoder(source, lengths)
    frames, unfolded = out["encoder_out"][0], out["unfolded_lengths"][0]
    assert unfolded.tolist() == [14, 12, 11]  # floor(1.5 * |s| + 2) for |s| = 8, 7, 6
    for row, length in enumerate(unfolded.tolist()):
        assert frames[row, length:].abs().sum() == 0
        assert frames[row, length - 1].abs().sum() > 0  # unfolded frames past the source carry information


def test_a_language_model_given_a_translation_task_is_refused():
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    dictionary = _dictionary()
    task = TranslationTask(TranslationConfig(), dictionary, dictionary)
    args = argparse.Namespace(arch="bytenet_lm_tiny", task="translation")
    ARCH_CONFIG_REGISTRY["bytenet_lm_tiny"](args)
    with pytest.raises(InputError, match="--arch bytenet_lm_tiny: a ByteNet language model .* given to --task "
                                         "translation: the translation model is --arch bytenet"):
        ARCH_MODEL_REGISTRY["bytenet_lm_tiny"].build_model(args, task)


def test_the_decoders_own_reorder_hook_reorders_its_frames():
    """fairseq's documented hook (``reorder_incremental_state``) and the generator's (``_scripting``) alike."""
    model = build("bytenet_tiny")
    source, lengths, target = _random_batch(model.decoder.dictionary, batch=3, source_len=6, target_len=5)
    new_order = torch.tensor([2, 2, 0])
    with torch.no_grad():
        encoder_out = model.encoder(source, lengths)
        state = {}
        for t in range(target.size(1)):
            model.decoder(target[:, : t + 1], encoder_out, incremental_state=state)
        before = {name: frames.clone()
                  for name, frames in model.decoder.stack.get_incremental_state(state, "frames").items()}
        model.decoder.reorder_incremental_state(state, new_order)
    after = model.decoder.stack.get_incremental_state(state, "frames")
    assert all(torch.equal(after[name], frames.index_select(0, new_order)) for name, frames in before.items())


def test_a_source_batch_padded_wider_than_it_needs_encodes_as_the_tight_one():
    """fairseq pads a batch to a multiple of --required-seq-len-multiple: the extra (left) padding changes
    nothing."""
    model = build("bytenet_tiny")
    pad = model.decoder.dictionary.pad()
    source, lengths, _ = _random_batch(model.decoder.dictionary, batch=3, source_len=6, target_len=5)
    wide = torch.cat([torch.full((3, 9), pad), source], dim=1)
    with torch.no_grad():
        assert torch.equal(model.encoder(wide, lengths)["encoder_out"][0][:, :7],
                           model.encoder(source, lengths)["encoder_out"][0][:, :7])


def test_a_sentence_decodes_the_same_alone_and_in_a_padded_batch():
    model = build("bytenet_tiny")
    source, lengths, target = _random_batch(model.decoder.dictionary, batch=4, source_len=10, target_len=25)
    with torch.no_grad():
        batched = _decode_full(model, source, lengths, target)
        for row in range(4):
            alone_source = source[row : row + 1, source.size(1) - int(lengths[row]):]
            alone = _decode_full(model, alone_source, lengths[row : row + 1], target[row : row + 1])
            assert torch.allclose(alone, batched[row : row + 1], atol=1e-10)


@pytest.mark.parametrize("preset", ["bytenet_tiny", "bytenet_lm_tiny"])
def test_layerdrop_skips_whole_blocks_in_training_and_none_at_inference(preset):
    side = "encoder" if preset == "bytenet_tiny" else "decoder"
    model = build(preset, **{f"{side}_layerdrop": 0.5})
    stack = getattr(model, side).stack
    channels = stack.final_norm.normalized_shape[0]
    x = torch.randn(2, 9, channels, dtype=torch.float64)
    every_block = x
    for block in stack.blocks:
        every_block = block(every_block, None)
    assert torch.equal(stack(x), stack.final_norm(every_block))  # eval mode: every block
    stack.train()
    torch.manual_seed(5)
    skipped = torch.rand(len(stack.blocks)) < 0.5
    assert 0 < int(skipped.sum()) < len(stack.blocks)  # this seed skips some blocks and keeps others
    kept = x
    for block, skip in zip(stack.blocks, skipped):
        if not skip:
            kept = block(kept, None)
    torch.manual_seed(5)
    assert torch.equal(stack(x), stack.final_norm(kept))


@pytest.mark.parametrize("flags, message", [
    ({"kernel_size": 4}, r"--kernel-size 4: .*odd"),
    ({"encoder_dilations": "1,x"}, r"--encoder-dilations '1,x'"),
    ({"decoder_dilations": "0"}, r"--decoder-dilations '0'"),
    ({"unfold_a": 0.0}, r"--unfold-a 0.0"),
    ({"encoder_blocks": 0}, r"--encoder-blocks 0: expected >= 1"),
    ({"kernel_size": 0}, r"--kernel-size 0: expected a positive number"),
    ({"decoder_layerdrop": 1.0}, r"--decoder-layerdrop 1.0: expected 0 <= P < 1"),
    ({"encoder_layerdrop": -0.1}, r"--encoder-layerdrop -0.1: expected 0 <= P < 1"),
    ({"dropout": -0.1}, r"--dropout -0.1: expected 0 <= P < 1"),
    ({"dropout": 1.5}, r"--dropout 1.5: expected 0 <= P < 1"),
])
def test_bad_model_flags_are_clear_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        build("bytenet_tiny", **flags)


# ---- through fairseq-train / fairseq-generate / fairseq-eval-lm ------------------------------------------

ALPHABET = "abcdefghijkl "


def _copy_corpus(directory, seed=3):
    """Character copy task: the target is the source."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    for split, size in (("train", 2000), ("val", 50), ("test", 40)):
        lines = []
        for _ in range(size):
            text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 24))).strip() or "a"
            lines.append(text)
        for lang in ("src", "tgt"):
            with open(os.path.join(directory, f"{split}.{lang}"), "w") as f:
                f.write("\n".join(lines) + "\n")
    return directory


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytenet")
    raw = _copy_corpus(str(root / "raw"))
    data = str(root / "data")
    plugins_cli("prepare", "--char", raw, data, "-s", "src", "-t", "tgt")
    save_dir = str(root / "checkpoints")
    run("fairseq_cli.train", os.path.join(data, "bin"), "--user-dir", USER_DIR, "--task", "translation",
        "--arch", "bytenet_tiny", "--optimizer", "adam", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "50", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "3000", "--max-epoch", "6", "--seed", "1", "--num-workers", "0", "--cpu",
        "--log-format", "simple", "--no-progress-bar", "--no-epoch-checkpoints", "--save-dir", save_dir,
        env={"OMP_NUM_THREADS": TRAIN_THREADS})
    return {"data": data, "bin": os.path.join(data, "bin"), "checkpoint": os.path.join(save_dir, "checkpoint_best.pt")}


def _generate(copy_model, *flags, task="translation"):
    proc = run("fairseq_cli.generate", copy_model["bin"], "--user-dir", USER_DIR, "--task", task,
               "--path", copy_model["checkpoint"], "--gen-subset", "test", "--cpu", *flags)
    return proc


def _hypotheses(output):
    rows = sorted((int(line.split("\t")[0][2:]), line.split("\t")[2]) for line in output.splitlines()
                  if line.startswith("H-"))
    return [text for _, text in rows]


def _references(copy_model):
    with open(os.path.join(copy_model["data"], "tok", "test.tgt")) as f:
        return [line.rstrip("\n") for line in f]


def test_a_tiny_character_model_learns_to_copy_and_decodes_through_fairseq_generate(copy_model):
    proc = _generate(copy_model, "--beam", "12", "--lenpen", "0", "--batch-size", "16")
    hypotheses = _hypotheses(proc.stdout)
    references = _references(copy_model)
    assert len(hypotheses) == len(references) == 40
    exact = sum(h == r for h, r in zip(hypotheses, references))
    assert exact >= 36, f"only {exact}/40 copied exactly"


def test_recomputed_decoding_gives_the_cached_hypotheses(copy_model):
    flags = ("--beam", "4", "--nbest", "4", "--batch-size", "8")
    cached = _generate(copy_model, *flags, task="bytenet_translation")
    recomputed = _generate(copy_model, *flags, "--bytenet-decoding", "recompute", task="bytenet_translation")

    def n_best(output):  # sentence -> [(text, score)] in rank order
        lists = {}
        for line in output.splitlines():
            if line.startswith("H-"):
                name, score, text = line.split("\t")
                lists.setdefault(int(name[2:]), []).append((text, float(score)))
        return lists

    cached, recomputed = n_best(cached.stdout), n_best(recomputed.stdout)
    assert len(cached) == 40 and all(len(hyps) == 4 for hyps in cached.values())
    assert cached.keys() == recomputed.keys()
    for sentence, hyps in cached.items():
        assert [text for text, _ in hyps] == [text for text, _ in recomputed[sentence]]
        assert [score for _, score in hyps] == pytest.approx([score for _, score in recomputed[sentence]], abs=1e-3)


def test_empty_and_overlong_sources_and_another_unfolding_decode(copy_model):
    # fairseq-interactive: an empty line (EOS only) and a source three times longer than any in training.
    long_line = ("abc def ghij kl " * 5).strip()
    from fairseq_plugins.tools.tokenization import CharTokenizer

    char = CharTokenizer()
    stdin = "\n".join(char.encode(line) for line in ["", "abc", long_line]) + "\n"
    proc = run("fairseq_cli.interactive", copy_model["bin"], "--user-dir", USER_DIR, "--path",
               copy_model["checkpoint"], "--beam", "4", "--cpu", "--max-len-a", "2", "--max-len-b", "10",
               stdin=stdin)
    hypotheses = [line.split("\t")[2] for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 3
    # The empty source (never seen in training) decodes too, within fairseq's length bound when it is alone:
    # 2 x 1 source token (its EOS) + 5.
    alone = run("fairseq_cli.interactive", copy_model["bin"], "--user-dir", USER_DIR, "--path",
                copy_model["checkpoint"], "--beam", "4", "--cpu", "--max-len-a", "2", "--max-len-b", "5", stdin="\n")
    empty = [line.split("\t") for line in alone.stdout.splitlines() if line.startswith("H-")]
    assert len(empty) == 1 and len(empty[0][2].split()) <= 7 and float(empty[0][1]) < 0
    assert char.decode(hypotheses[1]) == "abc"
    assert char.decode(hypotheses[2])[:40] == long_line[:40]  # copying goes on past anything seen in training
    other = _generate(copy_model, "--beam", "4", "--model-overrides", "{'unfold_a': 2.0, 'unfold_b': 1.0}")
    # A longer unfolding leaves room to stop: the copies come out as they do with the trained one.
    copies = sum(h == r for h, r in zip(_hypotheses(other.stdout), _references(copy_model)))
    assert len(_hypotheses(other.stdout)) == 40 and copies >= 36, copies
    assert "trained with 1.2 and 0.0" in other.stderr


def _character_lm_data(directory, alphabet, seed=0):
    """prepare-lm's data directory for random lines over ``alphabet`` (train 360 lines, valid 40)."""
    rng = random.Random(seed)
    text = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(400)]
    os.makedirs(directory, exist_ok=True)
    for name, lines in (("train.txt", text[:360]), ("valid.txt", text[360:])):
        with open(os.path.join(directory, name), "w") as f:
            f.write("\n".join(lines) + "\n")
    data = os.path.join(directory, "lm")
    plugins_cli("prepare-lm", os.path.join(directory, "train.txt"), os.path.join(directory, "valid.txt"), data)
    return os.path.join(data, "bin")


# bytenet_lm_tiny's receptive field is 125 characters: shorter training blocks warn (below 33, refused).
LM_TRAIN = ["--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "bytenet_lm_tiny",
            "--sample-break-mode", "none", "--optimizer", "adam", "--lr", "3e-3", "--criterion", "cross_entropy",
            "--max-tokens", "2048", "--cpu", "--num-workers", "0", "--no-epoch-checkpoints"]


@pytest.fixture(scope="module")
def lm_trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytenet_lm")
    data = _character_lm_data(str(root / "ab"), "ab ")
    save_dir = str(root / "checkpoints")
    run("fairseq_cli.train", data, *LM_TRAIN, "--tokens-per-sample", "128", "--max-update", "80",
        "--save-dir", save_dir)
    return {"root": root, "bin": data, "checkpoint": os.path.join(save_dir, "checkpoint_last.pt")}


def _eval_lm(lm_trained, data, *flags, check=True):
    return run("fairseq_cli.eval_lm", data, "--user-dir", USER_DIR, "--path", lm_trained["checkpoint"],
               "--tokens-per-sample", "128", "--max-tokens", "2048", "--gen-subset", "valid", "--cpu", *flags,
               check=check)


@pytest.mark.slow  # trains a model (make test-fast runs the tests that train none)
def test_the_language_model_trains_and_is_scored_by_fairseq_eval_lm(lm_trained):
    proc = _eval_lm(lm_trained, lm_trained["bin"])
    loss = float(proc.stderr.split("Loss (base 2): ")[1].split(",")[0])
    # Bits per character: below uniform over the dictionary (log2 8 = 3), and not below what a causal model
    # can reach on this text: characters uniform over "ab " and line lengths uniform over 0..30 give 1.80 bits
    # a token to a model that knows each line's position (a model that sees the future would score near 0).
    assert 1.6 < loss < 2.0
    # Scoring with a context window shorter than the receptive field is fairseq-eval-lm's business, not refused.
    _eval_lm(lm_trained, lm_trained["bin"], "--context-window", "96")


@pytest.mark.slow
@pytest.mark.parametrize("alphabet, size", [("xy ", 8), ("uvwxyz ", 16)])  # fairseq pads to a multiple of 8
def test_a_character_data_directory_for_another_vocabulary_is_refused(lm_trained, alphabet, size):
    """The checkpoint keeps its dictionary's fingerprint: another vocabulary is refused, naming the data
    directory, whether or not its size would have made load_state_dict fail."""
    other = _character_lm_data(str(lm_trained["root"] / alphabet.strip()), alphabet)
    proc = _eval_lm(lm_trained, other, check=False)
    assert proc.returncode != 0
    assert f"InputError: {other}: its source dictionary ({size} symbols" in proc.stderr, \
        proc.stderr[-1500:]
    assert "is not the one this ByteNet language model was trained with (8 symbols" in proc.stderr
    assert f"trained on {lm_trained['bin']}): give the data directory the model was trained on" in proc.stderr


@pytest.mark.slow
def test_a_checkpoint_from_before_the_fingerprints_names_another_vocabulary_size(lm_trained):
    old = str(lm_trained["root"] / "before_fingerprints.pt")
    state = torch.load(lm_trained["checkpoint"], map_location="cpu", weights_only=False)
    for key in ("target_dictionary_fingerprint", "target_dictionary_size",
                "source_dictionary_fingerprint", "source_dictionary_size", "dictionaries_data"):
        delattr(state["cfg"]["model"], key)
    torch.save(state, old)
    other = _character_lm_data(str(lm_trained["root"] / "uvwxyz-before"), "uvwxyz ")
    proc = run("fairseq_cli.eval_lm", other, "--user-dir", USER_DIR, "--path", old, "--tokens-per-sample", "128",
               "--gen-subset", "valid", "--cpu", check=False)
    assert proc.returncode != 0
    assert (f"InputError: {other}: 16 symbols where this ByteNet language checkpoint was trained with 8 "
            "(decoder.embed_tokens.weight)" in proc.stderr), proc.stderr[-1500:]


def test_tokens_per_sample_that_blinds_a_layer_is_refused_before_training(tmp_path):
    data = _character_lm_data(str(tmp_path), "ab ")
    # bytenet_lm_tiny: 5 blocks (two masked 3-tap convolutions each), dilations 1-16: the dilation-16
    # convolutions reach back 32 tokens.
    proc = run("fairseq_cli.train", data, *LM_TRAIN, "--tokens-per-sample", "30", "--max-update", "1",
               "--save-dir", str(tmp_path / "checkpoints"), check=False)
    assert proc.returncode != 0
    assert ("InputError: --tokens-per-sample 30: below this model's receptive field (125 tokens: --decoder-blocks 5"
            in proc.stderr), proc.stderr[-1500:]
    assert "a token is predicted from at most the 30 before it, not the 125 the model can see" in proc.stderr
    assert ("the convolutions of dilation 16 reach back further than a block, so their farthest taps only ever see "
            "padding: use --tokens-per-sample 33 or more" in proc.stderr)
    assert not (tmp_path / "checkpoints" / "checkpoint_last.pt").exists()


@pytest.mark.slow
def test_tokens_per_sample_below_the_receptive_field_trains_with_a_warning(tmp_path):
    data = _character_lm_data(str(tmp_path), "ab ")
    proc = run("fairseq_cli.train", data, *LM_TRAIN, "--tokens-per-sample", "80", "--max-update", "2",
               "--save-dir", str(tmp_path / "checkpoints"))
    log = proc.stdout + proc.stderr  # fairseq-train logs to stdout
    assert ("--tokens-per-sample 80: below this model's receptive field (125 tokens" in log
            and "not the 125 the model can see (use --tokens-per-sample 125 for all of it)" in log)
    assert (tmp_path / "checkpoints" / "checkpoint_last.pt").exists()


def test_a_translation_checkpoint_given_to_fairseq_eval_lm_is_refused(copy_model, tmp_path):
    data = _character_lm_data(str(tmp_path), "ab ")
    proc = run("fairseq_cli.eval_lm", data, "--user-dir", USER_DIR, "--path", copy_model["checkpoint"],
               "--tokens-per-sample", "128", "--gen-subset", "valid", "--cpu", check=False)
    assert proc.returncode != 0
    assert ("InputError: --arch bytenet_tiny: a ByteNet translation model (source and target networks) given to "
            "--task language_modeling" in proc.stderr), proc.stderr[-1500:]


def test_the_recipe_refuses_a_cool_down_whose_starting_checkpoint_is_missing(tmp_path):
    """A "-anneal" LM system starts from its source run's best checkpoint: without it (and without the source
    among the systems to train first), the recipe names the file and the system to train and starts nothing."""
    def train_lm(systems):
        return subprocess.run(["bash", os.path.join(REPO, "examples", "bytenet", "run.sh"), str(tmp_path / "m"),
                               str(tmp_path / "s"), str(tmp_path / "work")],
                              env=dict(os.environ, LM_SYSTEMS=systems, STAGES="train-lm"),
                              capture_output=True, text=True, timeout=120)

    # bytenet-lm is listed first but must not start: the check comes before any training.
    proc = train_lm("bytenet-lm bytenet-lm-deep-anneal")
    assert proc.returncode == 2, proc.stderr
    wanted = str(tmp_path / "work" / "bytenet-lm-deep" / "checkpoints" / "checkpoint_best.pt")
    assert (f"bytenet-lm-deep-anneal starts from {wanted}, which does not exist: train bytenet-lm-deep first"
            in proc.stderr)
    assert not (tmp_path / "work" / "bytenet-lm").exists()
    proc = train_lm("bytenet-lm-shallow-anneal")  # no such system
    assert proc.returncode == 2
    assert "LM_SYSTEMS names bytenet-lm-shallow-anneal, which is not a cool-down of this recipe" in proc.stderr


def test_a_cool_down_starts_at_the_learning_rate_its_source_had_at_its_best_checkpoint(tmp_path):
    """An MT "-anneal" system restarts its source from checkpoint_best.pt with the learning rate falling linearly
    from the one saved there to 0; resumed, it keeps the rate it started at (its own checkpoint's --lr), even once
    the source is gone. Checked with a stand-in fairseq-train that records its arguments."""
    work, stand_ins, calls = tmp_path / "work", tmp_path / "bin", tmp_path / "calls"
    best = work / "bytenet-mt" / "checkpoints" / "checkpoint_best.pt"
    os.makedirs(best.parent)
    torch.save({"last_optimizer_state": {"param_groups": [{"lr": 3.5e-4}]}}, best)
    os.makedirs(stand_ins)
    (stand_ins / "fairseq-train").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    os.chmod(stand_ins / "fairseq-train", 0o755)
    venv_bin = recipe_bin()

    def train_mt(systems):
        proc = subprocess.run(["bash", os.path.join(REPO, "examples", "bytenet", "run.sh"), str(tmp_path / "m"),
                               str(tmp_path / "s"), str(work)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PATH=f"{stand_ins}:{venv_bin}:{os.environ['PATH']}",
                                       MT_SYSTEMS=systems, LM_SYSTEMS="", STAGES="train-mt",
                                       TRAIN_POLL_SECONDS="0.1"))
        last = calls.read_text().splitlines()[-1].split() if calls.exists() else []
        return proc, {flag: last[len(last) - 1 - last[::-1].index(flag) + 1] for flag in last if flag.startswith("--")}

    proc, flags = train_mt("bytenet-mt-anneal")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert flags["--finetune-from-model"] == str(best) and flags["--arch"] == "bytenet_multi30k_char"
    # the last --lr and --lr-scheduler are the ones fairseq's parser keeps
    assert (flags["--lr"], flags["--lr-scheduler"], flags["--end-learning-rate"]) == ("0.00035", "polynomial_decay", "0")
    assert flags["--total-num-update"] == flags["--max-update"] == "1228"
    # bounded by its updates, not by the source's time cap (fairseq carries the source's training time into it)
    assert flags["--stop-time-hours"] == "0"
    assert flags["--save-dir"] == str(work / "bytenet-mt-anneal" / "checkpoints")

    os.remove(best)
    os.makedirs(work / "bytenet-mt-anneal" / "checkpoints")
    torch.save({"cfg": {"optimization": {"lr": [2e-4]}}}, work / "bytenet-mt-anneal" / "checkpoints" / "checkpoint_last.pt")
    proc, flags = train_mt("bytenet-mt-anneal")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert flags["--lr"] == "0.0002"

    calls.unlink()
    proc, flags = train_mt("transformer-mt-anneal")  # its source never trained: nothing starts
    assert proc.returncode == 2 and not calls.exists()
    assert ("transformer-mt-anneal starts from " + str(work / "transformer-mt" / "checkpoints" / "checkpoint_best.pt")
            + ", which does not exist: train transformer-mt first (MT_SYSTEMS=transformer-mt)") in proc.stderr
    proc, _ = train_mt("bytenet-mt-shallow-anneal")
    assert proc.returncode == 2 and "MT_SYSTEMS names bytenet-mt-shallow-anneal, which is not a cool-down" in proc.stderr


def _recipe_with_stand_in_training(tmp_path, script: str, systems: str, together: str = "2", unreadable=(), **env):
    """examples/bytenet/run.sh's train-mt stage with a stand-in fairseq-train (``script``, sh, given its
    system's name as $name and the event log as $events), both sources' best checkpoints in place for the
    cool-downs' learning rates (not a checkpoint for the sources in ``unreadable``). The recipe's result and the
    events ("start NAME", "end NAME") in order."""
    work, stand_ins, events = tmp_path / "work", tmp_path / "bin", tmp_path / "events"
    for source in ("bytenet-mt", "transformer-mt"):
        os.makedirs(work / source / "checkpoints", exist_ok=True)
        best = work / source / "checkpoints" / "checkpoint_best.pt"
        if source in unreadable:
            best.write_text("not a checkpoint\n")
        else:
            torch.save({"last_optimizer_state": {"param_groups": [{"lr": 3e-4}]}}, best)
    os.makedirs(stand_ins, exist_ok=True)
    (stand_ins / "fairseq-train").write_text(
        '#!/bin/sh\nfor last; do :; done\nname=$(basename "$(dirname "$last")")\n'
        f'events={events}\necho "start $name" >> "$events"\n{script}\nstatus=$?\necho "end $name" >> "$events"\n'
        'exit $status\n')
    os.chmod(stand_ins / "fairseq-train", 0o755)
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "bytenet", "run.sh"), str(tmp_path / "m"),
                           str(tmp_path / "s"), str(work)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PATH=f"{stand_ins}:{recipe_bin()}:{os.environ['PATH']}",
                                   MT_SYSTEMS=systems, LM_SYSTEMS="", STAGES="train-mt", TOGETHER=together,
                                   TRAIN_POLL_SECONDS="0.1", **env))
    return proc, events.read_text().splitlines() if events.exists() else []


def _most_at_once(events):
    running, most = 0, 0
    for event in events:
        running += 1 if event.startswith("start ") else -1
        most = max(most, running)
    return most


def test_a_cool_down_starts_as_soon_as_its_source_ends_while_the_other_trains_on(tmp_path):
    """Two places (TOGETHER=2): ByteNet's training ends first, and its cool-down takes its place while the
    transformer trains on (which here waits for that start, so the test does not race the clock); the
    transformer's cool-down starts only once the transformer has ended."""
    wait_for_the_bytenet_cool_down = (
        'if [ "$name" = transformer-mt ]; then i=0; while ! grep -qx "start bytenet-mt-anneal" "$events" '
        '&& [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done; fi')
    proc, events = _recipe_with_stand_in_training(
        tmp_path, wait_for_the_bytenet_cool_down, "bytenet-mt transformer-mt bytenet-mt-anneal transformer-mt-anneal")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert events.index("start bytenet-mt-anneal") < events.index("end transformer-mt")
    assert events.index("end bytenet-mt") < events.index("start bytenet-mt-anneal")
    assert events.index("end transformer-mt") < events.index("start transformer-mt-anneal")
    assert sorted(events) == sorted(f"{kind} {name}" for kind in ("start", "end") for name in
                                    ("bytenet-mt", "transformer-mt", "bytenet-mt-anneal", "transformer-mt-anneal"))
    assert _most_at_once(events) == 2
    # one place: in the order given, a cool-down after its source
    proc, events = _recipe_with_stand_in_training(tmp_path / "one", "", "bytenet-mt-anneal bytenet-mt transformer-mt",
                                                  together="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [e for e in events if e.startswith("start")] == ["start bytenet-mt", "start transformer-mt",
                                                            "start bytenet-mt-anneal"]
    assert _most_at_once(events) == 1


def test_a_training_stopped_at_its_time_cap_is_not_trained_again_and_its_cool_down_starts(tmp_path):
    """Re-run, the recipe skips a system whose log ends in a stop by the time cap it still has (fairseq would
    train one more update, then validate and save again) and starts its cool-down at once; a finished cool-down
    (its update budget) is skipped too; a larger MT_MINUTES trains the system on."""
    os.makedirs(tmp_path / "work" / "transformer-mt")
    (tmp_path / "work" / "transformer-mt" / "train.log").write_text(
        "| INFO | fairseq.trainer | No existing checkpoint found checkpoints/checkpoint_last.pt\n"
        "| INFO | fairseq_cli.train | Stopping training due to cumulative_training_time: 10.0002 > stop_time_hours: "
        "10.0 hour(s)\n")
    proc, events = _recipe_with_stand_in_training(tmp_path, "", "bytenet-mt transformer-mt transformer-mt-anneal")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "start transformer-mt" not in events and sorted(events) == [
        "end bytenet-mt", "end transformer-mt-anneal", "start bytenet-mt", "start transformer-mt-anneal"]
    assert ("transformer-mt: stopped at its time budget, 10.000 > 10.0 hours ("
            f"{tmp_path / 'work' / 'transformer-mt' / 'train.log'}): not trained again") in proc.stderr
    (tmp_path / "work" / "transformer-mt-anneal" / "train.log").write_text(
        "| INFO | fairseq.checkpoint_utils | loading pretrained model from best.pt: optimizer, lr scheduler ...\n"
        "| INFO | fairseq_cli.train | Stopping training due to num_updates: 1228 >= max_update: 1228\n")
    (tmp_path / "events").unlink()
    proc, events = _recipe_with_stand_in_training(tmp_path, "", "transformer-mt transformer-mt-anneal")
    assert proc.returncode == 0 and events == [], proc.stderr[-2000:]
    assert "transformer-mt-anneal: stopped at its update budget, 1228 updates" in proc.stderr
    proc, events = _recipe_with_stand_in_training(tmp_path, "", "transformer-mt", MT_MINUTES="700")
    assert proc.returncode == 0 and events == ["start transformer-mt", "end transformer-mt"], proc.stderr[-2000:]


def test_a_system_the_recipe_does_not_know_is_refused_before_any_training(tmp_path):
    proc, events = _recipe_with_stand_in_training(tmp_path, "", "bytenet-mt bytenet-mt-tiny")
    assert proc.returncode == 2 and events == []
    assert "run.sh: MT_SYSTEMS names bytenet-mt-tiny, which is not a system of this recipe (its systems: " in proc.stderr
    assert " transformer-mt " in proc.stderr


def test_a_failed_training_starts_nothing_more_and_stops_the_recipe_naming_its_log(tmp_path):
    fail_bytenet = 'if [ "$name" = bytenet-mt ]; then exit 1; fi; sleep 1'
    proc, events = _recipe_with_stand_in_training(
        tmp_path, fail_bytenet, "bytenet-mt transformer-mt bytenet-mt-anneal transformer-mt-anneal")
    assert proc.returncode == 1
    log = tmp_path / "work" / "bytenet-mt" / "train.log"
    assert f"run.sh: the training of bytenet-mt failed (or could not start): see {log} and above" in proc.stderr
    assert events[-1] == "end transformer-mt"  # waited for, not left running
    assert not any(event.startswith("start") and event.endswith("-anneal") for event in events)
    # a cool-down that cannot start (its learning rate unreadable) while the transformer trains on: the same
    wait_for_the_bytenet_end = (
        'if [ "$name" = transformer-mt ]; then i=0; while ! grep -qx "end bytenet-mt" "$events" '
        '&& [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done; sleep 1; fi')
    proc, events = _recipe_with_stand_in_training(
        tmp_path / "unreadable", wait_for_the_bytenet_end,
        "bytenet-mt transformer-mt bytenet-mt-anneal transformer-mt-anneal", unreadable=("bytenet-mt",))
    assert proc.returncode == 1
    log = tmp_path / "unreadable" / "work" / "bytenet-mt-anneal" / "train.log"
    assert f"run.sh: the training of bytenet-mt-anneal failed (or could not start): see {log}" in proc.stderr
    assert events[-1] == "end transformer-mt"
    assert not any(event.startswith("start") and event.endswith("-anneal") for event in events)


def test_saliency_of_the_copy_model_puts_each_word_on_its_source_word(copy_model, tmp_path):
    import json

    png, out = str(tmp_path / "fig6.png"), str(tmp_path / "fig6.json")
    plugins_cli("saliency", "--path", copy_model["checkpoint"], "--data", copy_model["data"],
                "--source", "abc def gh", "--target", "abc def gh", "--output", png, "--json", out)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(out) as f:
        result = json.load(f)
    assert result["columns"] == ["abc", "def", "gh"] and result["rows"] == ["abc", "def", "gh"] * 2
    matrix = torch.tensor(result["matrix"])
    assert torch.allclose(matrix.sum(0), torch.ones(3), atol=1e-6)  # normalised per column
    source_block = matrix[: result["source_rows"]]
    assert source_block.argmax(0).tolist() == [0, 1, 2]  # copying: each output word leans on its own source word
    # the generated target is used when none is given, and bad input is a clear error
    plugins_cli("saliency", "--path", copy_model["checkpoint"], "--data", copy_model["data"],
                "--source", "abc", "--output", str(tmp_path / "greedy.png"))
    proc = plugins_cli("saliency", "--path", copy_model["checkpoint"], "--data", copy_model["data"],
                       "--source", " ", "--output", str(tmp_path / "empty.png"), check=False)
    assert proc.returncode == 2 and "--source: empty sentence" in proc.stderr
    assert not os.path.exists(tmp_path / "empty.png")
    # checked before any checkpoint is read
    proc = plugins_cli("saliency", "--path", str(tmp_path / "missing.pt"), "--data", copy_model["data"],
                       "--source", " ", "--output", str(tmp_path / "empty.png"), check=False)
    assert proc.returncode == 2 and "--source: empty sentence" in proc.stderr


def test_saliency_refuses_a_language_model_checkpoint_by_its_arch(copy_model, lm_trained, tmp_path):
    proc = plugins_cli("saliency", "--path", lm_trained["checkpoint"], "--data", copy_model["data"],
                       "--source", "abc", "--output", str(tmp_path / "lm.png"), check=False)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert (f"--path {lm_trained['checkpoint']}: a ByteNetLanguageModel checkpoint (--arch bytenet_lm_tiny), not a "
            "ByteNet translation model" in proc.stderr), proc.stderr[-1500:]
    assert not os.path.exists(tmp_path / "lm.png")


@pytest.mark.parametrize("batch_size", [1, 2])
def test_bench_times_recomputed_against_cached_decoding_at_a_forced_length(copy_model, tmp_path, batch_size):
    import json

    result_path = tmp_path / "length.json"
    plugins_cli("bench", "--method", "bytenet", "--path", copy_model["checkpoint"], "--data", copy_model["data"],
                "--threads", 1, "--runs", 1, "--warmup", 0, "--beam", 1, "--limit", 4, "--latency-limit", 0,
                "--batch-size", batch_size,
                "--min-len", 30, "--max-len-a", 0, "--max-len-b", 30, "--bytenet-decoding", "recompute",
                "--json", result_path)
    result = json.loads(result_path.read_text())
    assert result["batch_size"] == batch_size and result["generator"]["min_len"] == 30
    # At batch 1 the timed batches are the latency figures; at batch 2 --latency-limit 0 leaves them out.
    assert (result["latency_ms_p50"] is None) == (batch_size > 1)
    assert result["generator"]["task_flags"]["bytenet_decoding"] == "recompute"
    assert result["stats"]["outputs_identical_to_baseline"] == 1.0
    assert result["target_tokens"] == 4 * 30  # every output forced to exactly 30 characters (EOS not counted)


def test_bench_times_the_torch_steps_against_the_native_step_with_the_same_outputs(copy_model, tmp_path):
    """--bytenet-decoding cached-torch on the method side, the stock generator on the same model objects stepping
    natively: both decode, and write the same characters."""
    import json

    result_path = tmp_path / "steps.json"
    plugins_cli("bench", "--method", "bytenet", "--path", copy_model["checkpoint"], "--data", copy_model["data"],
                "--threads", 1, "--runs", 1, "--warmup", 0, "--beam", 4, "--limit", 6, "--latency-limit", 0,
                "--bytenet-decoding", "cached-torch", "--json", result_path)
    result = json.loads(result_path.read_text())
    assert result["generator"]["task_flags"]["bytenet_decoding"] == "cached-torch"
    assert result["stats"]["outputs_identical_to_baseline"] == 1.0


def test_the_step_timing_script_times_both_steps_and_writes_its_figures(copy_model, tmp_path):
    """examples/bytenet/step_timing.py, what NATIVE_MAX_ROWS is set from: every row count timed both ways, the
    same characters chosen, the command and device kept."""
    import json

    from fairseq_plugins.kernels import native

    if not native.available():
        pytest.skip("the native kernels could not be built here")
    out = tmp_path / "timing.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "bytenet", "step_timing.py"),
                           copy_model["checkpoint"], copy_model["bin"], "--rows", "1", "3", "--steps", "5", "--runs",
                           "2", "--json", str(out)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    timing = json.loads(out.read_text())
    assert [row["rows"] for row in timing["figures"]] == [1, 3]
    assert all(row["same_characters"] and row["native_ms"]["min"] <= row["native_ms"]["median"] <=
               row["native_ms"]["max"] and row["torch_ms"]["median"] > 0 for row in timing["figures"])
    assert timing["command"][1:] == ["examples/bytenet/step_timing.py", copy_model["checkpoint"], copy_model["bin"],
                                     "--rows", "1", "3", "--steps", "5", "--runs", "2", "--json", str(out)]
    assert "rows   3: native" in proc.stdout


def test_bench_times_bytenet_against_a_character_transformer_in_one_run(copy_model, tmp_path):
    """The recipe's speed comparison: ByteNet (the method side, cached) against a transformer trained on the same
    character data (--baseline-path, loaded with its own task) and CTranslate2 float32 on that transformer
    (--reference ctranslate2), in one process; each fairseq side scores exactly as it does benched alone."""
    pytest.importorskip("ctranslate2", reason="ctranslate2 is installed by `make install`")
    save_dir = str(tmp_path / "transformer")
    run("fairseq_cli.train", copy_model["bin"], "--task", "translation", "--arch", "transformer",
        "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--share-all-embeddings", "--optimizer", "adam", "--lr", "3e-3",
        "--criterion", "cross_entropy", "--max-tokens", "3000", "--max-epoch", "2", "--seed", "1",
        "--num-workers", "0", "--cpu", "--no-progress-bar", "--no-epoch-checkpoints", "--save-dir", save_dir,
        env={"OMP_NUM_THREADS": TRAIN_THREADS})
    transformer = os.path.join(save_dir, "checkpoint_last.pt")
    # The recipe's length limit: without it a weak model runs to fairseq's 200 tokens, where CTranslate2 and
    # fairseq, summing in other orders, part at some near-tie (1 sentence in 6 here when tried).
    common = ["--data", copy_model["data"], "--threads", 1, "--runs", 1, "--warmup", 0, "--beam", 4, "--lenpen", 0,
              "--max-len-a", 1.5, "--max-len-b", 10, "--limit", 6, "--no-whole-split-bleu"]
    together, alone = tmp_path / "versus.json", tmp_path / "alone.json"
    plugins_cli("bench", "--method", "bytenet", "--path", copy_model["checkpoint"], "--baseline-path", transformer,
                *common, "--reference", "ctranslate2", "--json", together)
    plugins_cli("bench", "--method", "baseline", "--path", transformer, *common, "--json", alone)
    result, transformer_alone = json.loads(together.read_text()), json.loads(alone.read_text())
    assert result["baseline_checkpoint"] == os.path.abspath(transformer)
    assert result["generator"]["task_flags"]["bytenet_decoding"] == "cached"
    assert result["baseline"]["bleu"] == transformer_alone["bleu"]
    assert result["baseline"]["hypothesis_length"] == transformer_alone["hypothesis_length"]
    # The copying ByteNet, decoded as fairseq-generate decodes it (these short lines have too few 4-grams for BLEU),
    # and two models, not one benched twice.
    assert result["bleu_precisions"][0] == 100 and result["hypothesis_length"] == result["reference_length"]
    assert result["stats"]["outputs_identical_to_baseline"] < 1
    # CTranslate2 converted the character transformer (not ByteNet, which its converter does not take) and decodes
    # it as the stock generator does, with --lenpen 0 as no normalisation: all 6 sentences the same when this was
    # written (a float32 near-tie could flip one; more than one means a wrong mapping).
    reference = result["ctranslate2"]
    assert reference["checkpoint"] == os.path.abspath(transformer)
    assert reference["generator"]["options"]["length_penalty"] == 0.0 and reference["generator"]["beam"] == 4
    assert reference["outputs_identical_to_stock"] >= 5 / 6
    assert reference["speed_ratio"] == pytest.approx(reference["run_seconds"][0] / result["run_seconds"][0])


@pytest.mark.cuda
def test_incremental_decoding_on_cuda_matches_the_cpu_full_forward_pass():
    model = build("bytenet_multi30k_char", narrow=True)
    source, lengths, target = _random_batch(model.decoder.dictionary, batch=3, source_len=9, target_len=30)
    with torch.no_grad():
        reference = _decode_full(model, source, lengths, target)
        model.cuda()
        incremental, _ = _decode_incremental(model, source.cuda(), lengths.cuda(), target.cuda())
    assert torch.allclose(incremental.cpu(), reference, atol=1e-5, rtol=0)


def test_recompute_decoding_refuses_models_that_are_not_bytenet():
    from fairseq_plugins.bytenet.task import ByteNetTranslationConfig, ByteNetTranslationTask

    dictionary = Dictionary()
    task = ByteNetTranslationTask(ByteNetTranslationConfig(bytenet_decoding="recompute"), dictionary, dictionary)
    with pytest.raises(ValueError, match=r"^--bytenet-decoding recompute needs ByteNet models \(--path\), got Linear$"):
        task.build_generator([torch.nn.Linear(1, 1)], argparse.Namespace())


def _recipe_summary():
    """examples/bytenet/summarize.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("summarize", os.path.join(REPO, "examples", "bytenet", "summarize.py"))
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    return summarize


def test_the_recipe_summary_counts_training_time_across_a_resume(tmp_path):
    """fairseq's ``wall`` can start again from 0 when a run resumes: the summary's curve keeps counting, and
    the total is no longer the last run's "done training in"."""
    summarize = _recipe_summary()

    def epoch(n, loss, wall):
        return (f"| INFO | train | epoch {n:03d} | loss 2.5 | ppl 5.6 | wps 800 | num_updates {10 * n} | wall {wall}\n"
                f"| INFO | valid | epoch {n:03d} | valid on 'valid' subset | loss {loss} | ppl 4.4 | num_updates {10 * n}\n")

    log = tmp_path / "train.log"
    log.write_text(epoch(1, 2.7, 600) + epoch(2, 2.4, 1200) + epoch(3, 2.2, 500) + epoch(4, 2.1, 1000)
                   + "| INFO | fairseq_cli.train | done training in 1001.0 seconds\n")
    figures = summarize.training(str(log))
    assert [point["wall_seconds"] for point in figures["curve"]] == [600, 1200, 1700, 2200]
    assert figures["wall_seconds"] == 2200 and figures["valid_loss_base2"] == [2.7, 2.4, 2.2, 2.1]
    log.write_text(epoch(1, 2.7, 600) + epoch(2, 2.4, 1200) + "| INFO | fairseq_cli.train | done training in 1201.0 seconds\n")
    assert summarize.training(str(log))["wall_seconds"] == 1201.0
    # Every process's clock starts at 0; one that resumes at epoch 3 counts on from epoch 2's end, also where its
    # own epoch outlasts all the time before (so no fall in ``wall`` shows the resume), and the part of epoch 3
    # that a stopped process did not finish is not counted.
    scratch = "| INFO | fairseq.trainer | No existing checkpoint found ckpt/checkpoint_last.pt\n"

    def resumed(n):
        return f"| INFO | fairseq.trainer | Loaded checkpoint ckpt/checkpoint_last.pt (epoch {n} @ {10 * (n - 1)} updates)\n"

    log.write_text(scratch + epoch(1, 2.7, 600) + resumed(2) + epoch(2, 2.4, 700)
                   + "| INFO | train_inner | epoch 003:     50 / 614 loss=2.3, wall=800\n" + resumed(3) + epoch(3, 2.2, 650))
    figures = summarize.training(str(log))
    assert [point["wall_seconds"] for point in figures["curve"]] == [600, 1300, 1950]
    assert figures["wall_seconds"] == 1950
    # A stop by --stop-time-hours inside epoch 2 logs and validates the part done and saves a mid-epoch
    # checkpoint; the resumed run finishes epoch 2 from there: both parts counted, epoch 2 in the curve once.
    log.write_text(scratch + epoch(1, 2.7, 600) + epoch(2, 2.5, 900) + resumed(2).replace(" @ 10 ", " @ 15 ")
                   + epoch(2, 2.4, 400) + epoch(3, 2.2, 1000))
    figures = summarize.training(str(log))
    assert [(point["epoch"], point["valid_loss_base2"], point["wall_seconds"]) for point in figures["curve"]] == [
        (1, 2.7, 600), (2, 2.4, 1300), (3, 2.2, 1900)]
    # FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES: a process killed after a mid-epoch save of checkpoint_last.pt (logged
    # with its wall) resumes from it; what it trained after that save is trained again, not counted.
    mid_epoch = "| INFO | fairseq_plugins.fairseq_fixes | saved checkpoint_last mid-epoch: epoch 2 @ 15 updates | wall 900\n"
    log.write_text(scratch + epoch(1, 2.7, 600) + mid_epoch + "| INFO | train_inner | epoch 002:     18 / 20 wall=1000\n"
                   + resumed(2).replace(" @ 10 ", " @ 15 ") + epoch(2, 2.4, 400) + epoch(3, 2.2, 1000))
    figures = summarize.training(str(log))
    assert [(point["epoch"], point["wall_seconds"]) for point in figures["curve"]] == [(1, 600), (2, 1300), (3, 1900)]
    # Started again from scratch (its checkpoints deleted): the earlier run's epochs count no more.
    log.write_text(scratch + epoch(1, 2.7, 600) + epoch(2, 2.5, 900) + scratch + epoch(1, 2.6, 500)
                   + "| INFO | fairseq_cli.train | done training in 501.0 seconds\n")
    figures = summarize.training(str(log))
    assert [(point["epoch"], point["wall_seconds"]) for point in figures["curve"]] == [(1, 500)]
    assert figures["wall_seconds"] == 501.0
    # A cool-down (--finetune-from-model) started again after its checkpoints were deleted: fairseq logs the
    # pretrained model's "Loaded checkpoint ... (epoch 16 @ 0 updates)"; a new training, not a resume at epoch 16.
    finetune = ("| INFO | fairseq.checkpoint_utils | loading pretrained model from ckpt/checkpoint_best.pt: "
                "optimizer, lr scheduler, meters, dataloader will be reset\n"
                "| INFO | fairseq.trainer | Loaded checkpoint ckpt/checkpoint_best.pt (epoch 16 @ 0 updates)\n")
    log.write_text(finetune + epoch(1, 2.7, 600) + epoch(2, 2.5, 1200) + finetune + epoch(1, 2.6, 500)
                   + "| INFO | fairseq_cli.train | done training in 501.0 seconds\n")
    figures = summarize.training(str(log))
    assert [(point["epoch"], point["wall_seconds"]) for point in figures["curve"]] == [(1, 500)]
    assert figures["wall_seconds"] == 501.0


def test_the_recipe_summary_says_why_each_training_stopped_counting_only_its_last_run(tmp_path):
    summarize = _recipe_summary()
    scratch = "| INFO | fairseq.trainer | No existing checkpoint found ckpt/checkpoint_last.pt\n"
    resumed = "| INFO | fairseq.trainer | Loaded checkpoint ckpt/checkpoint_last.pt (epoch 3 @ 20 updates)\n"
    valid = "| INFO | valid | epoch {:03d} | valid on 'valid' subset | loss {} | ppl 4.4 | num_updates 10\n"
    patience = "| INFO | fairseq_cli.train | early stop since valid performance hasn't improved for last 5 runs\n"
    time_cap = "| INFO | fairseq_cli.train | Stopping training due to cumulative_training_time: 10.1 > 10.0\n"
    done = "| INFO | fairseq_cli.train | done training in 61.5 seconds\n"
    log = tmp_path / "train.log"
    for text, stopped_by, best in (
            (scratch + valid.format(1, 2.5) + valid.format(2, 2.4) + valid.format(3, 2.45) + patience + done,
             "patience (plateau of validation loss)", 2),
            (scratch + valid.format(1, 2.5) + time_cap + done, "time budget (--stop-time-hours)", 1),
            (scratch + valid.format(1, 2.5) + done, "max epoch", 1),
            # a time cap, then a resumed run still going (or killed): the cap no longer says why it stopped
            (scratch + valid.format(1, 2.5) + time_cap + done + resumed + valid.format(2, 2.4),
             "not finished (no end of training in the log)", 2)):
        log.write_text(text)
        figures = summarize.training(str(log))
        assert (figures["stopped_by"], figures["best_epoch"]) == (stopped_by, best)


def test_the_recipe_summary_keeps_the_speed_of_bytenet_against_the_transformer(tmp_path):
    """bytenet_speed.json's one-run bench of ByteNet against the transformer (--baseline-path) goes into the
    summary as its speed ratio (transformer time / ByteNet time) with its runs; a bench of a system against itself
    (the recipe's older bench) is no such comparison."""
    summarize = _recipe_summary()
    side = {"bleu": 20.0, "sentences_per_s": 2.0, "latency_ms_p50": 400.0, "hypothesis_length": 900,
            "generator": {"description": "beam 12"}}
    versus = {**side, "method": "bytenet", "checkpoint": "/w/bytenet-mt/checkpoints/checkpoint_avg.pt",
              "baseline_checkpoint": "/w/transformer-mt/checkpoints/checkpoint_avg.pt", "bleu": 15.0,
              "baseline": side, "speed_ratio": 0.9, "speed_ratio_runs": [0.88, 0.9, 0.95], "speed_ratio_min": 0.88,
              "speed_ratio_max": 0.95, "speed_ratio_spread": 0.07 / 0.9, "beam": 12, "batch_size": 1, "threads": 1,
              "sentences": 200, "device": "test CPU", "timing": {"alternation": "per batch"}}
    path = tmp_path / "bytenet_speed.json"
    path.write_text(json.dumps([versus]))
    speed = summarize.speed_against_transformer(str(path))
    assert (speed["speed_ratio"], speed["speed_ratio_runs"], speed["speed_ratio_flags"]) == (0.9, [0.88, 0.9, 0.95], [])
    assert speed["bytenet"]["bleu"] == 15.0 and speed["transformer"]["bleu"] == 20.0 and speed["beam"] == 12
    system = {"parameters": 6, "evaluated": "checkpoint_best.pt",
              "training": {"stopped_by": "max epoch", "wall_seconds": 60, "curve": [
                  {"epoch": 1, "valid_loss_base2": 2.0, "wall_seconds": 60}]}}
    text = summarize.translation_markdown({"translation": {"bytenet-mt": system}, "speed_against_transformer": speed})
    assert text.endswith(f"Speed, {speed['definition']}: **0.90** (0.88-0.95; runs 0.88, 0.90, 0.95), beam 12, batch 1, "
                         "1 thread(s), 200 sentences, test CPU; ByteNet 2.00 sentences/s, the transformer 2.00.\n")
    assert speed["ctranslate2"] is None  # benched without --reference ctranslate2
    # With CTranslate2 on the transformer in the same runs: its ratio (CTranslate2 time / ByteNet time), flagged
    # for its own spread, and a line of its own under the speed line.
    reference = {"speed_ratio": 0.5, "speed_ratio_runs": [0.4, 0.5, 0.52], "speed_ratio_min": 0.4,
                 "speed_ratio_max": 0.52, "speed_ratio_spread": 0.12 / 0.5, "compute_type": "float32",
                 "version": "4.8.5", "bleu": 19.5, "sentences_per_s": 4.0, "outputs_identical_to_stock": 0.99}
    path.write_text(json.dumps([{**versus, "ctranslate2": reference}]))
    speed = summarize.speed_against_transformer(str(path))
    assert speed["ctranslate2"]["speed_ratio"] == 0.5 and speed["ctranslate2"]["bleu"] == 19.5
    assert speed["ctranslate2"]["speed_ratio_flags"] and not speed["speed_ratio_flags"]
    text = summarize.translation_markdown({"translation": {"bytenet-mt": system}, "speed_against_transformer": speed})
    assert text.endswith("Against CTranslate2 float32 (4.8.5) decoding the transformer in the same runs (CTranslate2 "
                         "time / ByteNet time): **0.50x (0.40-0.52), spread 24% !**; CTranslate2 4.00 sentences/s, "
                         "BLEU 19.50, its outputs the transformer's stock ones on 99% of the sentences.\n")
    path.write_text(json.dumps([{**versus, "method": "baseline", "baseline_checkpoint": versus["checkpoint"]}]))
    assert summarize.speed_against_transformer(str(path)) is None
    assert summarize.speed_against_transformer(str(tmp_path / "missing.json")) is None


def _summary_work(tmp_path):
    """A recipe WORK with prepared-data languages and commands, and the RAW_DIR of a one-line corpus: what the
    summary needs besides the systems' own files."""
    work, raw = tmp_path / "work", tmp_path / "raw"
    (work / "mt-data").mkdir(parents=True)
    (work / "mt-data" / "prepare.json").write_text('{"version": 1, "source_lang": "en", "target_lang": "de"}')
    raw.mkdir()
    for split in ("train", "valid", "test"):
        (raw / f"{split}.en").write_text("a b\n")
        (raw / f"{split}.de").write_text("c d\n")
    (work / "commands.txt").write_text("fairseq-train ...\n")
    return work, raw


def test_the_recipe_summary_scores_each_beam_and_length_penalty_of_a_translation_system(tmp_path, capsys):
    """test.beam12.txt is beam 12 at --lenpen 0 (the paper's), test.beam12.lenpen1.txt at --lenpen 1 (fairseq's
    default): each scored against the test references under its own name, with brevity penalty and length; an
    output older than the checkpoint scored is left out, and said."""
    summarize = _recipe_summary()
    work, raw = _summary_work(tmp_path)
    (raw / "test.de").write_text("ein kleiner Hund läuft über die Wiese\n")
    system = work / "bytenet-mt"
    (system / "checkpoints").mkdir(parents=True)
    torch.save({"model": {"w": torch.zeros(3, 2)}, "extra_state": {}}, system / "checkpoints" / "checkpoint_avg.pt")
    (system / "train.log").write_text(
        "| INFO | valid | epoch 001 | valid on 'valid' subset | loss 2.5 | ppl 5.6 | num_updates 10\n")
    (system / "test.beam12.txt").write_text("ein kleiner Hund läuft über\n")
    (system / "test.beam12.lenpen1.txt").write_text("ein kleiner Hund läuft über die Wiese\n")
    (system / "test.beam1.txt").write_text("ein kleiner Hund läuft über die Wiese\n")
    # A beam no longer evaluated, translated by an earlier checkpoint than the one scored: not its figures.
    (system / "test.beam4.txt").write_text("ein Hund\n")
    checkpoint_time = os.path.getmtime(system / "checkpoints" / "checkpoint_avg.pt")
    os.utime(system / "test.beam4.txt", (checkpoint_time - 60, checkpoint_time - 60))
    out = tmp_path / "results" / "bytenet.json"
    out.parent.mkdir()
    summarize.main(str(work), str(raw), str(out))
    mt = json.loads(out.read_text())["translation"]["bytenet-mt"]
    assert mt["parameters"] == 6
    assert "bleu_beam4_lenpen0" not in mt and "beam4_lenpen0" not in mt
    assert "test.beam4.txt: older than" in capsys.readouterr().err
    assert mt["bleu_beam12_lenpen1"] == mt["bleu_beam1_lenpen0"] == 100.0
    assert 0 < mt["bleu_beam12_lenpen0"] < 100.0 and mt["beam12_lenpen0"]["bleu_brevity_penalty"] < 1.0
    assert (mt["beam12_lenpen0"]["hypothesis_length"], mt["beam12_lenpen0"]["reference_length"]) == (5, 7)


def test_the_recipe_summary_writes_the_translation_tables_of_the_docs(tmp_path):
    """bytenet_translation.md beside the summary: both systems' curves side by side (best in bold), the cool-down's
    epochs after them with minutes counted on from its source's, and a row of scores per system (BLEU with
    precisions, brevity penalty and length ratio; "-" where a decoding is missing), as docs/bytenet.md shows them."""
    summarize = _recipe_summary()
    work, raw = _summary_work(tmp_path)
    (raw / "test.de").write_text("ein kleiner Hund läuft über die Wiese\n")
    scratch = "| INFO | fairseq.trainer | No existing checkpoint found ckpt/checkpoint_last.pt\n"
    finetune = "| INFO | fairseq.checkpoint_utils | loading pretrained model from ckpt/checkpoint_best.pt: ...\n"

    def epochs(*points):
        return "".join(f"| INFO | train | epoch {n:03d} | loss 2.9 | num_updates {10 * n} | wall {wall}\n"
                       f"| INFO | valid | epoch {n:03d} | valid on 'valid' subset | loss {loss} | ppl 5 | "
                       f"num_updates {10 * n}\n" for n, loss, wall in points)

    logs = {"bytenet-mt": scratch + epochs((1, 2.5, 600), (2, 2.2, 1200), (3, 2.3, 1800))
            + "| INFO | fairseq_cli.train | early stop since valid performance hasn't improved for last 1 runs\n",
            "transformer-mt": scratch + epochs((1, 2.6, 540), (2, 2.4, 1080), (3, 2.25, 1620), (4, 2.1, 2160)),
            "bytenet-mt-anneal": finetune + epochs((1, 2.15, 300), (2, 2.1, 600))
            + "| INFO | fairseq_cli.train | Stopping training due to num_updates: 20 >= max_update: 20\n"}
    for name, log in logs.items():
        (work / name / "checkpoints").mkdir(parents=True)
        averaged = {"averaged_checkpoints": ["checkpoint1.pt", "checkpoint2.pt", "checkpoint3.pt"]}
        torch.save({"model": {"w": torch.zeros(1000, 2000)}, "extra_state": averaged if name == "bytenet-mt" else {}},
                   work / name / "checkpoints" / ("checkpoint_avg.pt" if name == "bytenet-mt" else "checkpoint_best.pt"))
        (work / name / "train.log").write_text(log)
        (work / name / "test.beam1.txt").write_text("ein kleiner Hund läuft über die Wiese\n")
    (work / "bytenet-mt" / "test.beam12.txt").write_text("ein kleiner Hund läuft über\n")
    out = tmp_path / "results" / "bytenet.json"
    out.parent.mkdir()
    summarize.main(str(work), str(raw), str(out))
    lines = (tmp_path / "results" / "bytenet_translation.md").read_text().splitlines()
    assert lines[0] == ("| epoch | `bytenet-mt` validation loss (base 2) | `bytenet-mt` training minutes | "
                        "`transformer-mt` validation loss (base 2) | `transformer-mt` training minutes |")
    assert lines[2:8] == ["| 1 | 2.500 | 10 | 2.600 | 9 |", "| 2 | **2.200** | 20 | 2.400 | 18 |",
                          "| 3 | 2.300 | 30 | 2.250 | 27 |", "| 4 |  |  | **2.100** | 36 |",
                          "| cool-down 1 | 2.150 | 35 |  |  |", "| cool-down 2 | **2.100** | 40 |  |  |"]
    assert lines[9] == ("| system | parameters | evaluated | training minutes; stopped by | BLEU beam 12, lenpen 0 | "
                        "BLEU greedy |")
    assert lines[11].startswith("| `bytenet-mt` | 2.00M | epochs 1-3 | 30; patience (plateau of validation loss) | ")
    assert lines[11].endswith(" | 100.00 (100.0/100.0/100.0/100.0, BP 1.000, ratio 1.000) |")
    assert " BP 0." in lines[11] and "ratio 0.714)" in lines[11]  # beam 12: 5 of the 7 reference words
    assert lines[12].startswith("| `transformer-mt` | 2.00M | checkpoint_best.pt | 36; not finished ")
    assert " | - | 100.00 " in lines[12]
    assert lines[13].startswith("| `bytenet-mt-anneal` | 2.00M | checkpoint_best.pt | 40; update budget (--max-update) | - |")
    assert lines[15].startswith("sacreBLEU signature: `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_the_recipe_summary_takes_a_device_trained_lm_from_its_logs(tmp_path):
    """An LM trained and scored on a lent GPU whose checkpoint did not come back: its parameter count from
    fairseq-train's log, the GPU it trained on, its bits per character; the MT side needs only the references."""
    summarize = _recipe_summary()

    work, raw = _summary_work(tmp_path)
    system = work / "bytenet-lm-deep-wide"
    system.mkdir()
    (system / "train.log").write_text(
        "| INFO | fairseq_cli.train | num. shared model params: 20,840,712 (num. trained: 20,840,712)\n"
        "| INFO | fairseq.utils | rank   0: capabilities =  9.0  ; total memory = 79.179 GB ; name = NVIDIA H100 80GB HBM3   \n"
        "| INFO | fairseq.trainer | No existing checkpoint found ckpt/checkpoint_last.pt\n"  # (after the device)
        "| INFO | train | epoch 001 | loss 2.9 | ppl 7.4 | num_updates 124 | wall 16\n"
        "| INFO | valid | epoch 001 | valid on 'valid' subset | loss 2.665 | ppl 6.3 | num_updates 124\n")
    (system / "eval-lm.log").write_text("INFO:fairseq_cli.eval_lm:Loss (base 2): 2.1293, Perplexity: 4.37\n")
    out = tmp_path / "results" / "bytenet.json"
    out.parent.mkdir()
    summarize.main(str(work), str(raw), str(out))
    lm = json.loads(out.read_text())["language_model"]
    assert list(lm) == ["bytenet-lm-deep-wide"]
    assert lm["bytenet-lm-deep-wide"]["parameters"] == 20840712
    assert lm["bytenet-lm-deep-wide"]["valid_bits_per_character"] == 2.1293
    assert lm["bytenet-lm-deep-wide"]["training"]["device"] == "NVIDIA H100 80GB HBM3"
    assert lm["bytenet-lm-deep-wide"]["evaluated"].startswith("checkpoint_avg.pt (where it was trained")
    assert "averaged" not in lm["bytenet-lm-deep-wide"]
    assert summarize.training(str(system / "train.log"))["curve"] == [
        {"epoch": 1, "valid_loss_base2": 2.665, "wall_seconds": 16}]
    assert (out.parent / "bytenet_curves.png").read_bytes().startswith(b"\x89PNG")


def test_the_recipe_summary_counts_a_cool_down_on_from_its_source(tmp_path):
    """A "-anneal" system's training starts where its source's ended: the summary names the source and its
    training seconds (the curves plot the cool-down after them)."""
    summarize = _recipe_summary()
    work, raw = _summary_work(tmp_path)
    for name, start, wall in (("bytenet-lm-deep", "No existing checkpoint found ckpt/checkpoint_last.pt", 700),
                              ("bytenet-lm-deep-anneal", "loading pretrained model from ckpt/checkpoint_best.pt", 90)):
        (work / name).mkdir()
        (work / name / "train.log").write_text(
            "| INFO | fairseq_cli.train | num. shared model params: 1,000 (num. trained: 1,000)\n"
            f"| INFO | fairseq.trainer | {start}\n"
            f"| INFO | train | epoch 001 | loss 2.9 | ppl 7.4 | num_updates 124 | wall {wall}\n"
            "| INFO | valid | epoch 001 | valid on 'valid' subset | loss 2.1 | ppl 4.3 | num_updates 124\n")
        (work / name / "eval-lm.log").write_text("INFO:fairseq_cli.eval_lm:Loss (base 2): 2.1, Perplexity: 4.3\n")
    out = tmp_path / "results" / "bytenet.json"
    out.parent.mkdir()
    summarize.main(str(work), str(raw), str(out))
    lm = json.loads(out.read_text())["language_model"]
    assert lm["bytenet-lm-deep-anneal"]["training"]["cool_down_of"] == "bytenet-lm-deep"
    assert lm["bytenet-lm-deep-anneal"]["training"]["source_wall_seconds"] == 700
    assert lm["bytenet-lm-deep-anneal"]["training"]["curve"][0]["wall_seconds"] == 90
    assert "cool_down_of" not in lm["bytenet-lm-deep"]["training"]
