"""Peak memory of a team of full copies against a LoRA team on one shared base (docs/scaling.md#lora-teams), and
of a team whose last agents are frozen (``trained_agents``, docs/algorithms.md#who-trains-when).

Each configuration runs in a fresh process (peak resident memory is per process): build a MAGRPO team of N
SmolLM2-135M-Instruct agents (the embedded model, offline) — N full copies, or one base with N LoRA adapters — and
train ``--updates`` updates (K=2 samples of 16 new tokens for one prompt each). With ``--frozen``, each team is also
run with only agent 0 trained (the others frozen: no gradients, no optimizer state). Reported: parameters held,
trainable parameters, the weights' bytes, the optimizer state's bytes, the mean seconds per update, and the
process's peak RSS (``ru_maxrss``) after the updates, which includes Python, torch and the optimizer state.

    python benchmarks/lora_memory.py --json benchmarks/results/lora_memory.json
    python benchmarks/lora_memory.py --agents 2 --frozen --updates 2 --json benchmarks/results/frozen_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def one(agents: int, lora: int | None, model: str, frozen: bool = False, updates: int = 1) -> dict:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    from lightning.pytorch import Trainer, seed_everything

    from comlrl_lightning import MAGRPO, TaskDataModule
    from comlrl_lightning.envs import toy

    seed_everything(0)
    module = MAGRPO(
        agents=model,
        num_agents=agents,
        reward_func=toy.letter_reward,
        num_generations=2,
        max_new_tokens=16,
        rollout_buffer_size=1,
        eval_interval=0,
        log_completions=False,
        lora_rank=lora,
        lora_alpha=2.0 * lora if lora else 16.0,
        trained_agents=[0] if frozen else None,
    )
    module.agents  # noqa: B018  (loads the team)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    params = list(module.parameters())
    trainer = Trainer(
        max_steps=updates,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=TaskDataModule(dataset=toy.story_tasks, prompts_per_step=1))
    seconds = (time.perf_counter() - start) / updates
    state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "agents": agents,
        "lora_rank": lora,
        "trained_agents": [0] if frozen else list(range(agents)),
        "updates": updates,
        "seconds_per_update": seconds,
        "optimizer_state_gib": sum(t.numel() * t.element_size() for t in state) / 2**30,
        "parameters": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "weights_gib": sum(p.numel() * p.element_size() for p in params) / 2**30,
        "peak_rss_after_loading_gib": loaded,
        "peak_rss_after_updates_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--agents", default="2,4")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--frozen", action="store_true", help="also run each team with only agent 0 trained")
    parser.add_argument("--updates", type=int, default=1, help="updates per run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "N,rank,frozen" in the child process
    args = parser.parse_args()
    if args.one:
        n, rank, frozen = args.one.split(",")
        print(json.dumps(one(int(n), int(rank) or None, args.model, frozen == "1", args.updates)))
        return
    rows = []
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    for n in (int(a) for a in args.agents.split(",")):
        for rank, frozen in [(r, f) for r in (0, args.rank) for f in ((0, 1) if args.frozen else (0,))]:
            out = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--updates", str(args.updates)]
                + ["--one", f"{n},{rank},{frozen}"],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            trained = "agent 0 trained" if frozen else "all trained"
            print(
                f"{n} agents, {'LoRA r=' + str(rank) if rank else 'full copies':>12}, {trained}: "
                f"{r['parameters'] / 1e6:7.1f}M parameters ({r['trainable'] / 1e6:6.2f}M trainable), weights "
                f"{r['weights_gib']:.2f} GiB, optimizer state {r['optimizer_state_gib']:.2f} GiB, peak RSS "
                f"{r['peak_rss_after_loading_gib']:.2f} GiB loaded, {r['peak_rss_after_updates_gib']:.2f} GiB after "
                f"{args.updates} update(s), {r['seconds_per_update']:.1f} s per update",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
