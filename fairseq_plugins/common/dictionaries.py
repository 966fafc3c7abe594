"""What files built from fairseq dictionaries share (registers nothing): a fingerprint of a dictionary, so
that a table built from one data directory is refused with another, and the ids in order of frequency."""

import hashlib
from typing import Dict, List

from .textio import InputError


def dictionary_fingerprint(dictionary) -> str:
    """A digest of a fairseq dictionary's symbols in order (what token ids mean)."""
    digest = hashlib.sha256()
    for symbol in dictionary.symbols:
        digest.update(symbol.encode("utf-8") + b"\n")
    return digest.hexdigest()[:16]


def check_dictionaries(path: str, state: Dict, src_dict, tgt_dict, remedy: str) -> None:
    """Refuse a file built from other dictionaries than the task's. ``state`` holds each side's fingerprint
    (``source_dictionary``, ``target_dictionary``) and size (``source_dictionary_size``, ...); a None
    dictionary is not checked."""
    for side, dictionary in (("source", src_dict), ("target", tgt_dict)):
        if dictionary is None or dictionary_fingerprint(dictionary) == state[f"{side}_dictionary"]:
            continue
        raise InputError(f"{path}: built with another {side} dictionary ({state[f'{side}_dictionary_size']} symbols, "
                         f"fingerprint {state[f'{side}_dictionary']}) than this task's ({len(dictionary)} symbols, "
                         f"{dictionary_fingerprint(dictionary)}): {remedy}")


def ids_by_count(dictionary) -> List[int]:
    """Every id of a fairseq dictionary, most frequent first (by its counts; ties by id)."""
    return sorted(range(len(dictionary)), key=lambda i: (-dictionary.count[i], i))
