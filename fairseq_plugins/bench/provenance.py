"""What a bench result was measured on, by content: the checkpoints (the method's and the stock side's), every
file a method's task flags name (lexical tables, shortlists, base checkpoints) and the test data, each with its
sha256, so that a figure names its model by what it is rather than by a path that may hold another model later."""

import functools
import hashlib
import os
from typing import Dict, Iterable, Optional

# A bench result's model hashes are quoted by their first characters in tables and notes.
SHORT_HASH = 12


def file_sha256(path: str) -> str:
    """The file's sha256, read once per process while its size and modification time stay (a bench hashes its
    checkpoint for its provenance and for the CTranslate2 conversion's key)."""
    stat = os.stat(path)
    return _sha256_of(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(path: str) -> str:
    """The sha256 of a fairseq checkpoint's weights alone (its "model" state dict: each tensor's name, dtype,
    shape and bytes, in name order). A checkpoint file also stores what the training measured besides the model
    (wall-clock meters, the optimiser's state, the arguments), so the same recipe retrained on another machine
    writes another file; when it writes the same weights, this hash says so. InputError for a file that is not
    such a checkpoint."""
    stat = os.stat(path)
    return _weights_sha256_of(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _weights_sha256_of(path: str, size: int, mtime_ns: int) -> str:
    import torch

    from ..common.textio import InputError

    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - whatever torch makes of a file that is no checkpoint
        raise InputError(f"{path}: not a checkpoint torch can read ({type(error).__name__}: {error})") from None
    weights = state.get("model") if isinstance(state, dict) else None
    if not isinstance(weights, dict):
        raise InputError(f"{path}: no 'model' state dict (not a fairseq checkpoint)")
    digest = hashlib.sha256()
    for name in sorted(weights):
        value = weights[name]
        if not torch.is_tensor(value):
            digest.update(f"{name}\0{value!r}\0".encode())
            continue
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def hashed(path: str) -> Dict:
    return {"path": os.path.abspath(path), "sha256": file_sha256(path)}


def task_files(task_flags: Dict) -> Dict[str, Dict]:
    """Every task flag whose value is an existing file (a table, a shortlist, a base checkpoint), hashed."""
    return {flag: hashed(value) for flag, value in sorted(task_flags.items())
            if isinstance(value, str) and value and os.path.isfile(value)}


def data_files(paths: Iterable[Optional[str]]) -> Dict[str, str]:
    """sha256 of the decoded data's files (the binarised split and its raw text, or --source/--reference-file),
    keyed by file name."""
    return {os.path.basename(path): file_sha256(path) for path in paths if path and os.path.isfile(path)}


def model_hashes(checkpoint: str, baseline_checkpoint: str, task_flags: Dict, data: Iterable[Optional[str]]) -> Dict:
    """The ``hashes`` block of a bench result (docs/bench.md)."""
    method = hashed(checkpoint)
    stock = method if os.path.abspath(baseline_checkpoint) == method["path"] else hashed(baseline_checkpoint)
    return {"checkpoint": method["sha256"], "baseline_checkpoint": stock["sha256"],
            "task_files": task_files(task_flags), "data": data_files(data)}
