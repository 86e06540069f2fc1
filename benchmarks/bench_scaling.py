"""Data-parallel scaling: training samples/s of one process against D processes (Lightning DDP), same total work.

Each run is the real command line (``python -m comlrl_lightning fit``) on the MAGRPO story task: N=2 agents, K
samples per prompt, exactly T new tokens per sample (``min_new_tokens``, so every run generates the same number of
tokens), one torch thread per process. The global batch is the same in every run — ``--global-prompts`` prompts
per step, split over the D processes — and so is the number of steps; only the number of processes changes.

The clock (``ScalingClock``, a callback) runs on every rank from the end of the first training step (start-up,
model building and the first step's one-off costs excluded) to the end of the last; samples/s = joint actions
(``env_step``, over all ranks) done in that window / its length. Efficiency = samples/s(D) / samples/s(1); ideal D.

    python benchmarks/bench_scaling.py                                  # tiny-5m, D = 1 and 2
    python benchmarks/bench_scaling.py --json benchmarks/results/cpu_scaling.json
    python benchmarks/bench_scaling.py --device cuda --model smollm2-135m-instruct --processes 1,2,4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback

REPO = Path(__file__).resolve().parents[1]


class ScalingClock(Callback):
    """Writes ``$SCALING_OUT/rank_<r>.json``: env_step and the time at the end of every training step."""

    def __init__(self):
        self.marks: list[tuple[float, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.marks.append((time.perf_counter(), pl_module.env_step))

    def on_train_end(self, trainer, pl_module):
        out = Path(os.environ["SCALING_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(self.marks))


def run(processes: int, args, workdir: Path) -> dict:
    per_rank = args.global_prompts // processes
    out = workdir / f"d{processes}"
    command = [
        sys.executable,
        "-m",
        "comlrl_lightning",
        "fit",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        "--model.init_args.agents",
        args.model,
        "--model.init_args.num_generations",
        str(args.k),
        "--model.init_args.max_new_tokens",
        str(args.tokens),
        "--model.init_args.generation_kwargs",
        json.dumps({"min_new_tokens": args.tokens}),
        "--model.init_args.rollout_buffer_size",
        str(per_rank),
        "--model.init_args.eval_interval",
        "0",
        "--model.init_args.log_completions",
        "false",
        "--data.init_args.prompts_per_step",
        str(per_rank),
        "--trainer.max_steps",
        str(args.steps),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.accelerator",
        args.device,
        "--trainer.devices",
        str(processes),
        "--trainer.strategy",
        "ddp" if processes > 1 else "auto",
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--checkpoint_every_n_updates",
        "0",
        "--trainer.callbacks+=bench_scaling.ScalingClock",
        "--trainer.default_root_dir",
        str(out / "run"),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "benchmarks"),
        "SCALING_OUT": str(out),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "WANDB_MODE": "offline",
    }
    out.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    if done.returncode != 0:
        raise SystemExit(f"D={processes} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    marks = json.loads((out / "rank_0.json").read_text())
    (t0, e0), (t1, e1) = marks[0], marks[-1]
    return {
        "processes": processes,
        "prompts_per_process": per_rank,
        "steps": len(marks),
        "wall_s": wall,
        "timed_s": t1 - t0,
        "samples": e1 - e0,
        "samples_per_s": (e1 - e0) / (t1 - t0),
        "tokens_per_s": (e1 - e0) * 2 * args.tokens / (t1 - t0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-5m")
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
    parser.add_argument("--global-prompts", type=int, default=4, help="prompts per step over all processes")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    counts = [int(c) for c in args.processes.split(",")]
    results: dict[int, list[dict]] = {d: [] for d in counts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):  # interleaved, so drift of the machine hits every D alike
            for d in counts:
                results[d].append(run(d, args, Path(tmp) / f"r{r}"))
    base = statistics.median(x["samples_per_s"] for x in results[counts[0]])
    print(
        f"{args.model}, N=2, K={args.k}, T={args.tokens}, {args.global_prompts} prompts per step in all, "
        f"{args.threads} thread(s) per process, {args.device}"
    )
    print(f"{'processes':>9} {'samples/s':>10} {'tokens/s':>9} {'efficiency':>10}   runs (samples/s)")
    rows = []
    for d in counts:
        rates = [x["samples_per_s"] for x in results[d]]
        median = statistics.median(rates)
        ratios = [x / base for x in rates]
        rows.append(
            {
                "processes": d,
                "samples_per_s_median": median,
                "speedup_median": median / base,
                "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in results[d]),
                "runs": results[d],
            }
        )
        print(
            f"{d:>9} {median:>10.1f} {rows[-1]['tokens_per_s_median']:>9.0f} {median / base:>9.2f}x   "
            + ", ".join(f"{x:.1f}" for x in rates)
            + f"  (ratios {', '.join(f'{x:.2f}' for x in ratios)})"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": {
                        "platform": platform.platform(),
                        "cpus": os.cpu_count(),
                        "python": platform.python_version(),
                    },
                    "config": vars(args),
                    "results": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
