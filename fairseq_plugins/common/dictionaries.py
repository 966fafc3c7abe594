"""What files built from fairseq dictionaries share (registers nothing): a fingerprint of a dictionary, so
that a table or a model built from one data directory is refused with another, and the ids in order of
frequency."""

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


def data_directory(task) -> str:
    """The data directory a task reads its dictionaries from (the first of fairseq's colon-separated shards)."""
    config = getattr(task, "cfg", None) or getattr(task, "args", None)  # legacy tasks (language_modeling) keep args
    return str(getattr(config, "data", "") or "").split(":")[0] or "the task's data directory"


def keep_or_check_model_dictionaries(args, task, model: str) -> bool:
    """A model built for the first time keeps its task's dictionary fingerprints (and data directory) in its
    args, which fairseq saves in every checkpoint; built again from a checkpoint for a data directory with other
    dictionaries, it is refused here. Otherwise another size fails in load_state_dict with a shape error that
    names no file, and the same size (two character vocabularies, say) loads and silently gives every id another
    symbol. Returns whether this was a first build (fairseq-train's, or a checkpoint saved before fingerprints)."""
    first_build = False
    for side, dictionary in (("source", task.source_dictionary), ("target", task.target_dictionary)):
        if dictionary is None:
            continue
        found, kept = dictionary_fingerprint(dictionary), getattr(args, f"{side}_dictionary_fingerprint", None)
        if kept is None:
            first_build = True
            setattr(args, f"{side}_dictionary_fingerprint", found)
            setattr(args, f"{side}_dictionary_size", len(dictionary))
            # Not args.data: fairseq's --model-overrides and the hub interface overwrite it with today's directory.
            args.dictionaries_data = data_directory(task)
        elif kept != found:
            raise InputError(
                f"{data_directory(task)}: its {side} dictionary ({len(dictionary)} symbols, fingerprint {found}) is "
                f"not the one this {model} model was trained with ({getattr(args, f'{side}_dictionary_size', '?')} "
                f"symbols, {kept}; trained on {getattr(args, 'dictionaries_data', '?')}): give the data directory "
                "the model was trained on")
    return first_build


def check_vocabulary_sizes(state_dict, embeddings: Dict[str, int], data: str, model: str) -> None:
    """For checkpoints saved before the fingerprints: at least another vocabulary size is named before
    load_state_dict's shape error. ``embeddings`` maps a state-dict key to the size this task gives it."""
    for key, size in embeddings.items():
        if key in state_dict and state_dict[key].size(0) != size:
            raise InputError(f"{data}: {size} symbols where this {model} checkpoint was trained with "
                             f"{state_dict[key].size(0)} ({key}): give the data directory the model was trained on")


def ids_by_count(dictionary) -> List[int]:
    """Every id of a fairseq dictionary, most frequent first (by its counts; ties by id)."""
    return sorted(range(len(dictionary)), key=lambda i: (-dictionary.count[i], i))
