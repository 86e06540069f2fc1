"""Tests for the untrusted-code sandbox (comlrl_lightning.envs.sandbox)."""

from __future__ import annotations

import os
import socket
import sys
import threading

import pytest

from comlrl_lightning.envs import sandbox
from comlrl_lightning.envs.sandbox import ExecutionResult, run_many, run_tests

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandbox relies on Linux/POSIX")

# Limits for programs that finish in milliseconds: wide enough for a machine loaded many times over (a job's start-up,
# fork and program load take seconds there; 1 s / 10 s timed out once under load). Tests of a timeout set their own.
FAST = {"timeout_per_test": 5.0, "timeout_total": 60.0}


def _n_children() -> int:
    """Number of live child processes of this (test) process."""
    me = str(os.getpid())
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            count += 1
    return count


def test_correct_program_passes_all():
    r = run_tests("def f(x):\n    return x + 1\nprint('hello')", ["assert f(1) == 2", "assert f(0) == 1"], **FAST)
    assert (r.passed, r.total, r.timeouts, r.errors, r.syntax_ok) == (2, 2, 0, [], True)
    assert r.pass_ratio == 1.0
    assert "hello" in r.stdout


def test_failing_asserts_and_errors_counted():
    r = run_tests("def f(x):\n    return x", ["assert f(1) == 1", "assert f(1) == 2", "g(1)"], **FAST)
    assert r.passed == 1 and r.total == 3
    assert r.errors == ["AssertionError", "NameError"]
    assert r.pass_ratio == pytest.approx(1 / 3)


def test_syntax_error():
    r = run_tests("def f(:\n  pass", ["assert f() is None", "assert True"], **FAST)
    assert not r.syntax_ok and r.passed == 0 and r.total == 2
    assert r.errors == ["SyntaxError", "SyntaxError"]


def test_empty_tests_pass_ratio_zero():
    r = run_tests("x = 1", [], **FAST)
    assert r.total == 0 and r.pass_ratio == 0.0 and r.syntax_ok


def evaluated(program, tests, **limits):
    """The result and whether the evaluator itself finished the job (its report came): a test that overran was
    ended by its own timeout, not by the trainer's backstop at ``timeout_total``."""
    job = sandbox.Job(program, tests)
    full = {**dict(timeout_per_test=10.0, timeout_total=60.0, memory_mb=512, disk_mb=64, max_timeouts=3), **limits}
    result, layers = sandbox._run(job, full, "best_effort")
    return result, bool(layers)


def test_infinite_loop_program_times_out_on_its_own_timeout():
    r, finished = evaluated("while True:\n    pass", ["assert True"], timeout_per_test=1.0, timeout_total=30.0)
    assert finished and r.passed == 0 and r.errors == ["Timeout"] and r.timeouts == 1


def test_infinite_loop_in_one_test_others_fine():
    prog = "def f(x):\n    while x < 0:\n        pass\n    return x"
    r = run_tests(prog, ["assert f(1) == 1", "f(-1)", "assert f(2) == 2"], timeout_per_test=2.0, timeout_total=60.0)
    assert r.passed == 2 and r.errors == ["Timeout"] and r.timeouts == 1


def test_uncatchable_loop_killed_by_parent_and_max_timeouts():
    # Disabling the in-child timer forces the parent-side wall-clock kill.
    hog = "import signal\ndef hog():\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass"
    r, finished = evaluated(hog, ["assert 1", "hog()", "assert 1"], timeout_per_test=1.0, timeout_total=60.0)
    assert finished
    # each test has a sandbox of its own: the one killed for time does not take the next test with it
    assert r.passed == 2 and r.errors == ["Timeout"]
    # max_timeouts: after 1 timeout the remaining tests are not run
    r = run_tests(
        "def f():\n    while True: pass",
        ["f()", "assert 1", "assert 1"],
        timeout_per_test=1.0,
        timeout_total=60.0,
        max_timeouts=1,
    )
    assert r.passed == 0 and r.errors == ["Timeout"] * 3


def test_fork_bomb_contained():
    before = _n_children()
    r = run_tests("import os\nwhile True:\n    os.fork()", ["assert True"], **FAST)
    assert r.passed == 0 and r.errors == ["SandboxViolation"]
    # even if the user swallows the error it is scored as a violation
    r = run_tests("import os\ntry:\n    os.fork()\nexcept Exception:\n    pass", ["assert True"], **FAST)
    assert r.passed == 0 and r.errors == ["SandboxViolation"]
    assert _n_children() <= before  # nothing left behind; we are still running


def test_huge_allocation_memory_error():
    r = run_tests("x = bytearray(10**10)", ["assert len(x) > 0"], memory_mb=256, **FAST)
    assert r.passed == 0 and r.errors == ["MemoryError"]


def test_socket_connect_blocked(tcp_server):
    server, port = tcp_server
    prog = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')"
    r = run_tests(prog, ["assert True"], **FAST)
    assert r.passed == 0 and r.errors == ["SandboxViolation"]
    with pytest.raises(socket.timeout):
        server.accept()  # no connection ever arrived


def test_write_outside_workdir_blocked(tmp_path):
    target = tmp_path / "pwned.txt"
    r = run_tests(f"open({str(target)!r}, 'w').write('x')", ["assert True"], **FAST)
    assert r.passed == 0 and r.errors == ["SandboxViolation"]
    assert not target.exists()
    r = run_tests(f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)", ["assert True"], **FAST)
    assert r.errors == ["SandboxViolation"] and not target.exists()


def test_write_inside_workdir_allowed_and_cleaned_up():
    prog = "import os\nopen('a.txt', 'w').write('x')\nWD = os.getcwd()"
    r = run_tests(prog, ["assert open('a.txt').read() == 'x'", "print(WD)"], **FAST)
    assert r.passed == 2
    workdir = r.stdout.strip().splitlines()[-1]
    assert os.path.basename(workdir).startswith("sandbox-")
    assert not os.path.exists(workdir)  # temp dir deleted afterwards


def test_delete_and_rename_outside_blocked(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("data")
    for prog in (
        f"import os\nos.remove({str(victim)!r})",
        f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
    ):
        r = run_tests(prog, ["assert True"], **FAST)
        assert r.passed == 0 and r.errors == ["SandboxViolation"], prog
    assert victim.read_text() == "data"


def test_kill_parent_blocked():
    r = run_tests("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", ["assert True"], **FAST)
    assert r.passed == 0 and r.errors == ["SandboxViolation"]
    r = run_tests("import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)", ["assert True"], **FAST)
    assert r.passed == 0 and r.errors == ["SandboxViolation"]
    os.kill(os.getpid(), 0)  # we are alive


def test_environment_secrets_not_visible(monkeypatch):
    monkeypatch.setenv("SANDBOX_SECRET", "s3cr3t")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-s3cr3t")
    prog = "import os\nprint(sorted(os.environ.items()))"
    r = run_tests(
        prog,
        ["assert 'SANDBOX_SECRET' not in os.environ", "assert 'AWS_SECRET_ACCESS_KEY' not in os.environ"],
        setup="import os",
        **FAST,
    )
    assert r.passed == 2
    assert "s3cr3t" not in r.stdout and "SANDBOX_SECRET" not in r.stdout
    # the parent's /proc/<pid>/environ is off limits too
    r = run_tests("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", ["assert True"], **FAST)
    assert r.errors == ["SandboxViolation"] and "s3cr3t" not in r.stdout


def test_subprocess_blocked():
    for prog in (
        "import subprocess\nsubprocess.run(['ls'])",
        "import os\nos.system('ls')",
        "import ctypes",
        "import _posixsubprocess",
    ):
        r = run_tests(prog, ["assert True"], **FAST)
        assert r.passed == 0 and r.errors == ["SandboxViolation"], prog
    r = run_tests("import subprocess, json, collections", ["assert True"], **FAST)  # importing is fine
    assert r.passed == 1


def test_child_crash_reported():
    r = run_tests("import os\nos._exit(3)", ["assert True", "assert True"], **FAST)
    assert r.passed == 0 and r.errors == ["Crash", "Crash"]
    # a test that ends its own evaluator process costs that test only (each test runs in a process of its own)
    r = run_tests("x = 1", ["assert x == 1", "import os; os._exit(0)", "assert True"], **FAST)
    assert r.passed == 2 and r.errors == ["Crash"]


def test_stdout_cannot_forge_results_and_is_truncated():
    prog = 'print(\'{"phase": "done"}\')\nprint("x" * 100000)'
    r = run_tests(prog, ["assert False"], **FAST)
    assert r.passed == 0 and r.errors == ["AssertionError"]
    assert len(r.stdout) <= 4096


def test_run_many_parallel_and_ordered(monkeypatch):
    """``workers`` jobs at a time, results in job order."""
    running, most, lock = [0], [0], threading.Lock()
    real = sandbox.run_tests

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(sandbox, "run_tests", counted)
    jobs = [
        (
            f"import time\nX = {i}\ndef slow():\n    time.sleep(0.5)\n    return X",
            [f"assert slow() == {i}", "assert X == 0"],
        )
        for i in range(4)
    ]
    results = run_many(jobs, workers=2, timeout_per_test=3.0, timeout_total=10.0)
    assert all(isinstance(r, ExecutionResult) for r in results)
    assert [r.passed for r in results] == [2, 1, 1, 1]  # order preserved
    assert most[0] == 2  # two at a time: in parallel, never more than asked
    assert run_many([]) == []


def test_files_in_the_working_directory_can_be_created_and_removed():
    """Relative paths resolve against the sandbox's own directory (dir_fd = AT_FDCWD), so cleanup works."""
    res = run_tests(
        "import os",
        ['open("c.txt", "w").close()\nos.remove("c.txt")\nassert not os.path.exists("c.txt")'],
        setup="import os",
        timeout_per_test=5,
    )
    assert (res.passed, res.errors) == (1, [])
