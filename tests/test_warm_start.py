"""Warm starts from a trained fairseq transformer (common/warm_start.py): double-token and the lattice encoder.

(Blockwise's warm start is tested in test_blockwise.py.)
"""

import os
import re

import pytest
import torch
from conftest import USER_DIR

import fairseq_plugins  # noqa: F401  (registers the plugins)
from fairseq_plugins.common.textio import InputError


def build(trained, *flags):
    """The task and an untrained-then-warm-started model, as fairseq-train builds them from ``flags``."""
    from fairseq import options, tasks

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [os.path.join(trained["data"], "bin"), "--user-dir", USER_DIR,
                                                "--dropout", "0", *map(str, flags)])
    task = tasks.setup_task(args)
    return task, task.build_model(args).eval()


def base_of(trained):
    from fairseq import checkpoint_utils

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([trained["checkpoint"]])
    return task, models[0].eval()


def test_a_warm_started_l2r_1_double_token_system_decodes_as_its_base(trained):
    from fairseq.sequence_generator import SequenceGenerator

    task, model = build(trained, "--task", "double_token_translation", "--token-order", "l2r",
                        "--tokens-per-step", 1, "--arch", "double_token_transformer_tiny",
                        "--double-token-base-checkpoint", trained["checkpoint"])
    base_task, base = base_of(trained)
    task.load_dataset("test")
    batches = task.get_batch_iterator(task.dataset("test"), max_sentences=8).next_epoch_itr(shuffle=False)
    decoded = 0
    for sample in batches:
        for beam in (1, 4):
            ours = SequenceGenerator([model], task.target_dictionary, beam_size=beam)
            theirs = SequenceGenerator([base], base_task.target_dictionary, beam_size=beam)
            with torch.no_grad():
                mine, stock = ours.generate([model], sample), theirs.generate([base], sample)
            assert [h[0]["tokens"].tolist() for h in mine] == [h[0]["tokens"].tolist() for h in stock]
        decoded += len(sample["id"])
    assert decoded == len(task.dataset("test"))


def test_a_warm_started_bidir_2_system_has_the_base_tensors_and_eod_and_positions_added(trained):
    from fairseq.modules import SinusoidalPositionalEmbedding

    task, model = build(trained, "--task", "double_token_translation", "--token-order", "bidir",
                        "--tokens-per-step", 2, "--arch", "double_token_transformer_tiny",
                        "--double-token-base-checkpoint", trained["checkpoint"])
    _base_task, base = base_of(trained)
    eos, eod = task.target_dictionary.eos(), task.eod
    own, theirs = model.state_dict(), base.state_dict()
    for key, tensor in theirs.items():
        if key.endswith("_float_tensor"):
            continue
        if own[key].shape == tensor.shape:
            torch.testing.assert_close(own[key], tensor, rtol=0, atol=0, msg=key)
        else:  # the embedding and output matrices: EOD's row added, starting as EOS's
            assert eod == tensor.size(0) == own[key].size(0) - 1, key
            torch.testing.assert_close(own[key][:-1], tensor, rtol=0, atol=0)
            torch.testing.assert_close(own[key][eod], tensor[eos], rtol=0, atol=0)
    positions = model.decoder.embed_positions
    table = SinusoidalPositionalEmbedding.get_embedding(positions.num_embeddings, positions.embedding_dim,
                                                        positions.padding_idx)
    torch.testing.assert_close(positions.weight.detach(), table, rtol=0, atol=0)
    # ... so the decoder's positions are the base's: the same embedding for the same (padded) inputs
    tokens = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(positions(tokens), base.decoder.embed_positions(tokens), rtol=0, atol=1e-6)


def test_a_warm_started_lattice_model_has_the_base_encoder_and_embeddings(trained):
    task, model = build(trained, "--task", "lattice_translation", "--arch", "lattice_transformer_tiny",
                        "--lattice-base-checkpoint", trained["checkpoint"])
    _base_task, base = base_of(trained)
    src = torch.tensor([[7, 8, 9, 10, 2], [1, 1, 11, 12, 2]])
    lengths = torch.tensor([5, 3])
    with torch.no_grad():
        ours, theirs = model.encoder(src, lengths), base.encoder(src, lengths)
    torch.testing.assert_close(ours["encoder_out"][0], theirs["encoder_out"][0], rtol=0, atol=0)
    torch.testing.assert_close(model.decoder.embed_tokens.weight, base.decoder.embed_tokens.weight, rtol=0, atol=0)


def test_a_deeper_lattice_encoder_takes_the_base_layers_as_its_lowest_and_keeps_the_rest_fresh(trained):
    """Depth moved from the scorer to the encoder: 4 encoder layers from the tiny base's 2."""
    deeper = ("--task", "lattice_translation", "--arch", "lattice_transformer_tiny", "--encoder-layers", 4)
    torch.manual_seed(3)
    _task, model = build(trained, *deeper, "--lattice-base-checkpoint", trained["checkpoint"])
    torch.manual_seed(3)
    _task, untouched = build(trained, *deeper)  # the same initialisation, no warm start
    _base_task, base = base_of(trained)
    assert len(base.encoder.layers) == 2 and len(model.encoder.layers) == 4
    own, theirs, init = model.state_dict(), base.state_dict(), untouched.state_dict()
    for key, tensor in own.items():
        if key.startswith(("encoder.layers.0.", "encoder.layers.1.", "encoder.embed_tokens.")):
            torch.testing.assert_close(tensor, theirs[key], rtol=0, atol=0, msg=key)
        elif key.startswith(("encoder.layers.2.", "encoder.layers.3.")):
            torch.testing.assert_close(tensor, init[key], rtol=0, atol=0, msg=key)
    # the lowest two layers compute the base's encoder output
    src, padding = torch.tensor([[7, 8, 9, 10, 2]]), torch.zeros(1, 5, dtype=torch.bool)
    with torch.no_grad():
        x = model.encoder.forward_embedding(src)[0].transpose(0, 1)
        lower = model.encoder.layers[1](model.encoder.layers[0](x, padding), padding)
        stock = base.encoder(src, torch.tensor([5]))["encoder_out"][0]
    torch.testing.assert_close(lower, stock, rtol=0, atol=0)


def test_a_base_deeper_than_the_lattice_encoder_is_a_clear_error(trained):
    with pytest.raises(InputError, match="--lattice-base-checkpoint .*the base has 2 encoder layers and this "
                                         "model 1 \\(--encoder-layers must be at least the base's\\)"):
        build(trained, "--task", "lattice_translation", "--arch", "lattice_transformer_tiny",
              "--encoder-layers", 1, "--lattice-base-checkpoint", trained["checkpoint"])


@pytest.mark.parametrize("system", [
    ("--task", "double_token_translation", "--token-order", "bidir", "--tokens-per-step", 2,
     "--arch", "double_token_transformer_tiny", "--double-token-base-checkpoint"),
    ("--task", "lattice_translation", "--arch", "lattice_transformer_tiny", "--lattice-base-checkpoint"),
    ("--task", "blockwise_translation", "--arch", "blockwise_transformer_tiny", "--blockwise-base-checkpoint"),
])
def test_a_resumed_training_does_not_apply_the_warm_start_again(trained, tmp_path, system):
    """As fairseq does for --finetune-from-model: once the save dir holds checkpoint_last.pt (or --restore-file
    names a checkpoint), that checkpoint's weights are what training continues from, and the base, which may
    have changed or gone since, is not read (here: a missing file, an error only on the first launch)."""
    gone = str(tmp_path / "gone.pt")
    with pytest.raises(InputError, match=f"{system[-1]} .*gone.pt: no such file"):
        build(trained, *system, gone, "--save-dir", tmp_path / "fresh")
    (tmp_path / "resumed").mkdir()
    (tmp_path / "resumed" / "checkpoint_last.pt").write_bytes(b"")
    build(trained, *system, gone, "--save-dir", tmp_path / "resumed")  # not read: no error
    build(trained, *system, gone, "--save-dir", tmp_path / "fresh", "--restore-file", tmp_path / "resumed" /
          "checkpoint_last.pt")


@pytest.mark.parametrize("system", [
    ("--task", "double_token_translation", "--token-order", "bidir", "--tokens-per-step", 2,
     "--arch", "double_token_transformer_multi30k", "--double-token-base-checkpoint"),
    ("--task", "lattice_translation", "--arch", "lattice_transformer_multi30k", "--lattice-base-checkpoint"),
])
def test_a_base_of_other_sizes_or_no_base_is_a_clear_error(trained, tmp_path, system):
    flag = system[-1]
    with pytest.raises(InputError, match=f"{flag} .*not a model this one can start from"):
        build(trained, *system, trained["checkpoint"])  # 256-d presets: the tiny base does not fit
    with pytest.raises(InputError, match=f"{flag} .*none.pt: no such file"):
        build(trained, *system, tmp_path / "none.pt")


@pytest.mark.parametrize("system, message", [
    (("--task", "double_token_translation", "--token-order", "l2r", "--tokens-per-step", 1,
      "--arch", "baseline_transformer_tiny", "--double-token-base-checkpoint"),
     "--double-token-base-checkpoint needs --arch double_token_transformer*"),
    (("--task", "lattice_translation", "--arch", "baseline_transformer_tiny", "--lattice-base-checkpoint"),
     "--lattice-base-checkpoint needs --arch lattice_transformer*"),
])
def test_a_base_checkpoint_with_a_model_that_cannot_take_it_is_refused(trained, system, message):
    """The warm start flags belong to their method's models: with another --arch they are an error naming the
    flag, not ignored."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build(trained, *system, trained["checkpoint"])
