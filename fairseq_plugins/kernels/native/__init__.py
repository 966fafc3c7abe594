"""The native kernels (C, beside this file), loaded with ctypes: int8 and float32 matrix products of a few rows
(products.c), a transformer decoder layer's incremental step and an encoder layer over one sentence
(layer_step.c), beam search over a scored lattice (lattice_search.c), a ByteNet stack's decoding step
(bytenet_step.c) and a sentence's whole greedy search or a batch's whole beam search over a transformer decoder
(search.c); kernels.h declares the structs that ``Matrix``, ``DecoderLayer``, ``ByteNetBlock`` and ``Decoder``
mirror (tests/test_native_layout.py holds them to the compiled layout). Registers nothing; used by the int8 matrices,
the packed products, the decoder step and its searches, ByteNet's decoder and the lattice's beam search.

No torch headers are needed (a build takes about a second, not the minute of a torch C++ extension), and
nothing is built at install time: the first user builds one shared library into ``$FAIRSEQ_PLUGINS_CACHE``
(default ``~/.cache/fairseq_plugins``), under a name that covers every source file and the header, the compiler
and its flags (-mavx2 where the CPU has AVX2), written aside and renamed, so concurrent processes never load a
half-written library. Where no compiler works, int8 matrices fall back to torch's fbgemm kernel (same per-row
semantics, slower at few rows) with one warning, and the fast step runs its layers as torch operations;
``FAIRSEQ_PLUGINS_INT8=fbgemm`` forces the int8 fallback.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from typing import Dict, NamedTuple, Optional, Set

import torch
from torch import Tensor

from ...common.textio import InputError

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
HEADER = "kernels.h"
SOURCES = ("products.c", "layer_step.c", "lattice_search.c", "bytenet_step.c", "search.c", "layout.c")
# The weight rows are zero padded to a multiple of this many bytes (one AVX2 register).
ALIGN = 32
BACKEND_VARIABLE = "FAIRSEQ_PLUGINS_INT8"
BACKENDS = ("native", "fbgemm")

_library = None
_failure: Optional[str] = None


def _cpu_flags() -> Set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _flags():
    # -ffp-contract=off: no fused multiply-adds, so the float arithmetic is the order the C source writes.
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags.append("-mavx2")
        # The int8 product's byte dot products in one VNNI instruction where the CPU has it (the same integer
        # sums: outputs do not change, only their speed).
        cpu = _cpu_flags()
        if "avx_vnni" in cpu:
            flags.append("-mavxvnni")
        elif {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu:
            flags += ["-mavx512vnni", "-mavx512vl", "-mavx512bw"]
    return flags


def _build() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) found")
    flags = _flags()
    sources = [os.path.join(SOURCE_DIR, name) for name in SOURCES]
    digest = hashlib.sha256()
    for path in sources + [os.path.join(SOURCE_DIR, HEADER)]:
        with open(path, "rb") as f:
            digest.update(f.read())
    key = hashlib.sha256(digest.digest() + " ".join([compiler] + flags).encode()).hexdigest()[:16]
    cache = os.environ.get("FAIRSEQ_PLUGINS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "fairseq_plugins")
    path = os.path.join(cache, f"kernels-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    handle, aside = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(handle)
    try:
        result = subprocess.run([compiler, *flags, *sources, "-o", aside, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} {' '.join(flags)} {' '.join(SOURCES)} in {SOURCE_DIR} failed: "
                               f"{result.stderr.strip()[-500:]}")
        os.replace(aside, path)
    finally:
        if os.path.exists(aside):
            os.unlink(aside)
    return path


def available() -> bool:
    """Whether the kernels are built and loaded (the first call builds them; a failure warns once)."""
    global _library, _failure
    if _library is None and _failure is None:
        try:
            library = ctypes.CDLL(_build())
            pointer, size = ctypes.c_void_p, ctypes.c_int64
            library.fp_quantize_rows.argtypes = [pointer, size, size, size, pointer, pointer]
            library.fp_quantize_rows.restype = None
            library.fp_int8_gemm.argtypes = [pointer, pointer, size, pointer, pointer, size, size, pointer, pointer]
            library.fp_int8_gemm.restype = None
            library.fp_has_packed_gemm.argtypes = []
            library.fp_has_packed_gemm.restype = ctypes.c_int
            if library.fp_has_packed_gemm():
                library.fp_int8_gemm_packed.argtypes = [pointer, pointer, size, pointer, pointer, pointer, size, size,
                                                        pointer, pointer]
                library.fp_int8_gemm_packed.restype = None
            library.fp_float_gemm.argtypes = [pointer, size, pointer, size, size, pointer, pointer]
            library.fp_float_gemm.restype = None
            library.fp_decoder_layer_step.argtypes = [ctypes.POINTER(DecoderLayer), pointer, size, pointer, pointer,
                                                      size, size, pointer, pointer, size, pointer, pointer, pointer,
                                                      pointer, pointer, size, size, pointer, pointer, pointer]
            library.fp_decoder_layer_step.restype = None
            library.fp_encoder_layer.argtypes = [ctypes.POINTER(DecoderLayer), pointer, size, pointer, pointer, pointer]
            library.fp_encoder_layer.restype = None
            library.fp_lattice_beam_search.argtypes = [pointer, pointer, pointer, pointer, size, size, size, size,
                                                       size, size, pointer, pointer, pointer]
            library.fp_lattice_beam_search.restype = ctypes.c_int
            library.fp_relu_blocks_frame_step.argtypes = [ctypes.POINTER(ByteNetBlock), size, pointer, size, pointer,
                                                          pointer]
            library.fp_relu_blocks_frame_step.restype = None
            library.fp_greedy_search.argtypes = [ctypes.POINTER(Decoder), pointer, pointer, size, pointer, pointer,
                                                 size, size, size, size, size, ctypes.c_float, size, size, pointer,
                                                 pointer, pointer, pointer, pointer]
            library.fp_greedy_search.restype = size
            library.fp_beam_search.argtypes = [ctypes.POINTER(Decoder), pointer, pointer, size, pointer, pointer,
                                               size, pointer, size, size, size, size, size, size, ctypes.c_float,
                                               size, size, pointer, pointer, pointer, pointer, pointer, pointer,
                                               pointer, pointer, pointer, pointer, pointer, pointer]
            library.fp_beam_search.restype = None
            library.fp_blockwise_search.argtypes = [ctypes.POINTER(Decoder), ctypes.POINTER(ProposalHeads),
                                                    pointer, pointer, size, pointer, pointer, size, pointer, size,
                                                    size, size, size, ctypes.c_float, size, size, pointer, pointer,
                                                    pointer, pointer, pointer, pointer]
            library.fp_blockwise_search.restype = size
            library.fp_struct_layout.argtypes = [size, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p),
                                                 ctypes.POINTER(size)]
            library.fp_struct_layout.restype = ctypes.c_int
            _library = library
        except (OSError, RuntimeError) as error:
            _failure = str(error)
            logger.warning("the native kernels could not be built (%s): int8 uses torch's fbgemm kernel, several "
                           "times slower at a few rows, and the fast step and ByteNet's decoder step run as torch "
                           "operations", _failure)
    return _library is not None


def backend() -> str:
    """The int8 kernel for int8 matrices made from now on: "native" (products.c) or "fbgemm" (torch's), by
    $FAIRSEQ_PLUGINS_INT8 (default native) and whether the native one could be built."""
    wanted = os.environ.get(BACKEND_VARIABLE, "native")
    if wanted not in BACKENDS:
        raise InputError(f"{BACKEND_VARIABLE}={wanted}: choose one of {', '.join(BACKENDS)}")
    return "native" if wanted == "native" and available() else "fbgemm"


class Matrix(ctypes.Structure):
    """kernels.h's fp_matrix: a float32 matrix's weights (out, in), or an int8 matrix's values (out, width) and
    row scales; the bias (or NULL) and the sizes."""
    _fields_ = [("weights", ctypes.c_void_p), ("values", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("bias", ctypes.c_void_p),
                ("out", ctypes.c_int64), ("in_", ctypes.c_int64), ("width", ctypes.c_int64),
                ("packed", ctypes.c_void_p), ("corrections", ctypes.c_void_p), ("packed_scales", ctypes.c_void_p),
                ("packed_bias", ctypes.c_void_p)]


LAYER_MATRICES = ("qkv", "self_out", "cross_q", "cross_out", "fc1", "fc2")
LAYER_NORMS = ("self_norm", "cross_norm", "final_norm")


class DecoderLayer(ctypes.Structure):
    """kernels.h's fp_layer: one transformer decoder layer's int8 matrices, layer norms and settings."""
    _fields_ = ([(name, Matrix) for name in LAYER_MATRICES]
                + [(f"{name}_{part}", ctypes.c_void_p) for name in LAYER_NORMS for part in ("weight", "bias")]
                + [(f"{name}_eps", ctypes.c_float) for name in LAYER_NORMS] + [("scaling", ctypes.c_float)]
                + [(name, ctypes.c_int64) for name in ("heads", "head_dim", "normalize_before", "gelu")])


def _pointer(tensor: Optional[Tensor]) -> Optional[int]:
    if tensor is None:
        return None
    if tensor.dtype not in (torch.float32, torch.int8) or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("native kernels read contiguous float32/int8 CPU tensors")
    return tensor.data_ptr()


def float_matrix(weight: Tensor, bias: Optional[Tensor]) -> Matrix:
    """fp_matrix of a float32 (out, in) weight and its bias (contiguous; kept alive by the caller)."""
    return Matrix(weights=_pointer(weight), bias=_pointer(bias), out=weight.size(0), in_=weight.size(1),
                  width=weight.size(1))


def int8_matrix(values: Tensor, scales: Tensor, bias: Optional[Tensor], dim: int,
                packed: Optional["PackedWeight"] = None) -> Matrix:
    """fp_matrix of padded int8 ``values`` (out, width), row ``scales`` and bias, and the same values ``packed``
    for the VNNI kernel where there is one (all kept alive by the caller)."""
    matrix = Matrix(values=_pointer(values), scales=_pointer(scales), bias=_pointer(bias), out=values.size(0),
                    in_=dim, width=values.size(1))
    if packed is not None:
        matrix.packed, matrix.corrections = _pointer(packed.values), packed.corrections.data_ptr()
        matrix.packed_scales, matrix.packed_bias = _pointer(packed.scales), _pointer(packed.bias)
    return matrix


def decoder_layer(matrices, norms, heads: int, head_dim: int, scaling: float, normalize_before: bool,
                  gelu: bool, matrix_names=LAYER_MATRICES, norm_names=LAYER_NORMS) -> DecoderLayer:
    """The fp_layer of ``matrices`` (name -> ``float_matrix``/``int8_matrix`` of each of ``matrix_names``) and
    ``norms`` (name -> float32 torch LayerNorm, ``norm_names``); the members not named stay NULL. The caller keeps
    the tensors of the matrices and the norms alive, and unchanged, as long as the layer."""
    layer = DecoderLayer(heads=heads, head_dim=head_dim, scaling=scaling, normalize_before=int(normalize_before),
                         gelu=int(gelu))
    for name in matrix_names:
        setattr(layer, name, matrices[name])
    for name in norm_names:
        norm = norms[name]
        setattr(layer, f"{name}_weight", norm.weight.data_ptr())
        setattr(layer, f"{name}_bias", norm.bias.data_ptr())
        setattr(layer, f"{name}_eps", norm.eps)
    # The widest input a product of the layer quantizes (the scratch a runner sizes for it), once here:
    # a step calls its runner once a layer.
    layer.widest_input = max(matrices[name].width for name in matrix_names)
    return layer


ENCODER_LAYER_MATRICES = ("qkv", "self_out", "fc1", "fc2")
ENCODER_LAYER_NORMS = ("self_norm", "final_norm")


def encoder_layer(matrices, norms, heads: int, head_dim: int, scaling: float, normalize_before: bool,
                  gelu: bool) -> DecoderLayer:
    """The fp_layer of an encoder layer for ``fp_encoder_layer``: ``decoder_layer`` without the cross-attention
    (ENCODER_LAYER_MATRICES and ENCODER_LAYER_NORMS; the others stay NULL, never read)."""
    return decoder_layer(matrices, norms, heads, head_dim, scaling, normalize_before, gelu,
                         ENCODER_LAYER_MATRICES, ENCODER_LAYER_NORMS)


class Decoder(ctypes.Structure):
    """kernels.h's fp_decoder: a transformer decoder's layers (fp_layer pointers), token and position embeddings,
    final layer norm and output matrix, for ``fp_greedy_search``."""
    _fields_ = [("layers", ctypes.POINTER(ctypes.POINTER(DecoderLayer))), ("n_layers", ctypes.c_int64),
                ("embed_tokens", ctypes.c_void_p), ("embed_scale", ctypes.c_float),
                ("positions", ctypes.c_void_p), ("n_positions", ctypes.c_int64),
                ("final_norm_weight", ctypes.c_void_p), ("final_norm_bias", ctypes.c_void_p),
                ("final_norm_eps", ctypes.c_float), ("output", Matrix), ("dim", ctypes.c_int64),
                ("vocab", ctypes.c_int64)]


def decoder(layers, embed_tokens: Tensor, embed_scale: float, final_norm: Optional[torch.nn.LayerNorm],
            output: Matrix) -> Decoder:
    """The fp_decoder of ``layers`` (``decoder_layer`` structs), the float32 (rows, d) token embeddings, the final
    norm (float32 torch LayerNorm, or None) and the output matrix (``float_matrix``/``int8_matrix``, its bias
    included). The positions are given per call (``GreedySearcher``). The caller keeps every tensor alive."""
    array = (ctypes.POINTER(DecoderLayer) * len(layers))(*[ctypes.pointer(layer) for layer in layers])
    struct = Decoder(layers=array, n_layers=len(layers), embed_tokens=_pointer(embed_tokens),
                     embed_scale=embed_scale, output=output, dim=embed_tokens.size(1), vocab=output.out)
    struct.layer_array = array  # (kept alive with the struct)
    if final_norm is not None:
        struct.final_norm_weight, struct.final_norm_bias = final_norm.weight.data_ptr(), final_norm.bias.data_ptr()
        struct.final_norm_eps = final_norm.eps
    if len({(layer.heads, layer.head_dim) for layer in layers}) != 1:
        raise ValueError("fp_decoder: layers with different numbers or sizes of heads")
    struct.heads, struct.head_dim = layers[0].heads, layers[0].head_dim
    struct.widest_input = max([layer.widest_input for layer in layers] + [output.width])
    struct.widest_ffn = max(layer.fc1.out for layer in layers)
    return struct


def _pointers(tensors) -> "ctypes.Array":
    return (ctypes.c_void_p * len(tensors))(*[_pointer(tensor) for tensor in tensors])


class _Scratch:
    """The work buffers a layer call needs (floats, quantized input bytes, row scales), grown as rows and lengths
    grow (to twice the need, so that a slowly growing need does not reallocate at every call)."""

    def __init__(self):
        self.scratch = torch.empty(0)
        self.quantized = torch.empty(0, dtype=torch.int8)
        self.row_scales = torch.empty(0)

    def reserve(self, floats: int, rows: int, widest_input: int) -> None:
        if self.scratch.numel() < floats:
            self.scratch = torch.empty(2 * floats)
        if self.quantized.numel() < rows * widest_input:
            self.quantized = torch.empty(2 * rows * widest_input, dtype=torch.int8)
        if self.row_scales.numel() < rows:
            self.row_scales = torch.empty(2 * rows)


class EncoderLayerRunner(_Scratch):
    """Runs ``fp_encoder_layer`` on one sentence's rows, with scratch buffers that grow with its length."""

    def __call__(self, layer: DecoderLayer, x: Tensor) -> None:
        """x (S, d) float32 contiguous: one sentence's S positions (no padding), updated in place."""
        length, d, ffn = x.size(0), layer.heads * layer.head_dim, layer.fc1.out
        if not (x.dtype == torch.float32 and x.dim() == 2 and x.size(1) == d and x.is_contiguous()
                and x.device.type == "cpu"):  # the C code trusts the shape: a mismatch would not raise
            raise ValueError("fp_encoder_layer: x must be a contiguous float32 CPU tensor (positions, d)")
        self.reserve(length * (5 * d + ffn) + length, length, layer.widest_input)
        _library.fp_encoder_layer(ctypes.byref(layer), x.data_ptr(), length, self.scratch.data_ptr(),
                                  self.quantized.data_ptr(), self.row_scales.data_ptr())


class LayerStepper(_Scratch):
    """Runs ``fp_decoder_layer_step`` with scratch buffers that grow as rows and lengths do."""

    def __call__(self, layer: DecoderLayer, x: Tensor, keys: Tensor, values: Tensor, t: int, cross_keys: Tensor,
                 cross_values: Tensor, source_attend: Optional[Tensor], group: int = 1, causal: bool = True,
                 self_attend: Optional[Tensor] = None) -> None:
        """x (rows, d) float32 contiguous, updated in place: rows / ``group`` hypotheses, each feeding ``group``
        new positions t, t + 1, ... (consecutive rows), causal among themselves or (``causal`` False) each
        seeing all of them; keys/values (>= hypotheses, heads, capacity, head_dim) get those positions;
        cross_keys/values (hypotheses, heads, S, head_dim); source_attend (hypotheses, S) bool or None;
        self_attend (>= hypotheses, capacity) bool, True where a cache slot is in the hypothesis's prefix (the
        new positions included), or None: every slot before t + group."""
        rows, source_length = x.size(0), cross_keys.size(2)
        d, ffn = layer.heads * layer.head_dim, layer.fc1.out
        hypotheses = rows // group
        # The C code trusts these shapes (a mismatch would read or write out of bounds, not raise).
        if not (group >= 1 and rows == hypotheses * group
                and x.dtype == keys.dtype == cross_keys.dtype == torch.float32 and x.shape == (rows, d)
                and x.is_contiguous() and keys.is_contiguous() and values.is_contiguous()
                and cross_keys.is_contiguous() and cross_values.is_contiguous() and keys.size(0) >= hypotheses
                and cross_keys.size(0) == hypotheses and t + group <= keys.size(2) and keys.shape == values.shape
                and (source_attend is None or (source_attend.shape == (hypotheses, source_length)
                                               and source_attend.is_contiguous()))
                and (self_attend is None or (self_attend.dtype == torch.bool and self_attend.dim() == 2
                                             and self_attend.size(0) >= hypotheses
                                             and self_attend.size(1) == keys.size(2)
                                             and self_attend.is_contiguous()))):
            raise ValueError("fp_decoder_layer_step: tensors of unexpected shapes, types or layouts")
        self.reserve(rows * (5 * d + ffn) + max(t + group, source_length), rows, layer.widest_input)
        _library.fp_decoder_layer_step(
            ctypes.byref(layer), x.data_ptr(), rows, keys.data_ptr(), values.data_ptr(), keys.size(2), t,
            cross_keys.data_ptr(), cross_values.data_ptr(), source_length,
            None if source_attend is None else source_attend.data_ptr(),
            None if self_attend is None else self_attend.data_ptr(), self.scratch.data_ptr(),
            self.quantized.data_ptr(), self.row_scales.data_ptr(), group, int(causal), None, None, None)


def _check_search(decoder: Decoder, positions: Optional[Tensor], keys, values, cross_keys, cross_values, rows: int,
                  min_len: int, max_len: int, name: str, source_rows: Optional[int] = None):
    """A whole search's tensors checked against the decoder (the C code trusts them: a mismatch would read or
    write out of bounds, not raise), and its positions set on the struct: ``rows`` cache rows, ``source_rows``
    (default ``rows``) rows of cross-attention keys and values. Returns (capacity, S, d)."""
    capacity, source_length, d = keys[0].size(2), cross_keys[0].size(2), decoder.dim
    cache = (rows, decoder.heads, capacity, decoder.head_dim)
    source = (rows if source_rows is None else source_rows, decoder.heads, source_length, decoder.head_dim)
    if not (len(keys) == len(values) == len(cross_keys) == len(cross_values) == decoder.n_layers
            and capacity > max_len >= min_len >= 0
            and all(t.dtype == torch.float32 and t.is_contiguous()
                    for t in (*keys, *values, *cross_keys, *cross_values))
            and all(t.shape == cache for t in (*keys, *values))
            and all(t.shape == source for t in (*cross_keys, *cross_values))
            and (positions is None or (positions.dtype == torch.float32 and positions.is_contiguous()
                                       and positions.dim() == 2 and positions.size(1) == d))):
        raise ValueError(f"{name}: tensors of unexpected shapes, types or layouts")
    decoder.positions = None if positions is None else positions.data_ptr()
    decoder.n_positions = 0 if positions is None else positions.size(0)
    return capacity, source_length, d


class GreedySearcher(_Scratch):
    """Runs ``fp_greedy_search``: a sentence's whole greedy search in one call, with its scratch buffers."""

    def __call__(self, decoder: Decoder, positions: Optional[Tensor], keys, values, cross_keys, cross_values,
                 bos: int, eos: int, pad: int, unk: int, unk_penalty: float, min_len: int, max_len: int):
        """keys/values: each layer's (1, heads, capacity, head_dim) cache, capacity > max_len; cross_keys/values:
        each layer's (1, heads, S, head_dim); positions: (n, d) float32, row t step t's position embedding, or
        None. Returns the tokens (end token included) and the cumulative score after each, as tensors."""
        capacity, source_length, d = _check_search(decoder, positions, keys, values, cross_keys, cross_values, 1,
                                                   min_len, max_len, "fp_greedy_search")
        self.reserve(d + decoder.vocab + 5 * d + decoder.widest_ffn + max(capacity, source_length), 1,
                     decoder.widest_input)
        tokens = torch.empty(max_len + 1, dtype=torch.int64)
        cumulative = torch.empty(max_len + 1)
        length = _library.fp_greedy_search(
            ctypes.byref(decoder), _pointers(keys), _pointers(values), capacity, _pointers(cross_keys),
            _pointers(cross_values), source_length, bos, eos, pad, unk, unk_penalty, min_len, max_len,
            tokens.data_ptr(), cumulative.data_ptr(), self.scratch.data_ptr(), self.quantized.data_ptr(),
            self.row_scales.data_ptr())
        return tokens[:length], cumulative[:length]


# fp_beam_search keeps its candidates in fixed arrays: beams up to this size.
MAX_NATIVE_BEAM = 32


class BeamSearcher(_Scratch):
    """Runs ``fp_beam_search``: the whole beam search (fairseq's) of a batch of sentences in one call."""

    def __call__(self, decoder: Decoder, positions: Optional[Tensor], keys, values, cross_keys, cross_values,
                 source_attend: Optional[Tensor], beam: int, bos: int, eos: int, pad: int, unk: int,
                 unk_penalty: float, min_len: int, max_len: int):
        """cross_keys/values: each layer's (sentences, heads, S, head_dim); source_attend: (sentences, S) bool,
        True where a source token is, or None (no padding); keys/values: each layer's (sentences * beam, heads,
        capacity, head_dim) cache, capacity > max_len (sentence s's hypotheses in rows s * beam ...); positions
        as ``GreedySearcher``. Returns each sentence's finished hypotheses in the order fairseq finalises them:
        [[(tokens, cumulative scores)]]."""
        if not 1 <= beam <= MAX_NATIVE_BEAM:
            raise ValueError(f"fp_beam_search: beam {beam} is not in 1..{MAX_NATIVE_BEAM}")
        sentences = cross_keys[0].size(0)
        capacity, source_length, d = _check_search(decoder, positions, keys, values, cross_keys, cross_values,
                                                   sentences * beam, min_len, max_len, "fp_beam_search",
                                                   source_rows=sentences)
        if source_attend is not None and not (source_attend.shape == (sentences, source_length)
                                              and source_attend.dtype == torch.bool):
            raise ValueError("fp_beam_search: source_attend must be (sentences, source length) bool")
        rows = sentences * beam
        self.reserve(rows * (6 * d + decoder.vocab + decoder.widest_ffn) + 2 * beam + max(capacity, source_length),
                     rows, decoder.widest_input)
        slots = torch.empty(rows * capacity, dtype=torch.int64)
        slot_copy = torch.empty(beam * capacity, dtype=torch.int64)
        history_tokens = torch.empty(sentences * 2 * beam * (max_len + 2), dtype=torch.int64)
        history_scores = torch.empty(sentences * 2 * beam * (max_len + 2))
        tokens = torch.empty(sentences, beam, max_len + 1, dtype=torch.int64)
        cumulative = torch.empty(sentences, beam, max_len + 1)
        lengths = torch.empty(sentences, beam, dtype=torch.int64)
        counts = torch.empty(sentences, dtype=torch.int64)
        row_index = torch.empty(3 * rows + sentences, dtype=torch.int64)
        attend = None if source_attend is None else source_attend.to(torch.uint8).contiguous()
        _library.fp_beam_search(
            ctypes.byref(decoder), _pointers(keys), _pointers(values), capacity, _pointers(cross_keys),
            _pointers(cross_values), source_length, None if attend is None else attend.data_ptr(), sentences, beam,
            bos, eos, pad, unk, unk_penalty, min_len, max_len, history_tokens.data_ptr(), history_scores.data_ptr(),
            tokens.data_ptr(), cumulative.data_ptr(), lengths.data_ptr(), counts.data_ptr(),
            self.scratch.data_ptr(), slots.data_ptr(), slot_copy.data_ptr(), self.quantized.data_ptr(),
            self.row_scales.data_ptr(), row_index.data_ptr())
        lengths_of = lengths.tolist()
        return [[(tokens[s, h, :n], cumulative[s, h, :n]) for h, n in enumerate(lengths_of[s][:count])]
                for s, count in enumerate(counts.tolist())]


class ProposalHeads(ctypes.Structure):
    """kernels.h's fp_proposal_heads: blockwise decoding's heads 2..k (their hidden layer, output layers reading
    it from an offset each, the projection to words) for ``fp_blockwise_search``."""
    _fields_ = [("fc1", Matrix), ("fc2", ctypes.POINTER(Matrix)), ("fc2_offsets", ctypes.c_void_p),
                ("n_fc2", ctypes.c_int64), ("n_heads", ctypes.c_int64), ("projection", Matrix)]


def proposal_heads(fc1: Matrix, fc2, fc2_offsets, n_heads: int, projection: Matrix) -> ProposalHeads:
    """The fp_proposal_heads of ``fc1`` (input -> every head's hidden units), the ``fc2`` matrices (each some
    heads' outputs, n_heads * d rows in all) reading the hidden units from ``fc2_offsets`` on, and the
    ``projection`` to the proposed words. The caller keeps the matrices' tensors alive."""
    fc2_array = (Matrix * len(fc2))(*fc2)
    offsets = torch.tensor(list(fc2_offsets), dtype=torch.int64)
    struct = ProposalHeads(fc1=fc1, fc2=ctypes.cast(fc2_array, ctypes.POINTER(Matrix)),
                           fc2_offsets=offsets.data_ptr(), n_fc2=len(fc2), n_heads=n_heads, projection=projection)
    struct.kept = (fc2_array, offsets)  # (alive with the struct)
    struct.widest_input = max([fc1.width, projection.width] + [m.width for m in fc2])
    return struct


# fp_blockwise_search keeps a block in fixed arrays: blocks up to this size.
MAX_NATIVE_BLOCK = 64


class BlockwiseSearcher(_Scratch):
    """Runs ``fp_blockwise_search``: one sentence's whole blockwise decoding (exact acceptance) in one call."""

    def __call__(self, decoder: Decoder, heads: ProposalHeads, positions: Optional[Tensor], keys, values, cross_keys,
                 cross_values, source_attend: Optional[Tensor], bos: int, eos: int, pad: int, unk: int,
                 unk_penalty: float, min_len: int, max_len: int):
        """keys/values: each layer's (1, heads, capacity, head_dim) cache, capacity > max_len + block size;
        cross_keys/values and positions as ``GreedySearcher`` (positions: a row for each cache position);
        source_attend: (S,) bool, True where a source token is, or None (no padding).
        Returns the tokens (end token included), each token's score, and (iterations, decoder passes)."""
        block = 1 + heads.n_heads
        if not 1 <= block <= MAX_NATIVE_BLOCK:
            raise ValueError(f"fp_blockwise_search: block size {block} is not in 1..{MAX_NATIVE_BLOCK}")
        capacity, source_length, d = _check_search(decoder, positions, keys, values, cross_keys, cross_values, 1,
                                                   min_len, max_len + block, "fp_blockwise_search")
        if heads.fc1.in_ != d or heads.projection.in_ != d or sum(m.out for m in heads.kept[0]) != heads.n_heads * d:
            raise ValueError("fp_blockwise_search: proposal heads of other sizes than the decoder's")
        self.reserve(block * (6 * d + decoder.vocab + decoder.widest_ffn) + heads.fc1.out
                     + heads.n_heads * (d + heads.projection.out) + max(capacity, source_length), block,
                     max(decoder.widest_input, heads.widest_input))
        tokens = torch.empty(max_len + 1, dtype=torch.int64)
        scores = torch.empty(max_len + 1)
        counts = torch.zeros(2, dtype=torch.int64)
        if source_attend is not None and not (source_attend.shape == (source_length,)
                                              and source_attend.dtype == torch.bool):
            raise ValueError("fp_blockwise_search: source_attend must be (source length,) bool")
        attend = None if source_attend is None else source_attend.to(torch.uint8).contiguous()
        length = _library.fp_blockwise_search(
            ctypes.byref(decoder), ctypes.byref(heads), _pointers(keys), _pointers(values), capacity,
            _pointers(cross_keys), _pointers(cross_values), source_length,
            None if attend is None else attend.data_ptr(), bos, eos, pad, unk, unk_penalty, min_len,
            max_len, tokens.data_ptr(), scores.data_ptr(), counts.data_ptr(), self.scratch.data_ptr(),
            self.quantized.data_ptr(), self.row_scales.data_ptr())
        iterations, passes = counts.tolist()
        return tokens[:length], scores[:length], (iterations, passes)


def padded_width(dim: int) -> int:
    return (dim + ALIGN - 1) // ALIGN * ALIGN


def quantize_weight(weight: Tensor, scales: Tensor) -> Tensor:
    """int8 rows round(W / scale) (half to even), zero padded to a multiple of ALIGN columns."""
    rows, dim = weight.shape
    values = torch.zeros(rows, padded_width(dim), dtype=torch.int8)
    values[:, :dim] = torch.round(weight / scales.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return values


class PackedWeight(NamedTuple):
    """A padded int8 weight in fp_int8_gemm_packed's layout, with what that kernel reads beside it."""
    values: Tensor       # (Np / 8, Kp / 4, 8, 4) int8
    corrections: Tensor  # (Np,) int32: 128 x each row's sum
    scales: Tensor       # (Np,) float32, zero padded
    bias: Optional[Tensor]  # (Np,) float32, zero padded, or None
    rows: int


def pack_weight(weight: Tensor, scales: Tensor, bias: Optional[Tensor]) -> Optional[PackedWeight]:
    """``quantize_weight``'s padded values (N, Kp) in the VNNI kernel's layout, or None where this build has no
    VNNI kernel (``int8_product`` then runs the plain one)."""
    if not available() or not _library.fp_has_packed_gemm():
        return None
    rows, width = weight.shape
    padded_rows = -(-rows // 8) * 8

    def padded(vector: Tensor, dtype) -> Tensor:
        out = torch.zeros(padded_rows, dtype=dtype)
        out[:rows] = vector
        return out

    values = torch.zeros(padded_rows, width, dtype=torch.int8)
    values[:rows] = weight
    values = values.view(padded_rows // 8, 8, width // 4, 4).permute(0, 2, 1, 3).contiguous()
    corrections = padded(weight.to(torch.int32).sum(dim=1) * 128, torch.int32)
    return PackedWeight(values, corrections, padded(scales, torch.float32),
                        None if bias is None else padded(bias, torch.float32), rows)


def int8_product(x: Tensor, weight: Tensor, scales: Tensor, bias: Optional[Tensor], dim: int,
                 packed: Optional[PackedWeight] = None) -> Tensor:
    """x (M, dim) float32 contiguous times the padded int8 ``weight`` (N, Kp) with row ``scales`` (N,), + bias."""
    rows, (out_rows, width) = x.size(0), weight.shape
    quantized = torch.empty(rows, width, dtype=torch.int8)
    row_scales = torch.empty(rows)
    y = torch.empty(rows, out_rows)
    _library.fp_quantize_rows(x.data_ptr(), rows, dim, width, quantized.data_ptr(), row_scales.data_ptr())
    if packed is not None:
        _library.fp_int8_gemm_packed(quantized.data_ptr(), row_scales.data_ptr(), rows, packed.values.data_ptr(),
                                     packed.scales.data_ptr(), packed.corrections.data_ptr(), out_rows, width,
                                     None if packed.bias is None else packed.bias.data_ptr(), y.data_ptr())
        return y
    _library.fp_int8_gemm(quantized.data_ptr(), row_scales.data_ptr(), rows, weight.data_ptr(), scales.data_ptr(),
                          out_rows, width, None if bias is None else bias.data_ptr(), y.data_ptr())
    return y


def float_product(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x (M, K) float32 contiguous times ``weight`` (N, K) float32 contiguous, + bias (N,): ``fp_float_gemm``,
    which reads each weight row once for up to four input rows."""
    rows, (out_rows, dim) = x.size(0), weight.shape
    # The C code trusts these shapes (a mismatch would read out of bounds, not raise).
    if not (x.dim() == 2 and x.size(1) == dim and x.dtype == weight.dtype == torch.float32 and x.is_contiguous()
            and weight.is_contiguous() and x.device.type == weight.device.type == "cpu"
            and (bias is None or (bias.shape == (out_rows,) and bias.dtype == torch.float32
                                  and bias.is_contiguous()))):
        raise ValueError("fp_float_gemm: tensors of unexpected shapes, types or layouts")
    y = torch.empty(rows, out_rows)
    _library.fp_float_gemm(x.data_ptr(), rows, weight.data_ptr(), out_rows, dim,
                           None if bias is None else bias.data_ptr(), y.data_ptr())
    return y


def reference_product(x: Tensor, weight: Tensor, scales: Tensor, bias: Optional[Tensor], dim: int) -> Tensor:
    """What ``int8_product`` computes, in torch operations (for tests): the same rounding, exact integer sums,
    then the same float32 operations in the same order."""
    amax = x.abs().amax(dim=1)
    row_scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    quantized = torch.round(x * (1 / row_scales).unsqueeze(1)).clamp(-127, 127)
    sums = (quantized.double() @ weight[:, :dim].double().t()).float()  # exact: |sums| < 2^24 here
    y = sums * row_scales.unsqueeze(1) * scales.unsqueeze(0)
    return y if bias is None else y + bias


def lattice_beam_search(transitions: Tensor, ends: Tensor, allowed: Tensor, tokens: Tensor, suffixes: int, n: int,
                        beam: int):
    """``fp_lattice_beam_search`` on one sentence's lattice: transitions (P, S, K) and ends (P + 1, S) float32,
    allowed (P + 1) bool, tokens (P, K) int64, all CPU. Returns the best ending score of each length (P + 1),
    and each length's best path (P + 1, P) and its step scores with the end's (P + 1, P + 1), meaningful where
    the score is finite."""
    positions, states, k = transitions.shape
    if not (transitions.dtype == ends.dtype == torch.float32 and ends.shape == (positions + 1, states)
            and allowed.shape == (positions + 1,) and tokens.shape == (positions, k) and tokens.dtype == torch.int64
            and suffixes * k == states and n >= 1 and beam >= 1):
        raise ValueError("fp_lattice_beam_search: tensors of unexpected shapes or types")
    transitions, ends, tokens = transitions.contiguous(), ends.contiguous(), tokens.contiguous()
    allowed = allowed.to(torch.uint8).contiguous()
    best_end = torch.empty(positions + 1)
    best_paths = torch.zeros(positions + 1, max(positions, 1), dtype=torch.int64)
    best_steps = torch.zeros(positions + 1, positions + 1)
    if _library.fp_lattice_beam_search(_pointer(transitions), _pointer(ends), allowed.data_ptr(), tokens.data_ptr(),
                                       positions, states, k, suffixes, n, beam, best_end.data_ptr(),
                                       best_paths.data_ptr(), best_steps.data_ptr()) != 0:
        raise MemoryError("fp_lattice_beam_search: out of memory")
    return best_end, best_paths, best_steps


class ByteNetBlock(ctypes.Structure):
    """kernels.h's fp_relu_block: one ByteNet ReLU residual block's layer norms, 1x1 products and dilated
    convolution, float32."""
    _fields_ = ([(f"norm_{name}_{part}", ctypes.c_void_p) for name in ("in", "mid", "out")
                 for part in ("weight", "bias")]
                + [(f"norm_{name}_eps", ctypes.c_float) for name in ("in", "mid", "out")]
                + [(f"{name}_{part}", ctypes.c_void_p) for name in ("reduce", "conv", "expand")
                   for part in ("weight", "bias")]
                + [(name, ctypes.c_int64) for name in ("channels", "hidden", "kernel", "dilation")])


class ReLUBlocksStepper(_Scratch):
    """``fp_relu_blocks_frame_step``: a ByteNet stack of ReLU blocks (``bytenet.layers.ReLUBlock``) on one new
    frame a row, in one call. Built from the blocks' float32 CPU parameters, which it reads in place (views:
    rebuild it after the parameters are replaced, e.g. by ``.half()``)."""

    def __init__(self, blocks):
        super().__init__()
        self.structs = (ByteNetBlock * len(blocks))()
        for struct, block in zip(self.structs, blocks):
            conv = block.conv.conv
            for name in ("in", "mid", "out"):
                norm = getattr(block, f"norm_{name}")
                setattr(struct, f"norm_{name}_weight", _pointer(norm.weight))
                setattr(struct, f"norm_{name}_bias", _pointer(norm.bias))
                setattr(struct, f"norm_{name}_eps", norm.eps)
            for name, module in (("reduce", block.reduce), ("conv", conv), ("expand", block.expand)):
                setattr(struct, f"{name}_weight", _pointer(module.weight))
                setattr(struct, f"{name}_bias", _pointer(module.bias))
            struct.channels, struct.hidden = block.reduce.in_features, block.reduce.out_features
            struct.kernel, struct.dilation = block.conv.kernel_size, block.conv.dilation
        self.histories = [block.conv.history for block in blocks]
        self.widest = max(2 * s.channels + (s.kernel + 2) * s.hidden for s in self.structs)
        self.channels = self.structs[0].channels
        self.hidden = [s.hidden for s in self.structs]

    def __call__(self, x: Tensor, pasts) -> None:
        """x (rows, channels) float32 contiguous, updated in place; pasts: each block's kept convolution input
        frames (rows, history, hidden) float32 contiguous, moved on by the new frame in place."""
        rows = x.size(0)
        # The C code trusts these shapes (a mismatch would read or write out of bounds, not raise).
        if not (x.dtype == torch.float32 and x.dim() == 2 and x.size(1) == self.channels and x.is_contiguous()
                and len(pasts) == len(self.histories)
                and all(p.dtype == torch.float32 and p.shape == (rows, history, hidden) and p.is_contiguous()
                        for p, history, hidden in zip(pasts, self.histories, self.hidden))):
            raise ValueError("fp_relu_blocks_frame_step: tensors of unexpected shapes, types or layouts")
        self.reserve(rows * self.widest, 0, 0)
        pointers = (ctypes.c_void_p * len(pasts))(*[p.data_ptr() for p in pasts])
        _library.fp_relu_blocks_frame_step(self.structs, len(pasts), x.data_ptr(), rows, pointers,
                                           self.scratch.data_ptr())


# Each ctypes mirror of a kernels.h struct, by its C name.
STRUCTS = {"fp_matrix": Matrix, "fp_layer": DecoderLayer, "fp_relu_block": ByteNetBlock, "fp_decoder": Decoder,
           "fp_proposal_heads": ProposalHeads}


def struct_layout() -> Dict[str, Dict[Optional[str], int]]:
    """The compiled library's layout of its structs: C name -> {field name: offset, None: the struct's size}."""
    if not available():
        raise RuntimeError(f"the native kernels are not built: {_failure}")
    layout: Dict[str, Dict[Optional[str], int]] = {}
    type_name, field_name, value = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int64()
    index = 0
    while _library.fp_struct_layout(index, ctypes.byref(type_name), ctypes.byref(field_name), ctypes.byref(value)):
        field = None if field_name.value is None else field_name.value.decode()
        layout.setdefault(type_name.value.decode(), {})[field] = value.value
        index += 1
    return layout
