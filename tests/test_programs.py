"""The tests' way of starting programs (tests/programs.py): a process forked from the server that
has Keras imported behaves as a fresh `python` one, and is what the tests get."""

import signal
import time

import pytest

from tests import programs

pytestmark = pytest.mark.slow  # starts processes

# What a program sees and how it ends, printed for comparison.
PROBE = r"""
import sys
print("keras imported before", "keras" in sys.modules)
import atexit, os, tempfile, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "temporary files in", tempfile.gettempdir())
print("stdin", sys.stdin.read().splitlines())
print("to stderr", file=sys.stderr)
atexit.register(lambda: sys.stdout.write("atexit ran"))  # no newline: written at the end
threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended"))).start()
ending = sys.argv[1]
if ending == "code":
    sys.exit(3)
if ending == "minus two":
    sys.exit(-2)
if ending == "message":
    raise SystemExit("error: a one-line message")
if ending == "exception":
    raise ValueError("not caught")
if ending == "interrupt":
    raise KeyboardInterrupt
"""


@pytest.fixture(params=["forked", "fresh"])
def mode(request, monkeypatch):
    if request.param == "fresh":
        monkeypatch.setenv("KYU_TESTS_FRESH_PROCESSES", "1")
    return request.param


@pytest.mark.parametrize("ending, code", [("normal", 0), ("code", 3), ("minus two", 254),
                                          ("message", 1), ("exception", 1),
                                          ("interrupt", -signal.SIGINT)])
def test_a_program_sees_and_ends_as_under_python(mode, ending, code, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = programs.run("-c", PROBE, ending, 2, stdin="one\ntwo\n", cwd=tmp_path,
                          env=programs.environment(TMPDIR=str(scratch)))
    assert result.returncode == code, result.stderr
    assert result.stdout.splitlines() == [
        f"keras imported before {mode == 'forked'}",
        f"argv ['{ending}', '2'] cwd {tmp_path} temporary files in {scratch}",
        "stdin ['one', 'two']", "thread ended", "atexit ran"]
    errors = result.stderr.splitlines()
    assert errors[0] == "to stderr"
    assert errors[1:] == {"normal": [], "code": [], "minus two": [],
                          "message": ["error: a one-line message"]}.get(ending, errors[1:])
    if ending in ("exception", "interrupt"):
        assert errors[1] == "Traceback (most recent call last):"
        assert errors[-1] == {"exception": "ValueError: not caught",
                              "interrupt": "KeyboardInterrupt"}[ending]


STREAMS = """
import sys
print("forked", "keras" in sys.modules)
for stream in (sys.stdin, sys.stdout, sys.stderr):
    print(stream.encoding, stream.errors, stream.line_buffering, stream.write_through,
          type(stream.buffer).__name__)
"""


def _environment(unbuffered):
    environment = programs.environment()
    if not unbuffered:
        del environment["PYTHONUNBUFFERED"]
    return environment


@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_forked_programs_streams_are_those_python_opens(unbuffered):
    forked, fresh = (programs.run("-c", STREAMS, env=_environment(unbuffered), fresh=fresh)
                     .stdout.splitlines() for fresh in (False, True))
    assert forked[0] == "forked True" and fresh[0] == "forked False"
    assert forked[1:] == fresh[1:] and len(fresh) == 4


@pytest.mark.parametrize("unbuffered", [True, False])
def test_what_was_written_before_a_kill_is_kept_as_python_keeps_it(mode, unbuffered):
    """`-u` writes through; otherwise standard output waits in its buffer (lost to SIGKILL) and
    standard error, line-buffered, does not."""
    script = ("import os, signal, sys\nprint('out')\nprint('err', file=sys.stderr)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    result = programs.run("-c", script, env=_environment(unbuffered))
    assert result.returncode == -signal.SIGKILL
    assert (result.stdout, result.stderr) == ("out\n" if unbuffered else "", "err\n")


def test_a_script_finds_its_folder_first_on_its_path(mode, tmp_path):
    (tmp_path / "beside.py").write_text("NAME = 'the module beside the script'\n")
    script = tmp_path / "script.py"
    script.write_text("import sys, beside\n"
                      "print(sys.argv, __file__, sys.path[0], beside.NAME, __name__)\n")
    result = programs.run(script, "an argument")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"[{str(script)!r}, 'an argument'] {script} {tmp_path} "
                             "the module beside the script __main__\n")


def test_programs_fork_from_the_server_unless_their_environment_imports_otherwise(
        monkeypatch, tmp_path):
    preloaded = "import sys; print('keras' in sys.modules)"
    assert programs.run("-c", preloaded).stdout == "True\n"
    # the preloaded modules' objects frozen out of the collector's scans, in forked programs
    frozen = "import gc; print(gc.get_freeze_count() > 100000)"
    assert programs.run("-c", frozen).stdout == "True\n"
    assert programs.run("-c", frozen, fresh=True).stdout == "False\n"
    for read_when_running in ({"TF_CONFIG": "{}"}, {"MULTI30K_URL": "http://localhost/"},
                              {"TMPDIR": str(tmp_path)}):
        environment = programs.environment(**read_when_running)
        assert programs.run("-c", preloaded, env=environment).stdout == "True\n"
    assert programs.run("-c", preloaded, env=_environment(unbuffered=False)).stdout == "True\n"
    assert programs.run("-c", preloaded, fresh=True).stdout == "False\n"
    for changed in ({"KERAS_BACKEND": "another"}, {"TF_ENABLE_ONEDNN_OPTS": "another"},
                    {"PYTHONPATH": "another"}):
        assert programs.run("-c", preloaded, env=programs.environment(**changed)).stdout == \
            "False\n"
    monkeypatch.setenv("KYU_TESTS_FRESH_PROCESSES", "1")
    assert programs.run("-c", preloaded).stdout == "False\n"


def test_a_started_program_takes_signals_and_gives_its_output(mode, tmp_path):
    ready = tmp_path / "ready"
    script = (
        "import pathlib, signal, sys, time\n"
        "print('keras imported before', 'keras' in sys.modules)\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('stopping'), sys.exit(75)))\n"
        "print('started', flush=True)\n"
        "print('to stderr', file=sys.stderr, flush=True)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n")
    program = programs.start("-c", script)
    deadline = time.time() + 60
    while not ready.exists() and program.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert program.poll() is None
    program.send_signal(signal.SIGTERM)
    output = program.stdout.read()
    assert program.wait(timeout=30) == 75 == program.returncode
    assert output.splitlines() == [f"keras imported before {mode == 'forked'}", "started",
                                   "to stderr", "stopping"]
    killed = programs.start("-c", "import time; time.sleep(60)")
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL
