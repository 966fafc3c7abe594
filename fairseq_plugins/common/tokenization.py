"""Subword and character tokenisers with an exact inverse, described by a JSON-able spec.

A prepared data directory records its tokeniser spec in ``prepare.json``; :func:`load_tokenizer` rebuilds
the tokeniser from it so that decoding, scoring and benchmarking all detokenise the same way.
"""

import os
import re
from typing import Dict, List, Optional

from .textio import InputError

VISIBLE_SPACE = "\u2581"  # "▁", the symbol SentencePiece also uses for a word boundary
# fairseq splits lines on any whitespace, so characters other than " " would silently vanish.
_OTHER_WHITESPACE = re.compile(r"[^\S ]")


class CharTokenizer:
    """One token per character; a space becomes the visible symbol, so decoding restores the text exactly."""

    kind = "char"

    def __init__(self, space_symbol: str = VISIBLE_SPACE):
        self.space_symbol = space_symbol

    def check(self, line: str, where: str) -> None:
        if self.space_symbol in line:
            raise InputError(f"{where}: contains the visible space symbol {self.space_symbol!r} itself")
        match = _OTHER_WHITESPACE.search(line)
        if match:
            raise InputError(
                f"{where}: column {match.start() + 1} holds whitespace {match.group()!r} other than a space, "
                "which fairseq's tokenizer would drop"
            )

    def encode(self, line: str) -> str:
        return " ".join(self.space_symbol if ch == " " else ch for ch in line)

    def decode(self, tokens: str) -> str:
        return "".join(tokens.split(" ")).replace(self.space_symbol, " ")

    def spec(self) -> Dict:
        return {"kind": self.kind, "space_symbol": self.space_symbol}


class SentencePieceTokenizer:
    """A trained SentencePiece model; fairseq sees its pieces separated by spaces."""

    kind = "sentencepiece"

    def __init__(self, model_path: str):
        import sentencepiece

        if not os.path.isfile(model_path):
            raise InputError(f"{model_path}: SentencePiece model not found")
        self.model_path = model_path
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_path)

    def check(self, line: str, where: str) -> None:
        pass  # SentencePiece normalises any text

    def encode(self, line: str) -> str:
        return " ".join(self.processor.encode(line, out_type=str))

    def decode(self, tokens: str) -> str:
        return self.processor.decode_pieces(tokens.split())

    def spec(self) -> Dict:
        return {"kind": self.kind, "model": self.model_path}


def train_sentencepiece(
    inputs: List[str], model_prefix: str, vocab_size: int, model_type: str = "unigram",
    character_coverage: float = 1.0,
) -> str:
    """Train a SentencePiece model on ``inputs`` (files); returns the ``.model`` path."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        input=",".join(inputs),
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        # fairseq adds its own specials; SentencePiece must not emit <s>, </s> as pieces.
        bos_id=-1, eos_id=-1, unk_id=0,
        input_sentence_size=0, shuffle_input_sentence=False,  # use every line, deterministically
        num_threads=1,
        minloglevel=2,
    )
    return model_prefix + ".model"


def load_tokenizer(spec: Dict, base_dir: Optional[str] = None):
    """Rebuild a tokeniser from its spec; relative model paths are taken from ``base_dir``."""
    kind = spec.get("kind")
    if kind == CharTokenizer.kind:
        return CharTokenizer(spec.get("space_symbol", VISIBLE_SPACE))
    if kind == SentencePieceTokenizer.kind:
        path = spec["model"]
        if base_dir is not None and not os.path.isabs(path):
            path = os.path.join(base_dir, path)
        return SentencePieceTokenizer(path)
    raise InputError(f"unknown tokenizer kind {kind!r} (expected 'char' or 'sentencepiece')")
