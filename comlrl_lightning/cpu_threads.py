"""Intra-op threads for a CPU run whose cores other processes are using.

torch starts one OpenMP intra-op thread per core, and every operation waits for all of them. Where other processes
keep those cores busy, the threads wait for each other at every operation and a run gets many times slower than it
would with fewer threads: on 2 cores beside one 2-thread torch job (and other work), the quick start's 3 updates took
66-79 s with torch's 2 threads and 5-6 s with 1 (README, "A shared machine").

So a CPU run measures, as it starts, how busy its cores are (``/proc/stat`` over :data:`SAMPLE_SECONDS`, the cores of
its CPU affinity) and, when torch's threads outnumber the free cores, runs with one thread per free core (at least
one), saying so in one line. Once per process: later runs in the same process keep the number (results do not change
with the load between two fits). ``OMP_NUM_THREADS``, when set, is the run's choice and is left alone; it is also how
to choose another number. Outside Linux (no ``/proc/stat``) nothing is changed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterable

SAMPLE_SECONDS = 0.2  # long enough to see a busy core (the kernel counts in 10 ms ticks), short beside a start-up
_decided: list[int | None] = []  # the process's decision, once made


def read_proc_stat() -> str:
    with open("/proc/stat") as file:
        return file.read()


def cpu_times(cpus: Iterable[int], read: Callable[[], str] = read_proc_stat) -> dict[int, tuple[int, int]]:
    """``{cpu: (busy, total)}`` clock ticks since boot of each of ``cpus``, from ``/proc/stat`` (idle and iowait are
    not busy; guest time is already in user time)."""
    wanted = {f"cpu{c}": c for c in cpus}
    times = {}
    for line in read().splitlines():
        name, *values = line.split()
        if name in wanted:
            ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            times[wanted[name]] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return times


def busy_cores(
    cpus: Iterable[int],
    seconds: float = SAMPLE_SECONDS,
    read: Callable[[], str] = read_proc_stat,
    sleep: Callable[[float], Any] = time.sleep,
) -> float | None:
    """How many of ``cpus`` other processes keep busy (0.0 to ``len(cpus)``), measured over ``seconds`` while this
    process sleeps; None when it cannot be read."""
    cpus = list(cpus)
    try:
        before = cpu_times(cpus, read)
        sleep(seconds)
        after = cpu_times(cpus, read)
    except (OSError, ValueError):
        return None
    busy = 0.0
    for cpu in cpus:
        if cpu not in before or cpu not in after:
            return None
        ticks = after[cpu][1] - before[cpu][1]
        busy += (after[cpu][0] - before[cpu][0]) / ticks if ticks > 0 else 0.0
    return busy


def threads_for(threads: int, cores: int, busy: float) -> int | None:
    """The intra-op threads for a run of ``threads`` on ``cores`` of which ``busy`` are used by other processes: one
    per free core (at least one) when the threads outnumber the free cores by more than half a core, else None (keep
    ``threads``)."""
    free = max(0.0, cores - busy)
    if threads <= free + 0.5:
        return None
    fewer = max(1, int(free + 0.5))
    return fewer if fewer < threads else None


def fit_threads_to_free_cores(log: Callable[[str], Any] | None = None, servers: int = 0) -> int | None:
    """Measure this process's cores and cap torch's intra-op threads to the free ones (module docstring); ``servers``:
    vLLM servers on this machine the run samples from, each counted as one busy core (idle as the run starts, they
    sample while it trains: on 2 cores beside two, the quick start took 1.19 s per update with 2 threads, 0.17 s
    with 1; benchmarks/README.md, "Synchronous vs one-step-off rollouts"). Returns the new number, or None when it is
    left as it was (``OMP_NUM_THREADS`` set, cores free, nothing to read, or decided earlier in this process)."""
    if _decided:
        return None
    import torch

    _decided.append(None)
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    threads = torch.get_num_threads()
    busy = busy_cores(cpus)
    fewer = threads_for(threads, len(cpus), busy + servers) if busy is not None else None
    if fewer is None:
        return None
    torch.set_num_threads(fewer)
    _decided[0] = fewer
    local = f" and {servers} vLLM server{'s' if servers > 1 else ''} on this machine sample" if servers else ""
    (log or _to_stderr)(
        f"CPU: {busy:.1f} of this run's {len(cpus)} cores are busy with other processes{local}, so torch runs {fewer} "
        f"intra-op thread{'s' if fewer > 1 else ''}, not {threads} (threads waiting for shared cores made runs >10x "
        f"slower); OMP_NUM_THREADS={threads} keeps {threads}"
    )
    return fewer


def local_servers(urls: Iterable[str]) -> int:
    """How many of the vLLM server ``urls`` run on this machine (a loopback address or this host's name)."""
    import socket
    from urllib.parse import urlparse

    here = {"localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname(), socket.getfqdn()}
    hosts = {url: urlparse(url).hostname or "" for url in urls}
    return len({url for url, host in hosts.items() if host in here or host.startswith("127.")})


def runs_on_cpu(accelerator: Any) -> bool:
    """Whether ``trainer.accelerator`` puts the run on the CPU (``cpu``, or ``auto``/unset without CUDA or MPS)."""
    name = str(accelerator).lower() if isinstance(accelerator, str) or accelerator is None else None
    if name == "cpu":
        return True
    if name not in ("auto", "none"):
        return False
    import torch

    return not torch.cuda.is_available() and not torch.backends.mps.is_available()


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
