"""`make install`'s first step: is this platform one that the pinned wheels install on?

Run by the Makefile with $(PYTHON) (or with the existing venv's python) before anything is created, so that
an unsupported platform is named in one line, with what to do, instead of failing deep inside pip.
Supported: Linux x86_64 with glibc 2.28 or later (manylinux_2_28) and CPython 3.11 or 3.12, the platforms of
the ve-fairseq 0.12.3 wheels (setup.py's python_requires says the same). With --fairseq-from-source (make install
FAIRSEQ_FROM_SOURCE=1: fairseq-fixed 0.12.3.1's source distribution compiled here) also macOS on arm64 and Linux on
other machines: only torch's wheels (macOS arm64; glibc 2.28 or later on Linux) and the Python version remain
conditions.

Every fact can be given explicitly (--system, --machine, --implementation, --python-version, --glibc), which
is how tests/test_install.py checks the messages. Exit status: 0 supported (or --allow-unsupported), 1 not.
Written for any Python that may be $(PYTHON), old ones included: no f-strings, nothing outside the stdlib.
"""

import argparse
import os
import platform
import sys

SUPPORTED_SYSTEM = "Linux"
SUPPORTED_MACHINES = ("x86_64", "amd64")
SUPPORTED_PYTHONS = ("3.11", "3.12")  # setup.py: python_requires=">=3.11,<3.13"
MIN_GLIBC = (2, 28)  # manylinux_2_28
SYSTEM_NAMES = {"Darwin": "macOS", "Windows": "Windows"}
README = "README.md, section 'Installing'"


def detect_glibc():
    """'2.36' for glibc 2.36; '' where the C library is not glibc (musl) or cannot be told."""
    try:
        name_version = os.confstr("CS_GNU_LIBC_VERSION")  # 'glibc 2.36'
        if name_version and name_version.split()[0] == "glibc":
            return name_version.split()[1]
    except (AttributeError, ValueError, OSError, IndexError):
        pass
    try:
        lib, version = platform.libc_ver()
        return version if lib == "glibc" else ""
    except Exception:  # noqa: BLE001 - old or odd platforms: treat as unknown
        return ""


def version_tuple(text):
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def on_path(name):
    """shutil.which, which Python 2 lacks."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder, name)
        if folder and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def pythons_on_path():
    return [name for name in ("python3.11", "python3.12") if on_path(name)]


def problems(system, machine, implementation, python_version, glibc, python_name, venv, from_source=False):
    """One line for each reason this platform is unsupported, each saying what to do. ``from_source``
    (make install FAIRSEQ_FROM_SOURCE=1): fairseq is compiled here, so only torch's platforms and the Python
    version remain conditions."""
    found = []
    where = "%s %s" % (SYSTEM_NAMES.get(system, system), machine)
    build_hint = ("make install FAIRSEQ_FROM_SOURCE=1 compiles fairseq from its source distribution here (a C++ "
                  "compiler, about 2 minutes)")
    if system == "Windows":
        found.append("unsupported: %s - fairseq is neither built nor tested on Windows; use WSL2 (its Ubuntu is "
                     "Linux x86_64), then make install" % where)
    elif system == "Darwin" and from_source and machine.lower() not in ("arm64", "aarch64"):
        found.append("unsupported: %s - torch 2.13 has no wheel for Intel macs (macOS arm64 only); use a Linux "
                     "x86_64 machine, VM or container (e.g. docker run --platform linux/amd64 -it python:3.11)"
                     % where)
    elif system != SUPPORTED_SYSTEM:
        if not from_source:
            found.append("unsupported: %s - ve-fairseq 0.12.3 (the fairseq this needs) has Linux x86_64 wheels only; "
                         "%s, or use a Linux x86_64 machine, VM or container (e.g. docker run --platform linux/amd64 "
                         "-it python:3.11); see %s" % (where, build_hint, README))
    else:
        if machine.lower() not in SUPPORTED_MACHINES and not from_source:
            found.append("unsupported: %s - ve-fairseq 0.12.3 (the fairseq this needs) has x86_64 wheels only; %s, "
                         "or use an x86_64 machine or container; see %s" % (where, build_hint, README))
        elif not glibc:
            found.append("unsupported: Linux with a C library other than glibc (musl, e.g. Alpine) - the "
                         "manylinux_2_28 wheels of torch (and ve-fairseq) need glibc 2.28 or later; use a glibc "
                         "distribution or container (e.g. python:3.11-slim)")
        elif version_tuple(glibc)[:2] < MIN_GLIBC:
            found.append("unsupported: glibc %s - the manylinux_2_28 wheels of torch (and ve-fairseq) need glibc 2.28 "
                         "or later; use a newer distribution (Debian 10, Ubuntu 20.04, RHEL 8 or later) or a "
                         "container (e.g. python:3.11-slim)" % glibc)
    short = ".".join(python_version.split(".")[:2])
    if implementation != "CPython" or short not in SUPPORTED_PYTHONS:
        others = [name for name in pythons_on_path() if name != python_name]
        if others:
            hint = "make install PYTHON=%s (%s is on PATH)" % (others[0], others[0])
        else:
            hint = ("install one (your distribution's python3.11 or python3.12 with its venv module, pyenv or uv), "
                    "then make install PYTHON=python3.11")
        if venv:
            hint = "%s was made with it: make clean, then %s" % (venv, hint)
        found.append("unsupported: %s %s (%s) - fairseq 0.12.3 (the ve-fairseq wheels and fairseq-fixed's source) "
                     "supports CPython %s only (setup.py: python_requires >=3.11,<3.13); %s"
                     % (implementation, python_version, python_name, " and ".join(SUPPORTED_PYTHONS), hint))
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", default=platform.system(), help="platform.system(): Linux, Darwin, Windows")
    parser.add_argument("--machine", default=platform.machine(), help="platform.machine(): x86_64, aarch64, arm64")
    parser.add_argument("--implementation", default=platform.python_implementation(), help="CPython, PyPy")
    parser.add_argument("--python-version", default=platform.python_version(), help="e.g. 3.11.7")
    parser.add_argument("--glibc", default=None, help="glibc version, e.g. 2.36; '' for another C library")
    parser.add_argument("--python-name", default=os.path.basename(sys.executable),
                        help="how the checked interpreter is named in messages ($(PYTHON))")
    parser.add_argument("--venv", default=None, help="the existing venv this interpreter belongs to, if any")
    parser.add_argument("--allow-unsupported", action="store_true",
                        help="report, but go on (make install ALLOW_UNSUPPORTED=1)")
    parser.add_argument("--fairseq-from-source", action="store_true",
                        help="fairseq is compiled here, not installed as a wheel (make install FAIRSEQ_FROM_SOURCE=1)")
    args = parser.parse_args(argv)
    glibc = detect_glibc() if args.glibc is None else args.glibc
    found = problems(args.system, args.machine, args.implementation, args.python_version, glibc,
                     args.python_name, args.venv, from_source=args.fairseq_from_source)
    described = "%s %s, %s %s%s" % (args.system, args.machine, args.implementation, args.python_version,
                                    ", glibc " + glibc if glibc else "")
    if not found:
        print("platform: %s: supported%s" % (described, ", fairseq from source" if args.fairseq_from_source else ""))
        if ".".join(args.python_version.split(".")[:2]) == "3.12":
            print("note: systran-align (the default aligner) has no Python 3.12 wheel and is left out: "
                  "fairseq-plugins align needs --backend fast_align, a fast_align you build (%s)" % README)
        return 0
    for line in found:
        sys.stderr.write("make install: %s\n" % line)
    if args.allow_unsupported:
        sys.stderr.write("make install: going on anyway (ALLOW_UNSUPPORTED=1): expect pip to fail on the pinned "
                         "wheels unless you install them some other way\n")
        return 0
    sys.stderr.write("make install: stopped here, before creating or installing anything; "
                     "make install ALLOW_UNSUPPORTED=1 goes on anyway\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
