"""`make install`'s own steps, without installing anything: the platform check (scripts/check_platform.py) with
explicit platform facts, and the commands `make -n install` would run (make -n only prints them)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(REPO, "scripts", "check_platform.py")
LINUX = ["--system", "Linux", "--machine", "x86_64", "--implementation", "CPython", "--glibc", "2.36"]


def check(*args, path=None):
    """Run the platform check with these facts; PATH (where it looks for python3.11/3.12) as given."""
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, CHECK, "--python-name", "python3", *args], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("version", ["3.11.7", "3.12.1"])
def test_supported_platform_passes(version):
    result = check(*LINUX, "--python-version", version)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"platform: Linux x86_64, CPython {version}, glibc 2.36: supported"
    assert result.stderr == ""
    # Python 3.12 installs without systran-align (no wheel): the note says what align needs instead.
    assert ("--backend fast_align" in result.stdout) == version.startswith("3.12")


def test_this_machine_is_supported():
    """The real facts, detected: wherever the suite runs, make install has just passed this check."""
    result = check()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("platform: Linux x86_64, CPython 3.1")


def test_unsupported_python_names_it_and_what_to_do(tmp_path):
    result = check(*LINUX, "--python-version", "3.10.12", path=str(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == ("make install: unsupported: CPython 3.10.12 (python3) - fairseq 0.12.3 (the ve-fairseq wheels "
                        "and fairseq-fixed's source) supports CPython 3.11 and 3.12 only (setup.py: python_requires "
                        ">=3.11,<3.13); install one (your distribution's python3.11 or python3.12 with its venv "
                        "module, pyenv or uv), then make install PYTHON=python3.11")
    assert lines[1].startswith("make install: stopped here, before creating or installing anything")
    assert "make install ALLOW_UNSUPPORTED=1" in lines[1]
    assert len(lines) == 2 and result.stdout == ""


def test_unsupported_python_suggests_one_on_path(tmp_path):
    fake = tmp_path / "python3.12"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    result = check(*LINUX, "--python-version", "3.13.0", path=str(tmp_path))
    assert result.returncode == 1
    assert "CPython 3.13.0 (python3)" in result.stderr
    assert "make install PYTHON=python3.12 (python3.12 is on PATH)" in result.stderr


def test_existing_venv_with_another_python_says_make_clean(tmp_path):
    result = check(*LINUX, "--python-version", "3.13.0", "--venv", ".venv", path=str(tmp_path))
    assert result.returncode == 1
    assert ".venv was made with it: make clean, then install one" in result.stderr


@pytest.mark.parametrize("facts, expected", [
    (["--system", "Darwin", "--machine", "arm64", "--glibc", ""],
     "make install: unsupported: macOS arm64 - ve-fairseq 0.12.3 (the fairseq this needs) has Linux x86_64 wheels "
     "only; make install FAIRSEQ_FROM_SOURCE=1 compiles fairseq from its source distribution here (a C++ compiler, "
     "about 2 minutes), or use a Linux x86_64 machine, VM or container"),
    (["--system", "Windows", "--machine", "AMD64", "--glibc", ""],
     "make install: unsupported: Windows AMD64 - fairseq is neither built nor tested on Windows; use WSL2"),
    (["--system", "Linux", "--machine", "aarch64", "--glibc", "2.36"],
     "make install: unsupported: Linux aarch64 - ve-fairseq 0.12.3 (the fairseq this needs) has x86_64 wheels only; "
     "make install FAIRSEQ_FROM_SOURCE=1 compiles fairseq"),
    (["--system", "Linux", "--machine", "x86_64", "--glibc", "2.17"],
     "make install: unsupported: glibc 2.17 - the manylinux_2_28 wheels of torch (and ve-fairseq) need glibc 2.28 "
     "or later; use a newer distribution"),
    (["--system", "Linux", "--machine", "x86_64", "--glibc", ""],
     "make install: unsupported: Linux with a C library other than glibc (musl, e.g. Alpine)"),
])
def test_unsupported_platforms_name_it_in_one_line(facts, expected):
    result = check(*facts, "--implementation", "CPython", "--python-version", "3.11.7")
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr  # the one problem (the Python is fine), then how to go on anyway
    assert lines[0].startswith(expected), lines[0]


@pytest.mark.parametrize("facts, supported", [
    (["--system", "Darwin", "--machine", "arm64", "--glibc", ""], True),
    (["--system", "Darwin", "--machine", "x86_64", "--glibc", ""], False),  # no torch wheel for Intel macs
    (["--system", "Linux", "--machine", "aarch64", "--glibc", "2.36"], True),
    (["--system", "Linux", "--machine", "aarch64", "--glibc", "2.17"], False),  # torch's wheels need 2.28
    (["--system", "Linux", "--machine", "x86_64", "--glibc", ""], False),  # musl: no torch wheel
    (["--system", "Windows", "--machine", "AMD64", "--glibc", ""], False),
])
def test_fairseq_from_source_leaves_only_torch_and_python_as_conditions(facts, supported):
    result = check(*facts, "--implementation", "CPython", "--python-version", "3.11.7", "--fairseq-from-source")
    assert (result.returncode == 0) == supported, result.stderr
    if supported:
        assert result.stdout.splitlines()[0].endswith(": supported, fairseq from source") and result.stderr == ""
    else:
        assert "FAIRSEQ_FROM_SOURCE" not in result.stderr  # not offered where it would not help
    python = check(*facts, "--implementation", "CPython", "--python-version", "3.13.0", "--fairseq-from-source")
    assert python.returncode == 1 and "unsupported: CPython 3.13.0" in python.stderr


def test_every_problem_is_named():
    result = check("--system", "Darwin", "--machine", "arm64", "--glibc", "", "--implementation", "PyPy",
                   "--python-version", "3.10.14")
    assert result.returncode == 1
    assert "unsupported: macOS arm64" in result.stderr and "unsupported: PyPy 3.10.14" in result.stderr


def test_allow_unsupported_reports_and_goes_on():
    result = check("--system", "Darwin", "--machine", "arm64", "--glibc", "", "--implementation", "CPython",
                   "--python-version", "3.12.1", "--allow-unsupported")
    assert result.returncode == 0
    assert "unsupported: macOS arm64" in result.stderr
    assert "going on anyway (ALLOW_UNSUPPORTED=1)" in result.stderr


def test_supported_pythons_match_setup_py():
    from packaging.specifiers import SpecifierSet

    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
        requires = SpecifierSet(re.search(r'python_requires="([^"]+)"', f.read()).group(1))
    with open(CHECK, encoding="utf-8") as f:
        supported = re.search(r'SUPPORTED_PYTHONS = \(([^)]*)\)', f.read()).group(1)
    supported = [v.strip().strip('"') for v in supported.split(",") if v.strip()]
    for minor in range(6, 16):
        version = f"3.{minor}.0"
        assert (version in requires) == (f"3.{minor}" in supported), version


def make_n_install(tmp_path, *variables):
    """The commands of `make install` into a venv that does not exist, printed, not run."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH", "TORCH_INDEX", "ALLOW_UNSUPPORTED", "PYTHON")}
    result = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}", *variables], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def torch_install_line(commands):
    [line] = [line for line in commands.splitlines() if "pip install" in line and '"torch==' in line]
    return line


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


@needs_make
def test_make_install_passes_torch_index_to_the_torch_install(tmp_path):
    url = "https://download.pytorch.org/whl/cpu"
    line = torch_install_line(make_n_install(tmp_path, f"TORCH_INDEX={url}"))
    assert f'--index-url "{url}" "torch==2.13.0"' in line
    # only there: fairseq and this package still come from the default index
    assert make_n_install(tmp_path, f"TORCH_INDEX={url}").count("--index-url") == 1


@needs_make
def test_make_install_uses_default_index_without_torch_index(tmp_path):
    commands = make_n_install(tmp_path)
    assert "--index-url" not in commands
    assert re.search(r'pip install -q +"torch==2\.13\.0"$', torch_install_line(commands))


@needs_make
def test_make_install_checks_the_platform_before_creating_the_venv(tmp_path):
    commands = make_n_install(tmp_path)
    assert 0 <= commands.index("scripts/check_platform.py") < commands.index("-m venv")
    assert "--allow-unsupported" not in commands
    assert "--allow-unsupported" not in make_n_install(tmp_path, "ALLOW_UNSUPPORTED=0")
    assert "scripts/check_platform.py --allow-unsupported" in make_n_install(tmp_path, "ALLOW_UNSUPPORTED=1")


def fairseq_install_line(commands):
    [line] = [line for line in commands.splitlines() if '-c "import fairseq"' in line]
    return line


@needs_make
def test_make_install_takes_the_fairseq_wheel_unless_asked_to_build_it(tmp_path):
    wheel = fairseq_install_line(make_n_install(tmp_path))
    assert re.search(r'pip install -q --no-deps "ve-fairseq==0\.12\.3"; }$', wheel)
    assert "--fairseq-from-source" not in make_n_install(tmp_path, "FAIRSEQ_FROM_SOURCE=0")
    commands = make_n_install(tmp_path, "FAIRSEQ_FROM_SOURCE=1")
    assert "scripts/check_platform.py  --fairseq-from-source" in commands
    built = fairseq_install_line(commands)
    assert "ve-fairseq" not in built
    # build requirements first, then the sdist compiled against the venv's torch (an isolated build fetches another),
    # without debug information (FAIRSEQ_SOURCE_CFLAGS added to the user's CFLAGS)
    assert re.search(r'pip install -q cython numpy setuptools wheel && CFLAGS="\$CFLAGS -g0" \S+ -m pip install -q '
                     r'--no-deps --no-build-isolation --no-binary :all: "fairseq-fixed==0\.12\.3\.1"; }$', built)
