"""The workloads a user would run, as one table: ``bench_step.py`` over real coding prompts at several K, prompts per
step and team sizes (benchmarks/README.md#the-workload-matrix-bench_matrixpy).

Every point is ``bench_step.py`` on the embedded SmolLM2-135M-Instruct with ``--task`` MBPP or CoopHumanEval prompts
(coding formatters, chat template), K samples per prompt of exactly T new tokens, M prompts per step and N agents,
one warm-up step and ``--steps`` timed steps in a fresh process. Two grids:

    generation  every (task, K, M, N): the step's sampling only (``--generate-only``): samples/s, tokens/s, peak
                memory, the fraction of the bandwidth limit (``roofline.py``)
    step        the whole step (generate + reward + update + optimizer) at a base point and with one axis changed at
                a time (``--step-points``): samples/s, peak memory, the fraction of the limit

A whole grid of full steps at T=128 would take hours on a 2-CPU machine; the one-axis-at-a-time points show how each
axis moves the step. Results: ``--json`` (every number) and ``--markdown`` (the tables of benchmarks/README.md).

    python benchmarks/bench_matrix.py --json benchmarks/results/matrix.json --markdown benchmarks/results/matrix.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402


def point_argv(task: str, k: int, prompts: int, agents: int, args, generate_only: bool) -> list[str]:
    argv = [
        "--task",
        task,
        "--k",
        str(k),
        "--prompts",
        str(prompts),
        "--agents",
        str(agents),
        "--tokens",
        str(args.tokens),
        "--repeats",
        "1",
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--model",
        args.model,
        "--precision",
        args.precision,
        "--generation-dtype",
        args.generation_dtype,
    ]
    return argv + (["--generate-only"] if generate_only else [])


def summarise(report: dict, task: str, k: int, prompts: int, agents: int, tokens: int, phase: str) -> dict:
    after = report["impls"]["after"]
    median = after["phases"][phase]["median"]
    samples = agents * prompts * k
    return {
        "task": task,
        "k": k,
        "prompts": prompts,
        "agents": agents,
        "tokens": tokens,
        "phase": phase,
        "seconds": median,
        "samples_per_s": samples / median,
        "generated_tokens_per_s": samples * tokens / after["phases"]["generate"]["median"],
        "peak_mib": after["peak_mib"],
        "fraction_of_limit": after["phases"][phase]["fraction_of_limit"],
        "prompt_tokens": report["prompt_tokens"],
        "limits": report["limits"],
    }


def step_points(args) -> list[tuple[str, int, int, int]]:
    """The base point, then one axis changed at a time."""
    base = (args.tasks[0], args.k[0], args.prompts[0], args.agents[min(1, len(args.agents) - 1)])
    points = [base]
    for axis, values in enumerate((args.tasks, args.k, args.prompts, args.agents)):
        for value in values:
            point = list(base)
            point[axis] = value
            if tuple(point) not in points:
                points.append(tuple(point))
    return points


def markdown(rows: list[dict], title: str, phase_label: str) -> str:
    lines = [
        f"### {title}",
        "",
        f"| task | K | prompts | N | {phase_label} s | samples/s | generated tokens/s | peak MiB | of limit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['k']} | {r['prompts']} | {r['agents']} | {r['seconds']:.2f} | "
            f"{r['samples_per_s']:.2f} | {r['generated_tokens_per_s']:.0f} | {r['peak_mib']:.0f} | "
            f"{r['fraction_of_limit'] or 0:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model factory name, path or hub id")
    p.add_argument("--tasks", nargs="+", choices=("mbpp", "che"), default=["mbpp", "che"], help="prompt sources")
    p.add_argument("--k", nargs="+", type=int, default=[4, 8], help="K values")
    p.add_argument("--prompts", nargs="+", type=int, default=[1, 4], help="prompts per step")
    p.add_argument("--agents", nargs="+", type=int, default=[1, 2, 4], help="team sizes N")
    p.add_argument("--tokens", type=int, default=128, help="T new tokens per sample, forced")
    p.add_argument("--steps", type=int, default=1, help="timed steps per point, after one warm-up step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), default="32", help="as bench_step.py")
    p.add_argument(
        "--generation-dtype", choices=("model", "bfloat16", "float16"), default="model", help="as bench_step.py"
    )
    p.add_argument(
        "--grids", nargs="+", choices=("generation", "step"), default=["generation", "step"], help="which grids to run"
    )
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    args = p.parse_args(argv)
    started = time.perf_counter()
    out: dict = {"config": vars(args), "generation": [], "step": []}
    plans = {
        "generation": list(itertools.product(args.tasks, args.k, args.prompts, args.agents)),
        "step": step_points(args),
    }
    for grid in args.grids:
        for n, (task, k, prompts, agents) in enumerate(plans[grid], 1):
            print(f"[{grid} {n}/{len(plans[grid])}] task {task}, K={k}, M={prompts}, N={agents}", flush=True)
            report = bench_step.main(point_argv(task, k, prompts, agents, args, grid == "generation"))
            row = summarise(
                report, task, k, prompts, agents, args.tokens, "generate" if grid == "generation" else "step"
            )
            out[grid].append(row)
            if args.json:  # after every point: nothing is lost if a later point fails
                Path(args.json).write_text(json.dumps(out, indent=2))
    out["wall_seconds"] = time.perf_counter() - started
    text = (
        f"Command: `python benchmarks/bench_matrix.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
        f"{out['wall_seconds'] / 60:.0f} min.\n\n"
    )
    if out["generation"]:
        text += markdown(out["generation"], f"Generation, T={args.tokens}", "generate") + "\n"
    if out["step"]:
        text += markdown(out["step"], f"Whole step, T={args.tokens}", "step")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(text)
    return out


if __name__ == "__main__":
    main()
