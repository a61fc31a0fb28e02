"""Starts the programs (`train.py`, `eval.py`, `export.py`, ...) as the tests need them.

Each program runs in a process of its own, with its own arguments, environment, working folder,
streams, exit code and global state, as `python PROGRAM ARGS` would. What differs is where that
process comes from: importing TensorFlow and Keras takes seconds and the suite starts programs more
than a hundred times, so the process is forked from a server that has imported them already
(multiprocessing's forkserver, with those modules preloaded). A program whose environment would
change what those imports do (another Keras backend, oneDNN switched, another PYTHONPATH) starts
from a fresh interpreter instead, as does every program when `KYU_TESTS_FRESH_PROCESSES=1`.

A forked program shares the server's hash seed and `sys.flags`, finds the tests' folders on its
`sys.path` after its own, does not see what the imports printed (once, in the server), starts with
what it inherited frozen out of the collector's scans (`gc.freeze`: the imports' objects, almost
none of them garbage, as `kyu_transformer.cli.startup` leaves a program's), and ends by `os._exit`
after its threads and atexit functions, with no interpreter teardown (a script's `__main__` is the
server's again by then). Tests that compare two training runs bit for bit start one of them
`fresh=True`: two hash seeds, as two users' runs have.

`run` runs a program to its end; `start` gives it running, for the tests that signal, stop or
kill it. The programs that the benchmark scripts start are the scripts' own: fresh interpreters.
"""
import atexit
import gc
import io
import json
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Read when a program runs, not while Keras and TensorFlow are imported: a forked program may
# set them to anything (pytest sets the last one for each test).
READ_AT_RUN_TIME = {"PYTHONUNBUFFERED", "MULTI30K_URL", "TMPDIR", "TF_CONFIG",
                    "PYTEST_CURRENT_TEST"}
# Keras imports its backend (TensorFlow, or JAX): the seconds a program would spend on imports.
# (Names the server imports from any folder: it is started without the tests' `sys.path`.)
PRELOADED = ["keras", "sentencepiece", "sacrebleu"]
INTERRUPTED = "KeyboardInterrupt"  # what ended a program, where Python ends by SIGINT
_server = {}
_server_lock = threading.Lock()


def environment(**changes):
    """The tests' environment for a program: this process's, unbuffered, with `changes`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **changes}


def run(*command, stdin=None, env=None, cwd=ROOT, timeout=600, fresh=False):
    """Runs `python *command` to its end and returns what `subprocess.run(...,
    capture_output=True, text=True)` would. `command` is a script (a path relative to the
    repository root, or absolute) and its arguments, or `"-c"`, a program's text and its.
    `fresh`: from a fresh interpreter (another hash seed, for instance, than the forked ones')."""
    command, env, context = _prepared(command, env, fresh)
    if context is None:
        return subprocess.run([sys.executable, *command], input=stdin, capture_output=True,
                              text=True, env=env, cwd=cwd, timeout=timeout)
    program = Forked(context, command, env, cwd, stdin, merged=False)
    try:
        code = program.wait(timeout)
    except subprocess.TimeoutExpired:
        program.kill()
        program.wait()
        raise
    stdout, stderr = program.outputs()
    return subprocess.CompletedProcess([sys.executable, *command], code, stdout, stderr)


def free_ports(count):
    """Returns `count` loopback ports free now."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def cluster_configs(count):
    """Returns the `TF_CONFIG` (JSON) of each of `count` workers of one loopback cluster."""
    workers = [f"127.0.0.1:{port}" for port in free_ports(count)]
    return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
            for index in range(count)]


def finish_all(processes, timeout=300):
    """Waits for every one of `processes` (from `start`) and asserts that each succeeded (its
    output's end in the message); kills those still running if one did not."""
    try:
        for process in processes:
            output, _ = process.communicate(timeout=timeout)
            assert process.returncode == 0, output[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


def start(*command, env=None, cwd=ROOT, fresh=False):
    """Starts `python *command` (as `run` takes it) and returns it running, as
    `subprocess.Popen(..., stdout=PIPE, stderr=STDOUT, text=True)` would: its `pid`, `poll`,
    `wait`, `send_signal`, `kill`, `communicate` and `stdout.read()` (which waits for its end, as
    a pipe's does)."""
    command, env, context = _prepared(command, env, fresh)
    if context is None:
        return subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    return Forked(context, command, env, cwd, None, merged=True)


class Forked:
    """A program in a process forked by the forkserver, its streams in files."""

    def __init__(self, context, command, env, cwd, stdin, merged):
        self._folder = tempfile.TemporaryDirectory()
        paths = [os.path.join(self._folder.name, name) for name in ("stdin", "stdout", "stderr")]
        self._paths = paths[:2] if merged else paths
        for path, text in zip(paths, (stdin or "", "", "")):
            with open(path, "w", encoding="utf-8") as file:
                file.write(text)
        # Daemonic: one a failed test left running ends with the tests, not after them.
        self._process = context.Process(target=_run_here, args=(command, env, cwd, self._paths),
                                        daemon=True)
        self._process.start()
        self.args, self.pid, self.stdout = [sys.executable, *command], self._process.pid, self

    def poll(self):
        return self._process.exitcode

    @property
    def returncode(self):
        return self.poll()

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, signal_number):
        if self.poll() is None:  # as Popen: never a signal to a pid that may be another's now
            os.kill(self.pid, signal_number)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def outputs(self):
        """What the program wrote to its standard output and error (one text when merged)."""
        return tuple(_read(path) for path in self._paths[1:])

    def read(self):
        self.wait()
        return self.outputs()[0]

    def communicate(self, timeout=None):
        self.wait(timeout)
        return (*self.outputs(), None)[:2]


def _prepared(command, env, fresh):
    """`python`'s arguments (the script's path joined to the root), the environment, and the
    forkserver context to fork from, or None for a fresh interpreter."""
    command = [str(word) for word in command]
    if command[0] != "-c":
        command[0] = os.path.join(ROOT, command[0])
    env = environment() if env is None else env
    return command, env, None if fresh else _forkserver_for(env)


def _forkserver_for(env):
    """The forkserver context, started on first use, if `env` imports as its environment does."""
    if os.environ.get("KYU_TESTS_FRESH_PROCESSES") == "1":
        return None
    with _server_lock:
        if not _server:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOADED)
            _server.update(context=context, environment=dict(os.environ))
            multiprocessing.forkserver.ensure_running()  # with this environment
    imported_under = _server["environment"]
    keys = (set(env) | set(imported_under)) - READ_AT_RUN_TIME
    return _server["context"] if all(env.get(k) == imported_under.get(k) for k in keys) else None


def _read(path):
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.read()


def _run_here(command, env, cwd, paths):
    """In the forked process: becomes `python command...` and exits with its exit code."""
    gc.freeze()  # the server's imports: its collections scan only what the program makes
    _take_streams(paths, unbuffered=bool(env.get("PYTHONUNBUFFERED")))  # as `python -u`
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    tempfile.tempdir = None  # read TMPDIR again
    if command[0] == "-c":
        sys.argv = ["-c", *command[2:]]
        sys.path.insert(0, "")
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        code = _exit_code(lambda: exec(compile(command[1], "<string>", "exec"), main.__dict__))
    else:
        sys.argv = list(command)
        sys.path.insert(0, os.path.dirname(command[0]))
        code = _exit_code(lambda: runpy.run_path(command[0], run_name="__main__"))
    # As the interpreter ends: its threads joined, the atexit functions, the streams flushed.
    code = _exit_code(threading._shutdown) or code
    code = _exit_code(atexit._run_exitfuncs) or code
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 (as the interpreter: 120 where it would have ended well)
        code = code or 120
    if code == INTERRUPTED:  # as the interpreter ends after a KeyboardInterrupt: by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    os._exit(code)


def _take_streams(paths, unbuffered):
    """Standard input, output and error on the files at `paths`, made as CPython makes them
    (pylifecycle's `create_stdio`), in the server's encodings and error handlers: those CPython
    chose for this environment."""
    for descriptor in (0, 1, 2):  # standard error in standard output's file when merged
        path = paths[min(descriptor, len(paths) - 1)]
        opened = os.open(path, os.O_WRONLY | os.O_APPEND if descriptor else os.O_RDONLY)
        os.dup2(opened, descriptor)
        os.close(opened)
    sys.stdin = _text_stream(0, sys.__stdin__, unbuffered)
    sys.stdout = _text_stream(1, sys.__stdout__, unbuffered)
    sys.stderr = _text_stream(2, sys.__stderr__, unbuffered, line_buffering=not unbuffered)


def _text_stream(descriptor, like, unbuffered, line_buffering=False):
    stream = io.FileIO(descriptor, "w" if descriptor else "r", closefd=False)
    if not (unbuffered and descriptor):  # standard input is buffered even under `-u`
        stream = io.BufferedWriter(stream) if descriptor else io.BufferedReader(stream)
    return io.TextIOWrapper(stream, encoding=like.encoding, errors=like.errors, newline="\n",
                            line_buffering=line_buffering, write_through=unbuffered)


def _exit_code(function):
    """Runs `function` and gives the exit code Python would give it at the top of a script."""
    try:
        function()
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except BaseException as error:  # noqa: B036 (as the interpreter: the traceback, then 1)
        sys.excepthook(type(error), error, error.__traceback__)
        return INTERRUPTED if isinstance(error, KeyboardInterrupt) else 1
    return 0
