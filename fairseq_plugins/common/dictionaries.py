"""What files built from fairseq dictionaries share (registers nothing): a fingerprint of a dictionary, so
that a table built from one data directory is refused with another."""

import hashlib


def dictionary_fingerprint(dictionary) -> str:
    """A digest of a fairseq dictionary's symbols in order (what token ids mean)."""
    digest = hashlib.sha256()
    for symbol in dictionary.symbols:
        digest.update(symbol.encode("utf-8") + b"\n")
    return digest.hexdigest()[:16]
