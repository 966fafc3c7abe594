"""Reading and writing text corpora: clear errors on bad input, nothing half-written on failure."""

import argparse
import contextlib
import os
import tempfile
from typing import Iterable, Iterator, List, Sequence


class InputError(ValueError):
    """Bad user input: the message names the file, line or flag at fault."""


def read_lines(path: str, allow_empty_lines: bool = False) -> List[str]:
    """Read a UTF-8 text file into lines without their newline; empty lines are an error by default."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    lines = []
    with open(path, "rb") as f:
        for number, line in enumerate(decode_lines(f, path), start=1):
            line = line.rstrip("\n").rstrip("\r")
            if not allow_empty_lines and not line.strip():
                raise InputError(f"{path}:{number}: empty line (every sentence needs text)")
            lines.append(line)
    if not lines:
        raise InputError(f"{path}: file is empty")
    return lines


def read_json(path: str, what: str):
    """The JSON value in ``path``; an InputError naming the file (``what`` it should be) or the line that is not
    valid JSON."""
    import json

    if not os.path.isfile(path):
        raise InputError(f"{path}: no such {what}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from error


def decode_lines(lines: Iterable[bytes], path: str) -> Iterator[str]:
    """Decode lines of bytes (a file opened "rb") as UTF-8; a bad byte names the file, line and byte offset."""
    offset = 0
    for number, line in enumerate(lines, start=1):
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InputError(
                f"{path}:{number}: not UTF-8 text: byte 0x{line[error.start]:02x} at byte offset "
                f"{offset + error.start} of the file (byte {error.start} of the line); convert the file to "
                "UTF-8 first (e.g. iconv -f LATIN1 -t UTF-8)"
            ) from None
        offset += len(line)


def read_parallel(source_path: str, target_path: str) -> (List[str], List[str]):
    """Read a sentence-aligned pair of files; line counts must match."""
    source, target = read_lines(source_path), read_lines(target_path)
    if len(source) != len(target):
        raise InputError(
            f"{source_path} has {len(source)} lines but {target_path} has {len(target)}: "
            "parallel files must be sentence-aligned"
        )
    return source, target


def positive_int(text: str) -> int:
    """argparse type of a count or size: an integer of at least 1, refused at parsing otherwise."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type of a count where 0 means "no limit" or "none": an integer of at least 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def check_output_path(path: str, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written: a directory, a path under a file,
    or one in a directory this user cannot write (missing parents are fine: atomic_output creates them)."""
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: is a directory (give a file name)")
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: directory {existing} is not writable")


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
