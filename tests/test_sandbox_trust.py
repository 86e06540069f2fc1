"""The third round of attacks on the sandbox's verdict (docs/sandbox.md): each test below forges a reward, leaks
what the tests hold, crashes or stalls the evaluator on the design before it, and is contained now.

1. names a test takes from the program (only the entry points may come from it);
2. the trusted evaluator's memory and time (a test's own process, bounded and killed on time);
3. (the rewards that parse model output never raise: tests/test_reward_properties.py);
4. the fallback without namespaces (forced here with ``COMLRL_SANDBOX_NO_NAMESPACES=1``);
5. small verdict leaks: ``__exit__``, the violation count, IPC, an executable working directory.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import tempfile
from pathlib import Path

import pytest
from test_sandbox_verdict import GUARD_OFF, SERVER

from comlrl_lightning.envs import sandbox
from comlrl_lightning.envs.sandbox import SandboxUnavailable, isolation_layers, run_tests

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandbox relies on Linux/POSIX")

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
LAYERS = isolation_layers() if sys.platform.startswith("linux") else {}
FAST = {"timeout_per_test": 3.0, "timeout_total": 30.0}


def needs(*layers: str):
    missing = [name for name in layers if not LAYERS.get(name)]
    return pytest.mark.skipif(bool(missing), reason=f"kernel layer(s) not available on this machine: {missing}")


@pytest.fixture
def no_namespaces(monkeypatch):
    """Run every job as on a machine whose kernel refuses namespaces (Docker without CAP_SYS_ADMIN, Ubuntu's
    AppArmor restriction, many HPC nodes)."""
    monkeypatch.setenv(sandbox.NO_NAMESPACES_ENV, "1")
    yield
    monkeypatch.delenv(sandbox.NO_NAMESPACES_ENV)


# ------------------------------------------------------------------------------ 1. names a test uses
def test_a_test_never_takes_a_name_the_program_imports():
    """The program imports ``math`` and rebinds ``math.isclose``; a test that uses ``math`` gets the trusted
    module from its setup, or a NameError -- never the program's (which made every such test pass)."""
    program = "import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n    return 0\n"
    tests = ["assert math.isclose(f(1), 2.0)"]
    assert run_tests(program, tests, entry_points=["f"], **FAST).errors == ["NameError"]
    assert run_tests(program, tests, setup="import math", entry_points=["f"], **FAST).errors == ["AssertionError"]
    assert run_tests("def f(x):\n    return 2.0\n", tests, setup="import math", **FAST).passed == 1


def test_without_named_entry_points_only_what_the_program_defines_reaches_the_tests():
    """The generic API's default: the functions, classes and variables the program defines, never its imports
    nor a builtin's name."""
    job = sandbox.Job(
        "import math, os as system\nfrom json import dumps\nX = 1\ndef f():\n    pass\n"
        "class C:\n    pass\ndef len(x):\n    return 0\n",
        [],
    )
    assert job.names() == ("X", "f", "C")
    assert sandbox.Job("import math", [], entry_points=["math"]).names() == ("math",)


@pytest.fixture(scope="module")
def mbpp_items():
    path = DATA / "mbpp" / "sanitized-mbpp.json"
    if not path.exists():
        pytest.skip(f"shared MBPP data not found under {path}")
    from comlrl_lightning.envs import coding

    return {item["task_id"]: item for item in coding.mbpp_tasks(str(path), split=None)}


def test_mbpp_596_computes_its_expected_value_with_the_trusted_sys(mbpp_items):
    """MBPP 596's tests compute the expected value with ``sys.getsizeof`` and import nothing: a load-time side
    effect in a default argument that plants a ``sys`` whose ``getsizeof`` answers 0 made a function returning 0
    pass every test. The item now imports ``sys`` in its trusted setup (fixed at load)."""
    from comlrl_lightning.envs import coding

    item = mbpp_items[596]
    assert "import sys" in item["trusted_imports"]
    forged = (
        "def tuple_size(t, _=globals().__setitem__('sys', type('S', (), {'getsizeof': staticmethod("
        "lambda o: 0)}))):\n    return 0\n"
    )
    honest_wrong = "def tuple_size(t):\n    return 0\n"
    honest = "import sys\ndef tuple_size(t):\n    return sys.getsizeof(t)\n"
    aux = "def aux():\n    return 0\n"
    breakdown = coding.coding_reward_breakdown([aux] * 3, [forged, honest_wrong, honest], batch_items=[item] * 3)
    assert [b["passed"] for b in breakdown] == [0, 0, 3]
    assert breakdown[0]["total"] == breakdown[1]["total"] < breakdown[2]["total"]


def test_mbpp_items_whose_tests_only_a_forgery_passes_are_dropped_at_load(caplog):
    """The HumanEval-style MBPP rewrite calls ``math.candidate(...)``, which nothing defines: an honest correct
    program fails those tests and only a program planting ``math`` passes them. They are dropped, counted in
    one warning."""
    path = DATA / "mbpp" / "mbpp_raw.json"
    if not path.exists():
        pytest.skip(f"shared MBPP data not found under {path}")
    from comlrl_lightning.envs import coding

    with caplog.at_level(logging.WARNING, logger="comlrl_lightning.envs.test_names"):
        items = coding.mbpp_tasks(str(path), split=None)
    assert not any("math.candidate" in test for item in items for test in coding.item_tests(item))
    assert "13 dropped" in caplog.text and "math.candidate" in caplog.text


@pytest.fixture(scope="module")
def classeval_items():
    path = DATA / "classeval" / "ClassEval_data.json.gz"
    if not path.exists():
        pytest.skip(f"shared ClassEval data not found under {path}")
    from comlrl_lightning.envs import classeval

    return {item["class_name"]: item for item in classeval.classeval_tasks(str(path))}


def test_classeval_tests_use_the_trusted_imports(classeval_items):
    """DataStatistics4's kurtosis test asks ``math.isnan(...)`` of the result: a class module that patched its
    ``math`` made any result NaN. The tests now import ``import_statement`` on the trusted side."""
    from comlrl_lightning.envs import classeval

    item = classeval_items["DataStatistics4"]
    forged = (
        "import math\nmath.isnan = lambda x: True\nclass DataStatistics4:\n"
        "    @staticmethod\n    def kurtosis(data):\n        return 0.0\n"
    )
    job = classeval.sandbox_job(forged, item)
    test = next(t for t in job.tests if "'test_kurtosis_2'" in t)
    r = run_tests(job.program, [test], setup=job.setup, entry_points=job.entry_points, **FAST)
    assert r.passed == 0, r
    honest = item["solution_code"]
    r = run_tests(honest, [test], setup=job.setup, entry_points=job.entry_points, **FAST)
    assert r.passed == 1, r


# ------------------------------------------------------------------------------ 2. the evaluator's bounds
def test_an_uninterruptible_c_call_in_a_test_costs_that_test_only():
    """``sum`` over an iterator of the program's length runs inside one C call that checks no signal, so
    SIGALRM cannot interrupt it: the test's own process is killed at its timeout and the next test runs (the
    whole job used to run on until the trainer killed it after ``timeout_total``, every remaining test lost)."""
    program = "def f():\n    return 10 ** 10\ndef g():\n    return 1\n"
    r = run_tests(
        program,
        ["assert sum(itertools.repeat(1, f())) > 0", "assert g() == 1"],
        setup="import itertools",
        timeout_per_test=1.0,
        timeout_total=30.0,
    )
    assert (r.passed, r.errors) == (1, ["Timeout"]), r


@pytest.mark.parametrize(
    "program, test, error",
    [
        ("def f():\n    return range(4 * 10 ** 7)\n", "assert sorted(f())", "ResultTooLarge"),
        ("def f():\n    return range(10 ** 18)\n", "assert sum(f()) > 0", "ResultTooLarge"),
        ("def f():\n    while True:\n        yield 'x' * (6 << 20)\n", "assert len(list(f())) == 0", "ResultTooLarge"),
        ("def f():\n    return 4 * 10 ** 9\n", "assert len('x' * f()) > 0", "MemoryError"),
    ],
)
def test_what_the_program_returns_cannot_exhaust_the_evaluator(program, test, error):
    r = run_tests(program, [test, "assert True"], **FAST)
    assert (r.passed, r.errors) == (1, [error]), r


def test_the_exception_classes_of_a_job_are_bounded():
    from comlrl_lightning.envs import _sandbox_worker as worker

    kinds = [worker.exception_class(f"E{i}", "ValueError") for i in range(3 * worker.MAX_EXCEPTION_CLASSES)]
    assert len(worker._SYNTHETIC_EXCEPTIONS) <= worker.MAX_EXCEPTION_CLASSES
    assert all(issubclass(kind, ValueError) and kind.__name__ == f"E{i}" for i, kind in enumerate(kinds))


# ------------------------------------------------------------------------------ 4. without namespaces
@pytest.mark.skipif(os.geteuid() != 0, reason="a root trainer's fallback (each job under a uid of its own)")
def test_without_namespaces_a_root_trainers_jobs_run_correctly_under_their_own_uid(no_namespaces):
    """The fallback used to keep uid 0, fail to enter the working directory chowned to the sandbox uid, and
    fail every test of every program. Now the job runs under its own uid, which reaches a private Python
    installation (this machine's is under /root) through directory fds."""
    layers = isolation_layers()
    assert not layers["pid_ns"] and layers["uid"] >= sandbox.SANDBOX_UID_BASE
    program = "import hashlib, numbers, os\ndef f(x):\n    return (x + 1, os.getuid())\n"
    r = run_tests(
        program,
        ["assert f(1)[0] == 2", f"assert f(1)[1] == {layers['uid']} or f(1)[1] != 0", "import wave\nassert wave"],
        **FAST,
    )
    assert r.passed == 3, r
    assert run_tests("def f(x):\n    return 0\n", ["assert f(1) == 2"], **FAST).errors == ["AssertionError"]


def test_without_namespaces_a_sandbox_sharing_the_trainers_uid_runs_only_under_landlock(
    no_namespaces, monkeypatch, tmp_path
):
    """No PID namespace and the trainer's own uid (a non-root trainer on a machine without user namespaces):
    Landlock keeps the program from the trainer's files and its /proc entry; where Landlock is missing too the
    run stops with what to enable (it used to run on a WARNING as the trainer's own user)."""
    monkeypatch.setattr(sandbox, "_sandbox_ids", lambda: (os.geteuid(), os.getegid()))
    secret = tmp_path / "trainer_secret.txt"
    secret.write_text("the trainer's own file")
    secret.chmod(0o600)
    program = GUARD_OFF + (
        "import os\ndef peek(path):\n    try:\n        return open(path).read()\n    except OSError as e:\n"
        "        return type(e).__name__\n"
    )
    tests = [
        f"assert peek({str(secret)!r}) == 'PermissionError'",
        f"assert peek('/proc/{os.getpid()}/environ') == 'PermissionError'",
    ]
    r = run_tests(program, tests, **FAST)
    assert r.passed == 2, r
    monkeypatch.setenv(sandbox.NO_LANDLOCK_ENV, "1")
    with pytest.raises(SandboxUnavailable, match="Landlock"):
        run_tests("def f():\n    return 1\n", ["assert f() == 1"], **FAST)


def test_the_job_reaches_the_evaluator_through_a_pipe_never_a_file(monkeypatch):
    """Nothing of the trainer's holds the tests once the evaluator has read them (a deleted payload file open
    in the trainer was readable through /proc/<trainer>/fd/N by a program sharing its uid)."""
    isolation_layers()  # probed before the spy: it counts this job's payload only
    written = []
    real = sandbox._send_payload

    def spy(fd, parts):
        import stat

        written.append(stat.S_ISFIFO(os.fstat(fd).st_mode))
        real(fd, parts)

    monkeypatch.setattr(sandbox, "_send_payload", spy)
    assert run_tests("def f():\n    return 1\n", ["assert f() == 1"], **FAST).passed == 1
    assert written == [True]


@pytest.mark.parametrize("how", ["path", "symlink"])
def test_another_processs_proc_entry_is_refused_before_its_magic_links_are_followed(how):
    """``/proc/<pid>/fd/N`` is checked before it is resolved: ``realpath`` turned it into the file it leads to
    (the trainer's deleted payload file), which the guard then took for an ordinary file."""
    opener = (
        "import os\ndef f():\n    pid = os.getppid()\n"
        + (
            "    os.symlink(f'/proc/{pid}/fd', 'link')\n    path = 'link/0'\n"
            if how == "symlink"
            else "    path = f'/proc/{pid}/fd/0'\n"
        )
        + "    try:\n        open(path, 'rb').close()\n    except PermissionError:\n        pass\n"
        "    return 1\n"
    )
    r = run_tests(opener, ["assert f() == 1"], **FAST)
    assert r.errors == ["SandboxViolation"], r


@pytest.mark.parametrize("namespaces", [True, False, "no_mounts"])
def test_a_private_temporary_directory_does_not_fail_every_test(namespaces, monkeypatch, tmp_path):
    """TMPDIR under a directory only the trainer may enter (a per-job private tmp on a cluster): the sandbox
    uid could not reach its working directory and every test of a correct program ended as ``Crash`` (without
    mounts in the namespaces: the evaluator's working directory was one of the mount namespace before)."""
    if namespaces is not True:
        if os.geteuid() != 0:
            pytest.skip("a root trainer's jobs run under a uid of their own")
        monkeypatch.setenv(sandbox.NO_MOUNTS_ENV if namespaces == "no_mounts" else sandbox.NO_NAMESPACES_ENV, "1")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    r = run_tests("def f(x):\n    return x\n", ["assert f(1) == 1", "open('here.txt', 'w').write('ok')"], **FAST)
    assert r.passed == 2, r


def test_a_sandbox_that_fails_its_canary_stops_the_run(monkeypatch):
    """Where the sandbox fails a correct program's tests, every reward would silently be "all tests failed":
    the first use checks a canary and raises instead."""
    monkeypatch.setattr(sandbox, "_layers", None)
    real = sandbox._run
    monkeypatch.setattr(
        sandbox,
        "_run",
        lambda job, limits, isolation: (sandbox.ExecutionResult(0, len(job.tests), 0, ["Crash"] * len(job.tests)), {}),
    )
    with pytest.raises(SandboxUnavailable, match="canary"):
        run_tests("def f():\n    return 1\n", ["assert f() == 1"])
    with pytest.raises(SandboxUnavailable):  # remembered: the run stops at every reward, not once
        isolation_layers()
    monkeypatch.setattr(sandbox, "_run", real)
    monkeypatch.setattr(sandbox, "_layers", None)
    assert isolation_layers()


@pytest.mark.parametrize("namespaces", [True, False])
def test_shared_memory_does_not_outlive_the_job(namespaces, monkeypatch):
    """``_posixshmem.shm_open`` raises no audit event: a segment in /dev/shm outlived the job without
    namespaces (a note for a later test or job). With namespaces there is no /dev/shm at all."""
    if not namespaces:
        if os.geteuid() != 0:
            pytest.skip("without namespaces only a root trainer runs jobs")
        monkeypatch.setenv(sandbox.NO_NAMESPACES_ENV, "1")
    name = "comlrl-" + secrets.token_hex(6)
    program = GUARD_OFF + (
        f"import _posixshmem, os\ndef f():\n    try:\n        fd = _posixshmem.shm_open('/{name}', "
        "os.O_CREAT | os.O_RDWR, 0o644)\n        os.write(fd, b'note')\n    except OSError:\n"
        "        pass\n    return 1\n"
    )
    assert run_tests(program, ["assert f() == 1"], **FAST).passed == 1
    assert not os.path.exists(f"/dev/shm/{name}")


# ------------------------------------------------------------------------------ 5. small leaks
def test_the_programs_exit_never_swallows_a_failing_assert():
    program = (
        "class Quiet:\n    def __enter__(self):\n        return self\n    def __exit__(self, *a):\n"
        "        return True\ndef cm():\n    return Quiet()\ndef f(x):\n    return 0\n"
    )
    r = run_tests(program, ["with cm():\n    assert f(1) == 2", "with cm():\n    assert f(1) == 0"], **FAST)
    assert (r.passed, r.errors) == (1, ["AssertionError"]), r


def test_violations_are_counted_where_the_program_cannot_erase_them():
    """A refused operation caught by the program, then the sandbox's own count reset: the count lives in the
    evaluator now (one byte on a pipe per refusal), and closing the pipe counts too."""
    caught = "import os\ntry:\n    os.system('true')\nexcept Exception:\n    pass\n"
    erase = SERVER + "SERVER.violations = lambda: 0\nSERVER.guard.clear()\n"
    honest = "def f(x):\n    return 2\n"
    assert run_tests(caught + erase + honest, ["assert f(1) == 2"], **FAST).errors == ["SandboxViolation"]
    assert run_tests("import os\nos.close(5)\n" + honest, ["assert f(1) == 2"], **FAST).errors == ["SandboxViolation"]
    late = (
        "import os\ndef f(x):\n    try:\n        os.system('true')\n    except Exception:\n        pass\n    return 2\n"
    )
    assert run_tests(late, ["assert f(1) == 2", "assert True"], **FAST).errors == ["SandboxViolation"]


@needs("seccomp")
def test_system_v_ipc_is_denied():
    """One test's sandbox left a System V message for the next one's (one IPC namespace serves a job)."""
    program = GUARD_OFF + (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef queues():\n"
        "    return libc.msgget(0, 0o1600)\ndef segments():\n    return libc.shmget(0, 4096, 0o1600)\n"
    )
    r = run_tests(program, ["assert queues() == -1", "assert segments() == -1"], **FAST)
    assert r.passed == 2, r


@needs("tmpfs_workdir")
def test_the_working_directory_is_not_executable():
    """A compiled extension written to the working directory carried a message from test to test; nothing in
    it can be mapped executable now."""
    program = GUARD_OFF + (
        "import mmap, os\ndef mapped():\n    with open('blob', 'wb') as f:\n"
        "        f.write(b'\\0' * 4096)\n    fd = os.open('blob', os.O_RDONLY)\n    try:\n"
        "        mmap.mmap(fd, 4096, prot=mmap.PROT_READ | mmap.PROT_EXEC)\n        return True\n"
        "    except OSError:\n        return False\n"
    )
    assert run_tests(program, ["assert not mapped()"], **FAST).passed == 1
