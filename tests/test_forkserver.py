"""tests/forkserver.py: a command forked from the server sees what `python -m MODULE` in a new process sees."""

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import FORK_SERVER, run

PROBE = textwrap.dedent("""
    import atexit, logging, os, sys
    fresh_logging = (logging.root.handlers, logging.root.level)  # what a command that configures logging finds
    import torch
    atexit.register(print, "at exit", file=sys.stderr)
    print(os.getcwd(), os.environ.get("PROBE_VALUE"), torch.get_num_threads(), sys.argv[1:], __name__)
    print(sys.path[0] == os.getcwd(), [m for m in ("fairseq", "fairseq_cli", "fairseq_plugins") if m in sys.modules],
          fresh_logging)
    print(sys.stdin.read().upper(), end="")
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""")


def test_a_forked_command_gets_its_directory_environment_threads_arguments_and_streams(tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    env = {"PROBE_VALUE": "forty two", "OMP_NUM_THREADS": "2"}
    assert FORK_SERVER.usable({**os.environ, **env})
    forked = run("probe_module", 3, "two words", env=env, cwd=tmp_path, stdin="some input\n", check=False)
    fresh = subprocess.run([sys.executable, "-m", "probe_module", "3", "two words"], capture_output=True, text=True,
                           cwd=tmp_path, input="some input\n", env={**os.environ, **env})
    assert forked.returncode == fresh.returncode == 3
    assert forked.stdout == fresh.stdout == (f"{tmp_path} forty two 2 ['3', 'two words'] __main__\n"
                                             "True [] ([], 30)\nSOME INPUT\n")
    assert forked.stderr == fresh.stderr == "to stderr\nat exit\n"
    assert run("probe_module", 0, cwd=tmp_path).returncode == 0  # and the next command too


def test_an_uncaught_exception_and_a_message_exit_are_status_1_with_their_text(tmp_path):
    (tmp_path / "raises.py").write_text("raise ValueError('went wrong')\n")
    (tmp_path / "says.py").write_text("import sys\nsys.exit('a message')\n")
    raised = run("raises", cwd=tmp_path, check=False)
    assert raised.returncode == 1 and "ValueError: went wrong" in raised.stderr and "Traceback" in raised.stderr
    said = run("says", cwd=tmp_path, check=False)
    assert said.returncode == 1 and said.stderr == "a message\n"


def test_an_overrunning_command_is_stopped_and_the_server_goes_on(tmp_path):
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run("sleeps", cwd=tmp_path, timeout=2)
    (tmp_path / "quick.py").write_text("print('done')\n")
    assert run("quick", cwd=tmp_path).stdout == "done\n"


def test_another_interpreter_setting_runs_a_fresh_process(tmp_path):
    (tmp_path / "lib").mkdir()
    assert not FORK_SERVER.usable({**os.environ, "PYTHONPATH": str(tmp_path / "lib")})
    (tmp_path / "lib" / "only_on_that_path.py").write_text("print('found')\n")
    assert run("only_on_that_path", env={"PYTHONPATH": str(tmp_path / "lib")}).stdout == "found\n"
