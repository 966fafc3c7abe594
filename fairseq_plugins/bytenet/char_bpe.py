"""``--bpe char``: the character tokens of ``fairseq-plugins prepare --char`` for fairseq-interactive and the hub
interface (``from_pretrained(..., bpe="char")``), so a character model translates raw text.

fairseq's own ``--bpe characters`` is registered without a config, so fairseq-interactive and -generate stop
with "Could not find 'bpe/characters'"; it also splits whitespace other than a space into tokens fairseq
drops. This one is :class:`~fairseq_plugins.tools.tokenization.CharTokenizer`, the exact tokens of prepared
data (a space as "▁", other whitespace as ``<U+XXXX>``) and their exact inverse.
"""

from dataclasses import dataclass

from fairseq.data.encoders import register_bpe
from fairseq.dataclass import FairseqDataclass

from ..tools.tokenization import CharTokenizer


@dataclass
class CharBPEConfig(FairseqDataclass):
    pass


@register_bpe("char", dataclass=CharBPEConfig)
class CharBPE:
    def __init__(self, cfg=None):
        self.tokenizer = CharTokenizer()

    def encode(self, x: str) -> str:
        return self.tokenizer.encode(x)

    def decode(self, x: str) -> str:
        return self.tokenizer.decode(x)

    def is_beginning_of_word(self, x: str) -> bool:
        return True
