"""`fairseq-plugins align --backend fast_align` against a real fast_align, built from source.

`make test` builds fast_align out of tree from ../shared/third_party/fast_align where that folder exists (CI and
the project's machines) and passes the binaries as FAST_ALIGN and ATOOLS; elsewhere these tests run with a
fast_align that FAST_ALIGN names or PATH holds, and skip, saying how to build one, without it. The agreement test
also needs real parallel text, ../shared/data/europarl_sample, and the systran-align wheel.
"""

import importlib.util
import math
import os
import random
import shutil

import pytest

from conftest import REPO, plugins_cli

SHARED = os.path.normpath(os.path.join(REPO, "..", "shared"))
FAST_ALIGN_SOURCE = os.path.join(SHARED, "third_party", "fast_align")
EUROPARL = os.path.join(SHARED, "data", "europarl_sample")


def how_to_build() -> str:
    if os.path.isfile(os.path.join(FAST_ALIGN_SOURCE, "CMakeLists.txt")):
        return ("`make test` builds it from ../shared/third_party/fast_align (needs cmake and a C++ compiler); by "
                "hand: cmake -S ../shared/third_party/fast_align -B build/fast_align -DCMAKE_BUILD_TYPE=Release "
                "&& cmake --build build/fast_align, then FAST_ALIGN=build/fast_align/fast_align")
    return ("build it from https://github.com/clab/fast_align (git clone it, then cmake -S fast_align -B "
            "fast_align/build && cmake --build fast_align/build) and set FAST_ALIGN=fast_align/build/fast_align "
            "(README, Installing: fast_align instead of systran-align)")


def fast_align_binary():
    """FAST_ALIGN (what `make test` sets), else fast_align on PATH, else None."""
    return os.environ.get("FAST_ALIGN") or shutil.which("fast_align")


needs_fast_align = pytest.mark.skipif(fast_align_binary() is None,
                                      reason=f"no fast_align (FAST_ALIGN unset, none on PATH): {how_to_build()}")


def align(backend, source, target, out_dir, lexical_table=False):
    """The CLI's alignments (a set of (i, j) links a sentence pair) and, if asked, its lexical table."""
    out_dir.mkdir(exist_ok=True)
    output, table = out_dir / f"{backend}.align", out_dir / f"{backend}.lex"
    flags = ["--lexical-table", table] if lexical_table else []
    plugins_cli("align", "--backend", backend, "--source", source, "--target", target, "--output", output, *flags)
    links = [{tuple(map(int, link.split("-"))) for link in line.split()}
             for line in output.read_text(encoding="utf-8").splitlines()]
    return links, (table if lexical_table else None)


def lexical_probabilities(path):
    """(source, target) -> p(target | source) of a lexical table in fast_align's -p format."""
    table = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        source, target, log_p = line.split("\t") if "\t" in line else line.split()
        table[source, target] = math.exp(float(log_p))
    return table


def word_corpus(directory, pairs=400, seed=7):
    """Sentences of 4-8 words from 40, each translated word for word (w7 -> W7) in reversed order, so the true
    alignment of every pair is known."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(40)]
    sources = [rng.sample(words, rng.randint(4, 8)) for _ in range(pairs)]
    source, target = directory / "words.src", directory / "words.tgt"
    source.write_text("".join(" ".join(s) + "\n" for s in sources))
    target.write_text("".join(" ".join(w.upper() for w in reversed(s)) + "\n" for s in sources))
    return source, target, sources


@needs_fast_align
def test_subprocess_backend_with_a_real_fast_align(tmp_path):
    source, target, sentences = word_corpus(tmp_path)
    first, _ = align("fast_align", source, target, tmp_path / "first")
    second, _ = align("fast_align", source, target, tmp_path / "second")
    assert first == second and len(first) == len(sentences)  # OMP_NUM_THREADS=1: reproducible
    true = sum(len(s) for s in sentences)
    found = sum((i, len(s) - 1 - i) in links for s, links in zip(sentences, first) for i in range(len(s)))
    assert found / true > 0.95  # word for word, reversed: fast_align finds nearly every true link


@needs_fast_align
@pytest.mark.skipif(importlib.util.find_spec("systran_align") is None,
                    reason="the systran-align wheel is not installed (Linux x86_64, Python < 3.12 only)")
@pytest.mark.skipif(not os.path.isfile(os.path.join(EUROPARL, "de-en.de")),
                    reason="no ../shared/data/europarl_sample (real parallel text: CI and the project's machines)")
def test_fast_align_agrees_with_systran_align_on_europarl(tmp_path):
    """The two backends on 1,000 Europarl sentence pairs (de -> en), the same recipe (-d -o -v, 5 iterations,
    grow-diag-final-and). They train the same model: the lexical tables hold the same entries with the same
    probabilities. The links are not all the same: systran-align's Aligner aligns from a probabilities file that
    holds the lexical table alone, not the diagonal tension that fast_align's -o optimised, and symmetrises in its
    own code where the command line runs atools. Measured: 73.6% of the links agree (shared / either's),
    89% of systran-align's are also fast_align's; 8% of the sentences get identical links."""
    source, target = os.path.join(EUROPARL, "de-en.de"), os.path.join(EUROPARL, "de-en.en")
    ours, our_table = align("fast_align", source, target, tmp_path, lexical_table=True)
    theirs, their_table = align("systran", source, target, tmp_path, lexical_table=True)
    assert len(ours) == len(theirs) == 1000

    ours_p, theirs_p = lexical_probabilities(our_table), lexical_probabilities(their_table)
    assert ours_p.keys() == theirs_p.keys()
    assert max(abs(ours_p[key] - theirs_p[key]) for key in ours_p) < 1e-4

    shared = sum(len(a & b) for a, b in zip(ours, theirs))
    either = sum(len(a | b) for a, b in zip(ours, theirs))
    assert shared / either > 0.70
    assert shared / sum(map(len, theirs)) > 0.85
