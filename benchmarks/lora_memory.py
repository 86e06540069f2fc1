"""Peak memory of a team of full copies against a LoRA team on one shared base (docs/scaling.md#lora-teams).

Each configuration runs in a fresh process (peak resident memory is per process): build a MAGRPO team of N
SmolLM2-135M-Instruct agents (the embedded model, offline) — N full copies, or one base with N LoRA adapters — and
train one update (K=2 samples of 16 new tokens for one prompt). Reported: parameters held, trainable parameters,
the weights' bytes, and the process's peak RSS (``ru_maxrss``) after the update, which includes Python, torch and
the optimizer state.

    python benchmarks/lora_memory.py --json benchmarks/results/lora_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path


def one(agents: int, lora: int | None, model: str) -> dict:
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
    )
    module.agents  # noqa: B018  (loads the team)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    params = list(module.parameters())
    trainer = Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=TaskDataModule(dataset=toy.story_tasks, prompts_per_step=1))
    return {
        "agents": agents,
        "lora_rank": lora,
        "parameters": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "weights_gib": sum(p.numel() * p.element_size() for p in params) / 2**30,
        "peak_rss_after_loading_gib": loaded,
        "peak_rss_after_one_update_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--agents", default="2,4")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "N,rank" in the child process
    args = parser.parse_args()
    if args.one:
        n, rank = args.one.split(",")
        print(json.dumps(one(int(n), int(rank) or None, args.model)))
        return
    rows = []
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    for n in (int(a) for a in args.agents.split(",")):
        for rank in (0, args.rank):
            out = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--one", f"{n},{rank}"],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"{n} agents, {'LoRA r=' + str(rank) if rank else 'full copies':>12}: {r['parameters'] / 1e6:7.1f}M "
                f"parameters ({r['trainable'] / 1e6:6.2f}M trainable), weights {r['weights_gib']:.2f} GiB, peak RSS "
                f"{r['peak_rss_after_loading_gib']:.2f} GiB loaded, {r['peak_rss_after_one_update_gib']:.2f} GiB "
                "after one update",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
