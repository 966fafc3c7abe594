"""int8 matrices with per-row activation scales (fairseq_plugins/kernels/int8.py): accuracy bounded by int8 rounding,
results independent of the other rows in a call, and the modules that use them."""

import argparse
import os
import warnings

import pytest
import torch
from torch import nn

from conftest import DictionaryTask, word_dictionary

from fairseq_plugins.kernels import native
from fairseq_plugins.kernels.int8 import Int8GRU, Int8Linear, Int8Matrix, int8_copy, int8_module_names
from fairseq_plugins.rnn_fc.model import RnnFcModel, rnn_fc_tiny
from fairseq_plugins.kernels.output_layer import OutputLayer

# The activation steps of a row, as a fraction of its largest magnitude. Native kernel: symmetric int8,
# max|x_i| / 127. fbgemm's dynamic kernel quantizes to 128 levels (reduce_range) over the call's range,
# which the guard row fixes to [-1, 1] after each row is divided by its largest magnitude: 2 max|x_i| / 127.
ACTIVATION_STEP = {"native": 1 / 127, "fbgemm": 2 / 127}


@pytest.fixture(params=native.BACKENDS, autouse=True)
def backend(request, monkeypatch):
    """Every test runs on both int8 kernels: the native one and torch's fbgemm fallback."""
    monkeypatch.setenv(native.BACKEND_VARIABLE, request.param)
    if native.backend() != request.param:
        pytest.fail(f"the {request.param} int8 kernel is not available here")
    return request.param


def expected_rounding_error(x, weight, backend):
    """Root-mean-square error of x W^T predicted from uniform rounding (step^2 / 12) of both factors with
    per-row weight scales max|W_j| / 127 and per-row activation steps (ACTIVATION_STEP)."""
    weight_step = weight.abs().amax(1) / 127  # (rows,)
    activation_step = ACTIVATION_STEP[backend] * x.abs().amax(1)  # (n,)
    variance = ((x ** 2) @ (weight_step ** 2).unsqueeze(0).expand(x.size(1), -1)
                + activation_step.unsqueeze(1) ** 2 * (weight ** 2).sum(1).unsqueeze(0)) / 12
    return float(variance.mean().sqrt())


@pytest.mark.parametrize("dim", [64, 256])
def test_the_int8_product_error_is_int8_rounding_error(dim, backend):
    torch.manual_seed(0)
    # Rows of very different magnitudes: one scale for the call would crush the small rows.
    x = torch.randn(32, dim) * torch.logspace(-3, 1, 32).unsqueeze(1)
    weight = torch.randn(500, dim) * torch.rand(500, 1)
    error = Int8Matrix(weight)(x) - x @ weight.t()
    # Per row, relative to that row's own expected error, so the small rows count as much as the large.
    predicted = torch.tensor([expected_rounding_error(x[i:i + 1], weight, backend) for i in range(32)])
    ratio = error.pow(2).mean(1).sqrt() / predicted  # 0.88-1.21 measured
    assert float(ratio.max()) < MAX_ERROR_RATIO and float(ratio.min()) > 0.7, ratio  # int8, not finer


MAX_ERROR_RATIO = 1.4


def rms_error_ratios(matrix, x, weight, backend):
    predicted = torch.tensor([expected_rounding_error(x[i:i + 1], weight, backend) for i in range(x.size(0))])
    return (matrix(x) - x @ weight.t()).pow(2).mean(1).sqrt() / predicted


def test_a_coarser_weight_scale_or_one_activation_scale_would_fail_the_error_bound(backend):
    torch.manual_seed(0)
    x = torch.randn(16, 64) * torch.logspace(-3, 1, 16).unsqueeze(1)
    weight = torch.randn(300, 64)
    # A scale 4x too coarse (what a wrong scale formula gives) fails on every row (1.6-2.6 measured).
    coarse = Int8Matrix(weight, scales=4 * weight.abs().amax(1) / 127)
    assert float(rms_error_ratios(coarse, x, weight, backend).min()) > MAX_ERROR_RATIO
    # One activation scale for the whole call (torch's dynamic quantization) fails on the small rows.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_call = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(64, 300, bias=False)),
                                                          dtype=torch.qint8)
    per_call[0].set_weight_bias(torch.quantize_per_channel(
        weight, weight.abs().amax(1).double() / 127, torch.zeros(300, dtype=torch.long), 0, torch.qint8), None)
    assert float(rms_error_ratios(per_call, x, weight, backend).max()) > 10 * MAX_ERROR_RATIO


@pytest.mark.parametrize("dim", [1, 2, 64])
def test_each_row_gets_the_same_result_whatever_else_is_in_the_call(dim):
    torch.manual_seed(0)
    matrix = Int8Matrix(torch.randn(100, dim))
    x = torch.randn(9, dim) * torch.logspace(-2, 2, 9).unsqueeze(1)
    x[4] = 0  # a row of zeros gives zeros, not NaN
    together = matrix(x)
    alone = torch.cat([matrix(x[i:i + 1]) for i in range(9)])
    reordered = matrix(x.flip(0)).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, reordered)
    assert torch.equal(together[4], torch.zeros(100))
    assert matrix(x.view(3, 3, dim)).shape == (3, 3, 100)


def test_the_stored_weights_are_int8_with_one_scale_per_row():
    torch.manual_seed(0)
    weight = torch.randn(40, 16) * torch.logspace(-2, 1, 40).unsqueeze(1)
    matrix = Int8Matrix(weight)
    values = matrix.int8_weight()
    assert values.dtype == torch.int8 and int(values.abs().max()) == 127
    assert bool((values.abs().amax(1) == 127).all())  # each row uses its full range: per-row scales
    assert float((matrix.dequantized() - weight).abs().max(1).values.div(matrix.scales).max()) <= 0.5 + 1e-4


def test_candidate_rows_are_the_full_int8_matrix_rows_exactly():
    torch.manual_seed(0)
    weight = torch.randn(50, 16)
    features = torch.randn(2, 3, 16)
    candidates = torch.tensor([[2, 5, 9, 40], [0, 1, 2, 3]])
    full, short = OutputLayer(weight, None, "int8"), OutputLayer(weight, None, "int8")
    full.prepare(None)
    short.prepare(candidates)
    all_logits = full(features)
    assert torch.equal(short(features), all_logits.gather(2, candidates.unsqueeze(1).expand(-1, 3, -1)))
    assert torch.equal(short(features[1:2], sentence=1), all_logits[1:2].gather(2, candidates[1:2].unsqueeze(1)
                                                                               .expand(-1, 3, -1)))
    assert not torch.equal(all_logits, features @ weight.t())  # int8, not float32


def test_linear_and_gru_follow_torchs_layers_within_int8_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(32, 48).requires_grad_(False)
    x = torch.randn(5, 7, 32)
    difference = (Int8Linear(linear)(x) - linear(x)).abs()
    assert 0 < float(difference.max()) < 0.05 * float(linear(x).abs().max())
    gru = nn.GRU(32, 24).requires_grad_(False)
    inputs, state = torch.randn(6, 3, 32), torch.randn(1, 3, 24)
    expected, expected_last = gru(inputs, state)
    outputs, last = Int8GRU(gru)(inputs, state)
    assert 0 < float((outputs - expected).abs().max()) < 0.05 and torch.equal(last[0], outputs[-1])
    # Batch independence holds through the recurrence, up to float32 noise: torch's vectorised and scalar
    # sigmoid/tanh differ in the last bit, and which elements take which path depends on the batch size.
    alone = torch.cat([Int8GRU(gru)(inputs[:, i:i + 1], state[:, i:i + 1])[0] for i in range(3)], dim=1)
    torch.testing.assert_close(alone, outputs, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="one-layer, unidirectional"):
        Int8GRU(nn.GRU(8, 8, bidirectional=True))


@pytest.mark.parametrize("top", ["tanh", "gru"])
def test_int8_copy_replaces_every_linear_and_decoder_gru_of_an_rnn_fc_model(top):
    args = argparse.Namespace(rnn_fc_top=top)
    rnn_fc_tiny(args)
    model = RnnFcModel.build_model(args, DictionaryTask(word_dictionary())).eval()
    quantized = int8_copy(model, keep_float={"decoder.output_projection"})
    names = int8_module_names(model, keep_float={"decoder.output_projection"})
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "decoder.output_projection"]
    assert set(linears) <= set(names) and len(linears) >= 6
    modules = dict(quantized.named_modules())
    for name in names:
        assert isinstance(modules[name], (Int8Linear, Int8GRU)), name
    assert isinstance(modules["decoder.top_layer"], Int8GRU if top == "gru" else Int8Linear)
    assert isinstance(modules["encoder.gru"], nn.GRU)  # bidirectional: float32, runs once a sentence
    assert isinstance(modules["decoder.output_projection"], nn.Linear)
    assert isinstance(model.decoder.fc_layers[0], nn.Linear)  # the original is untouched


def test_int8_matrices_refuse_cuda_weights_clearly():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pytest.raises(ValueError, match="CPU only"):
        Int8Matrix(torch.randn(4, 4, device="cuda"))


@pytest.mark.parametrize("kernel", ["plain", "vnni"])
@pytest.mark.parametrize("rows, out_rows, dim, with_bias", [
    (1, 256, 256, True), (5, 300, 70, True), (9, 33, 1, True), (4, 64, 1024, True), (13, 7, 40, False),
    (400, 24, 512, True), (2, 8, 64, False), (6, 17, 96, True),
])
def test_the_native_kernel_is_its_reference_bit_for_bit(backend, kernel, rows, out_rows, dim, with_bias):
    """Symmetric per-row rounding of the activations, exact integer sums, then the same float32 operations:
    equal to the last bit (the kernel is built without fused multiply-adds), whatever the row count (the
    kernels take rows four at a time), the output count (the VNNI kernel takes outputs 16 at a time, in
    padded blocks of 8) and the padding of ``dim`` to 32 bytes."""
    if backend != "native":
        pytest.skip("the native kernel's own check")
    torch.manual_seed(rows)
    weight = torch.randn(out_rows, dim)
    bias = torch.randn(out_rows) if with_bias else None
    x = torch.randn(rows, dim) * torch.logspace(-3, 2, rows).unsqueeze(1)
    x = torch.cat([x, torch.zeros(1, dim)])  # and a row of zeros: scale 1, bias only
    matrix = Int8Matrix(weight, bias=bias)
    assert matrix.backend == "native" and matrix.values.size(1) % 32 == 0
    if kernel == "plain":
        matrix.vnni = None
    elif matrix.vnni is None:
        pytest.skip("this CPU (or compiler) has no VNNI: the plain kernel runs")
    expected = native.reference_product(x, matrix.values, matrix.scales, bias, dim)
    assert torch.equal(matrix(x), expected)
    assert torch.equal(matrix(x)[-1], bias if with_bias else torch.zeros(out_rows))
    assert not torch.equal(matrix(x), x @ weight.t() + (bias if with_bias else 0))  # int8, not float32


def test_the_vnni_kernel_is_built_where_the_cpu_has_vnni(backend):
    if backend != "native":
        pytest.skip("the native kernel's own check")
    cpu = native._cpu_flags()
    has_vnni = "avx_vnni" in cpu or {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu
    assert (Int8Matrix(torch.randn(8, 32)).vnni is not None) == has_vnni


def test_without_a_compiler_int8_falls_back_to_fbgemm_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(native.BACKEND_VARIABLE, "native")
    monkeypatch.setenv("FAIRSEQ_PLUGINS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    with caplog.at_level("WARNING"):
        matrix = Int8Matrix(torch.randn(8, 4))
    assert matrix.backend == "fbgemm" and "the native kernels could not be built" in caplog.text
    assert "/bin/false" in caplog.text and os.listdir(tmp_path / "cache") == []  # nothing half-written left
    monkeypatch.setenv(native.BACKEND_VARIABLE, "avx9")
    with pytest.raises(ValueError, match="FAIRSEQ_PLUGINS_INT8=avx9: choose one of native, fbgemm"):
        native.backend()


@pytest.mark.parametrize("pre_norm, activation", [(False, "relu"), (True, "gelu")])
def test_an_int8_transformer_encoder_follows_the_float32_one_and_does_not_depend_on_the_batch(backend, pre_norm,
                                                                                             activation):
    """On the native backend each layer is one native call a sentence (NativeInt8Encoder): the torch int8
    layers' products, attention and norms in C, so the same outputs to float rounding."""
    from fairseq.models.transformer import TransformerModel, base_architecture

    from fairseq_plugins.kernels.int8 import Int8EncoderSelfAttention, int8_encoder
    from fairseq_plugins.kernels.int8 import NativeInt8Encoder

    torch.manual_seed(0)
    dictionary = word_dictionary()
    args = argparse.Namespace(encoder_layers=2, decoder_layers=1, encoder_embed_dim=32, decoder_embed_dim=32,
                              encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                              decoder_attention_heads=4, max_source_positions=64, max_target_positions=64, dropout=0.0,
                              encoder_normalize_before=pre_norm, activation_fn=activation)
    base_architecture(args)
    model = TransformerModel.build_model(args, DictionaryTask(dictionary)).eval()
    encoder = int8_encoder(model.encoder)
    layered = int8_encoder(model.encoder, native_layers=False)  # the same int8 matrices, as torch operations
    assert isinstance(encoder, NativeInt8Encoder) == (backend == "native") and type(layered) is type(model.encoder)
    assert all(isinstance(layer.self_attn, Int8EncoderSelfAttention) and isinstance(layer.fc1, Int8Linear)
               for layer in encoder.layers)
    assert isinstance(model.encoder.layers[0].fc1, nn.Linear)  # the original is untouched
    assert (model.encoder.layer_norm is not None) == pre_norm
    lengths = torch.tensor([7, 4, 6])
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (3, 7))
    for row, length in enumerate(lengths.tolist()):  # left-padded, as fairseq's translation task pads sources
        tokens[row, :7 - length] = dictionary.pad()
    with torch.no_grad():
        expected = model.encoder(tokens, lengths)["encoder_out"][0]
        together = encoder(tokens, lengths)
        as_torch = layered.forward_torchscript({"src_tokens": tokens, "src_lengths": lengths})["encoder_out"][0]
        alone = [encoder(tokens[row:row + 1, 7 - length:], lengths[row:row + 1])["encoder_out"][0][:, 0]
                 for row, length in enumerate(lengths.tolist())]
    stock = model.encoder(tokens, lengths)
    assert sorted(together) == sorted(stock) and torch.equal(together["encoder_padding_mask"][0], tokens.eq(1))
    assert torch.equal(together["src_lengths"][0], stock["src_lengths"][0])
    together = together["encoder_out"][0]
    for row, length in enumerate(lengths.tolist()):
        real = together[7 - length:, row]
        # int8 rounding (a few hundredths of the largest magnitude), not another computation
        error = float((real - expected[7 - length:, row]).abs().max() / expected.abs().max())
        assert 0 < error < 0.05, error
        torch.testing.assert_close(real, as_torch[7 - length:, row], rtol=0, atol=2e-5 * float(expected.abs().max()))
        # a sentence's output does not depend on its batch-mates (exactly, on the native layers)
        torch.testing.assert_close(real, alone[row], rtol=0, atol=0 if backend == "native" else 1e-5)
    if backend == "native":
        import copy
        import pickle

        # a copy or a pickled one rebuilds its native structs from its own tensors: the original can go
        copies = [copy.deepcopy(encoder), pickle.loads(pickle.dumps(encoder))]
        del encoder
        for copied in copies:
            assert isinstance(copied, NativeInt8Encoder) and not copied.training
            assert copied.padding_idx == dictionary.pad() and copied.embed_tokens.num_embeddings == len(dictionary)
            with torch.no_grad():
                output = copied(tokens, lengths)["encoder_out"][0]
            assert output.is_contiguous() and torch.equal(output, together)
        copies[0].train()  # training runs the torch layers (dropout, gradients): not the native ones
        assert not torch.equal(copies[0](tokens, lengths)["encoder_out"][0], together)
