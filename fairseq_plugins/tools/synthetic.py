"""An embedded synthetic reordering corpus, for when no real data is at hand (the demo's last resort, tests).

Source sentences follow SVO order with adjectives before nouns; their "translations" map every word
through a fixed lexicon and reorder it: verb last (SOV), adjectives after their noun, and the
prepositional phrase first. Learning it needs attention and reordering, not just copying. Figures measured
on it say nothing about real translation quality.
"""

import os
import random
from typing import List, Tuple

from ..common.textio import write_lines

_NOUNS = "dog cat man woman child bird horse boy girl car ball tree house river bike street hat dress table cup".split()
_ADJECTIVES = "red small big old young green happy tall blue white".split()
_VERBS = "sees holds chases pulls likes finds carries watches paints throws".split()
_PLACES = "park beach garden city field".split()
SPLIT_SIZES = {"train": 4000, "val": 300, "test_2016_flickr": 300}


def _translate_word(word: str) -> str:
    """A fixed, invertible pseudo-lexicon: reverse the word and mark its class by a suffix."""
    suffix = "o" if word in _NOUNS else "i" if word in _ADJECTIVES else "u" if word in _VERBS else "a"
    return word[::-1] + suffix


def _noun_phrase(rng: random.Random) -> Tuple[List[str], List[str]]:
    noun = rng.choice(_NOUNS)
    adjectives = rng.sample(_ADJECTIVES, rng.choice((0, 0, 1, 2)))
    source = ["the"] + adjectives + [noun]
    target = [_translate_word("the"), _translate_word(noun)] + [_translate_word(a) for a in adjectives]
    return source, target


def sentence_pair(rng: random.Random) -> Tuple[str, str]:
    subject_source, subject_target = _noun_phrase(rng)
    object_source, object_target = _noun_phrase(rng)
    verb = rng.choice(_VERBS)
    source = subject_source + [verb] + object_source
    target = subject_target + object_target + [_translate_word(verb)]
    if rng.random() < 0.4:
        place = rng.choice(_PLACES)
        source += ["in", "the", place]
        target = [_translate_word("in"), _translate_word("the"), _translate_word(place)] + target
    return " ".join(source) + " .", " ".join(target) + " ."


def write_corpus(out_dir: str, source_lang: str = "src", target_lang: str = "tgt", seed: int = 1,
                 sizes=None) -> str:
    """Write train/val/test_2016_flickr files in the Multi30k layout; returns ``out_dir``."""
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    for split, size in (sizes or SPLIT_SIZES).items():
        pairs = [sentence_pair(rng) for _ in range(size)]
        write_lines(os.path.join(out_dir, f"{split}.{source_lang}"), [s for s, _ in pairs])
        write_lines(os.path.join(out_dir, f"{split}.{target_lang}"), [t for _, t in pairs])
    return out_dir
