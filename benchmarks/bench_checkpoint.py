"""Writing one training checkpoint: Lightning's default ``TorchCheckpointIO`` against ``FileCheckpointIO``
(comlrl_lightning/callbacks/checkpoints.py), which every run's ``RunCheckpoints`` uses
(benchmarks/README.md#checkpoints).

The checkpoint is a team's as a fit writes it: the module's state dict and the AdamW state after one step (both
moments), for ``--agents`` copies of ``--model`` (default: two SmolLM2-135M-Instruct agents, 3.2 GB). Each save runs
in its own process, so that its peak memory is its own: the process builds the checkpoint, notes its peak resident
memory, saves to a fresh directory under ``--dir`` (default: the system's temporary directory), and reports the seconds
and the peak's growth. ``--repeats`` rounds alternate the two, so that the machine's load hits them alike; the script
prints medians and the ratio per round.

    python benchmarks/bench_checkpoint.py --repeats 3 --json benchmarks/results/checkpoint_smollm2_team.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WAYS = ("lightning", "file")


def worker(args) -> dict:
    """Build the checkpoint, save it ``args.worker``'s way, report seconds, size and the peak memory's growth."""
    import torch
    from bench_step import peak_rss_mib
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from comlrl_lightning import MAGRPO
    from comlrl_lightning.callbacks.checkpoints import FileCheckpointIO
    from comlrl_lightning.envs import toy

    torch.set_num_threads(1)
    module = MAGRPO(agents=args.model, num_agents=args.agents, reward_func=toy.brevity_reward)
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    for parameter in module.parameters():  # one step, so that AdamW holds both moments, as after any update
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    module.zero_grad(set_to_none=True)
    checkpoint = {
        "epoch": 0,
        "global_step": 1,
        "state_dict": module.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
    }
    io = TorchCheckpointIO() if args.worker == "lightning" else FileCheckpointIO()
    folder = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        before = peak_rss_mib()
        start = time.perf_counter()
        io.save_checkpoint(checkpoint, folder / "epoch=0-step=1.ckpt")
        seconds = time.perf_counter() - start
        size = (folder / "epoch=0-step=1.ckpt").stat().st_size
        return {"way": args.worker, "seconds": seconds, "bytes": size, "peak_growth_mib": peak_rss_mib() - before}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_worker(args, way: str) -> dict:
    argv = [sys.executable, __file__, "--worker", way, "--model", args.model, "--agents", str(args.agents)]
    if args.dir:
        argv += ["--dir", args.dir]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"the {way} save failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    rounds = [{way: run_worker(args, way) for way in WAYS} for _ in range(args.repeats)]
    size = rounds[0]["file"]["bytes"]
    print(f"checkpoint: {args.agents} x {args.model} with AdamW's moments, {size / 1e9:.2f} GB")
    print(f"{'':10} {'median s':>9} {'GB/s':>6} {'peak growth MiB':>16}")
    summary = {}
    for way in WAYS:
        seconds = statistics.median(r[way]["seconds"] for r in rounds)
        growth = statistics.median(r[way]["peak_growth_mib"] for r in rounds)
        summary[way] = {"median_s": seconds, "gb_per_s": size / 1e9 / seconds, "peak_growth_mib": growth}
        print(f"{way:10} {seconds:9.2f} {size / 1e9 / seconds:6.2f} {growth:16.0f}")
    ratios = {way: [r[way]["seconds"] / r["lightning"]["seconds"] for r in rounds] for way in WAYS[1:]}
    for way, per_round in ratios.items():
        print(
            f"{way} / lightning: {statistics.median(per_round):.2f} "
            f"(per round {', '.join(f'{x:.2f}' for x in per_round)})"
        )
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "config": vars(args),
        "bytes": size,
        "rounds": rounds,
        "summary": summary,
        "ratio_per_round": ratios,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="agent model (a factory name or a path)")
    parser.add_argument("--agents", type=int, default=2, help="agents in the team")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each saving both ways")
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary directory)")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--worker", choices=WAYS, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
