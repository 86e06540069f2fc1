"""Escapes from the sandbox, each observed from outside (comlrl_lightning.envs.sandbox).

Every program first switches the sandbox's Python audit hook off (``GUARD_OFF``, the review's re-entrancy-flag
attack), so what is tested is the kernel layers: the test checks canary files, processes, the trainer's
environment, priority and affinity, the disk and the trainer's memory after the run. A test that needs a
kernel layer this machine does not give is skipped and names it; the flood tests run everywhere.
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_sandbox_verdict import GUARD_OFF

from comlrl_lightning.envs import coding as C
from comlrl_lightning.envs.sandbox import KERNEL_LAYERS, SANDBOX_UID_BASE, isolation_layers, run_tests

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandbox relies on Linux/POSIX")

LAYERS = isolation_layers() if sys.platform.startswith("linux") else {}
FAST = {"timeout_per_test": 3.0, "timeout_total": 20.0}


def needs(*layers: str):
    missing = [name for name in layers if not LAYERS.get(name)]
    return pytest.mark.skipif(bool(missing), reason=f"kernel layer(s) not available on this machine: {missing}")


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def sandbox_uid_processes() -> list[int]:
    """Pids of live processes owned by a sandbox uid (root trainers only) that run something other than the
    sandbox's own worker (another test file's jobs may be running at the same time)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if SANDBOX_UID_BASE <= os.stat(f"/proc/{pid}").st_uid < SANDBOX_UID_BASE + (1 << 16):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read()
                if command and b"_sandbox_worker.py" not in command:  # empty: a zombie, being reaped
                    out.append(int(pid))
        except OSError:
            pass
    return out


def settled(check, seconds: float = 2.0):
    """``check()`` after processes had up to ``seconds`` to disappear (True as soon as it is)."""
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def test_guard_off_switches_the_audit_hook_off():
    """The premise of this file: after GUARD_OFF the audit hook refuses nothing (on the host this read of
    another process's /proc is a SandboxViolation)."""
    program = "open('/proc/1/status').read()\nopen('/proc/1/cmdline').read()"
    assert run_tests(program, ["assert True"], **FAST).errors == ["SandboxViolation"]
    assert run_tests(GUARD_OFF + program, ["assert True"], **FAST).passed == 1


SPAWN_ROUTES = {
    "os.system": "import posix\nassert posix.system('sleep {mark} &') == 0",
    "fork_exec": "import posix\nif posix.fork() == 0:\n    posix.execv('/bin/sleep', ['sleep', '{mark}'])",
    "subprocess": "import importlib, subprocess\nimportlib.reload(subprocess)\n"
    "subprocess.Popen(['sleep', '{mark}'], start_new_session=True)",
    "_posixsubprocess": "import _posixsubprocess, importlib, subprocess\nimportlib.reload(subprocess)\n"
    "subprocess._fork_exec = getattr(subprocess, '_fork_exec', _posixsubprocess.fork_exec)\n"
    "subprocess.run(['sleep', '{mark}'], timeout=60)",
    "posix_spawn": "import posix\nposix.posix_spawn('/bin/sleep', ['sleep', '{mark}'], {{}})",
    "pty": "import posix\npid, fd = posix.forkpty()\nif pid == 0:\n    posix.execv('/bin/sleep', ['sleep', '{mark}'])",
    "exec_in_place": "import posix\nposix.execv('/bin/sleep', ['sleep', '{mark}'])",
    "double_fork_setsid": "import posix\nif posix.fork() == 0:\n    posix.setsid()\n    if posix.fork() == 0:\n"
    "        posix.execv('/bin/sleep', ['sleep', '{mark}'])\n    posix._exit(0)",
    "thread": "import threading, time\nthreading.Thread(target=time.sleep, args=({mark},), daemon=True).start()",
}


@needs("seccomp")
@pytest.mark.parametrize("route", sorted(SPAWN_ROUTES))
def test_no_process_is_created_by_any_spawn_route(route):
    mark = f"31.{secrets.randbelow(10**9):09d}"
    program = GUARD_OFF + SPAWN_ROUTES[route].format(mark=mark) + "\nSPAWNED = True"
    r = run_tests(program, ["assert SPAWNED"], **FAST)
    assert r.passed == 0, r
    assert settled(lambda: not processes_with(mark)), f"{route}: a process of the sandbox is running"
    if os.geteuid() == 0:
        assert settled(lambda: not sandbox_uid_processes())


WRITES = """
import os, shutil
def attack(paths):
    done = []
    def attempt(name, fn):
        try:
            fn()
            done.append(name)
        except Exception:
            pass
    for p in paths:
        d = os.path.dirname(p)
        attempt("write " + p, lambda: open(p, "w").write("pwned"))
        attempt("append " + p, lambda: open(p, "a").write("pwned"))
        attempt("truncate " + p, lambda: os.truncate(p, 0))
        attempt("chmod " + p, lambda: os.chmod(p, 0o777))
        attempt("fchmod on a read-only fd " + p, lambda: os.fchmod(os.open(p, os.O_RDONLY), 0o777))
        attempt("utime " + p, lambda: os.utime(p, (0, 0)))
        attempt("rename " + p, lambda: os.rename(p, p + ".moved"))
        attempt("link " + p, lambda: os.link(p, p + ".link"))
        attempt("remove " + p, lambda: os.remove(p))
        attempt("new file in " + d, lambda: open(os.path.join(d, "new"), "w").close())
        attempt("mkfifo in " + d, lambda: os.mkfifo(os.path.join(d, "fifo")))
        attempt("mknod in " + d, lambda: os.mknod(os.path.join(d, "node"), 0o600 | 0o020000, os.makedev(1, 3)))
        attempt("mkdir in " + d, lambda: os.mkdir(os.path.join(d, "dir")))
        root = os.open("/", os.O_RDONLY)
        attempt("dir_fd write " + p, lambda: os.open(p.lstrip("/"), os.O_WRONLY | os.O_CREAT, dir_fd=root))
        attempt("symlink then write " + p, lambda: (os.symlink(p, "via"), open("via", "w").write("pwned")))
        attempt("rmtree " + d, lambda: shutil.rmtree(d))
    return done
"""


def _snapshot(paths):
    return {p: (open(p).read(), os.stat(p).st_mode, os.stat(p).st_mtime_ns) for p in paths}


@needs("read_only_root", "mount_ns")
def test_files_outside_the_workdir_are_untouched(tmp_path):
    """Writes, appends, truncation, chmod (also through a read-only descriptor), utime, rename, link, remove,
    FIFOs, device nodes, directories, dir_fd-relative paths, symlinks and rmtree against canaries outside the
    working directory: in the host's temp dir (invisible in the sandbox) and, as root, next to the Python
    installation (visible, read-only)."""
    canaries = [tmp_path / "canary.txt"]
    if os.geteuid() == 0:
        canaries.append(_visible_canary_dir(tmp_path) / "canary.txt")
    for c in canaries:
        c.write_text("original")
    paths = [str(c) for c in canaries]
    before, listing = _snapshot(paths), {str(c.parent): sorted(os.listdir(c.parent)) for c in canaries}
    r = run_tests(GUARD_OFF + WRITES, [f"assert attack({paths!r}) == []"], **FAST)
    assert r.passed == 1, r
    assert _snapshot(paths) == before
    assert {d: sorted(os.listdir(d)) for d in listing} == listing


def _visible_canary_dir(tmp_path):
    """A directory inside the Python installation (bound read-only into the sandbox), removed after the test."""
    path = os.path.join(sys.base_prefix, f"sandbox-canary-{secrets.token_hex(4)}")
    os.mkdir(path)
    (tmp_path / "cleanup").write_text(path)
    return Path(path)


@pytest.fixture(autouse=True)
def _remove_visible_canaries(tmp_path):
    yield
    marker = tmp_path / "cleanup"
    if marker.exists():
        shutil.rmtree(marker.read_text(), ignore_errors=True)


@needs("read_only_root")
def test_only_harmless_devices():
    program = GUARD_OFF + (
        "import os\ndef devices():\n    return sorted(os.listdir('/dev'))\n"
        "def open_any(names):\n    ok = []\n    for n in names:\n        try:\n            open(n, 'rb').close()\n"
        "            ok.append(n)\n        except OSError:\n            pass\n    return ok"
    )
    harmless = {"null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr"}
    tests = [
        f"assert set(devices()) <= {harmless!r}",
        "assert open_any(['/dev/sda', '/dev/vda', '/dev/mem', '/dev/kmsg', '/dev/tty', '/dev/shm']) == []",
    ]
    assert run_tests(program, tests, **FAST).passed == 2


@needs("pid_ns")
def test_trainer_environment_and_processes_are_invisible(monkeypatch):
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("SANDBOX_TRAINER_SECRET", secret)
    program = (
        GUARD_OFF
        + f"""
import os
def pids():
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
def loot():
    out = []
    for pid in [*os.listdir("/proc"), "{os.getpid()}", "{os.getppid()}"]:
        for name in ("environ", "cmdline"):
            try:
                out.append(open(f"/proc/{{pid}}/{{name}}", "rb").read().decode("latin-1"))
            except OSError:
                pass
    print("".join(out))
    return "".join(out)
"""
    )
    # the job's PID namespace holds its spawner (PID 1), the test's sandbox and the test's evaluator process
    r = run_tests(
        program,
        [
            f"assert {secret!r} not in loot()",
            "assert len(pids()) <= 3 and 1 in pids()",
            f"assert {os.getpid()} not in pids() or {os.getpid()} <= 3",
        ],
        **FAST,
    )
    assert r.passed == 3, r
    assert secret not in r.stdout


@needs("pid_ns", "seccomp")
def test_other_processes_cannot_be_signalled_reniced_or_pinned():
    decoy = subprocess.Popen(["sleep", "60"])
    try:
        me, them = os.getpid(), decoy.pid
        state = lambda: [(os.getpriority(os.PRIO_PROCESS, p), os.sched_getaffinity(p)) for p in (me, them)]  # noqa
        before = state()
        program = (
            GUARD_OFF
            + f"""
import os, posix, signal
def attack():
    done = []
    for name, fn in [
        ("kill", lambda: posix.kill({them}, signal.SIGKILL)),
        ("kill all", lambda: posix.kill(-1, signal.SIGKILL)),
        ("pidfd", lambda: signal.pidfd_send_signal(os.pidfd_open({them}), signal.SIGKILL)),
        ("renice trainer", lambda: os.setpriority(os.PRIO_PROCESS, {me}, 19)),
        ("renice other", lambda: os.setpriority(os.PRIO_PROCESS, {them}, 19)),
        ("pin trainer", lambda: os.sched_setaffinity({me}, {{0}})),
        ("pin other", lambda: os.sched_setaffinity({them}, {{0}})),
    ]:
        try:
            fn()
            done.append(name)
        except Exception:
            pass
    return done
"""
        )
        r = run_tests(program, ["assert attack() == []"], **FAST)
        assert r.passed == 1, r
        assert decoy.poll() is None and state() == before
    finally:
        decoy.kill()
        decoy.wait()


@needs("net_ns")
def test_no_network(tcp_server):
    server, port = tcp_server
    program = GUARD_OFF + f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    assert run_tests(program, ["assert True"], **FAST).passed == 0
    with pytest.raises(socket.timeout):
        server.accept()


@needs("tmpfs_workdir")
def test_disk_quota():
    free_before = shutil.disk_usage(os.path.dirname(os.path.realpath(tempfile.gettempdir()))).free
    program = GUARD_OFF + (
        "def fill():\n    n = 0\n    try:\n        for i in range(64):\n"
        "            with open(f'blob{i}', 'wb') as f:\n                for _ in range(16):\n"
        "                    f.write(bytes(1 << 20))\n                    n += 1 << 20\n"
        "    except OSError:\n        pass\n    return n"
    )
    r = run_tests(program, ["assert fill() <= 9 << 20"], disk_mb=8, **FAST)
    assert r.passed == 1
    free_after = shutil.disk_usage(os.path.dirname(os.path.realpath(tempfile.gettempdir()))).free
    assert free_before - free_after < 64 << 20


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


FLOODS = {
    "stdout": "import os\ndef f(x):\n    chunk = b'x' * (1 << 20)\n    for _ in range(100):\n        os.write(1, chunk)\n"
    "    return 0",
    "stderr": "import sys\ndef f(x):\n    for _ in range(100):\n        sys.stderr.write('y' * (1 << 20))\n    return 0",
    "reply_channel": "import os\ndef f(x):\n    chunk = b'[' * (1 << 20)\n    for _ in range(100):\n"
    "        os.write(4, chunk)\n    return 0",
    "huge_result": "def f(x):\n    return 'z' * (100 << 20)",
    "result_lines": "import os\ndef f(x):\n    for _ in range(100000):\n        os.write(4, b'[\"ok\", null, null]\\n')\n"
    "    return 0",
}


@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_floods_do_not_reach_the_trainer(flood):
    """Output and result-channel floods (100 MB each) cost the sandbox and its evaluator, not the trainer."""
    rss0, peak0 = _rss_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_tests(FLOODS[flood], ["assert f(1) == 2"], timeout_per_test=10.0, timeout_total=30.0)
    assert r.passed == 0 and len(r.stdout.encode()) <= 4096 + 3
    assert _rss_kb() - rss0 < 20_000
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0 < 20_000


def test_self_inflicted_ends_cost_the_test_only():
    program = GUARD_OFF + (
        "import os, posix, signal, sys\ndef stop(x):\n    posix.kill(0, signal.SIGSTOP)\n"
        "def leave(x):\n    sys.exit(1)\ndef die(x):\n    os._exit(1)\ndef ok(x):\n    return x"
    )
    r = run_tests(
        program, ["stop(1)", "leave(1)", "die(1)", "assert ok(2) == 2"], timeout_per_test=1.0, timeout_total=20.0
    )
    assert r.passed == 1 and r.errors == ["Timeout", "SystemExit", "Crash"], r
    if os.geteuid() == 0:
        assert settled(lambda: not sandbox_uid_processes())


def test_strict_isolation_runs_here_or_refuses():
    missing = [k for k in KERNEL_LAYERS if not LAYERS.get(k)] + ["uid"] * (LAYERS.get("uid") == 0)
    reward = C.CodingReward(timeout_per_test=2.0, sandbox_isolation="strict")
    item = {"prompt": "def f(x):\n", "entry_point": "f", "test": ["assert f(1) == 2"]}
    main = "def f(x):\n    p = aux(x)\n    return 2 * x"
    if missing:
        with pytest.raises(RuntimeError, match="strict"):
            run_tests("x = 1", ["assert x == 1"], isolation="strict")
        with pytest.raises(RuntimeError, match="strict"):
            reward(["def aux(x):\n    return x"], [main], [item])
    else:
        assert run_tests("x = 1", ["assert x == 1"], isolation="strict").passed == 1
        assert reward(["def aux(x):\n    return x"], [main], [item]) == [pytest.approx(4.5)]
    with pytest.raises(ValueError, match="isolation"):
        run_tests("x = 1", [], isolation="paranoid")
