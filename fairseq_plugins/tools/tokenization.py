"""Subword and character tokenisers with an exact inverse, described by a JSON-able spec.

A prepared data directory records its tokeniser spec in ``prepare.json``; :func:`load_tokenizer` rebuilds
the tokeniser from it so that decoding, scoring and benchmarking all detokenise the same way.
"""

import os
import re
from typing import Dict, List, Optional

from ..common.textio import InputError

VISIBLE_SPACE = "\u2581"  # "▁", the symbol SentencePiece also uses for a word boundary
# fairseq splits lines on any whitespace, so whitespace other than " " becomes an escape token.
_ESCAPED = re.compile(r"^<U\+([0-9A-F]{4,6})>$")


class CharTokenizer:
    """One token per character; a space becomes the visible symbol, so decoding restores the text exactly.

    Other whitespace (no-break space, tab, ...) would vanish in fairseq's whitespace split, so it becomes a
    token such as ``<U+00A0>``; text can never yield one of those itself (its characters are separate tokens).
    """

    kind = "char"

    def __init__(self, space_symbol: str = VISIBLE_SPACE):
        self.space_symbol = space_symbol

    def check(self, line: str, where: str) -> None:
        if self.space_symbol in line:
            raise InputError(f"{where}: contains the visible space symbol {self.space_symbol!r} itself")

    def encode(self, line: str) -> str:
        return " ".join(self._encode_char(ch) for ch in line)

    def _encode_char(self, ch: str) -> str:
        if ch == " ":
            return self.space_symbol
        return f"<U+{ord(ch):04X}>" if ch.isspace() else ch

    def decode(self, tokens: str) -> str:
        return "".join(self._decode_token(token) for token in tokens.split(" "))

    def _decode_token(self, token: str) -> str:
        if token == self.space_symbol:
            return " "
        escaped = _ESCAPED.match(token)
        return chr(int(escaped.group(1), 16)) if escaped else token

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
