"""Best-effort sandbox for running untrusted, model-generated Python code.

Coding-task rewards execute programs written by the policy. This module runs
such a program plus a list of test snippets (``"assert f(1) == 2"``) and
reports how many passed, without letting the code hang, crash or tamper with
the training process.

Layers of containment (outermost first)
---------------------------------------
1. **Separate process.** Every call spawns a fresh ``sys.executable -I -B``
   interpreter (isolated mode: no ``PYTHON*`` env vars, no user site, no
   script dir on ``sys.path``; no ``.pyc`` writes). ``start_new_session=True``
   puts it in its own process group, which the parent kills with ``SIGKILL``
   when done or on timeout, so stragglers cannot outlive the call.
2. **Fresh working directory.** A new ``tempfile.mkdtemp`` directory is the
   child's cwd, ``HOME`` and ``TMPDIR``; it is deleted afterwards.
3. **Clean environment.** The child gets only ``PATH``, ``LANG``, ``HOME`` and
   ``TMPDIR``; nothing from the parent's ``os.environ`` (API keys, cloud
   credentials, ...) is inherited. Reading ``/proc/<other pid>/...`` (e.g. the
   parent's ``environ``) is denied by layer 6.
4. **Wall-clock limits enforced by the parent.** Each test has a deadline
   (``timeout_per_test`` plus a small grace) and the whole run has
   ``timeout_total``; on expiry the process group is ``SIGKILL``-ed. Inside the
   child, ``signal.setitimer`` raises a timeout in the running test so a
   simple ``while True: pass`` costs one test, not the whole run.
5. **Resource limits** (``resource.setrlimit``), applied by the child runner
   before any untrusted code is read or executed (not in ``preexec_fn``:
   that is documented as unsafe in multi-threaded parents such as a trainer
   or :func:`run_many`'s thread pool): ``RLIMIT_AS`` (``memory_mb``),
   ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (16 MB, ``SIGXFSZ`` ignored so writes fail
   with ``OSError`` rather than killing), ``RLIMIT_NOFILE`` (64),
   ``RLIMIT_NPROC`` (0 new processes/threads -- **not enforced for root**),
   ``RLIMIT_CORE`` (0).
6. **Python-level guard** installed before user code runs:

   * a ``sys.addaudithook`` hook (cannot be removed by Python code) that raises
     ``SandboxViolation`` for process creation (``os.fork``, ``os.forkpty``,
     ``os.system``, ``os.exec``, ``os.spawn``, ``os.posix_spawn``,
     ``subprocess.Popen``), signals to other processes (``os.kill``,
     ``os.killpg``, ``signal.pthread_kill``), networking
     (``socket.__new__``, ``socket.connect``, ``socket.bind``,
     ``socket.getaddrinfo``, ...), ``ctypes``/``cffi``/``_posixsubprocess``
     imports, ``resource.setrlimit`` (root could raise hard limits),
     ``gc.get_objects``/``get_referrers`` (used to dig out the runner's
     internals), any write/create/delete/rename/chmod/link outside the working
     directory (``open`` in write modes, ``os.remove``, ``os.rmdir``,
     ``os.rename``/``os.replace``, ``os.chmod``, ``os.mkdir``, ``os.utime``,
     ``shutil.rmtree``, ...; ``dir_fd`` arguments are resolved through
     ``/proc/self/fd``), opening directories outside it (which would give
     a ``dir_fd`` for ``os.open``), and reads of other processes' ``/proc``;
   * ``os.fork``/``os.system``/``os.exec*``/``os.spawn*``/``os.kill``/
     ``subprocess.Popen``/... replaced by functions raising
     ``SandboxViolation`` (clearer errors; the audit hook is the real check).

   Any violation during the program or a test fails it with
   ``"SandboxViolation"`` even if the user code catches the exception.
7. **Result channel.** The child reports one JSON line per phase on a
   dedicated pipe (an inherited fd, not stdout), each prefixed by a random
   nonce; the parent only accepts well-formed lines for the expected next
   test, so ``print`` noise cannot fake results. User stdout/stderr go to a
   temp file of which the first few KB are returned.

What is *not* guaranteed
------------------------
The Python-level guard is defence in depth against *accidental* damage and
casual reward hacking, not a security boundary: audit hooks do not see
everything done in C code, a determined attacker with a memory-corruption bug
or an unforeseen stdlib path can bypass them, and user code runs in the same
interpreter as the runner (it could, with effort, find the nonce and forge
results). Arbitrary files stay *readable*. As root, ``RLIMIT_NPROC`` is not
enforced, so fork containment relies on the guard. Real isolation needs OS
mechanisms (user/mount/network namespaces, seccomp, a container or gVisor,
an unprivileged uid); run training on a machine where that residual risk is
acceptable.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["ExecutionResult", "run_tests", "run_many"]

logger = logging.getLogger(__name__)

STDOUT_LIMIT = 4096  # bytes of user stdout/stderr kept in the result
_GRACE_S = 1.0  # parent-side slack on top of the in-child per-test timer
_STARTUP_S = 5.0  # interpreter start-up allowance for the first phase


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


# --------------------------------------------------------------------------- #
# Child-side runner. Executed with ``python -I -B -c _RUNNER <result_fd>``.
# Payload (JSON) arrives on stdin from an unlinked temp file.
# --------------------------------------------------------------------------- #
_RUNNER = r'''
import sys, os, json, resource, signal

def _main():
    rfd = int(sys.argv[1])
    payload = json.loads(sys.stdin.buffer.read())
    nonce = payload["nonce"]
    dn = os.open(os.devnull, os.O_RDONLY)
    os.dup2(dn, 0)
    os.close(dn)

    # ---- resource limits (before any untrusted code) -------------------- #
    mem = payload["memory_mb"] * 1024 * 1024
    cpu = payload["cpu_s"]
    for lim, val in (
        (resource.RLIMIT_AS, (mem, mem)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (16 * 1024 * 1024,) * 2),
        (resource.RLIMIT_NOFILE, (64, 64)),
        (resource.RLIMIT_NPROC, (0, 0)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        try:
            resource.setrlimit(lim, val)
        except (ValueError, OSError):
            pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def emit(obj):
        os.write(rfd, (nonce + " " + json.dumps(obj) + "\n").encode())

    # ---- python-level guard ---------------------------------------------- #
    class SandboxViolation(PermissionError):
        pass

    class _Timeout(BaseException):
        pass

    import subprocess, builtins  # pre-import, then neuter (see below)

    workdir = os.path.realpath(os.getcwd())
    mypid = str(os.getpid())
    state = {"violations": 0, "busy": False}
    DENY = {
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.spawn",
        "os.posix_spawn", "subprocess.Popen", "pty.spawn",
        "os.kill", "os.killpg", "signal.pthread_kill",
        "socket.__new__", "socket.connect", "socket.bind",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
        "socket.sendto", "socket.sendmsg",
        "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
        "resource.setrlimit", "resource.prlimit",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "os.symlink", "os.link", "os.chown", "shutil.chown", "os.chroot",
        "os.setuid", "os.setgid", "os.setreuid", "os.setregid",
    }
    BAD_IMPORTS = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess"}
    # event -> ((path_arg_index, dir_fd_arg_index or None), ...)
    PATH_EVENTS = {
        "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
        "os.rename": ((0, 2), (1, 3)), "os.chmod": ((0, 2),),
        "os.utime": ((0, 3),), "os.truncate": ((0, None),),
        "os.chflags": ((0, None),), "os.setxattr": ((0, None),),
        "os.removexattr": ((0, None),), "shutil.rmtree": ((0, None),),
        "shutil.move": ((0, None), (1, None)),
    }
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def resolve(path, dir_fd=None):
        if isinstance(path, int):
            return None  # an already-open fd: it was checked when opened
        path = os.fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(path):  # AT_FDCWD (< 0) = the cwd
            base = os.readlink("/proc/self/fd/%d" % dir_fd)
            path = os.path.join(base, path)
        return os.path.realpath(path)

    def inside(p):
        return p is None or p == workdir or p.startswith(workdir + os.sep)

    def other_proc(p):
        parts = p.split(os.sep)
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != mypid

    def violation(event):
        state["violations"] += 1
        raise SandboxViolation("sandbox: %s denied" % event)

    def check(event, args):
        if event in DENY:
            violation(event)
        if event == "import" and args and args[0] in BAD_IMPORTS:
            violation("import " + args[0])
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, int):
                if path == rfd:
                    violation("open result fd")
                return
            p = resolve(path)
            write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            if write:
                if not (inside(p) or p == os.devnull):
                    violation("write " + p)
            elif other_proc(p) or (not inside(p) and os.path.isdir(p)):
                violation("open " + p)
            return
        spec = PATH_EVENTS.get(event)
        if spec:
            for pi, di in spec:
                dfd = args[di] if di is not None and di < len(args) else None
                if pi < len(args) and not inside(resolve(args[pi], dfd)):
                    violation(event)

    def hook(event, args):
        if state["busy"]:
            return
        state["busy"] = True
        try:
            check(event, args)
        except SandboxViolation:
            raise
        except Exception:  # a malformed path etc.: fail closed
            violation(event)
        finally:
            state["busy"] = False

    def blocked(*a, **k):
        state["violations"] += 1
        raise SandboxViolation("sandbox: process control is disabled")

    for name in ("fork", "forkpty", "system", "popen", "kill", "killpg",
                 "execv", "execve", "execl", "execle", "execlp", "execlpe",
                 "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                 "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn",
                 "posix_spawnp", "setsid", "setpgid"):
        if hasattr(os, name):
            setattr(os, name, blocked)
    class _BlockedPopen:
        def __init__(self, *a, **k):
            blocked()
    subprocess.Popen = _BlockedPopen
    for name in ("run", "call", "check_call", "check_output", "getoutput",
                 "getstatusoutput"):
        setattr(subprocess, name, blocked)
    subprocess._posixsubprocess = None
    sys.modules.pop("_posixsubprocess", None)
    sys.modules.pop("ctypes", None)
    sys.addaudithook(hook)

    # ---- per-test timer -------------------------------------------------- #
    def on_alarm(signum, frame):
        if state["in_test"]:
            raise _Timeout()
    state["in_test"] = False
    signal.signal(signal.SIGALRM, on_alarm)
    per_test = payload["timeout_per_test"]

    def run_phase(src, name, ns):
        """Run one phase; returns None on success or an error name."""
        v0 = state["violations"]
        err = None
        try:
            code = compile(src, name, "exec")
        except BaseException as e:  # SyntaxError, ValueError (null bytes), ...
            return "SyntaxError" if isinstance(e, SyntaxError) else type(e).__name__[:100]
        try:
            state["in_test"] = True
            signal.setitimer(signal.ITIMER_REAL, per_test)
            try:
                exec(code, ns)
            finally:
                state["in_test"] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:
            err = "Timeout"
        except BaseException as e:
            err = type(e).__name__[:100]
        if err != "Timeout" and state["violations"] != v0:
            err = "SandboxViolation"
        try:
            sys.stdout.flush(); sys.stderr.flush()
        except BaseException:
            pass
        return err

    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        compile(payload["program"], "<program>", "exec")
        syntax_ok = True
    except BaseException:
        syntax_ok = False
    if not syntax_ok:
        emit({"phase": "program", "syntax_ok": False, "error": "SyntaxError"})
        return
    err = run_phase(payload["program"], "<program>", ns)
    emit({"phase": "program", "syntax_ok": True, "error": err})
    if err is not None:
        return
    timeouts = 0
    for i, test in enumerate(payload["tests"]):
        if timeouts >= payload["max_timeouts"]:
            e = "Timeout"
        else:
            e = run_phase(test, "<test %d>" % i, ns)
            timeouts += e == "Timeout"
        emit({"phase": "test", "i": i, "error": e})
    emit({"phase": "done"})

try:
    _main()
except BaseException:
    pass
os._exit(0)
'''


def _clean_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - unkillable child
        logger.warning("sandbox child %d did not exit after SIGKILL", proc.pid)


def _rmtree(path: str) -> None:
    def onerror(func, p, exc):  # user code may have chmod-ed things read-only
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


def run_tests(
    program: str,
    tests: Sequence[str],
    *,
    timeout_per_test: float = 10.0,
    timeout_total: float = 60.0,
    memory_mb: int = 512,
    max_timeouts: int = 3,
) -> ExecutionResult:
    """Run ``program`` once, then each test snippet in the same namespace.

    Never raises because of user code; infrastructure failures (cannot spawn a
    process, ...) are logged and reported as ``"Crash"`` for every test.
    """
    tests = [str(t) for t in tests]
    total = len(tests)
    try:
        return _run(program, tests, timeout_per_test, timeout_total, memory_mb, max_timeouts)
    except Exception:  # pragma: no cover - defensive
        logger.exception("sandbox infrastructure failure")
        return ExecutionResult(passed=0, total=total, timeouts=0, errors=["Crash"] * total, syntax_ok=True)


def _run(
    program: str, tests: list[str], timeout_per_test: float, timeout_total: float, memory_mb: int, max_timeouts: int
) -> ExecutionResult:
    total = len(tests)
    nonce = secrets.token_hex(16)
    payload = {
        "nonce": nonce,
        "program": program,
        "tests": tests,
        "timeout_per_test": float(timeout_per_test),
        "max_timeouts": int(max_timeouts),
        "memory_mb": int(memory_mb),
        "cpu_s": int(timeout_total) + 2,
    }
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    rfd, wfd = os.pipe()
    proc = None
    program_info: dict[str, Any] | None = None
    test_errors: list[str | None] = []
    done = False
    killed_for_time = False
    try:
        with tempfile.TemporaryFile() as stdin_f, tempfile.TemporaryFile() as out_f:
            stdin_f.write(json.dumps(payload).encode())
            stdin_f.seek(0)
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-B", "-c", _RUNNER, str(wfd)],
                    stdin=stdin_f,
                    stdout=out_f,
                    stderr=subprocess.STDOUT,
                    cwd=workdir,
                    env=_clean_env(workdir),
                    pass_fds=(wfd,),
                    close_fds=True,
                    start_new_session=True,
                )
            finally:
                os.close(wfd)
            start = time.monotonic()
            overall_deadline = start + timeout_total
            phase_deadline = start + _STARTUP_S + timeout_per_test + _GRACE_S
            buf = b""
            while not done:
                now = time.monotonic()
                deadline = min(overall_deadline, phase_deadline)
                if now >= deadline:
                    killed_for_time = True
                    break
                ready, _, _ = select.select([rfd], [], [], deadline - now)
                if not ready:
                    continue
                chunk = os.read(rfd, 65536)
                if not chunk:  # child exited / closed the pipe
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    msg = _parse(line, nonce)
                    if msg is None:
                        continue
                    phase = msg.get("phase")
                    if phase == "program" and program_info is None:
                        program_info = msg
                        if msg.get("error") is not None or not msg.get("syntax_ok", True):
                            done = True
                            break
                    elif phase == "test" and program_info is not None and msg.get("i") == len(test_errors):
                        err = msg.get("error")
                        test_errors.append(None if err is None else str(err)[:100])
                    elif phase == "done" and program_info is not None and len(test_errors) == total:
                        done = True
                        break
                    else:
                        continue
                    phase_deadline = time.monotonic() + timeout_per_test + _GRACE_S
            _kill_group(proc)
            out_f.seek(0)
            stdout = out_f.read(STDOUT_LIMIT).decode("utf-8", errors="replace")
    finally:
        os.close(rfd)
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        _rmtree(workdir)

    # Fill in everything the child did not report.
    fill = "Timeout" if killed_for_time else "Crash"
    if program_info is None:
        return ExecutionResult(0, total, total if fill == "Timeout" else 0, [fill] * total, True, stdout)
    if not program_info.get("syntax_ok", True):
        return ExecutionResult(0, total, 0, ["SyntaxError"] * total, False, stdout)
    if program_info.get("error") is not None:
        errors = [str(program_info["error"])[:100]] * total
    else:
        errors = [e for e in test_errors if e is not None] + [fill] * (total - len(test_errors))
    passed = sum(e is None for e in test_errors)
    return ExecutionResult(passed, total, errors.count("Timeout"), errors, True, stdout)


def _parse(line: bytes, nonce: str) -> dict | None:
    prefix = nonce.encode() + b" "
    if not line.startswith(prefix):
        return None
    try:
        msg = json.loads(line[len(prefix) :])
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


def run_many(
    jobs: Sequence[tuple[str, Sequence[str]]], *, workers: int = 2, **limits: Any
) -> list[ExecutionResult]:
    """Run several ``(program, tests)`` jobs in parallel; results keep job order."""
    jobs = list(jobs)
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, int(workers))) as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], **limits), jobs))
