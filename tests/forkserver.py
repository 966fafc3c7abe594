"""The tests' ``python -m MODULE ARGS`` without paying for torch's import each time: a fork server.

Most of the suite's commands (``fairseq-train``, ``fairseq-generate``, ``fairseq-plugins``) are short, and each
new Python process spent about 4 of its seconds importing torch and fairseq before doing anything (on this
project's 2-core machine, idle). The server (one per test worker) imports torch and the libraries fairseq
imports (not fairseq itself: see _serve) once, then forks a child per command. The child becomes what ``python -m MODULE`` would be: the command's environment, directory, argv,
standard streams (files the client reads) and torch thread count, the module run as ``__main__`` by runpy, its
atexit handlers run at its end, its exit status the process's. Nothing the command reads at its own import time is imported before the fork: only
torch and third-party libraries below fairseq, none of which reads a variable the tests set or configures
logging; fairseq, the plugins, fairseq_cli and the command's module are imported in the child, under its
environment.

Commands whose interpreter must differ (a PYTHON* variable other than the server's, e.g. PYTHONPATH naming
another fairseq) run as ordinary subprocesses; so does everything with FAIRSEQ_PLUGINS_TEST_FORK=0.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

# Variables read only when an interpreter starts: a command that sets them differently needs a fresh one.
INTERPRETER_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUSERBASE",
                         "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONMALLOC", "LD_PRELOAD", "LD_LIBRARY_PATH",
                         "OPENBLAS_NUM_THREADS")


def _serve():  # the server: python forkserver.py, requests on stdin, answers on stdout (a JSON line each)
    import runpy
    import traceback

    # The point: the heavy libraries imported once, before any fork. Not fairseq itself: importing it configures
    # the root logger (fairseq.models.wav2vec calls logging.basicConfig), and fairseq's commands configure it
    # first, before they import fairseq; each child imports fairseq (about a fifth of the time) in its own order.
    import hydra  # noqa: F401
    import numpy  # noqa: F401
    import omegaconf  # noqa: F401
    import sacrebleu  # noqa: F401
    import sentencepiece  # noqa: F401
    import sklearn.metrics  # noqa: F401  (fairseq.tasks.audio_classification's, with scipy: a third of the time)
    import torch

    requests, answers = sys.stdin.buffer, sys.stdout
    while True:
        line = requests.readline()
        if not line:
            return
        request = json.loads(line)
        answers.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, 0)  # the client stops a command that overruns with its whole process group
                for fd, path, flags in ((0, request["stdin"], os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                                        (2, request["stderr"], os.O_WRONLY)):
                    opened = os.open(path, flags)
                    os.dup2(opened, fd)
                    os.close(opened)
                sys.stdin = open(0, encoding="utf-8", closefd=False)  # not the server's, which read requests
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                if request["env"].get("OMP_NUM_THREADS", "").isdigit():
                    torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
                sys.path[0] = os.getcwd()  # as `python -m` puts it
                sys.argv = [request["module"], *request["args"]]
                runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as stop:
                if stop.code is None or isinstance(stop.code, int):
                    code = stop.code or 0
                else:  # sys.exit("message"): printed, status 1, as the interpreter does
                    print(stop.code, file=sys.stderr)
            except BaseException:  # noqa: B902  (what an uncaught exception does to `python -m`)
                traceback.print_exc()
            finally:
                try:  # what the interpreter does at exit: the command's atexit handlers (summary lines) first
                    atexit._run_exitfuncs()
                except BaseException:  # noqa: B902
                    traceback.print_exc()
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:  # noqa: B902
                        pass
                os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


class ForkServer:
    """The client: one server process, started on first use, one command at a time."""

    def __init__(self):
        self.process = None

    def usable(self, env):
        if os.environ.get("FAIRSEQ_PLUGINS_TEST_FORK", "1") == "0" or not hasattr(os, "fork"):
            return False
        return all(env.get(name) == os.environ.get(name) for name in INTERPRETER_VARIABLES)

    def _start(self):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
        env.pop("PYTHONUNBUFFERED", None)  # the answers are flushed; children set their own
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                        cwd=os.path.dirname(os.path.abspath(__file__)))
        atexit.register(self.close)

    def close(self):
        if self.process and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        self.process = None

    def _answer(self, timeout=None):
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the tests' fork server exited")
        return json.loads(line)

    def run(self, command, env, cwd=None, stdin=None, timeout=None) -> subprocess.CompletedProcess:
        """``subprocess.run(command, capture_output=True, text=True, ...)`` for ``command`` = [python, -m, MODULE,
        ARGS...], forked from the server."""
        if self.process is None or self.process.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="forked-") as directory:
            paths = {name: os.path.join(directory, name) for name in ("stdin", "stdout", "stderr")}
            with open(paths["stdin"], "w", encoding="utf-8") as f:
                f.write(stdin or "")
            for name in ("stdout", "stderr"):
                open(paths[name], "w").close()
            request = {"module": command[2], "args": command[3:], "env": env, "cwd": os.path.abspath(cwd or "."),
                       **paths}
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            pid = self._answer()["pid"]
            answer = self._answer(timeout)
            if answer is None:  # overran: stopped as subprocess.run stops its child
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._answer()
                raise subprocess.TimeoutExpired(command, timeout)
            outputs = {}
            for name in ("stdout", "stderr"):
                with open(paths[name], encoding="utf-8", errors="replace") as f:
                    outputs[name] = f.read()
        return subprocess.CompletedProcess(command, answer["returncode"], outputs["stdout"], outputs["stderr"])


if __name__ == "__main__":
    _serve()
