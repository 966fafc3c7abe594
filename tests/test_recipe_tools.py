"""examples/tools.sh: a recipe run by hand after `make install`, without activating .venv, finds the venv's
commands (a new user's first try), and without a venv says what to do."""

import glob
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO

BARE_PATH = "/usr/bin:/bin"  # no venv on it, as in a new user's shell after make install


def bash(script, cwd, path=BARE_PATH):
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd, timeout=60,
                          env={"PATH": path, "HOME": os.environ.get("HOME", "/tmp")})


@pytest.mark.skipif(not os.path.isfile(os.path.join(REPO, ".venv", "bin", "fairseq-plugins")),
                    reason="this checkout's venv is not .venv (make install VENV=...)")
def test_a_recipe_finds_the_repositorys_venv_when_it_is_not_active():
    found = bash("source examples/tools.sh && command -v fairseq-plugins && command -v fairseq-train", cwd=REPO)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [os.path.join(REPO, ".venv", "bin", name)
                                    for name in ("fairseq-plugins", "fairseq-train")]


def test_without_a_venv_a_recipe_stops_saying_to_run_make_install(tmp_path):
    os.makedirs(tmp_path / "examples")
    shutil.copy(os.path.join(REPO, "examples", "tools.sh"), tmp_path / "examples" / "tools.sh")
    stopped = bash("source examples/tools.sh; echo went on", cwd=tmp_path)
    assert stopped.returncode == 2 and "went on" not in stopped.stdout
    assert "fairseq-plugins is neither on PATH nor in this repository's .venv: run make install first" in stopped.stderr


def test_an_active_venv_comes_first(tmp_path):
    """Whatever fairseq-plugins is on PATH (another venv, a conda env) is the one used: tools.sh adds nothing."""
    own = tmp_path / "bin"
    own.mkdir()
    (own / "fairseq-plugins").write_text("#!/bin/sh\n")
    (own / "fairseq-plugins").chmod(0o755)
    found = bash("source examples/tools.sh && command -v fairseq-plugins && echo $PATH", cwd=REPO,
                 path=f"{own}:{BARE_PATH}")
    assert found.stdout.split() == [str(own / "fairseq-plugins"), f"{own}:{BARE_PATH}"]


def scripts():
    """Every script a user may run: the executable .sh files under examples/ (not the sourced helpers), but the
    GPU kit's, which installs its own wheels on the device first."""
    for path in sorted(glob.glob(os.path.join(REPO, "examples", "*", "*.sh"))):
        with open(path, encoding="utf-8") as f:
            if f.readline().startswith("#!") and "/gpu/" not in path:
                yield path


@pytest.mark.parametrize("recipe", list(scripts()))
def test_every_script_sources_it_before_its_first_command(recipe):
    """Only its shell options (and a change of directory) come before it."""
    with open(recipe, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    sourced = next(i for i, line in enumerate(lines) if re.match(r'source "?(\$\(dirname "\$0"\)/\.\./|examples/)'
                                                                 r'tools\.sh', line))
    assert all(re.match(r"(set|cd) ", line) for line in lines[:sourced]), lines[:sourced]


def test_two_recipes_needing_one_distilled_set_at_once_build_it_once(tmp_path):
    """examples/common.sh's distill_training_set under two recipes started side by side (make retrain): the second
    waits for the first and finds the set made, instead of both translating the training set into the same files."""
    if not shutil.which("flock"):
        pytest.skip("flock (util-linux) is not on this machine: the recipes then take no lock")
    stubs, base = tmp_path / "bin", tmp_path / "base"
    stubs.mkdir()
    (base / "data" / "bin").mkdir(parents=True)
    (base / "data" / "tok").mkdir()
    (base / "data" / "tok" / "train.en").write_text("a b\nc d\n")
    for split in ("valid", "test"):
        (base / "data" / "bin" / f"{split}.en-de.en.bin").write_text("")
    calls = tmp_path / "calls"
    for name, body in {
        "fairseq-generate": f'echo generate >> "{calls}"; sleep 1',
        "fairseq-plugins": f'cat "{base}/data/tok/train.en"',  # detok: one line per training sentence
        "fairseq-preprocess": 'while (( $# )); do [[ $1 == --destdir ]] && dest=$2; shift; done\n'
                              'mkdir -p "$dest" && touch "$dest/train.en-de.de.bin"',
    }.items():
        (stubs / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (stubs / name).chmod(0o755)
    script = (f"set -euo pipefail; source {REPO}/examples/common.sh; COMMANDS={tmp_path}/commands.txt; "
              f"USER_DIR=x; distill_training_set {base} {tmp_path}/distill --beam 5")
    env = {"PATH": f"{stubs}:{BARE_PATH}", "HOME": os.environ.get("HOME", "/tmp")}
    both = [subprocess.Popen(["bash", "-c", script], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in both:
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert calls.read_text() == "generate\n"
    assert (tmp_path / "distill" / "bin" / "train.en-de.de.bin").is_file()
    assert (tmp_path / "distill" / "bin" / "test.en-de.en.bin").is_file()
