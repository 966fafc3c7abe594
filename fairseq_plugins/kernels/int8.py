"""int8 matmuls for any fairseq model on CPU, with results that do not depend on the batch.

Weights are int8 with one scale per output row; activations are quantized with one scale per input row
(per token), as int8 inference engines do, so a row's result is the same at batch 1 and batch 64.

Two kernels compute it. The native one (``kernels/native``: products.c, built at first use) rounds each row to
int8 with its own symmetric scale and sums int8 products in int32 with AVX2 (VNNI where the CPU has it), reading
each weight byte once a call; torch's dynamic-quantization kernel (fbgemm) quantizes, packs and dispatches at
every call, which dominates at a few rows. The native kernels also run a whole transformer layer in one call
(the fast step's int8 path, ``int8_encoder``'s layers). Where no C compiler is found, fbgemm computes the same
per-row product: torch picks one activation range per call, so each row is first divided by its own largest
magnitude, a guard row fixes the call's range to [-1, 1] whatever the other rows hold, and the product is
multiplied back.

``Int8Matrix`` is the product; the modules that use it: ``Int8Linear`` for ``nn.Linear``, ``Int8GRU`` for a
one-layer unidirectional ``nn.GRU``, ``Int8EncoderSelfAttention`` and ``int8_encoder`` for a transformer
encoder, ``int8_copy`` for a whole model. Registers nothing; used by the fast step (``--fast-step-precision
int8``), rnn_fc's steppers (``--rnn-fc-precision int8``) and the lattice decoder
(``--lattice-scorer-precision``, ``--lattice-encoder-precision``).
"""

import contextlib
import copy
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..common.textio import InputError
from . import native


@contextlib.contextmanager
def _quiet_quantization():
    # torch warns that its quantized tensors move to torchao; fbgemm's int8 kernels are what we run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def row_scales(weight: Tensor) -> Tensor:
    """Symmetric int8 scale of each row of ``weight`` (rows of zeros get 1, any scale represents them)."""
    scales = weight.detach().abs().amax(dim=1).float() / 127
    return torch.where(scales > 0, scales, torch.ones_like(scales))


class Int8Matrix:
    """x W^T with W (rows, d) stored as int8, one scale per row; x in float32, any leading shape.

    ``scales`` fixes the row scales (a candidate list's rows keep the full matrix's scales, so its logits
    are exactly the full int8 product's). The product runs on the native kernel (``kernels/native``:
    activations rounded to int8 with one symmetric scale per row) or, where it cannot be built, on torch's
    fbgemm kernel (activations scaled per row into a fixed range, see the module docstring)."""

    def __init__(self, weight: Tensor, scales: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                 backend: Optional[str] = None):
        weight = weight.detach().float().contiguous()
        if weight.device.type != "cpu":
            raise InputError("int8 matrices run on the CPU only (fbgemm's kernels); decode with --cpu")
        self.rows, self.dim = weight.shape
        self.scales = row_scales(weight) if scales is None else scales.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.backend = backend or native.backend()
        if self.backend == "native" and not native.available():  # asked for by name: the kernels must load
            raise ValueError("int8 backend native: the native kernels could not be built; use fbgemm")
        self._dequantized = None
        if self.backend == "native":
            self.values = native.quantize_weight(weight, self.scales)  # (rows, d padded), int8
            # The same values in the VNNI kernel's layout where this CPU has one (None: the plain kernel).
            self.vnni = native.pack_weight(self.values, self.scales, self.bias)
            return
        with _quiet_quantization():
            quantized = torch.quantize_per_channel(weight, self.scales.double(),
                                                   torch.zeros(self.rows, dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        # Row 0 of the input buffer is the guard: +1 and -1, so every call's activation range is exactly
        # [-1, 1] (d == 1: the guard takes two rows). Rows after it take the scaled activations.
        self.guard_rows = 1 if self.dim >= 2 else 2
        self.buffer = torch.zeros(self.guard_rows + 8, self.dim)
        self.buffer[0, 0] = 1.0
        self.buffer[self.guard_rows - 1, -1] = -1.0

    def int8_weight(self) -> Tensor:
        """The stored weight as int8 values (rows, d), for checks."""
        if self.backend == "native":
            return self.values[:, :self.dim]
        with _quiet_quantization():
            quantized, _ = torch.ops.quantized.linear_unpack(self.packed)
        return quantized.int_repr()

    def dequantized(self) -> Tensor:
        """The float32 matrix the int8 product stands for: int8 values times their row's scale."""
        if self._dequantized is None:
            self._dequantized = self.int8_weight().float() * self.scales.unsqueeze(1)
        return self._dequantized

    def select(self, rows: Tensor) -> "Int8Matrix":
        """The matrix of the given rows, with their int8 values, scales (and biases) from this matrix."""
        bias = None if self.bias is None else self.bias[rows]
        if self.backend != "native":
            return Int8Matrix(self.dequantized()[rows], self.scales[rows], bias, self.backend)
        selected = Int8Matrix.__new__(Int8Matrix)
        selected.rows, selected.dim, selected.backend, selected._dequantized = rows.numel(), self.dim, "native", None
        selected.scales, selected.bias, selected.values = self.scales[rows], bias, self.values[rows]
        selected.vnni = None  # a candidate list changes every sentence: not worth repacking
        return selected

    def __call__(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.dim).float().contiguous()
        if self.backend == "native":
            return native.int8_product(flat, self.values, self.scales, self.bias, self.dim,
                                       self.vnni).view(*shape[:-1], self.rows)
        rows = flat.size(0)
        if self.buffer.size(0) < self.guard_rows + rows:
            grown = torch.zeros(self.guard_rows + 2 * rows, self.dim)
            grown[:self.guard_rows] = self.buffer[:self.guard_rows]
            self.buffer = grown
        # max|x| of each row; abs().amax, not vector_norm(inf): the same values, 20x faster on the CPU at 1000
        # rows (torch 2.x's inf-norm reduction is not vectorised).
        magnitude = flat.abs().amax(dim=1, keepdim=True)
        magnitude.clamp_(min=torch.finfo(torch.float32).tiny)  # a row of zeros stays zeros
        scaled = self.buffer[:self.guard_rows + rows]
        torch.div(flat, magnitude, out=scaled[self.guard_rows:])
        # (no warnings filter here: catch_warnings empties the once-registry and costs ~80 us a call)
        product = torch.ops.quantized.linear_dynamic(scaled, self.packed, True)
        product = product[self.guard_rows:].mul_(magnitude)
        if self.bias is not None:
            product.add_(self.bias)
        return product.view(*shape[:-1], self.rows)


class Int8Linear(nn.Module):
    """``nn.Linear`` with an int8 weight (``Int8Matrix``) and its float32 bias."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.matrix = Int8Matrix(linear.weight, bias=linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.matrix(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"


class Int8GRU(nn.Module):
    """A one-layer unidirectional, time-major ``nn.GRU`` with int8 input and recurrent matrices; the gates
    follow torch's GRU (the reset gate scales W_hn h + b_hn)."""

    def __init__(self, gru: nn.GRU):
        super().__init__()
        if gru.num_layers != 1 or gru.bidirectional or gru.batch_first or not gru.bias:
            raise ValueError("Int8GRU takes a one-layer, unidirectional, time-major GRU with biases")
        self.hidden_size = gru.hidden_size
        self.input_matrix = Int8Matrix(gru.weight_ih_l0, bias=gru.bias_ih_l0)
        self.state_matrix = Int8Matrix(gru.weight_hh_l0, bias=gru.bias_hh_l0)

    def forward(self, inputs: Tensor, state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        steps, batch, _ = inputs.shape
        h = inputs.new_zeros(batch, self.hidden_size) if state is None else state[0]
        projected = self.input_matrix(inputs)  # every step's input part in one product
        outputs = []
        for t in range(steps):
            x_r, x_z, x_n = projected[t].chunk(3, dim=-1)
            h_r, h_z, h_n = self.state_matrix(h).chunk(3, dim=-1)
            r = torch.sigmoid(x_r + h_r)
            z = torch.sigmoid(x_z + h_z)
            h = (1 - z) * torch.tanh(x_n + r * h_n) + z * h
            outputs.append(h)
        return torch.stack(outputs), h.unsqueeze(0)


def _self_attention_unsupported_reason(attention: nn.Module) -> Optional[str]:
    if not attention.self_attention or not attention.qkv_same_dim or attention.bias_k is not None \
            or attention.add_zero_attn:
        return "self-attention with --add-bias-kv, --add-zero-attn or other key/value dimensions"
    return None


class Int8EncoderSelfAttention(nn.Module):
    """fairseq's ``MultiheadAttention`` as an encoder's self-attention (whole sequences, no incremental state)
    with its q/k/v projections as one int8 matrix and its output projection int8. fairseq runs an encoder's
    self-attention through torch's fused kernel, which reads the float32 weights, so ``Int8Linear`` cannot
    stand in for its projections."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        reason = _self_attention_unsupported_reason(attention)
        if reason is not None:
            raise ValueError(f"Int8EncoderSelfAttention: {reason}")
        self.heads, self.head_dim, self.scaling = attention.num_heads, attention.head_dim, attention.scaling
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        biases = [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections]
        self.qkv = Int8Matrix(torch.cat([p.weight.detach() for p in projections]),
                              bias=torch.cat([b.detach() for b in biases]))
        self.out = Int8Matrix(attention.out_proj.weight, bias=attention.out_proj.bias)

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, incremental_state=None, need_weights: bool = True,
                static_kv: bool = False, attn_mask: Optional[Tensor] = None, before_softmax: bool = False,
                need_head_weights: bool = False) -> Tuple[Tensor, None]:
        if incremental_state is not None or attn_mask is not None or before_softmax or need_head_weights:
            raise ValueError("Int8EncoderSelfAttention: incremental states, attention masks and attention "
                             "weights are not supported (an encoder's self-attention needs none)")
        length, batch, dim = query.shape
        q, k, v = self.qkv(query).view(length, batch, 3, self.heads, self.head_dim).permute(2, 1, 3, 0, 4).unbind(0)
        attend = None if key_padding_mask is None else ~key_padding_mask.bool()[:, None, None, :]
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=self.scaling)  # (B, H, T, hd)
        return self.out(context.permute(2, 0, 1, 3).reshape(length, batch, dim)), None


def int8_model_unsupported_reason(model: nn.Module, kernels: str = "the int8 kernels") -> Optional[str]:
    """Why ``model``'s matrices cannot be made int8 (they are quantized from float32 CPU weights), or None."""
    parameters = list(model.parameters())
    devices = sorted({str(p.device) for p in parameters})
    if devices != ["cpu"]:
        return f"{kernels} run on the CPU only, the model is on {', '.join(devices)} (add --cpu)"
    dtypes = sorted({str(p.dtype) for p in parameters})
    if dtypes != ["torch.float32"]:
        return f"quantizes a float32 model, this one is {', '.join(dtypes)} (drop --fp16/--bf16)"
    return None


def int8_encoder_unsupported_reason(encoder: nn.Module) -> Optional[str]:
    """Why ``int8_encoder`` cannot convert ``encoder``, or None when it can."""
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

    layers = getattr(encoder, "layers", None)
    if not layers:
        return f"{type(encoder).__name__} has no transformer encoder layers"
    for index, layer in enumerate(layers):
        where = f"encoder layer {index} ({type(layer).__name__})"
        if type(layer).forward is not TransformerEncoderLayerBase.forward:
            return f"{where} is not a plain fairseq transformer encoder layer"
        if not isinstance(layer.fc1, nn.Linear) or not isinstance(layer.fc2, nn.Linear):
            return f"{where}: a feed-forward block that is not two Linear layers (quantization noise?)"
        reason = _self_attention_unsupported_reason(layer.self_attn)
        if reason is not None:
            return f"{where}: {reason}"
    return None


def int8_encoder(encoder: nn.Module, native_layers: bool = True) -> nn.Module:
    """A copy of a fairseq transformer encoder with every layer's matrices int8: the self-attention
    (``Int8EncoderSelfAttention``) and the feed-forward block (``Int8Linear``). With ``native_layers`` and
    where the native kernels run it (``NativeInt8Encoder.unsupported_reason``), each layer is one native call
    per sentence instead of its torch operations: the same int8 products, the attention and layer norms in C."""
    reason = int8_encoder_unsupported_reason(encoder)
    if reason is not None:
        raise ValueError(f"int8 encoder: {reason}")
    copied = copy.deepcopy(encoder)
    for layer in copied.layers:
        layer.self_attn = Int8EncoderSelfAttention(layer.self_attn)
        layer.fc1, layer.fc2 = Int8Linear(layer.fc1), Int8Linear(layer.fc2)
    if native_layers and NativeInt8Encoder.unsupported_reason(copied) is None:
        return NativeInt8Encoder(copied)
    return copied


def _native_int8_encoder(encoder: nn.Module, training: bool) -> "NativeInt8Encoder":
    return NativeInt8Encoder(encoder).train(training)


class NativeInt8Encoder(nn.Module):
    """``int8_encoder``'s encoder with each layer run as one call of the native ``fp_encoder_layer`` (layer_step.c) per sentence
    (its tokens only, so a sentence's output does not depend on its batch-mates or their padding). The
    embeddings, the final layer norm and the output dictionary are fairseq's; at padded positions the output is
    zero before the final layer norm (fairseq's is never read there: the padding mask goes with it). Other
    attributes are the int8 copy's (``padding_idx``, ``embed_tokens``, ...); in training mode, with
    ``return_all_hiddens`` or on a GPU it runs that copy's torch layers. At a sentence's 10-30 rows a layer's
    ~25 torch operations cost about as much as its int8 products."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        from fairseq.modules import gelu

        self.encoder = encoder  # the int8 copy: embeddings, the final norm, and the path of the rare cases
        self.train(encoder.training)  # the copied encoder's mode (an evaluation model's copy evaluates)
        self.runner = native.EncoderLayerRunner()
        self.native_layers, self._kept = [], []  # the structs, and what their pointers point into
        for layer in encoder.layers:
            attention = layer.self_attn
            matrices = {"qkv": attention.qkv, "self_out": attention.out, "fc1": layer.fc1.matrix,
                        "fc2": layer.fc2.matrix}
            structs = {name: native.int8_matrix(m.values, m.scales, m.bias, m.dim, m.vnni)
                       for name, m in matrices.items()}
            # float32 copies: a later .to()/.half() of the module leaves the kernel's pointers valid
            norms = {name: copy.deepcopy(module).float() for name, module in
                     (("self_norm", layer.self_attn_layer_norm), ("final_norm", layer.final_layer_norm))}
            self._kept.append((matrices, norms))
            self.native_layers.append(native.encoder_layer(structs, norms, attention.heads, attention.head_dim,
                                                    attention.scaling, layer.normalize_before,
                                                    gelu=layer.activation_fn is gelu))

    @staticmethod
    def unsupported_reason(encoder: nn.Module) -> Optional[str]:
        """Why the native layers cannot run ``encoder`` (an ``int8_encoder`` copy), or None when they can."""
        from fairseq.modules import gelu

        if not native.available():
            return "the native kernels are not built"
        for index, layer in enumerate(encoder.layers):
            where = f"encoder layer {index}"
            matrices = (layer.self_attn.qkv, layer.self_attn.out, layer.fc1.matrix, layer.fc2.matrix)
            if any(m.backend != "native" for m in matrices):
                return f"{where}: int8 matrices on the {matrices[0].backend} backend"
            if layer.activation_fn not in (F.relu, gelu):
                return f"{where}: an activation other than relu or gelu"
            if any(not isinstance(n, nn.LayerNorm) or n.weight is None or n.bias is None
                   for n in (layer.self_attn_layer_norm, layer.final_layer_norm)):
                return f"{where}: layer norms without affine weights"
        return None

    def forward(self, src_tokens: Tensor, src_lengths: Optional[Tensor] = None, return_all_hiddens: bool = False,
                token_embeddings: Optional[Tensor] = None):
        encoder = self.encoder
        if self.training or return_all_hiddens or token_embeddings is not None or src_tokens.device.type != "cpu":
            return encoder(src_tokens, src_lengths, return_all_hiddens, token_embeddings)
        padding = src_tokens.eq(encoder.padding_idx)
        x, embedding = encoder.forward_embedding(src_tokens)
        out = x.new_zeros(x.size(1), x.size(0), x.size(2))  # T x B x C, as fairseq's (and contiguous)
        for row in range(x.size(0)):
            kept = ~padding[row]
            sentence = x[row, kept].float().contiguous()  # (its tokens, d)
            for layer in self.native_layers:
                self.runner(layer, sentence)
            out[kept, row] = sentence.to(out.dtype)
        if encoder.layer_norm is not None:
            out = encoder.layer_norm(out)
        lengths = src_tokens.ne(encoder.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
        return {"encoder_out": [out], "encoder_padding_mask": [padding], "encoder_embedding": [embedding],
                "encoder_states": [], "fc_results": [], "src_tokens": [], "src_lengths": [lengths]}

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules (nn.Module keeps them apart)
        except AttributeError:
            if name == "encoder":
                raise
            return getattr(self.encoder, name)

    def __deepcopy__(self, memo):
        # The structs hold raw pointers into this copy's tensors: a copy rebuilds its own from its own tensors.
        return _native_int8_encoder(copy.deepcopy(self.encoder, memo), self.training)

    def __reduce__(self):
        return _native_int8_encoder, (self.encoder, self.training)

    @property
    def layers(self) -> nn.ModuleList:
        """The int8 copy's layers (Int8EncoderSelfAttention, Int8Linear), which the native calls compute."""
        return self.encoder.layers

    def forward_torchscript(self, net_input: Dict[str, Tensor]):
        return self.forward(net_input["src_tokens"], net_input.get("src_lengths"))

    def reorder_encoder_out(self, encoder_out, new_order: Tensor):
        return self.encoder.reorder_encoder_out(encoder_out, new_order)

    def max_positions(self):
        return self.encoder.max_positions()


def _convertible(name: str, module: nn.Module) -> bool:
    # fairseq's attention runs torch's fused kernel (which reads .weight) outside incremental decoding:
    # the encoder's self-attention projections stay float32.
    if name.startswith("encoder.") and ".self_attn." in name:
        return False
    if isinstance(module, nn.Linear):
        return True
    return (isinstance(module, nn.GRU) and module.num_layers == 1 and not module.bidirectional
            and not module.batch_first and module.bias)


def int8_module_names(model: nn.Module, keep_float: Iterable[str] = ()) -> List[str]:
    """Names of the layers ``int8_copy`` makes int8: every Linear and every one-layer unidirectional GRU
    but ``keep_float`` and the encoder's self-attention projections. Other GRUs (rnn_fc's bidirectional
    encoder, which runs once a sentence) stay float32."""
    keep_float = set(keep_float)
    return [name for name, module in model.named_modules() if name not in keep_float and _convertible(name, module)]


def int8_copy(model: nn.Module, keep_float: Iterable[str] = ()) -> nn.Module:
    """A copy of ``model`` with the layers of ``int8_module_names`` replaced by int8 ones."""
    names = int8_module_names(model, keep_float)
    copied = copy.deepcopy(model)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = copied.get_submodule(parent_name) if parent_name else copied
        module = getattr(parent, child)
        setattr(parent, child, Int8Linear(module) if isinstance(module, nn.Linear) else Int8GRU(module))
    return copied
