"""Sandbox for running untrusted, model-generated Python code against trusted tests.

Coding-task rewards execute programs written by the policy. :func:`run_tests` runs such a program and a list of
tests (``"assert f(1) == 2"``, a loop of asserts, a ``unittest`` method run through a helper) and reports how
many passed; :func:`run_many` runs several jobs in parallel.

The verdict lives outside the untrusted process
-----------------------------------------------
The tests never run in the process that runs the program. Per job, a trusted *evaluator* process runs the test
code; per test, a fresh *sandbox* process (forked from a clean *spawner* that never saw a test) runs the program.
In the test, the program's top-level names are handles: a call, an attribute read or write, an item access,
iteration, ``len``/``bool``/``str``/``repr`` or ``isinstance`` on one is a request on a pipe to the sandbox,
answered with plain data only -- ``None``, ``bool``, ``int``, ``float`` (inf/nan kept), ``complex``, ``str``,
``bytes``/``bytearray``, ``list``/``tuple``/``set``/``frozenset``/``dict``, the standard library's
``datetime``/``date``/``time``/``timedelta``/``Decimal``/``Fraction``/``deque``/``range``/``slice`` and dict
views, builtin classes by name -- in a strict tagged JSON encoding (8 MB and 100 levels at most; never pickle,
never an object with behaviour). A subclass of one of these arrives as its plain value (a ``str`` subclass
with ``__eq__`` returning True is a plain ``str``); anything else arrives as a new handle, which equals only
itself, so an "always equal" object fails every comparison with an expected value. An exception raised by the
program arrives as its type name and arguments: a builtin type becomes the real type (``assertRaises`` and
``except ValueError`` work), another becomes a local class of that name deriving from its builtin base, and
``SystemExit``/``KeyboardInterrupt`` become plain exceptions that fail the test. Expected values, the test
code and the pass/fail decision never enter the sandbox; forging the channel, patching ``builtins``, the JSON
encoder or the runner, or walking frames to a reporter changes nothing but what the sandbox answers.

Semantics kept for the benchmarks' tests: a test takes only the job's ``entry_points`` from the program (the
function or class under test; any other name it uses and nothing trusted defines is a ``NameError``, so a
program's ``import math`` is never the ``math`` a test computes with -- docs/sandbox.md#names-a-test-uses);
builtins in a test are the real builtins, except an entry point (MBPP 126 is a function named ``sum``);
``setup`` is trusted test code run before each test (the item's imports, a ClassEval test module); a
list/dict/set/bytearray/deque argument changed in place by a call is copied back into the test's object; a
list/dict/set read from an attribute of the program's object (``obj.menu``, nested ones too) is a local copy
whose changes (``obj.menu.append(x)``, ``obj.d["k"] = v``) are made on the program's object as well. A test may
hand the program standard-library functions and classes (by name: the program gets its own copy) but no other
trusted callable (a mock, a lambda); the test that tries fails with ``TypeError``. The trainer kills an evaluator
whose test overruns its time even inside a C call, and goes on with the next test in a new evaluator.

Each test gets a new sandbox with the program loaded afresh and a new empty working directory, so no test's
side effects (memory, files, a hung or killed process) reach another test. A job's first sandbox also decides
the program-level result: a syntax error, an exception, a timeout or a sandbox violation while the program
loads fails every test with that error, as before.

Layers of isolation (outermost first) and what each stops
---------------------------------------------------------
The layers the machine gives are probed once per process (:func:`isolation_layers`) and logged in one line; a
warning names the missing ones. ``isolation="strict"`` (``sandbox_isolation`` on the rewards) refuses to run
without all of :data:`KERNEL_LAYERS` and an unprivileged uid.

1. **Separate processes, clean environment.** The evaluators are forked by a launcher started once per trainer
   process as ``python -I -B`` with only ``PATH``, ``LANG``, ``HOME`` and ``TMPDIR``: nothing of the trainer's
   memory, environment (API keys) or open files is there. The trainer reads only the evaluator's short report
   lines (bounded), so floods of the result channel or of stdout cost the sandbox, not the trainer.
2. **Unprivileged uid** (``uid``). Started as root, each job runs as a uid/gid of its own (from
   :data:`SANDBOX_UID_BASE`), no supplementary groups: file permissions apply, other users' processes cannot
   be signalled or reniced, and ``RLIMIT_NPROC`` is enforced.
3. **Namespaces** (``user_ns``, ``mount_ns``, ``pid_ns``, ``net_ns``, ``ipc_ns``, ``uts_ns``), created with
   ``unshare`` by the evaluator (no daemon, no setuid helper). Network: no device but a down loopback, so no
   connection anywhere. PID: the spawner is PID 1 of the job's namespace; the trainer and every other process
   are invisible (no ``/proc/<ppid>/environ``, no ``kill``/``pidfd_send_signal``/``setpriority``/
   ``sched_setaffinity`` on them), and killing PID 1 kills every process of the job, detached or not. IPC:
   the job's own namespace (and seccomp refuses its system calls, layer 5).
4. **A root of its own** (``read_only_root``, ``proc``, ``tmpfs_workdir``). The evaluator chroots into a small
   read-only tmpfs holding the program's *view*, an allow-list (docs/sandbox.md#what-a-program-sees): read-only,
   ``nosuid``/``nodev`` binds of the system's shared libraries and time-zone data, the standard library and the
   packages the job names (``packages``; none by default), every Python package tree in them masked; the devices
   ``null``/``zero``/``full``/``random``/``urandom`` only, a ``/proc`` of the job's PID namespace and, per test, a
   fresh ``noexec`` tmpfs working directory of ``disk_mb`` MB and ``WORKDIR_INODES`` inodes: writes, deletes,
   renames, ``chmod``/``utime``, links, FIFOs and device nodes anywhere else fail in the kernel however the path
   is spelt (``dir_fd``, symlinks, races), and neither the disk nor the kernel's memory can be filled through it.
   The training environment, its packages' data (an answer key shipped in a package), data sets, caches and
   home directories are not visible.
4b. **Landlock** (``landlock``): the same view as kernel rules (read the view, write the working directory,
   execute nothing), which the spawner takes on before any program runs; in a deployment without a root of its
   own it is what keeps the program to the view.
5. **no_new_privs and seccomp** (``no_new_privs``, ``seccomp``; the filter is compiled once by libseccomp
   through ``pyseccomp``): the sandbox gets ``EPERM`` for ``fork``/``vfork``/``clone``/``execve`` (every spawn
   route: ``subprocess``, ``_posixsubprocess``, ``posix``, ``os.posix_spawn``, ``pty``), ``ptrace`` and
   cross-process memory, signals to anything but its own process group, ``pidfd_*``, ``setpriority``,
   ``sched_set*``, ``setsid``/``setpgid``, ``prctl``, ``mount``/``unshare``/``setns``/``chroot``,
   ``mknod``, sockets, System V IPC and POSIX message queues, ``bpf``, ``perf_event_open``, ``io_uring``,
   ``userfaultfd``, keyrings, modules, extended attributes, ``fcntl`` signals (``F_SETOWN``/``F_SETSIG``),
   ``kexec``, clock and host settings; system calls of another architecture kill it.
6. **Resource limits** in the sandbox: ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (16 MB),
   ``RLIMIT_NOFILE`` (64), ``RLIMIT_NPROC`` (0: no new process or thread), ``RLIMIT_CORE`` (0); wall-clock
   limits enforced by the evaluator (``timeout_per_test`` for each test and for each program load,
   ``timeout_total`` for the job, ``max_timeouts``) and, as a backstop, by the trainer (per test and per job).
   The evaluator's memory is bounded too (docs/sandbox.md#the-evaluators-bounds).
7. **Python audit hook** (``audit_hook``, the last layer): refuses process control, signals, sockets,
   ``ctypes``, ``_posixshmem``, writes outside the working directory and any path through another process's
   ``/proc`` entry (checked before its magic links are followed); each refusal is one byte on a pipe the
   evaluator reads, so a refused operation fails its test (``"SandboxViolation"``) even when the program
   catches the error and erases whatever it can reach.

What is not guaranteed
----------------------
Where the kernel refuses user namespaces, or mounts inside them (some containers, hardened distributions), layer 4
is missing and Landlock alone keeps the program to its view: the working directory is a host temp dir emptied
between tests (without recursion, entered through a directory fd), the disk is not capped and the names (never
the files) of a masked tree below a listed directory can be listed. A root trainer's job still runs under its own
uid, reaching a Python installation that uid cannot read by path through directory fds opened before the drop.
Where there is neither a root of its own nor Landlock the run is refused (:class:`SandboxUnavailable`, saying what
to enable): the program would see the host's files. The evaluator decides this from what it set up itself, never
from what a sandbox reports. Without ``pyseccomp``/libseccomp layer 5 is ``no_new_privs`` only. The first use in a process runs a canary program whose tests must pass, and raises
:class:`SandboxUnavailable` where they do not. The kernel itself is shared: a kernel exploit is out of scope (use a
VM or gVisor for that). The evaluator runs the tests as trusted code: tests that execute what the program returns
are only as safe as that. docs/sandbox.md has the threat model and what each deployment gets.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import fcntl
import functools
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from comlrl_lightning.envs._sandbox_worker import KERNEL_LAYERS, KILL_GRACE_S, remove_tree
from comlrl_lightning.runs import stop

__all__ = ["ExecutionResult", "Job", "run_tests", "run_many", "isolation_layers", "KERNEL_LAYERS", "SandboxUnavailable"]

logger = logging.getLogger(__name__)

Isolation = Literal["best_effort", "strict"]
WORKER = Path(__file__).with_name("_sandbox_worker.py")
STDOUT_LIMIT = 4096  # bytes of program/test output kept in the result
SANDBOX_UID_BASE = 1 << 30  # a root trainer runs each job under its own uid/gid in [base, base + 65536)
_STARTUP_S = 5.0  # evaluator start-up allowance on top of timeout_total before the trainer kills it
_REPORT_LIMIT = 1 << 20  # bytes of one evaluator report line
_STOP_POLL_S = 0.5  # longest wait for a report between two looks at a requested stop (runs/stop.py)
# "1": run as on a machine that refuses namespaces / mounts inside them / Landlock (the suite forces deployments)
NO_NAMESPACES_ENV = "COMLRL_SANDBOX_NO_NAMESPACES"
NO_MOUNTS_ENV = "COMLRL_SANDBOX_NO_MOUNTS"
NO_LANDLOCK_ENV = "COMLRL_SANDBOX_NO_LANDLOCK"
_FORCING = (NO_NAMESPACES_ENV, NO_MOUNTS_ENV, NO_LANDLOCK_ENV)
_LEFTOVER_DIRS = ("/dev/shm", "/tmp", "/var/tmp", "/run/lock")  # world-writable trees a job's uid might reach


class SandboxUnavailable(RuntimeError):
    """This machine cannot run generated programs safely or correctly (the message says what to enable). A run
    stops on it: training on rewards the sandbox could not compute would be training on noise."""


@dataclass
class ExecutionResult:
    passed: int
    total: int
    timeouts: int
    errors: list[str] = field(default_factory=list)  # one entry per failed test
    syntax_ok: bool = True
    stdout: str = ""

    @property
    def pass_ratio(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class Job:
    """One program and its tests. ``setup`` is trusted test code run before each test in the evaluator (imports,
    helpers, ``unittest.TestCase`` classes); ``entry_points`` are the program names the tests call that may
    shadow a builtin (MBPP's ``sum``): every other builtin name in a test is the real builtin."""

    program: str
    tests: Sequence[str]
    setup: str = ""
    entry_points: Sequence[str] = ()

    def names(self) -> tuple[str, ...]:
        """The program's names the tests may use: ``entry_points``, or where none are given the functions,
        classes and variables the program defines at its top level -- never what it imports (a test that uses
        ``math`` gets it from ``setup`` or not at all) nor a builtin's name (only a named entry point may shadow
        one, as MBPP 126's ``sum``). The rewards name their entry points."""
        if self.entry_points:
            return tuple(self.entry_points)
        from comlrl_lightning.envs.untrusted import parse_python

        tree = parse_python(self.program)
        names: list[str] = []
        for node in tree.body if tree is not None else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        return tuple(name for name in dict.fromkeys(names) if not hasattr(builtins, name))


@functools.lru_cache(maxsize=64)
def package_paths(names: tuple[str, ...]) -> tuple[str, ...]:
    """The files and directories of the installed packages ``names`` (import names: ``numpy``, ``docx``) and of
    every distribution they require (unconditionally), as installed: what a job's view adds to the standard
    library. Raises ValueError naming a package that is not installed."""
    import importlib.metadata as metadata
    import importlib.util

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    by_import = metadata.packages_distributions()
    paths: set[str] = set()
    todo: list[str] = []
    for name in names:
        if name.split(".")[0] in sys.stdlib_module_names:
            continue
        if name in by_import:
            todo += by_import[name]
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or not (spec.submodule_search_locations or spec.origin):
            raise ValueError(
                f"packages: {name!r} is not installed in this environment (the sandbox shows a program only the "
                "standard library and the installed packages named here)"
            )
        paths.update(spec.submodule_search_locations or [spec.origin])
    seen: set[str] = set()
    while todo:
        dist_name = canonicalize_name(todo.pop())
        if dist_name in seen:
            continue
        seen.add(dist_name)
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:  # an optional requirement that is not installed
            continue
        for file in dist.files or ():
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith((".dist-info", ".egg-info", ".pth")):
                continue
            paths.add(str(dist.locate_file(top)))
        for text in dist.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return tuple(sorted(paths))


_CANARY = Job("def canary(x):\n    return x + 1\n", ["assert canary(1) == 2", "assert canary(-1) == 0"])


class _Launcher:
    """The worker's launcher process: started once per trainer process (again after a fork or a crash); forks
    one evaluator per job."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.owner = 0

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-B", str(WORKER), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                cwd="/",
                env=_clean_env("/"),
                start_new_session=True,
            )
        mine.settimeout(30.0)
        self.sock, self.owner = mine, os.getpid()

    def stop(self) -> None:
        if self.sock is not None and self.owner == os.getpid():
            self.sock.close()
            self.proc.wait()
        self.sock = self.proc = None

    def start_job(self, fds: list[int]) -> int | None:
        """Fork an evaluator for a job; returns a pidfd for it (None when it is already gone)."""
        with self.lock:
            for attempt in (0, 1):
                if self.sock is None or self.owner != os.getpid() or self.proc.poll() is not None:
                    self.sock = None
                    self._start()
                try:
                    socket.send_fds(self.sock, [b"job"], fds)
                    msg, pidfds, _, _ = socket.recv_fds(self.sock, 64, 1)
                    if msg:
                        return pidfds[0] if pidfds else None
                except OSError:
                    if attempt:
                        raise
                self.stop()
            raise RuntimeError("the sandbox launcher stopped")


_launcher = _Launcher()
atexit.register(_launcher.stop)


def _clean_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _sandbox_ids() -> tuple[int, int]:
    if os.geteuid() != 0:
        return os.getuid(), os.getgid()
    uid = SANDBOX_UID_BASE + secrets.randbelow(1 << 16)
    return uid, uid


def _kill(pidfd: int | None) -> None:
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def run_tests(
    program: str,
    tests: Sequence[str],
    *,
    setup: str = "",
    entry_points: Sequence[str] = (),
    timeout_per_test: float = 10.0,
    timeout_total: float = 60.0,
    memory_mb: int = 512,
    disk_mb: int = 64,
    max_timeouts: int = 3,
    isolation: Isolation = "best_effort",
    packages: Sequence[str] = (),
) -> ExecutionResult:
    """Run ``program``, then each test against it (see the module docstring); ``setup`` and ``entry_points`` as
    in :class:`Job`. ``packages``: the installed packages (import names) the program and its tests may import
    besides the standard library, with what they require (:func:`package_paths`); nothing else of the Python
    environment is visible to them.

    Never raises because of user code; infrastructure failures (cannot start a process, ...) are logged and
    reported as ``"Crash"`` for every test. Raises :class:`SandboxUnavailable` where this machine cannot run a
    program safely or correctly (checked once per process with a canary program), and ``isolation="strict"``
    a RuntimeError where the kernel layers are missing."""
    job = Job(program, [str(t) for t in tests], setup, tuple(entry_points))
    limits = dict(
        timeout_per_test=float(timeout_per_test),
        timeout_total=float(timeout_total),
        memory_mb=int(memory_mb),
        disk_mb=int(disk_mb),
        max_timeouts=int(max_timeouts),
        packages=list(package_paths(tuple(packages))),
    )
    if isolation == "strict":
        _require_kernel_layers()
    elif isolation != "best_effort":
        raise ValueError(f"isolation must be 'best_effort' or 'strict', got {isolation!r}")
    else:
        isolation_layers()
    try:
        return _run(job, limits, isolation)[0]
    except SandboxUnavailable:
        raise
    except RuntimeError as exc:
        if isolation == "strict" and "refused" in str(exc):
            raise
        logger.exception("sandbox infrastructure failure")
    except Exception:  # pragma: no cover - defensive
        logger.exception("sandbox infrastructure failure")
    total = len(job.tests)
    return ExecutionResult(passed=0, total=total, timeouts=0, errors=["Crash"] * total, syntax_ok=True)


def _run(job: Job, limits: dict[str, Any], isolation: str) -> tuple[ExecutionResult, dict[str, Any]]:
    """Run ``job`` in an evaluator; the trainer watches each test's time. A test that overruns its timeout by
    :data:`KILL_GRACE_S` (a C call in the test that never returns to Python: SIGALRM cannot end it) has its
    evaluator killed and is a ``Timeout``; one whose evaluator dies in it is a ``Crash``; a new evaluator goes on
    with the tests after it."""
    total, start = len(job.tests), time.monotonic()
    errors_out: list[str | None] = []  # per finished test: None (passed) or its error, in test order
    outcomes: list[_Outcome] = []
    while True:
        remaining = limits["timeout_total"] - (time.monotonic() - start)
        part = Job(job.program, job.tests[len(errors_out) :], job.setup, job.names())
        outcome = _run_once(part, {**limits, "timeout_total": max(remaining, 0.0)}, isolation)
        outcomes.append(outcome)
        program = outcome.program
        if len(outcomes) == 1:  # the first load decides the program-level result
            stdout = outcome.stdout
            if program is None:
                fill = "Timeout" if outcome.killed_for_time else "Crash"
                return ExecutionResult(0, total, total if fill == "Timeout" else 0, [fill] * total, True, stdout), {}
            if not program.get("syntax_ok", True):
                return ExecutionResult(0, total, 0, ["SyntaxError"] * total, False, stdout), outcome.layers
            if program.get("error") is not None:
                errors = [_error_name(program["error"])] * total
                return ExecutionResult(0, total, errors.count("Timeout"), errors, True, stdout), outcome.layers
        elif program is None or program.get("error") is not None:  # a later evaluator could not load it again
            errors_out += ["Crash" if program is None else _error_name(program["error"])] * (total - len(errors_out))
            break
        errors_out += outcome.tests
        if outcome.ended_in is None:  # finished, or ended between tests or out of the job's time: the rest is filled
            errors_out += ["Timeout" if outcome.killed_for_time else "Crash"] * (total - len(errors_out))
            break
        timeouts = errors_out.count("Timeout")
        if (
            len(errors_out) >= total
            or timeouts >= limits["max_timeouts"]
            or time.monotonic() - start >= limits["timeout_total"]
        ):
            errors_out += ["Timeout"] * (total - len(errors_out))
            break
    failed = [e for e in errors_out if e is not None]
    layers = next((o.layers for o in reversed(outcomes) if o.layers), {})
    return ExecutionResult(total - len(failed), total, failed.count("Timeout"), failed, True, stdout), layers


@dataclass
class _Outcome:
    """What one evaluator reported: the program's load, the tests it finished (their errors), ``ended_in``: the
    test under way when it ended early (killed for that test's time, or dead: None when it was not), and its
    output and layers."""

    program: dict[str, Any] | None = None
    tests: list[str | None] = field(default_factory=list)
    ended_in: int | None = None
    killed_for_time: bool = False
    stdout: str = ""
    layers: dict[str, Any] = field(default_factory=dict)


def _run_once(job: Job, limits: dict[str, Any], isolation: str) -> _Outcome:
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    uid, gid = _sandbox_ids()
    if os.geteuid() == 0:
        os.chown(workdir, uid, gid)
    cfg = dict(
        limits,
        program=job.program,
        workdir=workdir,
        uid=uid,
        gid=gid,
        isolation=isolation,
        **{key: os.environ.get(env, "") != "1" for key, env in zip(("namespaces", "mounts", "landlock"), _FORCING)},
    )
    rest = {"tests": list(job.tests), "setup": job.setup, "entry_points": list(job.names())}
    out, done = _Outcome(), None
    try:
        with tempfile.TemporaryFile() as errors:
            # The job travels through a pipe, read by the evaluator before any sandbox exists: no file of the
            # trainer's ever holds the tests (a program could open it through /proc/<trainer>/fd).
            payload_r, payload_w = os.pipe()
            rfd, wfd = os.pipe()
            try:
                pidfd = _launcher.start_job([payload_r, wfd, errors.fileno()])
            except BaseException:
                os.close(payload_w)
                raise
            finally:
                os.close(wfd)
                os.close(payload_r)
            try:
                _send_payload(payload_w, (cfg, rest))
                done = _follow(rfd, limits, out)
            finally:
                os.close(rfd)
                _kill(pidfd)
            if done is None and not out.killed_for_time and out.ended_in is None:
                errors.seek(0)
                tail = errors.read(4096).decode("utf-8", "replace").strip()
                if tail:
                    logger.warning("sandbox evaluator stopped early: %s", tail)
    finally:
        try:
            remove_tree(workdir)
        finally:
            confined = ((done or {}).get("layers") or {}).get  # the evaluator's own account, never the sandbox's
            if os.geteuid() == 0 and not (confined("read_only_root") or confined("landlock")):
                _remove_leftovers(uid)
    out.stdout = str((done or {}).get("stdout", ""))[:STDOUT_LIMIT]
    out.layers = (done or {}).get("layers") or {}
    return out


def _error_name(error: Any) -> str:
    """An error the evaluator reported, as the trainer keeps it: an ASCII identifier of at most 100 characters
    (an exception's name or a verdict), else ``SandboxException``, so that no text of the program reaches the
    error list or a multi-turn feedback prompt (the evaluator already names errors so; this is the second
    check)."""
    if isinstance(error, str) and len(error) <= 100 and error.isascii() and error.isidentifier():
        return error
    return "SandboxException"


def _follow(fd: int, limits: dict[str, Any], out: _Outcome) -> dict[str, Any] | None:
    """Read the evaluator's reports into ``out`` until its ``done`` report (returned), its end, the job's deadline
    or a test's own (each ``begin`` report starts one)."""
    job_deadline = time.monotonic() + limits["timeout_total"] + _STARTUP_S
    test = {"i": None, "deadline": job_deadline}  # the test under way and when it must have ended
    for msg in _reports(fd, lambda: min(job_deadline, test["deadline"])):
        phase = msg.get("phase")
        if phase == "unavailable":
            raise SandboxUnavailable(_UNAVAILABLE)
        if phase == "refused":
            missing = ", ".join(map(str, msg.get("missing", [])))
            raise RuntimeError(f"sandbox refused to run with isolation='strict': missing {missing}")
        if phase == "program" and out.program is None:
            out.program = msg
        elif phase == "begin" and msg.get("i") == len(out.tests) and isinstance(msg.get("seconds"), (int, float)):
            test.update(i=msg["i"], deadline=time.monotonic() + float(msg["seconds"]) + KILL_GRACE_S)
        elif phase == "test" and out.program is not None and msg.get("i") == len(out.tests):
            err = msg.get("error")
            out.tests.append(None if err is None else _error_name(err))
            test.update(i=None, deadline=job_deadline)
        elif phase == "done":
            return msg
    overran = time.monotonic() >= test["deadline"]
    if test["i"] is not None and (overran or time.monotonic() < job_deadline):
        # Killed for this test's time, or dead in it (a test that ends the process): the test pays, and the
        # next evaluator goes on after it.
        out.tests.append("Timeout" if overran else "Crash")
        out.ended_in = test["i"]
    else:
        out.killed_for_time = time.monotonic() >= job_deadline
    return None


_UNAVAILABLE = (
    "the sandbox cannot show generated programs only what they may see on this machine: it could neither build "
    "a root of its own (user and mount namespaces: refused, or mounts refused inside them) nor confine the "
    "program with Landlock, so a program would see the host's files (data sets, answer keys, home directories). "
    "Enable one of them: Landlock (Linux 5.13 or later with 'landlock' in the lsm= boot parameter or "
    "CONFIG_LSM; most distributions have it on), or unprivileged user namespaces with mounts (sysctl "
    "kernel.unprivileged_userns_clone=1; on Ubuntu 23.10+ also kernel.apparmor_restrict_unprivileged_userns=0; "
    "in Docker, --security-opt seccomp=unconfined and apparmor=unconfined, or CAP_SYS_ADMIN) "
    "(docs/sandbox.md#deployments)."
)


def _send_payload(fd: int, parts: Sequence[dict[str, Any]]) -> None:
    """Write the job to the evaluator's pipe and close it (an evaluator gone early: the reports say why)."""
    data = b"".join(b"%020d" % len(p) + p for p in (json.dumps(part).encode() for part in parts))
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), min(max(len(data), 1 << 16), 1 << 20))
    except OSError:
        pass
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


def _remove_leftovers(uid: int) -> None:
    """What a job's uid left in the shared temporary trees (``/dev/shm`` segments, files anywhere below ``/tmp``,
    ``/var/tmp``, ``/run/lock``) when neither a root of its own nor Landlock kept it in its working directory (an
    evaluator that died before it said which it had). Walks every directory the job could traverse (any user may
    search it), without recursion; only the job's own uid (one of a root trainer's sandbox uids, never the
    trainer's or any other user's) has its files removed."""
    if not SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + (1 << 16) or uid == os.geteuid():
        return
    todo = list(_LEFTOVER_DIRS)
    while todo:
        folder = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == uid:
                    remove_tree(entry.path)
                elif entry.is_dir(follow_symlinks=False) and info.st_mode & 0o001:
                    todo.append(entry.path)
            except OSError:
                pass


def _reports(fd: int, deadline: Any):
    """The evaluator's report lines (dicts) until EOF or ``deadline()`` (asked again after every read)."""
    buf = bytearray()
    while True:
        remaining = deadline() - time.monotonic()
        if remaining <= 0:
            return
        stop.check()  # a safe point while waiting (runs/stop.py): the caller's clean-up kills the evaluator
        if not select.select([fd], [], [], min(remaining, _STOP_POLL_S))[0]:
            continue  # asked again: the deadline, a stop
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            end = buf.index(b"\n")
            line = bytes(buf[:end])
            del buf[: end + 1]
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict):
                yield msg
        if len(buf) > _REPORT_LIMIT:
            return


_layers: tuple[str, Any] | None = None  # (the namespaces setting, its layers or why the sandbox is unavailable)
_layers_lock = threading.Lock()


def isolation_layers() -> dict[str, Any]:
    """The layers of isolation this machine gives a sandbox (``KERNEL_LAYERS`` plus ``uid``, ``rlimits`` and
    ``audit_hook``): probed once per process (and again after :envvar:`COMLRL_SANDBOX_NO_NAMESPACES` changes)
    by running a canary program whose tests must pass, and logged once. Raises :class:`SandboxUnavailable` where
    the sandbox would be unsafe or where the canary fails (a run would otherwise train on every test failing)."""
    global _layers
    key = ",".join(os.environ.get(env, "") for env in _FORCING)
    with _layers_lock:
        if _layers is None or _layers[0] != key:
            try:
                result, layers = _run(
                    _CANARY,
                    dict(timeout_per_test=10.0, timeout_total=30.0, memory_mb=512, disk_mb=1, max_timeouts=1),
                    "best_effort",
                )
                if result.passed != result.total:
                    raise SandboxUnavailable(
                        f"the sandbox fails a correct program on this machine (a canary whose {result.total} tests "
                        f"must pass: errors {result.errors}), so every reward that runs code would be 0; layers: "
                        f"{layers or 'none reported'}. See docs/sandbox.md#deployments for what each deployment "
                        "needs."
                    )
            except SandboxUnavailable as error:
                _layers = (key, error)
            else:
                _layers = (key, layers)
                _log_layers(layers)
        if isinstance(_layers[1], SandboxUnavailable):
            raise SandboxUnavailable(str(_layers[1]))
        return dict(_layers[1])


def _missing(layers: dict[str, Any]) -> list[str]:
    missing = [k for k in KERNEL_LAYERS if not layers.get(k)]
    return missing + ["unprivileged uid"] * (layers.get("uid", 0) == 0)


def _log_layers(layers: dict[str, Any]) -> None:
    present = [k for k in (*KERNEL_LAYERS, "rlimits", "audit_hook") if layers.get(k)]
    missing = _missing(layers)
    line = f"sandbox isolation: uid {layers.get('uid')}; layers: {', '.join(present) or 'none'}"
    if missing:
        logger.warning(
            "%s; MISSING: %s (%s; docs/sandbox.md#deployments)",
            line,
            ", ".join(missing),
            "Landlock keeps the program to its view"
            if layers.get("landlock")
            else "a root of its own keeps the program to its view",
        )
    else:
        logger.info(line)


def _require_kernel_layers() -> None:
    missing = _missing(isolation_layers())
    if missing:
        raise RuntimeError(f"sandbox_isolation='strict' but this machine lacks: {', '.join(missing)}")


def run_many(
    jobs: Sequence[Job | tuple[str, Sequence[str]]], *, workers: int = 2, **limits: Any
) -> list[ExecutionResult]:
    """Run several jobs (:class:`Job` or ``(program, tests)``) in parallel; results keep job order."""
    jobs = [j if isinstance(j, Job) else Job(j[0], j[1]) for j in jobs]
    if not jobs:
        return []

    def one(job: Job) -> ExecutionResult:
        stop.check()  # a safe point per job (runs/stop.py): after a stop the queued jobs end at once
        return run_tests(job.program, job.tests, setup=job.setup, entry_points=job.entry_points, **limits)

    with ThreadPoolExecutor(max_workers=max(1, int(workers))) as pool:
        return list(pool.map(one, jobs))
