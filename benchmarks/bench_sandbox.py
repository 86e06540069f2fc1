"""Throughput of the sandbox (``comlrl_lightning.envs.sandbox``) on the MBPP reference solutions.

Workload: the 427 MBPP (sanitized) reference solutions, each as the program the coding reward builds for it
(``build_program`` with a trivial ``aux``) and its asserts (``item_tests``, 1281 in all), run with ``run_many``
at ``workers`` 1 and 2. Reported: programs/s and tests/s (median over ``--repeats``), and how many tests passed.

``--old REV`` also times the sandbox of a git revision (default ``main``) on the same jobs, in the same run: its
``envs/sandbox.py`` is written to a temporary directory and imported from there (that version is one file and
takes ``(program, tests)`` pairs). The new sandbox gets the jobs the reward gives it (``sandbox_job``: the item's
imports as trusted setup, the entry point).

    python benchmarks/bench_sandbox.py --old main --json benchmarks/results/cpu_sandbox.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from comlrl_lightning.envs import coding as C  # noqa: E402
from comlrl_lightning.envs import sandbox  # noqa: E402

MBPP = REPO.parent / "shared" / "data" / "mbpp" / "sanitized-mbpp.json"
AUX = "def aux():\n    return None"


def load_old(rev: str, tmp: str):
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:comlrl_lightning/envs/sandbox.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tmp) / "old_sandbox.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def time_runs(run, jobs, workers: int, repeats: int) -> dict:
    seconds, passed = [], None
    run(jobs[:4], workers)  # warm-up (the new sandbox starts its launcher and probes the machine once)
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = run(jobs, workers)
        seconds.append(time.perf_counter() - t0)
        passed = sum(r.passed for r in results)
    total = sum(r.total for r in results)
    median = statistics.median(seconds)
    return {
        "workers": workers,
        "seconds": seconds,
        "median_s": median,
        "programs_per_s": len(jobs) / median,
        "tests_per_s": total / median,
        "tests": total,
        "passed": passed,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default=None, help="git revision whose sandbox to time as well (e.g. main)")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    items = C.mbpp_tasks(str(MBPP), split=None)
    pairs = [(C.build_program(AUX, it["code"], it), C.item_tests(it)) for it in items]
    jobs = [C.sandbox_job(program, it) for (program, _), it in zip(pairs, items)]
    layers = sandbox.isolation_layers()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old(args.old, tmp) if args.old else None
        for workers in (int(w) for w in args.workers.split(",")):
            rows.append(
                {
                    "sandbox": "new",
                    **time_runs(lambda j, w: sandbox.run_many(j, workers=w), jobs, workers, args.repeats),
                }
            )
            if old is not None:
                rows.append(
                    {
                        "sandbox": f"old ({args.old})",
                        **time_runs(lambda j, w: old.run_many(j, workers=w), pairs, workers, args.repeats),
                    }
                )
    print(
        f"{len(jobs)} MBPP programs, {sum(len(t) for _, t in pairs)} tests; isolation layers: "
        f"{', '.join(k for k, v in layers.items() if v is True)}"
    )
    print(f"{'sandbox':<14} {'workers':>7} {'median s':>9} {'programs/s':>11} {'tests/s':>8} {'passed':>7}")
    for r in rows:
        print(
            f"{r['sandbox']:<14} {r['workers']:>7} {r['median_s']:>9.2f} {r['programs_per_s']:>11.1f} "
            f"{r['tests_per_s']:>8.1f} {r['passed']:>4}/{r['tests']}"
        )
    out = {
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "euid": os.geteuid(),
        },
        "config": vars(args),
        "layers": layers,
        "results": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
