"""CTranslate2 as a same-run reference for ``fairseq-plugins bench --reference ctranslate2``.

The stock side's checkpoint (``--baseline-path``, else ``--path``) is converted once with CTranslate2's own
fairseq converter into a folder beside it (``ctranslate2-<hash>/``, keyed by the checkpoint's and the
dictionaries' content and the CTranslate2 version; written aside and renamed), then decoded by a
``ctranslate2.Translator`` on the same collated batches as fairseq's generators, alternating with them batch by
batch. fairseq's decoding rules are mapped to CTranslate2's options one by one (``decoding_options``); a rule
CTranslate2 cannot follow is refused before anything is decoded.
"""

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Dict, List, Optional

import torch

from ..common.textio import InputError
from .provenance import file_sha256

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install ctranslate2==4.8.5 (`make install` installs it)"
# CTranslate2's names for the precision of its weights and products (ctranslate2.Translator's compute_type).
COMPUTE_TYPES = ("float32", "int8", "int8_float32", "int16", "float16", "int8_float16", "bfloat16",
                 "int8_bfloat16", "auto", "default")
# The encoder-decoder models of CTranslate2's fairseq converter (its _SUPPORTED_MODELS, less the language model
# and the multilingual and BART models, which bench's translation tasks do not load).
CONVERTIBLE_MODELS = ("transformer", "transformer_align")
# ctranslate2-<16 hex digits of the content hash>: the folder of one conversion.
FOLDER_PREFIX = "ctranslate2-"


def require_ctranslate2():
    """The ctranslate2 module, or a clear error naming the install command."""
    try:
        import ctranslate2
    except ImportError as error:
        raise InputError(f"--reference ctranslate2: the ctranslate2 package is not installed ({error}); "
                         f"{INSTALL_HINT}") from None
    return ctranslate2


def check_convertible(path: str, flag: str) -> str:
    """The fairseq model name of the checkpoint's architecture; an error naming the reason where CTranslate2's
    converter cannot take it (a method's own model: its stock side is the baseline, given by --baseline-path)."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    state = torch.load(path, map_location="cpu", weights_only=False)
    args = state.get("args") or (state.get("cfg") or {}).get("model")
    arch = getattr(args, "arch", None) or (args.get("arch") if hasattr(args, "get") else None)
    model = ARCH_MODEL_NAME_REGISTRY.get(arch)
    if model not in CONVERTIBLE_MODELS:
        raise InputError(
            f"--reference ctranslate2: {flag} {path} is a {model or 'unknown'} model (architecture {arch}), which "
            f"CTranslate2's fairseq converter does not take (it converts {', '.join(CONVERTIBLE_MODELS)}); for a "
            "method that changes the model, give the transformer it is compared with as --baseline-path")
    return model


def _conversion_key(checkpoint: str, dictionaries: List[str], version: str) -> str:
    digest = hashlib.sha256(file_sha256(checkpoint).encode())
    for path in dictionaries:
        digest.update(file_sha256(path).encode())
    digest.update(version.encode())
    return digest.hexdigest()[:16]


def _cache_root(checkpoint: str) -> str:
    """Beside the checkpoint where that folder is writable, else the user's cache."""
    beside = os.path.dirname(os.path.abspath(checkpoint))
    if os.access(beside, os.W_OK):
        return beside
    return os.path.join(os.environ.get("FAIRSEQ_PLUGINS_CACHE")
                        or os.path.join(os.path.expanduser("~"), ".cache", "fairseq_plugins"), "ctranslate2")


def converted_model(checkpoint: str, data_bin: str, source_lang: str, target_lang: str, user_dir: str) -> Dict:
    """The CTranslate2 model folder of ``checkpoint`` (converted now, or found from an earlier conversion), with
    the seconds the conversion took (None when reused): {"dir", "conversion_seconds", "key"}."""
    ctranslate2 = require_ctranslate2()
    from ctranslate2.converters import FairseqConverter

    dictionaries = [os.path.join(data_bin, f"dict.{lang}.txt") for lang in (source_lang, target_lang)]
    for path in dictionaries:
        if not os.path.isfile(path):
            raise InputError(f"--reference ctranslate2: {path}: no such dictionary (the converter reads it)")
    key = _conversion_key(checkpoint, dictionaries, ctranslate2.__version__)
    root = _cache_root(checkpoint)
    folder = os.path.join(root, FOLDER_PREFIX + key)
    if os.path.isfile(os.path.join(folder, "model.bin")):
        return {"dir": folder, "conversion_seconds": None, "key": key}
    os.makedirs(root, exist_ok=True)
    # The converter reads fairseq's checkpoint with torch.load(weights_only=True), which refuses the argparse
    # Namespace fairseq stores its arguments in.
    torch.serialization.add_safe_globals([argparse.Namespace])
    aside = tempfile.mkdtemp(prefix=f".{FOLDER_PREFIX}{key}-", dir=root)
    start = time.perf_counter()
    try:
        FairseqConverter(checkpoint, data_bin, source_lang=source_lang, target_lang=target_lang,
                         user_dir=user_dir).convert(aside, force=True)
        seconds = time.perf_counter() - start
        try:
            os.rename(aside, folder)
        except OSError:  # another process converted it meanwhile: theirs is the same model
            if not os.path.isfile(os.path.join(folder, "model.bin")):
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    logger.info("ctranslate2: converted %s into %s in %.1f s", checkpoint, folder, seconds)
    return {"dir": folder, "conversion_seconds": seconds, "key": key}


# fairseq generation options CTranslate2 has no counterpart for, with the value that means "off".
_UNSUPPORTED = {
    "sampling": False, "unnormalized": False, "match_source_len": False, "prefix_size": 0,
    "diverse_beam_groups": -1, "diversity_rate": -1.0, "temperature": 1.0, "unkpen": 0, "constraints": None,
    "lm_path": None,
}


def decoding_options(generation, beam: int) -> Dict:
    """CTranslate2's translate_batch options that decode as fairseq's SequenceGenerator does with ``generation``
    (fairseq's GenerationConfig) at ``beam``; an InputError naming the first flag CTranslate2 cannot follow.

    Lengths: fairseq stops a batch at min(max_len_a * S + max_len_b, max positions - 1) tokens before the end
    token, S the batch's padded source length (end token included), and forbids the end token before min_len
    tokens; CTranslate2's max_decoding_length and min_decoding_length count the same tokens (the end token not
    included). Length penalty: both divide a finished hypothesis' summed log-probability by its length
    (end token included) to the power lenpen (CTranslate2's length_penalty with normalized scores)."""
    for name, off in _UNSUPPORTED.items():
        value = getattr(generation, name, off)
        if value != off:
            raise InputError(f"--reference ctranslate2: fairseq's --{name.replace('_', '-')} {value} has no "
                             "counterpart in CTranslate2's decoding; leave it at its default to compare with it")
    return {
        "beam_size": beam,
        "length_penalty": float(generation.lenpen),
        "min_decoding_length": int(generation.min_len),
        "no_repeat_ngram_size": int(generation.no_repeat_ngram_size or 0),
        "return_scores": False,
    }


class CTranslate2Decoder:
    """A converted model decoding fairseq's collated batches: batch -> {sentence id: tokens ending in EOS},
    the same form as bench's other decoders, so outputs compare token by token with stock fairseq's."""

    def __init__(self, model_dir: str, compute_type: str, threads: int, device: torch.device, src_dict, tgt_dict,
                 generation, beam: int, max_positions: int):
        ctranslate2 = require_ctranslate2()
        self.options = decoding_options(generation, beam)
        self.max_len_a, self.max_len_b = float(generation.max_len_a), int(generation.max_len_b)
        self.max_positions = max_positions
        self.src_dict, self.tgt_dict = src_dict, tgt_dict
        self.compute_type = compute_type
        self.version = ctranslate2.__version__
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            # CTranslate2 appends the end token to every source itself (the converter records it for fairseq's
            # models): fairseq's own must then be left off, or the encoder reads it twice.
            self.adds_source_eos = bool(json.load(f).get("add_source_eos"))
        self.translator = ctranslate2.Translator(model_dir, device=device.type, compute_type=compute_type,
                                                 intra_threads=threads, inter_threads=1)

    def max_decoding_length(self, padded_source_length: int) -> int:
        """fairseq's SequenceGenerator limit for a batch whose padded source (end token included) is this long."""
        return min(int(self.max_len_a * padded_source_length + self.max_len_b), self.max_positions - 1)

    def source_tokens(self, src_tokens: torch.Tensor) -> List[List[str]]:
        """fairseq's collated source ids (padded, each ending in the end token) as CTranslate2's token strings."""
        pad, eos = self.src_dict.pad(), self.src_dict.eos()
        rows = [[i for i in row.tolist() if i != pad] for row in src_tokens]
        if self.adds_source_eos:
            rows = [row[:-1] if row[-1:] == [eos] else row for row in rows]
        return [[self.src_dict[i] for i in row] for row in rows]

    def __call__(self, batch) -> Dict[int, List[int]]:
        src_tokens = batch["net_input"]["src_tokens"]
        results = self.translator.translate_batch(
            self.source_tokens(src_tokens.cpu()), max_batch_size=0,
            max_decoding_length=self.max_decoding_length(src_tokens.size(1)), **self.options)
        index, eos = self.tgt_dict.index, self.tgt_dict.eos()
        return {int(sid): [index(token) for token in result.hypotheses[0]] + [eos]
                for sid, result in zip(batch["id"].tolist(), results)}

    def description(self) -> Dict:
        beam = self.options["beam_size"]
        return {
            "class": "ctranslate2.Translator",
            "description": ("greedy" if beam == 1 else f"beam {beam}") + f", CTranslate2 {self.compute_type}",
            "beam": beam,
            "compute_type": self.compute_type,
            "ctranslate2_version": self.version,
            "options": {**self.options, "max_decoding_length": f"min({self.max_len_a:g} * padded source length + "
                                                              f"{self.max_len_b}, {self.max_positions - 1})"},
        }


def max_decoder_positions(models) -> Optional[int]:
    """fairseq's SequenceGenerator bound on output length: the smallest decoder's max positions."""
    return min(model.max_decoder_positions() for model in models)
