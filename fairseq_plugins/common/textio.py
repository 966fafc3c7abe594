"""Reading and writing text corpora: clear errors on bad input, nothing half-written on failure."""

import contextlib
import os
import tempfile
from typing import Iterator, List, Sequence


class InputError(ValueError):
    """Bad user input: the message names the file, line or flag at fault."""


def read_lines(path: str, allow_empty_lines: bool = False) -> List[str]:
    """Read a UTF-8 text file into lines without their newline; empty lines are an error by default."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    lines = []
    with open(path, encoding="utf-8", newline="\n") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\n").rstrip("\r")
            if not allow_empty_lines and not line.strip():
                raise InputError(f"{path}:{number}: empty line (every sentence needs text)")
            lines.append(line)
    if not lines:
        raise InputError(f"{path}: file is empty")
    return lines


def read_parallel(source_path: str, target_path: str) -> (List[str], List[str]):
    """Read a sentence-aligned pair of files; line counts must match."""
    source, target = read_lines(source_path), read_lines(target_path)
    if len(source) != len(target):
        raise InputError(
            f"{source_path} has {len(source)} lines but {target_path} has {len(target)}: "
            "parallel files must be sentence-aligned"
        )
    return source, target


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "w", encoding: str = "utf-8") -> Iterator:
    """Open a temporary file beside ``path`` and rename it into place only if the block succeeds."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, temp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
        give_default_mode(temp_path)
        os.replace(temp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_path)
        raise


def give_default_mode(path: str) -> None:
    """mkstemp/mkdtemp create 0600/0700; give a finished output the mode a plain open/mkdir would have."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)


def write_lines(path: str, lines: Sequence[str]) -> None:
    with atomic_output(path) as f:
        for line in lines:
            f.write(line + "\n")
