"""The processes behind :mod:`comlrl_lightning.envs.sandbox` (run as a script; standard library, plus
``pyseccomp`` for the seccomp layer when it is installed).

One launcher per trainer process forks one evaluator per job; the evaluator forks one spawner, and the spawner
forks one sandbox per test::

    trainer ──socket──▶ launcher  (trusted; a fresh interpreter started once; forks an evaluator per job)
                         └─ evaluator  (trusted; runs the test code and decides pass/fail; reports to the trainer)
                              └─ spawner  (trusted, holds no test; PID 1 of the job's PID namespace)
                                   └─ sandbox  (untrusted; one per test: the program, then the calls the test makes)

The spawner is forked before the evaluator reads the tests, so no sandbox (a fork of the spawner) has a test or an
expected value in its memory. A test is Python code run by the evaluator; the program's top-level names are
:class:`Remote` handles there, and each operation on one (call, attribute read or write, item access, iteration,
``len``/``bool``/``str``/``repr``, ``isinstance``) is one request on a pipe to the sandbox. Values cross as plain
data only (see :func:`encode`): what is not plain data comes back as a new handle, which is equal only to itself.
See the module docstring of :mod:`comlrl_lightning.envs.sandbox` for the layers of isolation.
"""

from __future__ import annotations

import builtins
import collections
import ctypes
import datetime
import decimal
import errno
import fractions
import gc
import importlib
import io
import json
import os
import pyexpat
import random
import resource
import select
import signal
import socket
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
import xml.parsers.expat as expat

MAX_MESSAGE = 8 << 20  # bytes of one request or reply on the channel
MAX_RECEIVED = 64 << 20  # bytes one test may receive from its sandbox in all (a generator of 6 MB strings...)
MAX_RANGE = 1 << 20  # elements of a range the sandbox may return (sorted(range(4 * 10**7)) is 1.5 GB here)
MAX_EXCEPTION_CLASSES = 256  # distinct exception names of the sandbox kept as classes
MAX_DEPTH = 100  # nesting of containers in one value
MAX_NAME = 100  # characters of an exception name from the sandbox (an ASCII identifier, else SANDBOX_EXCEPTION)
MAX_XML_BYTES = 1 << 20  # bytes (characters of a str) one XML parser of the evaluator takes: a file the program wrote
EVALUATOR_MEMORY_MB = 256  # address space a trusted evaluator may add to what it has mapped when it starts
TEST_MEMORY_MB = 512  # ... and for the tests it runs on top of that (a test decodes the program's values)
KILL_GRACE_S = 0.5  # the trainer kills an evaluator this long after a test's timeout (an uninterruptible C call)
VIOLATION_FD = 5  # the sandbox's end of the pipe its guard reports each refused operation on
STDOUT_LIMIT = 4096  # bytes of program/test output kept
SPAWNER_REPLY_S = 10.0  # the spawner answers at once; this only bounds a broken one

# ----------------------------------------------------------------------------------------------- codec
# Plain data: None, bool, str as JSON; everything else as a tagged list. Both directions use it; only the
# sandbox sends handles (["h", id, type name]) and exception classes (["E", name, builtin base]).

_CONTAINER_TAG = {list: "l", tuple: "t", set: "s", frozenset: "S"}
_TAG_CONTAINER = {tag: kind for kind, tag in _CONTAINER_TAG.items()}
_SCALAR_TAG = {int: "i", float: "f", complex: "c", bytes: "y", bytearray: "Y"}


def encode(value, other, depth=0):
    """JSON-ready form of ``value``; ``other(value)`` encodes what is not plain data (or raises TypeError)."""
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return ["i", format(value, "x")]
    if kind is float:
        return ["f", value.hex()]
    if depth >= MAX_DEPTH:
        return other(value)
    if kind in _CONTAINER_TAG:
        return [_CONTAINER_TAG[kind], [encode(v, other, depth + 1) for v in value]]
    if kind is dict:
        return ["d", [[encode(k, other, depth + 1), encode(v, other, depth + 1)] for k, v in value.items()]]
    if kind is bytes or kind is bytearray:
        return [_SCALAR_TAG[kind], value.hex()]
    if kind is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    return value_type(value, other, depth) or other(value)


def decode(data, other, depth=0):
    """Inverse of :func:`encode`; ``other(data)`` decodes the tags it does not know. Raises ValueError,
    TypeError (an unhashable key) or KeyError on malformed data."""
    if data is None or data is True or data is False or type(data) is str:
        return data
    if type(data) is not list or not data or depth > MAX_DEPTH:
        raise ValueError("malformed value")
    tag = data[0]
    if tag == "i":
        return int(_text(data, 1), 16)
    if tag == "f":
        return float.fromhex(_text(data, 1))
    if tag in _TAG_CONTAINER:
        items = data[1] if len(data) == 2 and type(data[1]) is list else _malformed()
        return _TAG_CONTAINER[tag](decode(v, other, depth + 1) for v in items)
    if tag == "d":
        pairs = data[1] if len(data) == 2 and type(data[1]) is list else _malformed()
        out = {}
        for pair in pairs:
            if type(pair) is not list or len(pair) != 2:
                _malformed()
            out[decode(pair[0], other, depth + 1)] = decode(pair[1], other, depth + 1)
        return out
    if tag == "y":
        return bytes.fromhex(_text(data, 1))
    if tag == "Y":
        return bytearray.fromhex(_text(data, 1))
    if tag == "c":
        return complex(float.fromhex(_text(data, 1)), float.fromhex(_text(data, 2)))
    if tag in _VALUE_DECODERS:
        if len(data) != 2 or type(data[1]) is not list:
            _malformed()
        value = _VALUE_DECODERS[tag](*[decode(v, other, depth + 1) for v in data[1]])
        if tag == "r" and _range_length(value) > MAX_RANGE:
            raise TooLarge(f"a range of over {MAX_RANGE} elements")
        return value
    return other(data)


class TooLarge(ValueError):
    """A value past what the evaluator decodes (the test's verdict is ``ResultTooLarge``)."""


def _range_length(r):
    try:
        return len(r)
    except OverflowError:  # past sys.maxsize
        return MAX_RANGE + 1


def _text(data, i):
    if len(data) <= i or type(data[i]) is not str:
        _malformed()
    return data[i]


def _malformed():
    raise ValueError("malformed value")


_PLAIN = (
    (str, str.__str__),
    (int, int.__index__),
    (float, float.__float__),
    (bytes, bytes.__bytes__),
    (bytearray, bytearray),
    (complex, lambda v: complex(v.real, v.imag)),
    (list, list.copy),
    (tuple, lambda v: tuple.__getitem__(v, slice(None))),
    (dict, dict.copy),
    (set, set.copy),
    (frozenset, frozenset.copy),
)


# Standard-library value types, rebuilt by the receiver's own constructors: tag -> (type, fields, constructor).
_VALUE_TYPES = {
    "dt": (datetime.datetime, lambda v: [v.isoformat()], datetime.datetime.fromisoformat),
    "da": (datetime.date, lambda v: [v.isoformat()], datetime.date.fromisoformat),
    "ti": (datetime.time, lambda v: [v.isoformat()], datetime.time.fromisoformat),
    "td": (datetime.timedelta, lambda v: [v.days, v.seconds, v.microseconds], datetime.timedelta),
    "de": (decimal.Decimal, lambda v: [str(v)], decimal.Decimal),
    "fr": (fractions.Fraction, lambda v: [v.numerator, v.denominator], fractions.Fraction),
    "q": (collections.deque, lambda v: [list(v), v.maxlen], collections.deque),
    "r": (range, lambda v: [v.start, v.stop, v.step], range),
    "sl": (slice, lambda v: [v.start, v.stop, v.step], slice),
    "K": (type({}.keys()), lambda v: [list(v)], lambda keys: dict.fromkeys(keys).keys()),
    "V": (type({}.values()), lambda v: [list(v)], lambda values: dict(enumerate(values)).values()),
    "I": (type({}.items()), lambda v: [[list(kv) for kv in v]], lambda items: dict(items).items()),
    # an XML element as its text (ClassEval's XMLProcessor tests hand the program a tree the test parsed)
    "xe": (ElementTree.Element, lambda v: [ElementTree.tostring(v, encoding="unicode")], ElementTree.fromstring),
}
_VALUE_TAGS = {kind: tag for tag, (kind, _, _) in _VALUE_TYPES.items()}
_VALUE_DECODERS = {tag: construct for tag, (_, _, construct) in _VALUE_TYPES.items()}
MUTABLE = (list, dict, set, bytearray, collections.deque)  # arguments whose changes a call sends back


def value_type(value, other, depth):
    """Encoded form of a standard-library value (exact type only), or None."""
    tag = _VALUE_TAGS.get(type(value))
    if tag is None:
        return None
    return [tag, [encode(v, other, depth + 1) for v in _VALUE_TYPES[tag][1](value)]]


def builtin_name(value):
    """The name under which ``value`` is a builtin (``int``, ``len``), or None."""
    name = getattr(value, "__name__", None)
    return name if isinstance(name, str) and getattr(builtins, name, None) is value else None


def plain_value(value):
    """The plain value of an instance of a subclass of a builtin data type (a namedtuple, an IntEnum, an
    OrderedDict, a str subclass, ...), or None. Sending the plain value can only lose behaviour, never add it."""
    for kind, convert in _PLAIN:
        if isinstance(value, kind):
            return convert(value)
    return None


def stdlib_reference(value):
    """``(module, qualified name)`` of a standard-library function, class or method bound to a class (the
    test's ``datetime.now``), which the sandbox looks up in its own copy of the module; None for anything else
    (a lambda, a mock, an instance: trusted objects never cross)."""
    owner = getattr(value, "__self__", None)
    if isinstance(owner, type) and not isinstance(value, type):  # a classmethod or a builtin method of a class
        module, name = owner.__module__, f"{owner.__qualname__}.{getattr(value, '__name__', '')}"
    elif isinstance(value, type) or type(value).__name__ in ("function", "builtin_function_or_method"):
        module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    else:
        return None
    if type(module) is not str or type(name) is not str or module.split(".")[0] not in sys.stdlib_module_names:
        return None
    try:
        return (module, name) if stdlib_object(module, name) == value else None
    except (ImportError, AttributeError, ValueError):
        return None


def stdlib_object(module, name):
    """The object ``module.name`` of a standard-library module (``name`` may be dotted; no private parts)."""
    if (
        module.split(".")[0] not in sys.stdlib_module_names
        or "<" in name
        or any(part.startswith("_") for part in name.split("."))
    ):
        raise ValueError("not a standard-library name")
    value = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def builtin_base(kind):
    """Name of the first builtin class in ``kind``'s MRO (``ValueError`` for ``class E(ValueError)``)."""
    return next((k.__name__ for k in kind.__mro__ if getattr(builtins, k.__name__, None) is k), "Exception")


def refuse_value(value):
    raise TypeError(f"{type(value).__name__} is not plain data")


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


# ------------------------------------------------------------------------------------------------- kernel
# Linux calls Python 3.11 does not wrap. Used by the trusted processes before they run anything untrusted.

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def umount(target):
    _check(_libc.umount2(target.encode(), ctypes.c_int(MNT_DETACH)), f"umount {target}")


def prctl(option, value):
    _check(
        _libc.prctl(
            ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)
        ),
        f"prctl {option}",
    )


def drop_capabilities():
    """Empty the effective, permitted and inheritable capability sets (the ambient set follows)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")


def die_with_parent():
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# ------------------------------------------------------------------------------- the program's view (allow-list)

LIBRARY_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
SHARED_FILES = ("/usr/share/zoneinfo", "/etc/localtime", "/etc/timezone", "/etc/ld.so.cache", "/etc/mime.types")
PACKAGE_TREES = ("python", "pypy", "node_modules", "site-packages", "dist-packages")  # names (prefixes) hidden
DEVICES = ("null", "zero", "full", "random", "urandom")
WORKDIR_INODES = 2048  # files and directories a test's working directory may hold (tmpfs nr_inodes)


def _real(path):
    return os.path.realpath(path)


def _covered(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def stdlib_dirs():
    """The standard library: its pure-Python directory, its zip (when there is one) and its compiled modules."""
    dirs = [os.path.dirname(os.__file__), *(p for p in sys.path if p.endswith(("lib-dynload", ".zip")))]
    return list(dict.fromkeys(_real(d) for d in dirs if os.path.exists(d)))


def _is_package_tree(path):
    return os.path.basename(path).startswith(PACKAGE_TREES)


def mapped_libraries(allowed):
    """Shared objects this process has loaded from outside ``allowed`` (a Python built with its own libraries):
    the program's extension modules may need them. Never one from a package tree."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith("/") and ".so" in os.path.basename(path) and os.path.isfile(path):
                found.add(_real(path))
    return sorted(p for p in found if not _covered(p, allowed) and not any(map(_is_package_tree, p.split("/"))))


class View:
    """What a program may see of the machine (an allow-list; docs/sandbox.md#what-a-program-sees): the system's
    shared libraries, time-zone data, the standard library, the packages a job names (``packages``: directories
    and files resolved by the trainer) and nothing else -- no package tree of any Python (site-packages,
    dist-packages, ``/usr/lib/python3``), no data set, cache, home directory or host data folder.

    ``readable``: paths readable with what lies beneath; ``hidden``: package trees inside them, masked;
    ``packages``: put back on top of the masks."""

    def __init__(self, packages=()):
        self.stdlib, self.readable, trees = _machine_view()
        self.packages = sorted(
            {_real(p) for p in packages if os.path.exists(p) and not _covered(_real(p), self.stdlib)}
        )
        self.hidden = [tree for tree in trees if tree not in self.packages]

    def sys_path(self):
        """This interpreter's import path as the program may use it: the standard library and the directories
        that hold a named package."""
        return [
            p
            for p in sys.path
            if _covered(_real(p), self.stdlib) or any(_covered(k, [_real(p)]) for k in self.packages)
        ]

    def rules(self):
        """The view as Landlock rules ``(path, rights)`` on real paths: each readable path, split around the
        hidden ones (Landlock grants what lies beneath a rule and cannot take a subtree back), then each package.
        A directory split so keeps the right to list what lies beneath it (imports list their directory): the
        names in a hidden tree can be listed, none of its files read."""
        out, listed = [], []
        todo = list(self.readable)
        while todo:
            path = todo.pop()
            if path in self.hidden:
                continue
            if any(_covered(h, [path]) for h in self.hidden):
                listed.append((path, FS_READ_DIR))
                todo += _entries(path)
            else:
                out.append(path)
        packages = [p for p in self.packages if not _covered(p, out)]
        listed += [(os.path.dirname(p), FS_READ_DIR) for p in packages]  # the import path entry that holds it
        return sorted(set(listed)) + [(p, READ) for p in sorted(out) + packages]


_MACHINE_VIEW = None


def _machine_view():
    """``(stdlib, readable, package trees in them)`` of this machine, computed once in the launcher (its forks
    inherit it): the standard library, the shared libraries and time-zone data, and the package trees to mask."""
    global _MACHINE_VIEW
    if _MACHINE_VIEW is None:
        stdlib = stdlib_dirs()
        bases = list(dict.fromkeys([*(_real(d) for d in LIBRARY_DIRS if os.path.isdir(d)), *stdlib]))
        readable = list(dict.fromkeys([*bases, *mapped_libraries(bases)]))
        readable += [p for p in map(_real, SHARED_FILES) if os.path.exists(p) and not _covered(p, readable)]
        trees = [
            entry
            for base in bases
            for entry in _entries(base)
            if _is_package_tree(entry) and not any(_covered(s, [entry]) for s in stdlib)
        ]
        _MACHINE_VIEW = (stdlib, readable, trees)
    return _MACHINE_VIEW


def _entries(path):
    try:
        return sorted(os.path.join(path, name) for name in os.listdir(path))
    except OSError:
        return []


def build_root(root, workdir, view):
    """Mount a small tmpfs at ``root`` holding the program's :class:`View` (read-only binds at their own paths,
    the package trees masked by empty read-only tmpfs, the named packages on top), the harmless devices, an
    empty ``/proc`` and ``/tmp``, and the mount point ``workdir``; then make it read-only."""
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path in LIBRARY_DIRS:  # merged /usr: /lib -> usr/lib
        if os.path.islink(path) and os.path.isdir(path):
            os.symlink(os.readlink(path), root + path)
    for path in view.readable:
        _bind_readonly(path, root + path, MS_NOSUID | MS_NODEV)
    masks = [path for path in view.hidden if os.path.isdir(root + path)]
    for path in masks:
        mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=1024,mode=0755")
    for path in view.packages:
        _bind_readonly(path, root + path, MS_NOSUID | MS_NODEV)
    for path in masks:
        mount(None, root + path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(root + "/dev", exist_ok=True)
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{root}/dev/{name}", "w").close()
            _bind_readonly("/dev/" + name, f"{root}/dev/{name}", MS_NOSUID, readonly=False)
    for link, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{link}")
    os.makedirs(root + "/proc")
    os.makedirs(root + "/tmp", exist_ok=True)
    os.makedirs(root + workdir, exist_ok=True)
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


_ST_TO_MS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC}


def _bind_readonly(source, target, extra, readonly=True):
    """Bind ``source`` at ``target`` (made first: a directory, or an empty file for a file), read-only."""
    if not os.path.lexists(target):
        if os.path.isdir(source):
            os.makedirs(target)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
    mount(source, target, None, MS_BIND)
    locked = sum(ms for st, ms in _ST_TO_MS.items() if os.statvfs(target).f_flag & st)  # must be kept
    mount(None, target, None, MS_REMOUNT | MS_BIND | extra | locked | (MS_RDONLY if readonly else 0))


# ---------------------------------------------------------------------------------------------- Landlock

# Linux's Landlock LSM (5.13+): an unprivileged process restricts what it and its children may do on the
# filesystem to an allow-list of paths -- no namespace, no privilege needed. The system call numbers are the same
# on every architecture.
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, LANDLOCK_SCOPE_SIGNAL = 1, 2
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_DIR, FS_MAKE_REG, FS_MAKE_SYM = 1 << 4, 1 << 5, 1 << 7, 1 << 8, 1 << 12
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14
FS_ABI_ACCESS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}  # every right of an ABI
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE  # the rights a rule on a file may carry
READ = FS_READ_FILE | FS_READ_DIR
WRITE = READ | FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG | FS_MAKE_SYM
WRITE |= FS_REFER | FS_TRUNCATE
DEVICE_RULES = [("/dev/" + name, FS_READ_FILE | FS_WRITE_FILE) for name in DEVICES]


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi():
    """The Landlock ABI version this kernel gives (0: none, or switched off at boot)."""
    _libc.syscall.restype = ctypes.c_long
    abi = _libc.syscall(
        ctypes.c_long(LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    return max(int(abi), 0)


def landlock_ruleset(abi, rules):
    """A Landlock ruleset fd from ``rules`` (``(path, rights)``; no exec anywhere): from ABI 6 also no signal
    and no abstract socket out of the domain."""
    handled = FS_ABI_ACCESS[max(v for v in FS_ABI_ACCESS if v <= abi)]
    attr = _RulesetAttr(handled, 0, (LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL) * (abi >= 6))
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    fd = _libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if fd < 0:
        _check(-1, "landlock_create_ruleset")
    try:
        for path, rights in rules:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                allowed = rights & handled & (~0 if os.path.isdir(path) else FILE_RIGHTS)
                if not allowed:
                    continue
                rule = _PathBeneath(allowed, target)
                _check(
                    _libc.syscall(
                        ctypes.c_long(LANDLOCK_ADD_RULE), fd, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
                    ),
                    f"landlock_add_rule {path}",
                )
            finally:
                os.close(target)
    except BaseException:
        os.close(fd)
        raise
    return fd


def landlock_restrict(fd):
    """Confine this process and its future children to the ruleset ``fd`` (no_new_privs must be set)."""
    _check(_libc.syscall(ctypes.c_long(LANDLOCK_RESTRICT_SELF), fd, 0), "landlock_restrict_self")


# ----------------------------------------------------------------------------------------------- seccomp

DENIED_SYSCALLS = (
    # new processes and programs
    "fork",
    "vfork",
    "clone",
    "clone3",
    "execve",
    "execveat",
    # other processes: signals (kill(0, sig), its own process group, stays allowed), memory, tracing, pidfds,
    # scheduling, sessions
    "tkill",
    "tgkill",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "setpriority",
    "ioprio_set",
    "sched_setaffinity",
    "sched_setscheduler",
    "sched_setparam",
    "sched_setattr",
    "setsid",
    "setpgid",
    "prctl",
    # namespaces, mounts, devices, the kernel
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "mknod",
    "mknodat",
    "open_by_handle_at",
    "name_to_handle_at",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "iopl",
    "ioperm",
    "fanotify_init",
    # extended attributes: tmpfs charges them to kernel memory outside every limit (64 kB per file)
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "setxattrat",
    # the network
    "socket",
    "socketpair",
    # System V and POSIX IPC (a message from one test's sandbox to the next one's, through the job's IPC namespace)
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "shmget",
    "shmat",
    "shmdt",
    "shmctl",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE, F_NOTIFY = 8, 10, 15, 1024, 1026


def compile_seccomp():
    """The sandbox's seccomp filter as a BPF program (bytes), compiled once by libseccomp through pyseccomp:
    ``EPERM`` for :data:`DENIED_SYSCALLS`, for ``kill`` of anything but the caller's own process group and for
    ``prlimit64`` on another process; syscalls of other architectures kill the process. None where pyseccomp
    or libseccomp is missing."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError):
        return None
    deny = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            rules.add_rule(deny, name)
        except (OSError, ValueError, RuntimeError):  # a syscall this architecture does not have
            pass
    rules.add_rule(deny, "kill", sc.Arg(0, sc.NE, 0))
    for command in (F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE, F_NOTIFY):  # signals by way of a file
        rules.add_rule(deny, "fcntl", sc.Arg(1, sc.EQ, command))
    rules.add_rule(deny, "prlimit64", sc.Arg(0, sc.NE, 0))
    read_fd, write_fd = os.pipe()
    try:
        with open(write_fd, "wb") as out:
            rules.export_bpf(out)
        with open(read_fd, "rb") as src:
            return src.read()
    except OSError:
        return None


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(program):
    """Set ``no_new_privs`` and install the BPF ``program`` from :func:`compile_seccomp` (when there is one)."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if not program:
        return False
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(
        _libc.prctl(
            ctypes.c_int(PR_SET_SECCOMP),
            ctypes.c_ulong(SECCOMP_MODE_FILTER),
            ctypes.byref(fprog),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        ),
        "seccomp",
    )
    return True


# ------------------------------------------------------------------------------------------ sandbox process


class SandboxViolation(PermissionError):
    pass


def install_guard(workdir, report_fd=VIOLATION_FD):
    """The Python-level guard (last layer): an audit hook that refuses process control, signals, sockets,
    ctypes, shared memory, writes outside ``workdir`` and any path through another process's ``/proc`` entry.
    Each refusal writes one byte to ``report_fd``, a pipe the evaluator reads: the count lives on the trusted
    side, so a refused operation fails its test even when the program catches the error and rewrites this
    process (closing or replacing the pipe is seen too). Returns the hook's state: the program can reach it like
    any object of its process (the suite switches the hook off through it to test the kernel layers)."""
    import subprocess

    state = {"busy": False}
    try:  # this process as the mounted /proc numbers it (the host's /proc in a PID namespace without mounts)
        mypid = os.readlink("/proc/self")
    except OSError:
        mypid = str(os.getpid())
    deny = {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.spawn",
        "os.posix_spawn",
        "subprocess.Popen",
        "pty.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "socket.sendto",
        "socket.sendmsg",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.call_function",
        "resource.setrlimit",
        "resource.prlimit",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "os.symlink",
        "os.link",
        "os.chown",
        "shutil.chown",
        "os.chroot",
        "os.setuid",
        "os.setgid",
        "os.setreuid",
        "os.setregid",
    }
    bad_imports = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "_posixshmem"}
    path_events = {  # event -> ((path argument, dir_fd argument or None), ...)
        "os.remove": ((0, 1),),
        "os.rmdir": ((0, 1),),
        "os.mkdir": ((0, 2),),
        "os.rename": ((0, 2), (1, 3)),
        "os.chmod": ((0, 2),),
        "os.utime": ((0, 3),),
        "os.truncate": ((0, None),),
        "os.chflags": ((0, None),),
        "os.setxattr": ((0, None),),
        "os.removexattr": ((0, None),),
        "shutil.rmtree": ((0, None),),
        "shutil.move": ((0, None), (1, None)),
    }
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def resolve(path, dir_fd=None):
        """The path with every symbolic link followed, one step at a time; refused where a step lies in
        another process's ``/proc`` entry -- checked before a magic link there (``/proc/PID/fd/N``, ``cwd``,
        ``root``) is followed, which ``realpath`` would turn into the file it leads to."""
        if isinstance(path, int):
            return None  # an open fd: checked when it was opened
        path = os.fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(path):  # AT_FDCWD (< 0) is the cwd
            path = os.path.join(os.readlink("/proc/self/fd/%d" % dir_fd), path)
        todo, current, hops = os.path.join(os.getcwd(), path).split(os.sep)[::-1], "/", 0
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                current = os.path.dirname(current)
                continue
            step = os.path.join(current, part)
            if other_proc(step):
                refuse("open " + step)
            if hops < 40 and os.path.islink(step):
                hops += 1
                target = os.readlink(step)
                todo.extend(target.split(os.sep)[::-1])
                current = "/" if target.startswith(os.sep) else current
                continue
            current = step
        return current

    def inside(p):
        return p is None or p == workdir or p.startswith(workdir + os.sep)

    def other_proc(p):
        parts = p.split(os.sep)
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != mypid

    def refuse(event):
        try:
            os.write(report_fd, b"!")
        except OSError:  # full (a count the evaluator has seen) or tampered with (it sees that too)
            pass
        raise SandboxViolation("sandbox: %s denied" % event)

    def check(event, args):
        if event in deny:
            refuse(event)
        if event == "import" and args and args[0] in bad_imports:
            refuse("import " + args[0])
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, int):
                return
            p = resolve(path)
            write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if write and not (inside(p) or p == os.devnull):
                refuse("write " + p)
            if not write and not inside(p) and os.path.isdir(p):
                refuse("open " + p)
            return
        for pi, di in path_events.get(event, ()):
            dfd = args[di] if di is not None and di < len(args) else None
            if pi < len(args) and not inside(resolve(args[pi], dfd)):
                refuse(event)

    def hook(event, args):
        if state["busy"]:
            return
        state["busy"] = True
        try:
            check(event, args)
        except SandboxViolation:
            raise
        except Exception:  # a malformed path etc.: fail closed
            refuse(event)
        finally:
            state["busy"] = False

    def blocked(*a, **k):
        refuse("process control")

    for name in (
        "fork",
        "forkpty",
        "system",
        "popen",
        "kill",
        "killpg",
        "execv",
        "execve",
        "execl",
        "execle",
        "execlp",
        "execlpe",
        "execvp",
        "execvpe",
        "spawnl",
        "spawnle",
        "spawnlp",
        "spawnlpe",
        "spawnv",
        "spawnve",
        "spawnvp",
        "spawnvpe",
        "posix_spawn",
        "posix_spawnp",
        "setsid",
        "setpgid",
    ):
        if hasattr(os, name):
            setattr(os, name, blocked)
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, name, blocked)
    for name in ("_posixsubprocess", "ctypes", "_ctypes"):
        sys.modules.pop(name, None)
    subprocess._posixsubprocess = None
    sys.addaudithook(hook)
    return state


def set_limits(cfg):
    mem = cfg["memory_mb"] << 20
    cpu = int(cfg["timeout_total"]) + 2
    for lim, val in (
        (resource.RLIMIT_AS, (mem, mem)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (16 << 20, 16 << 20)),
        (resource.RLIMIT_NOFILE, (64, 64)),
        (resource.RLIMIT_NPROC, (0, 0)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(lim, val)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file size limit fails with OSError


def sandbox_main(cfg, req_fd, rep_fd, out_fd, violation_fd, python_dirs):
    """One test's sandbox: confine this process, run the program, then answer requests until EOF.
    ``python_dirs``: ``{path: fd}`` of the Python directories this uid could not reach by path (see
    :meth:`Isolation.open_python_dirs`)."""
    os.setsid()
    die_with_parent()
    null = os.open("/dev/null", os.O_RDWR)
    kept = {path: VIOLATION_FD + 1 + i for i, path in enumerate(python_dirs)}
    for fd, target in (
        (null, 0),
        (out_fd, 1),
        (out_fd, 2),
        (req_fd, 3),
        (rep_fd, 4),
        (violation_fd, VIOLATION_FD),
        *((python_dirs[path], kept[path]) for path in python_dirs),
    ):
        os.dup2(fd, target)
    os.closerange(VIOLATION_FD + 1 + len(kept), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.set_blocking(VIOLATION_FD, False)  # the guard never waits on the evaluator
    sys.path[:] = [p for p in sys.path if p in cfg["sys_path"]]  # the view's: no package tree of the trainer's
    import_through(kept)
    if cfg["chdir"]:  # a fresh tmpfs per test, mounted over the path; else the spawner's cwd is the workdir
        os.chdir(cfg["workdir"])
    random.seed()
    set_limits(cfg)
    layers = {"rlimits": True, "seccomp": load_seccomp(SECCOMP_PROGRAM), "no_new_privs": True}
    if cfg["isolation"] == "strict" and not layers["seccomp"]:
        os._exit(3)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), errors="backslashreplace", line_buffering=True)
    sys.stderr = sys.stdout
    guard = install_guard(os.path.realpath(os.getcwd()))
    layers["audit_hook"] = True
    Server(cfg["program"], layers, guard).serve()


def import_through(fds):
    """Imports reach the directories of ``fds`` (``{path: fd}``) through this process's own fds (the magic
    links of ``/proc/self/fd``), where this uid could not reach them by path."""
    if fds:
        sys.path[:] = [_through_fd(entry, fds) for entry in sys.path]
        for module in list(sys.modules.values()):  # the packages imported already find their submodules so too
            path = getattr(module, "__path__", None)
            if type(path) is list:
                path[:] = [_through_fd(entry, fds) for entry in path]
        sys.path_importer_cache.clear()


def _through_fd(path, fds):
    """``path`` spelt through ``/proc/self/fd/N`` when it lies in one of the directories ``fds`` holds."""
    for root, fd in fds.items():
        if path == root or path.startswith(root + os.sep):
            return f"/proc/self/fd/{fd}" + path[len(root) :]
    return path


class Server:
    """The sandbox side of the channel. Nothing here is trusted: the program can change any of it, which only
    changes what the evaluator receives, and that is plain data or handles."""

    def __init__(self, program, layers, guard):
        self.program, self.layers, self.guard = program, layers, guard
        self.ns = {"__name__": "__main__", "__builtins__": builtins}
        self.objects, self.ids = [], {}  # handle id -> object; id(object) -> handle id

    def send(self, message):
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        data = dumps(message)
        if len(data) > MAX_MESSAGE:
            data = dumps(["raise", "ResultTooLarge", "Exception", None, f"over {MAX_MESSAGE} bytes", None])
        view = memoryview(data)
        while view:
            view = view[os.write(4, view) :]

    def serve(self):
        error = None
        try:
            code = compile(self.program, "<program>", "exec")
        except BaseException as exc:  # SyntaxError, ValueError (null bytes), ...
            error = "SyntaxError" if isinstance(exc, SyntaxError) else type(exc).__name__
            self.send(["ready", error, False, self.layers])
            return
        try:
            exec(code, self.ns)
        except BaseException as exc:
            error = type(exc).__name__
        self.send(["ready", error, True, self.layers])
        if error is not None:
            return
        requests = os.fdopen(3, "rb")
        for line in requests:
            self.send(self.answer(line))

    def answer(self, line):
        """Reply ``["ok", value, changed arguments]`` or :meth:`raised`."""
        op, args = None, ()
        try:
            op, *args = [decode(a, self.resolve) for a in json.loads(line)]
            result = getattr(self, "op_" + op)(*args)
            value = self.live(result) if op in ("getattr", "global") else encode(result, self.other)
            return ["ok", value, self.changed(op, args)]
        except BaseException as exc:
            return self.raised(exc, self.changed(op, args))

    def live(self, value, depth=0):
        """Encode an attribute's value with its lists, dicts and sets (nested in lists and dicts too) as live
        containers ``["L", handle, kind, items]``: the evaluator keeps a copy and makes each change on both."""
        kind = type(value)
        if kind not in (list, dict, set) or depth >= MAX_DEPTH:
            return encode(value, self.other, depth)
        if kind is dict:
            items = [[encode(k, self.other, depth + 1), self.live(v, depth + 1)] for k, v in value.items()]
        else:
            items = [self.live(v, depth + 1) if kind is list else encode(v, self.other, depth + 1) for v in value]
        return ["L", self.handle(value)[1], _CONTAINER_TAG.get(kind, "d"), items]

    def changed(self, op, args):
        """For a call, the state after it of each list/dict/set/bytearray/deque argument (None for the
        others): the evaluator copies it back into its own objects, so in-place changes are seen there."""
        if op != "call" or len(args) != 3:
            return None
        try:
            return [
                [encode(a, self.other) if type(a) in MUTABLE else None for a in args[1]],
                {k: encode(a, self.other) for k, a in args[2].items() if type(a) in MUTABLE},
            ]
        except BaseException:
            return None

    def raised(self, exc, changed=None):
        try:
            args = encode(exc.args, refuse_value)
        except (TypeError, ValueError, RecursionError):
            args = None
        try:
            message = str(exc)[:1000]
        except BaseException:
            message = ""
        return ["raise", type(exc).__name__[:100], builtin_base(type(exc)), args, message, changed]

    def resolve(self, data):
        if data[0] == "h" and len(data) == 2 and type(data[1]) is int and 0 <= data[1] < len(self.objects):
            return self.objects[data[1]]
        if data[0] == "B" and len(data) == 2 and hasattr(builtins, str(data[1])):
            return getattr(builtins, data[1])
        if data[0] == "M" and len(data) == 3 and type(data[1]) is str and type(data[2]) is str:
            return stdlib_object(data[1], data[2])
        raise ValueError("malformed value")

    def other(self, value):
        """A value that is not plain data: a builtin data type's subclass as its plain value, a class of the
        builtins or an exception class by name, anything else as a handle."""
        plain = plain_value(value)
        if plain is not None:
            return encode(plain, self.other)
        if isinstance(value, type) and builtin_name(value):
            return ["B", value.__name__]
        if isinstance(value, type) and issubclass(value, BaseException):
            return ["E", value.__name__[:100], builtin_base(value)]
        return self.handle(value)

    def handle(self, value):
        key = id(value)
        if key not in self.ids:
            self.ids[key] = len(self.objects)
            self.objects.append(value)
        return ["h", self.ids[key], type(value).__name__[:100]]

    def op_global(self, name):
        if name in self.ns and name != "__builtins__":
            return self.ns[name]
        raise NameError(f"name {name!r} is not defined")

    def op_call(self, obj, args, kwargs):
        return obj(*args, **kwargs)

    def op_getattr(self, obj, name):
        return getattr(obj, name)

    def op_callmethod(self, obj, name, args, kwargs):
        return getattr(obj, name)(*args, **kwargs)

    def op_setattr(self, obj, name, value):
        setattr(obj, name, value)

    def op_delattr(self, obj, name):
        delattr(obj, name)

    def op_getitem(self, obj, key):
        return obj[key]

    def op_setitem(self, obj, key, value):
        obj[key] = value

    def op_delitem(self, obj, key):
        del obj[key]

    def op_iter(self, obj):
        return iter(obj)

    def op_next(self, obj):
        return next(obj)

    def op_len(self, obj):
        return len(obj)

    def op_bool(self, obj):
        return bool(obj)

    def op_str(self, obj):
        return str(obj)

    def op_repr(self, obj):
        return repr(obj)

    def op_isinstance(self, obj, cls):
        return isinstance(obj, cls)

    def op_issubclass(self, obj, cls):
        return issubclass(obj, cls)


# ------------------------------------------------------------------------------------------- spawner process


def spawner_main(sock, cfg, python_dirs, ruleset):
    """Fork one sandbox per ``spawn`` request; on ``reap`` kill every process of the job but this one. As PID 1
    of the job's PID namespace it mounts that namespace's ``/proc`` first; then it confines itself, and so every
    sandbox it forks, to the Landlock ``ruleset`` (None where the kernel has no Landlock)."""
    die_with_parent()
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    keep = sorted({sock.fileno(), *python_dirs.values(), *([ruleset] if ruleset is not None else [])})
    for low, high in zip([2, *keep], [*keep, resource.getrlimit(resource.RLIMIT_NOFILE)[0]]):
        os.closerange(max(low + 1, 3), high)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    proc = False
    if os.getpid() == 1 and cfg["chdir"]:  # a root of its own (without one the evaluator shares this /proc)
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            proc = True
        except OSError:
            pass
    try:
        drop_capabilities()
    except OSError:
        pass
    prctl(PR_SET_DUMPABLE, 0)
    if ruleset is not None:
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        landlock_restrict(ruleset)
        os.close(ruleset)
    sock.send(b"ready proc=%d" % proc)
    child = 0
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 64, 4)
        if msg == b"spawn" and len(fds) == 4:
            child = os.fork()
            if child == 0:
                sock.close()
                try:
                    sandbox_main(cfg, *fds, python_dirs)
                finally:
                    os._exit(0)
            for fd in fds:
                os.close(fd)
            sock.send(b"ok")
        elif msg == b"reap":
            _kill_all(child)
            sock.send(b"done")
        else:
            break
    _kill_all(child)


def _kill_all(child):
    """Kill the sandbox ``child`` and, as PID 1 of the job's PID namespace, every other process of the job."""
    try:
        if os.getpid() == 1:  # everything in the job's PID namespace but this process
            os.kill(-1, signal.SIGKILL)
        elif child:
            os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


class Spawner:
    """The evaluator's end of the spawner."""

    def __init__(self, cfg, python_dirs, ruleset=None):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            mine.close()
            try:
                spawner_main(theirs, cfg, python_dirs, ruleset)
            finally:
                os._exit(0)
        theirs.close()
        self.sock = mine
        self.proc = self._expect(b"ready proc=") == b"1"

    def _expect(self, prefix):
        if not select.select([self.sock], [], [], SPAWNER_REPLY_S)[0]:
            raise RuntimeError("the sandbox spawner stopped answering")
        msg = self.sock.recv(64)
        if not msg.startswith(prefix):
            raise RuntimeError("the sandbox spawner stopped")
        return msg[len(prefix) :]

    def spawn(self, capture):
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        out_r, out_w = os.pipe()
        violation_r, violation_w = os.pipe()
        try:
            socket.send_fds(self.sock, [b"spawn"], [req_r, rep_w, out_w, violation_w])
            self._expect(b"ok")
        finally:
            for fd in (req_r, rep_w, out_w, violation_w):
                os.close(fd)
        return Channel(req_w, rep_r, out_r, violation_r, capture)

    def reap(self):
        """Kill the job's sandboxes. A runner killed in the middle of a request may have left the spawner's
        answer to it unread: answers before ``done`` are skipped."""
        self.sock.send(b"reap")
        while self._expect(b"") != b"done":
            pass

    def close(self):
        self.sock.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


# ------------------------------------------------------------------------------------ evaluator: the channel


class Abort(BaseException):
    """Ends the running test: its sandbox timed out, died or broke the protocol (``args[0]``: the error)."""


_BUILTIN_EXCEPTIONS = {
    name: kind for name, kind in vars(builtins).items() if isinstance(kind, type) and issubclass(kind, Exception)
}
_SYNTHETIC_EXCEPTIONS = {}


SANDBOX_EXCEPTION = "SandboxException"  # the name of a sandbox's exception whose own name is not an identifier
_ITERATION_ENDS = ("StopIteration", "StopAsyncIteration")


def error_name(name):
    """``name`` when it is an ASCII identifier of at most :data:`MAX_NAME` characters, else
    :data:`SANDBOX_EXCEPTION`: a name the sandbox chose reaches the test, the trainer's error list and a
    multi-turn feedback prompt as an identifier only, never as a line of text."""
    if type(name) is str and len(name) <= MAX_NAME and name.isascii() and name.isidentifier():
        return name
    return SANDBOX_EXCEPTION


def exception_class(name, base, iterating=False):
    """The local class for an exception type of the sandbox: the builtin itself (``ValueError``), else a class
    of that name deriving from the builtin base (``class InsufficientFunds(ValueError)``). Types that do not
    derive from Exception (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``) become Exception
    subclasses, so they fail the test that meets them; so do ``StopIteration`` and ``StopAsyncIteration`` (and
    their subclasses) unless ``iterating`` (the answer to ``next``, where they mean "exhausted"): raised by a
    call, the real one would silently end the test's ``map``/``filter``/generator (``all(map(f, cases))``
    would pass). A name that is not an identifier (:func:`error_name`) becomes ``SandboxException``."""
    if type(name) is not str or type(base) is not str:
        raise ValueError("malformed exception")
    name = error_name(name)
    if base in _ITERATION_ENDS and not iterating:
        base = "Exception"
    if name == base and name in _BUILTIN_EXCEPTIONS:
        return _BUILTIN_EXCEPTIONS[name]
    key = (name, _BUILTIN_EXCEPTIONS.get(base, Exception))
    if key in _SYNTHETIC_EXCEPTIONS:
        return _SYNTHETIC_EXCEPTIONS[key]
    kind = type(key[0], (key[1],), {"__module__": "sandbox"})
    if len(_SYNTHETIC_EXCEPTIONS) < MAX_EXCEPTION_CLASSES:  # past that, a class lives as long as its exception
        _SYNTHETIC_EXCEPTIONS[key] = kind
    return kind


class Channel:
    """The evaluator's connection to one sandbox: requests go out as plain data, replies come back as plain
    data, :class:`Remote` handles or an exception to raise."""

    def __init__(self, req_w, rep_r, out_r, violation_r, capture):
        self.req_w, self.rep_r, self.out_r, self.violation_r, self.capture = req_w, rep_r, out_r, violation_r, capture
        os.set_blocking(violation_r, False)
        self.buffer = bytearray()
        self.received = 0  # bytes read from the sandbox (MAX_RECEIVED)
        self.failure = None  # "Timeout", "Crash", "ResultTooLarge" or "ProtocolError": the test's verdict
        self.violations = 0
        self.closed = False

    def fail(self, name):
        self.failure = self.failure or name
        raise Abort(self.failure)

    def request(self, op, *values):
        if self.closed:
            raise RuntimeError("a handle from an earlier test's sandbox")
        if self.failure:
            raise Abort(self.failure)
        data = dumps([op, *(encode(v, self.argument) for v in values)])
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"argument over {MAX_MESSAGE} bytes")
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.req_w, view) :]
        except OSError:
            self.fail("Crash")
        return self.reply(self.read_line(), values if op == "call" else None, op == "next")

    def argument(self, value):
        if isinstance(value, Remote):
            if value._channel is not self:
                raise TypeError("an object of an earlier test's sandbox")
            return ["h", value._id]
        plain = plain_value(value)
        if plain is not None:
            return encode(plain, self.argument)
        if builtin_name(value):
            return ["B", value.__name__]
        reference = stdlib_reference(value)
        if reference is not None:
            return ["M", *reference]
        raise TypeError(
            f"{type(value).__name__} cannot be passed to the sandboxed program (plain data, standard-"
            "library functions and classes, and its own objects only)"
        )

    def count_violations(self):
        """The refusals the sandbox's guard has reported so far (read from the violation pipe; a sandbox that
        closed or replaced its end while alive has tampered with its guard, which counts as one)."""
        while True:
            try:
                chunk = os.read(self.violation_r, 1 << 16)
            except BlockingIOError:
                return self.violations
            if not chunk:
                if self.failure is None:
                    self.violations += 1
                return self.violations
            self.violations += len(chunk)

    def read_line(self):
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_MESSAGE or self.received > MAX_RECEIVED:
                self.fail("ResultTooLarge")
            fds = [self.rep_r] if self.out_r is None else [self.out_r, self.rep_r]
            ready = select.select(fds, [], [])[0]
            if self.out_r in ready:
                self.pump_output()
            if self.rep_r in ready:
                chunk = os.read(self.rep_r, 1 << 16)
                if not chunk:
                    self.fail("Crash")
                self.buffer += chunk
                self.received += len(chunk)
        end = self.buffer.index(b"\n")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        return line

    def pump_output(self):
        chunk = os.read(self.out_r, 1 << 16)
        if chunk:
            self.capture.add(chunk)
        else:
            os.close(self.out_r)
            self.out_r = None

    def ready(self):
        """Wait for the program to load: ``(error, syntax_ok, layers)``."""
        line = self.read_line()
        try:
            kind, error, syntax_ok, layers = json.loads(line)
            if kind != "ready" or type(layers) is not dict or not (error is None or type(error) is str):
                raise ValueError
        except (ValueError, TypeError, RecursionError):
            self.fail("ProtocolError")
        return (error_name(error) if error is not None else None), syntax_ok is True, layers

    def reply(self, line, call=None, iterating=False):
        """The result of a request (``call``: its target, arguments and keywords, for the write-back;
        ``iterating``: the request was ``next``, whose StopIteration ends the test's loop)."""
        try:
            msg = json.loads(line)
            if type(msg) is not list or not msg:
                raise ValueError
            if msg[0] == "ok" and len(msg) == 3:
                result, exc, changed = decode(msg[1], self.resolve), None, msg[2]
            elif msg[0] == "raise" and len(msg) == 6:
                result, exc, changed = None, self.exception(*msg[1:5], iterating), msg[5]
            else:
                raise ValueError
            if call is not None and changed is not None:
                self.write_back(call[1], call[2], *changed)
        except (TooLarge, ResultTooLarge):  # ResultTooLarge: an XML element over MAX_XML_BYTES
            self.fail("ResultTooLarge")
        except Exception:
            self.fail("ProtocolError")
        if exc is not None:
            raise exc
        return result

    def write_back(self, args, kwargs, positional, keywords):
        """Copy the sandbox's state of mutable arguments after a call into the test's own objects."""
        pairs = [*zip(args, positional), *((kwargs[k], v) for k, v in keywords.items() if k in kwargs)]
        for local, new in pairs:
            if new is None or type(local) not in MUTABLE:
                continue
            new = decode(new, self.resolve)
            if type(new) is not type(local) or new == local:
                continue
            if isinstance(local, (list, bytearray)):
                local[:] = new
            else:
                local.clear()
                (local.extend if isinstance(local, collections.deque) else local.update)(new)

    def exception(self, name, base, args, message, iterating=False):
        kind = exception_class(name, base, iterating)
        try:
            return kind(*(decode(args, self.resolve) if args is not None else (str(message),)))
        except Exception:
            try:
                return kind(str(message))
            except Exception:
                return exception_class(name, "Exception")(str(message))

    def resolve(self, data):
        if data[0] == "h" and len(data) == 3 and type(data[1]) is int and type(data[2]) is str:
            return Remote(self, data[1], data[2][:100])
        if data[0] == "E" and len(data) == 3:
            return exception_class(data[1], data[2])
        if data[0] == "B" and len(data) == 2 and isinstance(getattr(builtins, str(data[1]), None), type):
            return getattr(builtins, data[1])
        if data[0] == "L" and len(data) == 4 and type(data[1]) is int and data[2] in _LIVE and type(data[3]) is list:
            live = _LIVE[data[2]]()
            live._remote = Remote(self, data[1], "container")
            base = _LIVE[data[2]].__mro__[1]
            items = (
                [[decode(k, self.resolve), decode(v, self.resolve)] for k, v in data[3]]
                if base is dict
                else [decode(v, self.resolve) for v in data[3]]
            )
            (base.update if base is not list else base.extend)(live, items)
            return live
        raise ValueError("malformed value")

    def close(self):
        """After the sandbox was killed: keep what is left of its output, close the pipes."""
        self.closed = True
        deadline = time.monotonic() + 1.0
        while self.out_r is not None and select.select([self.out_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            self.pump_output()
        for fd in (self.req_w, self.rep_r, self.out_r, self.violation_r):
            if fd is not None:
                os.close(fd)


class Remote:
    """An object of the sandboxed program, seen from the evaluator. Each operation is one request to the
    sandbox and gives plain data, another handle or a raised exception. A handle equals only itself (so an
    object claiming to equal everything cannot pass a test); ``x in handle`` iterates it and compares each
    item here."""

    __slots__ = ("_channel", "_id", "_type")

    def __init__(self, channel, ident, type_name):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_id", ident)
        object.__setattr__(self, "_type", type_name)

    def __getattr__(self, name):
        return self._channel.request("getattr", self, name)

    def __setattr__(self, name, value):
        self._channel.request("setattr", self, name, value)

    def __delattr__(self, name):
        self._channel.request("delattr", self, name)

    def __call__(self, *args, **kwargs):
        return self._channel.request("call", self, list(args), kwargs)

    def __getitem__(self, key):
        return self._channel.request("getitem", self, key)

    def __setitem__(self, key, value):
        self._channel.request("setitem", self, key, value)

    def __delitem__(self, key):
        self._channel.request("delitem", self, key)

    def __iter__(self):
        return self._channel.request("iter", self)

    def __next__(self):
        return self._channel.request("next", self)

    def __len__(self):
        return self._channel.request("len", self)

    def __bool__(self):
        return self._channel.request("bool", self)

    def __str__(self):
        return self._channel.request("str", self)

    def __repr__(self):
        try:
            return self._channel.request("repr", self)
        except BaseException:
            return f"<sandboxed {self._type} object>"

    def __eq__(self, other):
        return isinstance(other, Remote) and other._channel is self._channel and other._id == self._id

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((id(self._channel), self._id))

    def __instancecheck__(self, obj):
        try:
            return self._channel.request("isinstance", obj, self)
        except TypeError:  # a local object is never an instance of the program's class
            return False

    def __subclasscheck__(self, cls):
        try:
            return self._channel.request("issubclass", cls, self)
        except TypeError:
            return False

    def __enter__(self):
        return self.__getattr__("__enter__")()

    def __exit__(self, *exc_info):
        """The program's ``__exit__`` runs, but never decides whether the test's exception is swallowed."""
        self.__getattr__("__exit__")(None, None, None)
        return False


def _mirrored(base, name):
    """``base.name`` that makes the same change on the sandbox's object first (for ``pop``/``popitem`` of a
    set or dict, whose element is the sandbox's choice, the local copy drops the element it returned)."""
    local = getattr(base, name)

    def method(self, *args, **kwargs):
        result = self._remote._channel.request("callmethod", self._remote, name, list(args), kwargs)
        if base is not list and name in ("pop", "popitem") and not args:
            base.pop(self, result[0] if base is dict else result)
            return result
        return local(self, *args, **kwargs)

    method.__name__ = name
    return method


def _live_class(base, mutators):
    return type(
        f"Live{base.__name__.title()}",
        (base,),
        {
            "__slots__": ("_remote",),
            "__doc__": f"A {base.__name__} attribute of a sandboxed object (see _mirrored).",
            **{name: _mirrored(base, name) for name in mutators},
        },
    )


_LIVE = {
    "l": _live_class(
        list,
        (
            "__setitem__",
            "__delitem__",
            "__iadd__",
            "__imul__",
            "append",
            "extend",
            "insert",
            "remove",
            "pop",
            "clear",
            "sort",
            "reverse",
        ),
    ),
    "d": _live_class(
        dict, ("__setitem__", "__delitem__", "__ior__", "update", "pop", "popitem", "clear", "setdefault")
    ),
    "s": _live_class(
        set,
        (
            "__ior__",
            "__iand__",
            "__isub__",
            "__ixor__",
            "add",
            "discard",
            "remove",
            "pop",
            "clear",
            "update",
            "difference_update",
            "intersection_update",
            "symmetric_difference_update",
        ),
    ),
}


class TestGlobals(dict):
    """Globals of one test: what the trusted setup code and the test define, then the builtins, then — for the
    job's ``entry_points`` only (the function or class under test) — the program's top-level names as handles or
    plain values. Any other name the test uses and nothing trusted defines is a ``NameError`` in the test: the
    program never chooses a name the test computes with (a program's ``import math`` with a rebound
    ``math.isclose``), and an entry point may shadow a builtin (MBPP 126 asks for a function named ``sum``) while
    the program cannot redefine ``abs`` or ``isinstance`` for the test. ``__file__`` is a file in the test's
    working directory (ClassEval writes its fixtures beside it)."""

    def __init__(self, channel, entry_points):
        super().__init__(
            __builtins__=builtins, __name__="__sandbox_test__", __file__=os.path.join(os.getcwd(), "test_module.py")
        )
        self.channel, self.entry_points = channel, entry_points

    def __missing__(self, name):
        if name not in self.entry_points:
            if name in vars(builtins):
                return vars(builtins)[name]
            raise KeyError(name)
        try:
            return self.channel.request("global", name)
        except NameError:
            raise KeyError(name) from None


class Capture(io.TextIOBase):
    """The first ``limit`` bytes of what the sandboxes and the tests print."""

    def __init__(self, limit=STDOUT_LIMIT):
        self.data, self.limit = bytearray(), limit

    def writable(self):
        return True

    def write(self, text):
        self.add(str(text).encode("utf-8", "backslashreplace"))
        return len(text)

    def add(self, chunk):
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    def text(self):
        return self.data.decode("utf-8", "replace")


class Timer:
    """SIGALRM-based deadline for what runs in the evaluator on behalf of one sandbox (its start-up and one
    test): on expiry the sandbox's verdict becomes ``Timeout`` and :class:`Abort` is raised, again every 50 ms
    while the test goes on (a test that catches it still ends)."""

    def __init__(self):
        self.channel = None
        signal.signal(signal.SIGALRM, self.fire)

    def fire(self, signum, frame):
        channel = self.channel
        if channel is not None:
            channel.failure = channel.failure or "Timeout"
            raise Abort("Timeout")

    def arm(self, seconds, channel):
        self.channel = channel
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001), 0.05)

    def disarm(self):
        self.channel = None
        signal.setitimer(signal.ITIMER_REAL, 0)


# ------------------------------------------------------------------------------------- evaluator: isolation

NAMESPACES = ("user_ns", "mount_ns", "pid_ns", "net_ns", "ipc_ns", "uts_ns")
KERNEL_LAYERS = (*NAMESPACES, "read_only_root", "tmpfs_workdir", "proc", "landlock", "no_new_privs", "seccomp")


def world_readable(path):
    """Every directory on the way to ``path`` can be searched by any user."""
    parts = os.path.realpath(path).split("/")
    return all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o001 for i in range(1, len(parts) + 1))


class Isolation:
    """Confines the evaluator, and so the spawner and every sandbox it forks (see the module docstring of
    ``comlrl_lightning.envs.sandbox``), as far as the kernel allows; gives each test a fresh working directory.
    Every layer is decided here, by what this trusted process set up -- never by what a sandbox reports.
    ``cfg["namespaces"]``, ``cfg["mounts"]`` and ``cfg["landlock"]`` False behave as on a machine that refuses
    namespaces, mounts in them, or Landlock (the suite forces each deployment so)."""

    def __init__(self, cfg):
        self.workdir, self.disk_mb = cfg["workdir"], cfg["disk_mb"]
        self.view = View(cfg.get("packages", ()))
        self.layers = dict.fromkeys((*NAMESPACES, "read_only_root", "tmpfs_workdir", "landlock"), False)
        self.trainer_uid = os.geteuid()
        self.abi = landlock_abi() if cfg.get("landlock", True) else 0
        self.ruleset = None  # a Landlock ruleset fd: the spawner confines itself (and so every sandbox) with it
        self.python_dirs = {}  # path -> fd: the Python directories the sandbox uid reaches through its fds only
        # Opened while this process may still reach it: TMPDIR can lie under a directory only the trainer enters.
        self.workdir_fd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY)
        if cfg.get("namespaces", True):
            self.setup(cfg["uid"], cfg["gid"], cfg.get("mounts", True))
        else:
            self.without_namespaces(os.geteuid() == 0, cfg["uid"], cfg["gid"], False, False)
        os.close(self.workdir_fd)
        self.workdir_fd = None
        if not self.layers["read_only_root"]:  # the working directory as entered (in the namespaces, if any)
            self.workdir_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
        elif self.abi:  # the root is the view: read it all; write only below the working directory's mount point
            rules = [("/", READ), (os.path.dirname(self.workdir), WRITE), *DEVICE_RULES]
            self.ruleset = landlock_ruleset(self.abi, rules)
        self.layers["landlock"] = self.ruleset is not None
        self.layers["uid"] = os.geteuid()

    def setup(self, uid, gid, mounts=True):
        root, built, dropped = os.geteuid() == 0, False, False
        try:
            if root:  # build the read-only root while privileged, then drop to the sandbox uid for the user ns
                unshare(CLONE_NEWNS)
                mount(None, "/", None, MS_REC | MS_PRIVATE)
                built = True
                if mounts:
                    build_root(self.workdir, self.workdir, self.view)
                    os.chdir(self.workdir)  # the new root, entered while every directory above it can be searched
                else:
                    self.view_from_host(root)  # while this process can still open the view
                    os.chdir(self.workdir)  # by path, so that the next namespace takes the working directory along
                os.setgroups([])
                os.setresgid(gid, gid, 0)
                os.setresuid(uid, uid, 0)
                dropped = True
                prctl(PR_SET_DUMPABLE, 1)  # the id maps are written through /proc/self
            unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
        except OSError:
            self.without_namespaces(root, uid, gid, built, dropped)
            return
        self.layers.update(dict.fromkeys(NAMESPACES, True))
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        try:
            if root:
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            if not mounts:
                raise OSError(errno.EPERM, "mount refused")
            if not root:
                mount(None, "/", None, MS_REC | MS_PRIVATE)
                build_root(self.workdir, self.workdir, self.view)
                os.chdir(self.workdir)
            os.chroot(".")
            os.chdir("/")
        except OSError:  # mounts refused in the namespaces (Docker's default AppArmor profile): Landlock or nothing
            if not root and os.path.ismount(self.workdir):
                umount(self.workdir)
            if not root:  # (a root trainer entered it before the namespaces, which took it along)
                try:  # by path where it can: the fd was opened in the mount namespace before these
                    os.chdir(self.workdir)
                except OSError:
                    os.fchdir(self.workdir_fd)
                self.view_from_host(root)
            return
        self.layers["read_only_root"] = True

    def without_namespaces(self, root, uid, gid, built, dropped):
        """No namespaces: the view is Landlock's alone (where the kernel has it; ``evaluator_main`` refuses the
        job where not). A root trainer's jobs still run under a uid of their own, the Python installation reached
        through directory fds opened now where that uid could not read it by path."""
        if dropped:
            os.setresuid(0, 0, 0)
            os.setresgid(0, 0, 0)
        if built and os.path.ismount(self.workdir):
            umount(self.workdir)
        os.fchdir(self.workdir_fd)
        if self.ruleset is None:
            self.view_from_host(root)
        if root:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            prctl(PR_SET_DUMPABLE, 0)  # the sandbox shares this uid: this process's memory stays unreadable

    def view_from_host(self, root):
        """Without a root of its own the program sees the host's filesystem through Landlock: read the view's
        rules, write only below the working directory. A root trainer also opens now the view's directories that
        the job's uid cannot reach by path."""
        if root and not self.python_dirs:
            holders = [os.path.dirname(p) for p in self.view.packages]  # the import path entries that hold them
            dirs = list(dict.fromkeys(self.view.stdlib + holders + self.view.packages))
            dirs = [d for d in dirs if os.path.isdir(d) and not world_readable(d)]
            self.python_dirs = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in dirs}
        if self.abi and self.ruleset is None:
            self.ruleset = landlock_ruleset(self.abi, [*self.view.rules(), (self.workdir, WRITE), *DEVICE_RULES])

    def fresh_workdir(self):
        """An empty working directory for the next test: a new ``noexec`` tmpfs of ``disk_mb`` MB and
        :data:`WORKDIR_INODES` files (what a test can pin of the kernel's memory is bounded by them; extended
        attributes are refused by seccomp), or the host directory emptied (entered through its fd: the path may
        lead through a directory this uid cannot search)."""
        if self.layers["read_only_root"]:
            os.chdir("/")
            if os.path.ismount(self.workdir):  # the last test's (mounted by this runner or an earlier one)
                umount(self.workdir)
            options = f"size={self.disk_mb}m,nr_inodes={WORKDIR_INODES},mode=0700"
            mount("tmpfs", self.workdir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options)
            self.layers["tmpfs_workdir"] = True
            os.chdir(self.workdir)
            return
        os.fchdir(self.workdir_fd)
        empty_directory(self.workdir_fd)


def empty_directory(fd):
    """Remove everything below the directory ``fd`` without recursion and holding one directory fd at a time (a
    chain of thousands of directories can neither overflow the stack nor exhaust the fds), never following a
    symbolic link: a directory is entered relative to its parent and left through its ``..``. Only for a tree
    nothing else changes any more (the job's processes are gone). What cannot be removed is left."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    current, pending, names = os.dup(fd), [None], []  # per level: subdirectories still to empty (None: unread)
    try:
        while True:
            if pending[-1] is None:
                pending[-1] = _unlink_files(current)
            if pending[-1]:
                name = pending[-1].pop()
                try:
                    os.chmod(name, 0o700, dir_fd=current)  # the program may have taken its permissions away
                except OSError:
                    pass
                try:
                    child = os.open(name, flags, dir_fd=current)
                except OSError:
                    continue  # cannot enter it: left
                os.close(current)
                current = child
                pending.append(None)
                names.append(name)
                continue
            if len(pending) == 1:
                return
            parent = os.open("..", flags, dir_fd=current)
            os.close(current)
            current = parent
            pending.pop()
            try:
                os.rmdir(names.pop(), dir_fd=current)
            except OSError:
                pass
    finally:
        os.close(current)


def _unlink_files(fd):
    """Unlink every entry of the directory ``fd`` but its subdirectories, whose names are returned."""
    subdirs = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    else:
                        os.unlink(entry.name, dir_fd=fd)
                except OSError:
                    pass
    except OSError:
        pass
    return subdirs


def remove_tree(path):
    """Remove ``path`` and everything below it (:func:`empty_directory`); a file or link is unlinked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    try:
        os.fchmod(fd, 0o700)
    except OSError:
        pass
    try:
        empty_directory(fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        pass


# ----------------------------------------------------------------------------------------- evaluator: tests

START_GRACE_S = 1.0  # a sandbox's start-up (fork + loading the program) gets timeout_per_test plus this


def read_part(fd):
    size = int(_read_exact(fd, 20))
    return json.loads(_read_exact(fd, size))


def _read_exact(fd, n):
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("truncated job")
        data += chunk
    return bytes(data)


def _compile(source, name):
    """Code object, or the error name when it does not compile."""
    try:
        return compile(source, name, "exec")
    except (SyntaxError, ValueError) as exc:
        return "SyntaxError" if isinstance(exc, SyntaxError) else type(exc).__name__


class Evaluation:
    """Runs one job: the program in a first sandbox (its load decides the program-level result), then each
    test against a sandbox of its own, reporting one line per phase. Before each test it reports ``begin`` with
    the test's time: the trainer kills this process when a test overruns it, even inside a C call that never
    returns to Python (``sum(itertools.repeat(1, n))``), which the SIGALRM of :class:`Timer` cannot interrupt,
    and goes on with the next test in a new evaluator."""

    def __init__(self, cfg, job, isolation, spawner, report):
        self.cfg, self.isolation, self.spawner, self.report = cfg, isolation, spawner, report
        self.tests = [_compile(t, f"<test {i}>") for i, t in enumerate(job["tests"])]
        self.setup = _compile(job["setup"], "<setup>") if job["setup"].strip() else None
        self.entry_points = frozenset(job["entry_points"])
        self.deadline = time.monotonic() + cfg["timeout_total"]
        self.capture = Capture()
        self.timer = Timer()

    def remaining(self):
        return self.deadline - time.monotonic()

    def start(self, first=False):
        """A new sandbox with the program loaded: ``(channel, error, syntax_ok)``. What the program prints while
        it loads is kept for the first sandbox only."""
        self.isolation.fresh_workdir()
        channel = self.spawner.spawn(self.capture if first else Capture(limit=0))
        try:
            self.timer.arm(min(self.cfg["timeout_per_test"] + START_GRACE_S, self.remaining()), channel)
            try:
                error, syntax_ok, _ = channel.ready()  # what the sandbox says of its layers is not used
            finally:
                self.timer.disarm()
        except Abort:
            error, syntax_ok = channel.failure, True
        channel.capture = self.capture
        if error is None and channel.count_violations():
            error = "SandboxViolation"
        return channel, error, syntax_ok

    def finish(self, channel):
        self.spawner.reap()
        channel.close()

    def run(self):
        channel, error, syntax_ok = self.start(first=True)
        self.report({"phase": "program", "syntax_ok": syntax_ok, "error": error})
        if error is not None:
            self.finish(channel)
            return
        timeouts = 0
        for i, code in enumerate(self.tests):
            if timeouts >= self.cfg["max_timeouts"] or self.remaining() <= 0:
                error = "Timeout"
            else:
                if channel is None:
                    channel, error, _ = self.start()
                if error is None:
                    seconds = min(self.cfg["timeout_per_test"], self.remaining())
                    self.report({"phase": "begin", "i": i, "seconds": seconds})
                    error = self.run_test(channel, code, seconds)
                self.finish(channel)
                channel = None
            timeouts += error == "Timeout"
            self.report({"phase": "test", "i": i, "error": error})
        if channel is not None:
            self.finish(channel)

    def run_test(self, channel, code, seconds):
        if isinstance(self.setup, str) or isinstance(code, str):
            return self.setup if isinstance(self.setup, str) else code
        before = channel.count_violations()
        namespace = TestGlobals(channel, self.entry_points)
        try:
            self.timer.arm(seconds, channel)
            try:
                if self.setup is not None:
                    exec(self.setup, namespace)
                exec(code, namespace)
            finally:
                self.timer.disarm()
            error = None
        except BaseException as exc:
            error = error_name(type(exc).__name__)
        if channel.failure:
            return channel.failure
        if channel.count_violations() != before:
            return "SandboxViolation"
        return error


class ResultTooLarge(Exception):
    """XML over :data:`MAX_XML_BYTES` given to a parser of the evaluator (see :func:`bound_xml_parsers`)."""


class _BoundedExpat:
    """A ``pyexpat`` parser that refuses input past :data:`MAX_XML_BYTES` (minidom, pulldom, sax and
    plain expat parse through one); everything else is the parser's own."""

    def __init__(self, parser):
        object.__setattr__(self, "_parser", parser)
        object.__setattr__(self, "_fed", 0)

    def __getattr__(self, name):
        return getattr(self._parser, name)

    def __setattr__(self, name, value):  # handlers and options go to the parser
        setattr(self._parser, name, value)

    def Parse(self, data, isfinal=False):
        fed = self._fed + len(data)
        if fed > MAX_XML_BYTES:
            raise ResultTooLarge(f"XML over {MAX_XML_BYTES} bytes")
        object.__setattr__(self, "_fed", fed)
        return self._parser.Parse(data, isfinal)

    def ParseFile(self, file):
        while data := file.read(1 << 16):
            self.Parse(data)
        return self.Parse(b"", True)


def bound_xml_parsers():
    """Make the XML parsers a test reaches in this process refuse input past :data:`MAX_XML_BYTES` with
    :class:`ResultTooLarge` (the test fails with that name): a test that parses a file the program wrote
    (ClassEval's XML tests) would otherwise grow the evaluator by ~20 times the file (16 MB of ``<a/>``: +340
    MB with ElementTree; minidom passes the evaluator's memory limit). Called after the spawner is forked, so
    the program's own parsing is not bounded."""
    create = pyexpat.ParserCreate

    def parser_create(*args, **kwargs):
        return _BoundedExpat(create(*args, **kwargs))

    pyexpat.ParserCreate = expat.ParserCreate = parser_create

    class XMLParser(ElementTree.XMLParser):
        """ElementTree's parser (``parse``, ``fromstring``, ``iterparse``, ``XMLPullParser`` make one), counting
        what it is fed."""

        def feed(self, data):
            self._fed = getattr(self, "_fed", 0) + len(data)
            if self._fed > MAX_XML_BYTES:
                raise ResultTooLarge(f"XML over {MAX_XML_BYTES} bytes")
            return super().feed(data)

        def _parse_whole(self, source):  # ElementTree.parse's shortcut past feed
            while data := source.read(1 << 16):
                self.feed(data)
            return self.close()

    ElementTree.XMLParser = XMLParser


def mapped_mb():
    """This process's address space (MB), what ``RLIMIT_AS`` counts."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") >> 20


def limit_memory(mb, hard=False):
    """Bound this process's address space at ``mb`` MB (the hard limit too when ``hard``)."""
    _, current_hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20 if hard else current_hard))


def evaluator_main(payload_fd, result_fd, stderr_fd):
    os.setsid()
    die_with_parent()
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(stderr_fd, 2)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def report(obj):
        view = memoryview(dumps(obj))
        while view:
            view = view[os.write(result_fd, view) :]

    cfg = read_part(payload_fd)
    cfg["mapped_mb"] = mapped_mb()  # before the root changes: /proc then shows the job's PID namespace only
    os.environ.update(HOME=cfg["workdir"], TMPDIR=cfg["workdir"])
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None
    isolation = Isolation(cfg)
    layers = dict(isolation.layers, rlimits=True, no_new_privs=True, seccomp=SECCOMP_PROGRAM is not None)
    if not (layers["read_only_root"] or layers["landlock"]):
        report({"phase": "unavailable", "layers": layers})  # the program would see the host's filesystem
        return
    missing = [k for k in KERNEL_LAYERS if k not in ("proc", "tmpfs_workdir") and not layers[k]]
    if cfg["isolation"] == "strict" and (missing or layers["uid"] == 0):
        report({"phase": "refused", "missing": missing + ["unprivileged uid"] * (layers["uid"] == 0)})
        return
    cfg["chdir"] = layers["read_only_root"]
    cfg["sys_path"] = isolation.view.sys_path()
    # forked before the tests are read: no sandbox holds them
    spawner = Spawner(cfg, isolation.python_dirs, isolation.ruleset)
    if isolation.ruleset is not None:
        os.close(isolation.ruleset)
    import_through(isolation.python_dirs)  # the trusted tests import too
    limit_memory(cfg["mapped_mb"] + EVALUATOR_MEMORY_MB + TEST_MEMORY_MB)  # the sandboxes set their own (forked)
    job = read_part(payload_fd)
    os.close(payload_fd)
    random.seed()  # the launcher's state is shared by every fork
    bound_xml_parsers()  # after the spawner's fork: the tests' parsers, not the program's
    evaluation = Evaluation(cfg, job, isolation, spawner, report)
    sys.stdout = sys.stderr = evaluation.capture
    try:
        evaluation.run()
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        spawner.close()
    layers.update(proc=spawner.proc, tmpfs_workdir=isolation.layers["tmpfs_workdir"], audit_hook=True)
    report({"phase": "done", "stdout": evaluation.capture.text(), "layers": layers})


# ----------------------------------------------------------------------------------------------- launcher

SECCOMP_PROGRAM = None  # set by the launcher, inherited by every fork
PRELOAD = (
    "subprocess",
    "unittest",
    "math",
    "random",
    "collections",
    "re",
    "itertools",
    "functools",
    "heapq",
    "bisect",
    "string",
    "datetime",
    "decimal",
    "fractions",
    "copy",
    "typing",
    "statistics",
    "traceback",
)


def launcher_main(sock_fd):
    """Serve ``job`` requests (fds: payload, result pipe, stderr) by forking an evaluator; answer with its pid
    and a pidfd. Exits when the trainer closes the socket."""

    global SECCOMP_PROGRAM
    for name in PRELOAD:
        importlib.import_module(name)
    SECCOMP_PROGRAM = compile_seccomp()
    _machine_view()  # once: every evaluator is a fork
    gc.freeze()  # the forks share these pages: keep the collector from writing to them
    sock = socket.socket(fileno=sock_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # evaluators are reaped by the kernel
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 64, 3)
        except OSError:
            return
        if msg != b"job" or len(fds) != 3:
            return
        pid = os.fork()
        if pid == 0:
            sock.close()
            code = 0
            try:
                evaluator_main(*fds)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        try:
            pidfd = [os.pidfd_open(pid)]
        except (AttributeError, OSError):
            pidfd = []
        socket.send_fds(sock, [str(pid).encode()], pidfd)
        for fd in pidfd:
            os.close(fd)


if __name__ == "__main__":
    launcher_main(int(sys.argv[1]))
