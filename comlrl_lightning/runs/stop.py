"""Stopping a run at its next safe point: what Ctrl-C (SIGINT) or SIGTERM asks of the long phases of a fit.

A fit's signal handler (``callbacks/checkpoints.py``) calls :func:`request`; nothing is raised from the handler
itself. The phases whose work can be thrown away without touching what a checkpoint holds -- sampling a step's
rollout, collecting preference pairs, an evaluation -- run inside :func:`discardable`; the long loops under them call
:func:`check` at their safe points (a generated token, a generation call, a reward call, a task, an evaluation
batch, a sandbox wait, an API request or its back-off). Inside a discardable phase a requested stop raises
:class:`StopRequested` there; outside one (an update, a checkpoint being written, code run by itself) :func:`check`
does nothing, and the step under way finishes first. Threads (agents generating on several devices, sandbox jobs,
API requests) check too, and their exception reaches the phase through their pool.

It imports nothing but the standard library: the sandbox and the comparators use it without Lightning.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

_WAIT_SLICE_S = 0.2  # longest sleep between two checks in :func:`wait`


class StopRequested(BaseException):
    """A stop was requested by ``signum`` while ``phase`` (a description, with its progress) was under way. A
    ``BaseException``, so that ``except Exception`` around a user's reward or a request does not swallow it."""

    def __init__(self, signum: int, phase: str):
        super().__init__(f"{signal_name(signum)} during {phase}")
        self.signum, self.phase = signum, phase


@dataclass
class Phase:
    """A discardable phase: its ``name`` and, where its loop counts, ``done`` of ``total`` ``unit``."""

    name: str
    total: int | None = None
    unit: str = ""
    done: int = 0

    def describe(self) -> str:
        return f"{self.name} ({self.done} of {self.total} {self.unit} done)" if self.total is not None else self.name


_lock = threading.Lock()
_signum: int | None = None  # the signal that asked for the stop
_phases: list[Phase] = []  # the discardable phases under way, outermost first (the main thread opens them)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def request(signum: int) -> None:
    """Ask the run to stop at its next safe point (called by a signal handler: sets a value, raises nothing)."""
    global _signum
    _signum = int(signum)


def requested() -> int | None:
    """The signal that asked for a stop, or None."""
    return _signum


def clear() -> None:
    """Forget a request (a fit starts, or has ended)."""
    global _signum
    _signum = None


def check() -> None:
    """A safe point: raise :class:`StopRequested` when a stop was requested and a discardable phase is under way."""
    signum = _signum
    if signum is not None and _phases:
        with _lock:
            where = _phases[0].describe()
        raise StopRequested(signum, where)


@contextlib.contextmanager
def discardable(name: str, total: int | None = None, unit: str = "") -> Iterator[Phase]:
    """Mark a phase whose work a stop may throw away (module docstring); the phase checks on entry. Its caller
    advances ``phase.done`` as its loop goes, for the log line that says what was discarded."""
    phase = Phase(name, total, unit)
    with _lock:
        _phases.append(phase)
    try:
        check()
        yield phase
    finally:
        with _lock:
            _phases.remove(phase)


def wait(seconds: float, sleep: Callable[[float], None] = time.sleep) -> None:
    """Sleep ``seconds`` with safe points: ``time.sleep`` in slices of at most 0.2 s; another ``sleep`` (a test's
    clock) is called once."""
    if sleep is not time.sleep:
        sleep(seconds)
        check()
        return
    end = time.monotonic() + max(seconds, 0.0)
    while (left := end - time.monotonic()) > 0:
        check()
        time.sleep(min(left, _WAIT_SLICE_S))
    check()
