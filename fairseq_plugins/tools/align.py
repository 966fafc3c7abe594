"""Word alignment of a tokenised parallel corpus (registers nothing): ``fairseq-plugins align``.

Two backends write the same Pharaoh ``i-j`` lines (source position i, target position j, 0-based):

- ``systran`` (default): systran-align, the fast_align library in a pip wheel. It trains fast_align's
  forward and reverse models with the command-line recipe's settings below (favour the diagonal, optimise its
  tension, variational Bayes: ``-d -o -v``) and symmetrises with grow-diag-final-and; nothing to build. Run on one OpenMP thread: reproducible output.
  ``--lexical-table`` decodes the forward model's binary table into fast_align's ``-p`` text format.
- ``fast_align``: a user-built fast_align driven by subprocess, the recipe of its README: forward
  ``-d -o -v``, reverse ``-d -o -v -r``, ``atools -c grow-diag-final-and``; ``--lexical-table`` keeps the
  forward model's ``-p`` table. ``OMP_NUM_THREADS=1`` makes its output reproducible.
"""

import contextlib
import math
import os
import shutil
import struct
import subprocess
import tempfile
from typing import Iterator, List, Optional, Sequence, Tuple

from ..common.progress import progress_bar
from ..common.textio import InputError, atomic_output, positive_int, read_parallel

BACKENDS = ("systran", "fast_align")
BACKEND_STEPS = {"systran": 2, "fast_align": 3}  # the _step calls of each, the length of its progress bar
Alignment = List[Tuple[int, int]]


def add_align_parser(subparsers):
    p = subparsers.add_parser("align", help="word-align a tokenised parallel corpus (Pharaoh i-j lines)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="tokenised source text, one sentence per line")
    p.add_argument("--target", required=True, help="tokenised target text, same number of lines")
    p.add_argument("--output", required=True, help="write the alignments here, one line per sentence pair")
    p.add_argument("--backend", choices=BACKENDS, default="systran",
                   help="systran: the pip wheel; fast_align: a user-built binary by subprocess")
    p.add_argument("--fast-align", default=None,
                   help="fast_align binary (default: $FAST_ALIGN, then fast_align on PATH)")
    p.add_argument("--atools", default=None,
                   help="atools binary (default: $ATOOLS, then atools beside fast_align, then PATH)")
    p.add_argument("--lexical-table", default=None,
                   help="also write the forward model's lexical table, ln p(target | source), in fast_align's -p "
                        "text format (both backends)")
    p.add_argument("--iterations", type=positive_int, default=5, help="EM iterations of each direction")
    p.set_defaults(run=_run_align)


def _run_align(args, argv=None) -> None:
    alignments = align_corpus(args.source, args.target, backend=args.backend, fast_align=args.fast_align,
                              atools=args.atools, lexical_table=args.lexical_table, iterations=args.iterations,
                              progress=True)
    write_pharaoh(args.output, alignments)
    links = sum(len(a) for a in alignments)
    print(f"{args.output}: {len(alignments)} sentence pairs, {links} links ({args.backend} backend)")


def align_corpus(source_path: str, target_path: str, backend: str = "systran", fast_align: Optional[str] = None,
                 atools: Optional[str] = None, lexical_table: Optional[str] = None,
                 iterations: int = 5, progress: bool = False) -> List[Alignment]:
    """Symmetrised (grow-diag-final-and) alignments of every sentence pair, as sorted (source, target) pairs.
    ``progress``: a bar on stderr of the aligner's steps (its EM training runs in C++, out of sight)."""
    if backend not in BACKENDS:
        raise InputError(f"--backend {backend}: choose one of {', '.join(BACKENDS)}")
    # read_parallel rejects empty lines and mismatched line counts, naming the file and line.
    source, target = read_parallel(source_path, target_path)
    for path, lines in ((source_path, source), (target_path, target)):
        for number, line in enumerate(lines, start=1):
            if "|||" in line.split():
                raise InputError(f"{path}:{number}: the token '|||' separates source and target in the "
                                 "aligner's input and cannot appear in a sentence")
    with _scratch_dir() as scratch:
        corpus = os.path.join(scratch, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            for src, tgt in zip(source, target):
                f.write(f"{' '.join(src.split())} ||| {' '.join(tgt.split())}\n")
        with progress_bar(None, progress, total=BACKEND_STEPS[backend], desc=f"align ({backend})", unit="step") as bar:
            if backend == "systran":
                return _align_systran(corpus, source, target, scratch, iterations, lexical_table, bar)
            return _align_fast_align(corpus, len(source), scratch, fast_align, atools, lexical_table, iterations,
                                     bar)


@contextlib.contextmanager
def _step(bar, name: str) -> Iterator[None]:
    """One step of an alignment's progress bar: named on the bar while it runs, counted when it ends."""
    bar.set_postfix_str(name)
    yield
    bar.update()


def _align_systran(corpus: str, source: Sequence[str], target: Sequence[str], scratch: str,
                   iterations: int, lexical_table: Optional[str], bar) -> List[Alignment]:
    try:
        import systran_align
    except ImportError as e:
        raise InputError("--backend systran needs the systran-align wheel (pip install systran-align==3.5.0, "
                         "Linux x86_64, Python < 3.12); or use --backend fast_align with a built fast_align") from e
    forward, backward = os.path.join(scratch, "forward.probs"), os.path.join(scratch, "backward.probs")
    with _single_openmp_thread():
        with _step(bar, f"EM training, both directions, {iterations} iterations"):
            # fast_align's recommended -d -o -v (the fast_align backend's flags): favour the diagonal, optimise
            # its tension, a sparse (variational Bayes) lexical prior; the library's defaults are all off.
            systran_align.generate_alignment_probabilities(corpus, forward, backward, iterations=iterations,
                                                           favor_diagonal=True, optimize_tension=True,
                                                           variational_bayes=True)
        with _step(bar, "aligning"):
            aligner = systran_align.Aligner(forward, backward)
            alignments = []
            chunk = 10000
            for start in range(0, len(source), chunk):
                results = aligner.align_batch([s.split() for s in source[start:start + chunk]],
                                              [t.split() for t in target[start:start + chunk]])
                alignments.extend(sorted(set(r["alignments"])) for r in results)
    if lexical_table:
        with atomic_output(lexical_table) as out:
            for source_word, target_word, probability in read_systran_probabilities(forward):
                if probability > 0:
                    out.write(f"{source_word}\t{target_word}\t{math.log(probability):.6g}\n")
    return alignments


def read_systran_probabilities(path: str) -> Iterator[Tuple[str, str, float]]:
    """(source word, target word, p(target | source)) of a systran-align probabilities file.

    Its layout (fast_align's lexical table, serialised by systran-align): int32 version, int32 word count,
    that many NUL-terminated words (word id = position + 1, ``<eps>`` first), int32 table size, then per
    source word with entries: int32 word id, int32 entry count, that many (int32 target id, float32 p).
    """
    with open(path, "rb") as f:
        data = f.read()
    version = None
    try:
        version, count = struct.unpack_from("<ii", data, 0)
        position = 8
        words = []
        for _ in range(count):
            end = data.index(b"\0", position)
            words.append(data[position:end].decode("utf-8"))
            position = end + 1
        position += 4  # the table's size (dense, in word ids); only rows with entries follow
        while position < len(data):
            source_id, entries = struct.unpack_from("<ii", data, position)
            position += 8
            for target_id, probability in struct.iter_unpack("<if", data[position:position + 8 * entries]):
                yield words[source_id - 1], words[target_id - 1], probability
            position += 8 * entries
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise RuntimeError(f"{path}: not a systran-align probabilities file (format version {version}): {e}") from e


@contextlib.contextmanager
def _single_openmp_thread() -> Iterator[None]:
    """fast_align's EM sums in OpenMP threads, and with several the alignments differ from run to run.
    systran-align loads the same OpenMP runtime as torch (libgomp-a34b3233), so torch's thread setting is
    its setting too (OMP_NUM_THREADS would be read too early: torch starts that runtime on import)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def find_binary(explicit: Optional[str], env_var: str, name: str, beside: Optional[str] = None) -> str:
    """The binary given by flag, else by environment variable, else next to ``beside``, else on PATH."""
    for candidate, origin in ((explicit, f"--{name.replace('_', '-')}"), (os.environ.get(env_var), f"${env_var}")):
        if candidate:
            if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
                raise InputError(f"{origin}={candidate}: not an executable file")
            return candidate
    if beside:
        sibling = os.path.join(os.path.dirname(beside), name)
        if os.path.isfile(sibling) and os.access(sibling, os.X_OK):
            return sibling
    found = shutil.which(name)
    if not found:
        raise InputError(f"{name}: not found (give --{name.replace('_', '-')} PATH, set ${env_var}, or put it on "
                         "PATH; build it from https://github.com/clab/fast_align), or use --backend systran")
    return found


def _align_fast_align(corpus: str, pairs: int, scratch: str, fast_align: Optional[str], atools: Optional[str],
                      lexical_table: Optional[str], iterations: int, bar) -> List[Alignment]:
    binary = find_binary(fast_align, "FAST_ALIGN", "fast_align")
    atools_binary = find_binary(atools, "ATOOLS", "atools", beside=binary)
    forward, reverse = os.path.join(scratch, "forward.align"), os.path.join(scratch, "reverse.align")
    common = [binary, "-i", corpus, "-d", "-o", "-v", "-I", str(iterations)]
    table = os.path.join(scratch, "forward.table")
    with _step(bar, f"forward model, {iterations} iterations"):
        _run_tool(common + ["-p", table], forward)
    with _step(bar, f"reverse model, {iterations} iterations"):
        _run_tool(common + ["-r"], reverse)
    symmetrised = os.path.join(scratch, "symmetrised.align")
    with _step(bar, "symmetrising"):
        _run_tool([atools_binary, "-i", forward, "-j", reverse, "-c", "grow-diag-final-and"], symmetrised)
    if lexical_table:
        with open(table, encoding="utf-8") as f, atomic_output(lexical_table) as out:
            shutil.copyfileobj(f, out)
    alignments = read_pharaoh(symmetrised)
    if len(alignments) != pairs:
        raise RuntimeError(f"atools wrote {len(alignments)} alignment lines for {pairs} sentence pairs")
    return alignments


def _run_tool(command: List[str], stdout_path: str) -> None:
    """Run an aligner tool single-threaded (reproducible), stdout to a file; stderr only when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(stdout_path, "w", encoding="utf-8") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.PIPE, env=env, text=True)
    # fast_align reports its progress and perplexities on stderr: keep it out of the log unless it failed.
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-10:])
        raise RuntimeError(f"{' '.join(command)} exited with status {result.returncode}:\n{tail}")


def parse_pharaoh_line(line: str, where: str) -> Alignment:
    links = []
    for link in line.split():
        i, sep, j = link.partition("-")
        if not sep or not i.isdigit() or not j.isdigit():
            raise InputError(f"{where}: '{link}' is not a Pharaoh link i-j")
        links.append((int(i), int(j)))
    return links


def read_pharaoh(path: str) -> List[Alignment]:
    """Alignments, one (possibly empty) line per sentence pair."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        return [parse_pharaoh_line(line, f"{path}:{number}") for number, line in enumerate(f, start=1)]


def write_pharaoh(path: str, alignments: Sequence[Alignment]) -> None:
    with atomic_output(path) as f:
        for links in alignments:
            f.write(" ".join(f"{i}-{j}" for i, j in links) + "\n")


@contextlib.contextmanager
def _scratch_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="fairseq-plugins-align.")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
