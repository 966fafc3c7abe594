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
