"""Every algorithm learning one cooperative toy task from random initialisation.

The task: two agents each write a short completion; the team reward is the mean over agents of the share of the
letter ``e`` among the letters written (``comlrl_lightning.envs.toy.letter_reward``; chance ~0.12). Every
algorithm trains a team of randomly initialised ``tiny`` models (138K parameters each, a different initialisation
per seed) for a fixed number of optimizer updates, and every one is measured the same way: the module's own
evaluation (``evaluate``: one sampled completion per agent for each held-out item, scored with the task reward,
the same sampling settings as training) on held-out items it never trains on, with a fixed evaluation seed so
the before and after numbers see the same random draws. MARLHF and MARLHFIter train on their learned reward model
only; the task reward scores their preference pairs and the evaluation.

    .venv/bin/python benchmarks/learning.py                       # all rows, seeds 0 1 2 (~5 min on 2 idle CPUs)
    .venv/bin/python benchmarks/learning.py --only MADPO,MARLHF-magrpo --seeds 0

Writes ``benchmarks/results/learning.md`` (the table), ``learning.json`` (every number, curves included) and
``learning.png`` (held-out reward against updates, mean over seeds, the band spans the seeds' min to max).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import comlrl_lightning as cl  # noqa: E402
from comlrl_lightning.envs import toy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TRAIN_ITEMS = [{"prompt": f"topic {i}", "topic": f"topic {i}"} for i in range(32)]
HELD_OUT = [{"prompt": f"held-out topic {i}", "topic": f"held-out topic {i}"} for i in range(64)]
EVAL_SEED = 1234  # every evaluation samples with this seed (in a forked RNG: training's stream is untouched)

COMMON = dict(
    agents="tiny",
    num_agents=2,
    reward_func=toy.letter_reward,
    max_new_tokens=8,
    temperature=1.0,
    top_p=1.0,
    top_k=None,
    eval_interval=0,
    log_completions=False,
)
GROUP = dict(num_generations=8, rollout_buffer_size=4, agent_learning_rate=1e-2)  # the MAGRPO family
# With advantage_normalization on (the default) the four baselines give the same advantages (docs/algorithms.md,
# baselines and advantages); off, each baseline acts. MAGRPO and MARLOO then still differ only by the factor K/(K-1),
# which AdamW's update does not see.
RAW_ADVANTAGES = dict(GROUP, advantage_normalization=False)
CRITICS = dict(GROUP, rollout_buffer_size=32, critic_learning_rate=1e-2)
DPO = dict(
    preference_num_candidates=16,
    preference_pairs_per_sample=16,
    train_batch_size=16,
    agent_learning_rate=1e-2,
    dpo_beta=0.1,
)
# The reward model must generalise from pairs of random text to the agents' later completions: many pairs with wide
# reward gaps (32 candidates, the 16 widest gaps per task) and a moderate learning rate (at 1e-2 it memorises its
# pairs and the policy exploits it). The RL stage uses a lower agent learning rate than plain MAGRPO: the policy
# leaves the reward model's training distribution more slowly.
REWARD_MODEL = dict(
    reward_model_name="tiny",
    preference_num_candidates=32,
    preference_pairs_per_sample=16,
    pair_selection="reward_gap",
    reward_learning_rate=2e-3,
    reward_train_batch_size=16,
    reward_num_train_epochs=2,
    agent_learning_rate=5e-3,
)


class EqualParts:
    """A centralized adapter for random models, which never write the default adapter's role tags: the joint prompt
    lists the role prompts, and the joint completion is cut into N equal character spans, one per role (it always
    parses)."""

    def build_prompt(self, item, prompts):
        return "; ".join(f"role {i}: {p}" for i, p in enumerate(prompts))

    def parse_completion(self, text, item, num_agents):
        bounds = [len(text) * i // num_agents for i in range(num_agents + 1)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@dataclass
class Spec:
    """One row of the benchmark: the module class and its fields, the data it trains on, the update budget."""

    cls: type
    fields: dict[str, Any]
    steps: int
    preference: bool = False  # trains from a PreferenceDataModule
    prompts_per_step: int = 4
    note: str = ""


SPECS: dict[str, Spec] = {
    "MAGRPO": Spec(cl.MAGRPO, GROUP, 40, note="default config (normalized advantages)"),
    "MAGRPO-clipped": Spec(
        cl.MAGRPO,
        dict(GROUP, policy_loss="clipped", num_iterations=2),
        40,
        note="policy_loss clipped: 2 passes per drained buffer, ratio clipped to [0.8, 1.2]",
    ),
    "MAGRPO-gspo": Spec(
        cl.MAGRPO,
        dict(GROUP, policy_loss="gspo", num_iterations=2),
        40,
        note="policy_loss gspo: sequence ratio clipped to [0.8, 1.2], 2 passes",
    ),
    "MAGRPO-dynamic": Spec(
        cl.MAGRPO, dict(GROUP, dynamic_sampling=True), 40, note="dynamic_sampling: tied groups dropped and refilled"
    ),
    "MAGRPO-components": Spec(
        cl.MAGRPO,
        dict(GROUP, reward_func=toy.letter_reward_components, reward_aggregation="normalize_components"),
        40,
        note="each agent's share a reward component, normalised within its group (normalize_components)",
    ),
    "MAGRPO-raw": Spec(cl.MAGRPO, RAW_ADVANTAGES, 40, note="advantage_normalization off"),
    "MAGRPO-alternating": Spec(
        cl.MAGRPO,
        dict(GROUP, agent_update_schedule="alternating", alternate_every=5),
        40,
        note="agent_update_schedule alternating: blocks of 5 updates per agent (each agent steps 20 times)",
    ),
    "MAGRPO-sequential": Spec(
        cl.MAGRPO,
        dict(GROUP, agent_update_schedule="sequential", sequential_order="shuffled", policy_loss="clipped"),
        40,
        note="agent_update_schedule sequential (HAPPO's M, shuffled order) with the clipped ratio loss",
    ),
    "MAGRPO-frozen-partner": Spec(
        cl.MAGRPO,
        dict(GROUP, trained_agents=[0]),
        40,
        note="trained_agents [0]: agent 1 frozen at its random init (the team reward's ceiling is ~0.56)",
    ),
    "MAGRPO-selfplay": Spec(
        cl.MAGRPO,
        dict(
            GROUP,
            num_agents=1,
            num_turns=2,
            formatters=[toy.proposer_prompt],
            external_transition=toy.switch_roles,
            external_prompt_passthrough=True,
            reward_func=toy.role_reward,
        ),
        40,
        note="self-play: ONE agent, proposer (share of e) at turn 1 and solver (share of vowels) at turn 2 by a "
        "role-switching transition; reward = mean over the two turns",
    ),
    "MARLOO-raw": Spec(
        cl.MARLOO,
        RAW_ADVANTAGES,
        40,
        note="advantage_normalization off; MAGRPO-raw's advantages × K/(K-1), which AdamW barely sees",
    ),
    "MAReMax-raw": Spec(cl.MAReMax, RAW_ADVANTAGES, 40, note="advantage_normalization off"),
    "MAREINFORCE-raw": Spec(cl.MAREINFORCE, RAW_ADVANTAGES, 40, note="advantage_normalization off (no baseline)"),
    "CentralizedMAGRPO": Spec(
        cl.CentralizedMAGRPO,
        dict(GROUP, max_new_tokens=16, centralized_adapter=EqualParts()),
        40,
        note="one actor writes both roles: 16 tokens cut into two equal parts",
    ),
    "IAC-critic": Spec(cl.IAC, dict(CRITICS, critic_model="tiny"), 40, note="a separate critic LM per agent"),
    "IAC-head": Spec(cl.IAC, dict(CRITICS, use_separate_critic=False), 40, note="a value head on each actor"),
    "MAAC": Spec(cl.MAAC, dict(CRITICS, critic_model="tiny", critic_type="v"), 40, note="one centralized critic"),
    "MADPO": Spec(
        cl.MADPO, DPO, 80, preference=True, prompts_per_step=8, note="pairs collected once from the initial team"
    ),
    "MARLHF-magrpo": Spec(
        cl.MARLHF,
        dict(GROUP, **REWARD_MODEL, rl_algorithm="magrpo"),
        112,
        preference=True,
        note="reward model, then MAGRPO on its scores",
    ),
    "MARLHF-iac": Spec(
        cl.MARLHF,
        dict(CRITICS, **REWARD_MODEL, rl_algorithm="iac", use_separate_critic=False),
        112,
        preference=True,
        note="reward model, then IAC (value heads) on its scores",
    ),
    "MADPOIter": Spec(
        cl.MADPOIter,
        dict(DPO, num_iterations=20),
        80,
        preference=True,
        prompts_per_step=8,
        note="rounds against an independent sample of the current team",
    ),
    "MARLHFIter": Spec(
        cl.MARLHFIter,
        {
            **GROUP,
            **REWARD_MODEL,
            "num_iterations": 20,
            "rl_epochs_per_round": 4,
            "preference_pairs_per_sample": 8,
            "reward_train_batch_size": 32,
        },
        192,
        preference=True,
        note="rounds: a fresh reward model, then 4 MAGRPO epochs on it",
    ),
}


class HeldOutCurve(Callback):
    """The held-out task reward at the start, every ``every`` updates and at the end of training; and which updates
    trained a reward model (MARLHF's reward-model stage) rather than the agents."""

    def __init__(self, items: list[dict[str, Any]], every: int):
        self.items, self.every = items, every
        self.points: list[tuple[int, float]] = []
        self.reward_model_updates: list[int] = []

    def measure(self, trainer, module) -> None:
        if self.points and self.points[-1][0] == trainer.global_step:
            return
        self.points.append((trainer.global_step, held_out_reward(module, self.items)))

    def on_train_start(self, trainer, module) -> None:
        self.measure(trainer, module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if getattr(module, "in_reward_model_stage", False):
            self.reward_model_updates.append(trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            self.measure(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        self.measure(trainer, module)


def held_out_reward(module, items) -> float:
    """The module's evaluation of ``items`` (task reward, one sampled trajectory each), with a fixed seed: the mean
    of its turns' rewards (one turn but for the self-play row)."""
    with torch.random.fork_rng():
        torch.manual_seed(EVAL_SEED)
        metrics = module.evaluation.evaluate(items, batch_size=len(items))
    turns = [value for key, value in metrics.items() if key.startswith("eval/turn_") and key.endswith("/reward_mean")]
    return sum(turns) / len(turns)


def run(name: str, spec: Spec, seed: int, every: int) -> dict[str, Any]:
    """Train one team from random init (``seed`` picks the initialisation and the sampling) and measure it."""
    seed_everything(seed, verbose=False)  # value heads and reward-model heads draw from the global RNG
    module = spec.cls(**{**COMMON, **spec.fields}, model_config={"model_kwargs": {"seed": seed}})
    data_cls = cl.PreferenceDataModule if spec.preference else cl.TaskDataModule
    extra = {"show_progress": False} if spec.preference else {}
    data = data_cls(dataset=TRAIN_ITEMS, prompts_per_step=spec.prompts_per_step, **extra)
    curve = HeldOutCurve(HELD_OUT, every)
    with tempfile.TemporaryDirectory() as logs:  # iterative variants write their replay shards into the run dir
        trainer = Trainer(
            max_steps=spec.steps,
            logger=CSVLogger(logs, name=name),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
            callbacks=[curve],
            accelerator="cpu",
            devices=1,
        )
        seed_everything(seed, verbose=False)
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        seconds = time.perf_counter() - start
    return {
        "seed": seed,
        "steps": trainer.global_step,
        "seconds": seconds,
        "before": curve.points[0][1],
        "after": curve.points[-1][1],
        "curve": curve.points,
        "reward_model_updates": curve.reward_model_updates,
    }


def summarize(name: str, spec: Spec, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def mean_std(key):
        values = [r[key] for r in runs]
        return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    (before, before_sd), (after, after_sd) = mean_std("before"), mean_std("after")
    note = spec.note
    rm_updates = [len(r["reward_model_updates"]) for r in runs]
    if any(rm_updates):
        note += f"; {span(rm_updates)} of the updates train the reward model"
    return {
        "algorithm": name,
        "class": spec.cls.__name__,
        "note": note,
        "before_mean": before,
        "before_std": before_sd,
        "after_mean": after,
        "after_std": after_sd,
        "delta": after - before,
        "steps": span([r["steps"] for r in runs]),
        "seconds_mean": statistics.mean(r["seconds"] for r in runs),
        "runs": runs,
    }


def span(values: list[int]) -> str:
    """``"7"`` when every run gave 7, else ``"lo-hi"``."""
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| algorithm | reward before | reward after | Δ | steps | wall s / run | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['before_mean']:.3f} ± {r['before_std']:.3f} | "
            f"{r['after_mean']:.3f} ± {r['after_std']:.3f} | {r['delta']:+.3f} | {r['steps']} | "
            f"{r['seconds_mean']:.1f} | {r['note']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    fig, axes = plt.subplots(
        -(-len(rows) // cols), cols, figsize=(4 * cols, 2.8 * -(-len(rows) // cols)), sharey=True, squeeze=False
    )
    for ax, row in zip(axes.flat, rows):
        steps = sorted({s for r in row["runs"] for s, _ in r["curve"]})
        per_seed = [dict(r["curve"]) for r in row["runs"]]
        xs = [s for s in steps if all(s in c for c in per_seed)]  # points every seed measured
        values = [[c[s] for c in per_seed] for s in xs]
        ax.plot(xs, [statistics.mean(v) for v in values], color="C0")
        ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color="C0", alpha=0.25)
        ax.axhline(row["before_mean"], color="grey", lw=0.8, ls="--")
        for step in row["runs"][0]["reward_model_updates"]:  # the first seed's reward-model updates, shaded
            ax.axvspan(step, step + 1, color="C1", alpha=0.15, lw=0)
        ax.set_title(row["algorithm"], fontsize=10)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("held-out task reward")
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    fig.suptitle(
        "letter task, tiny models from random init: held-out task reward, mean over seeds, band = min..max "
        "(orange: reward-model updates)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help=f"comma-separated rows (default all: {', '.join(SPECS)})")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--every", type=int, default=4, help="evaluate the held-out items every this many updates")
    parser.add_argument("--out", default=str(RESULTS), help="directory for learning.md/.json/.png")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    names = list(SPECS) if args.only is None else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        parser.error(f"--only: unknown row(s) {unknown}; choose from: {', '.join(SPECS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    for name in ("lightning.pytorch", "lightning.fabric"):  # one line per run instead of Lightning's banners
        logging.getLogger(name).setLevel(logging.WARNING)
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    command = " ".join([python, *sys.argv] if argv is None else [python, __file__, *argv])

    rows, total = [], time.perf_counter()
    for name in names:
        runs = []
        for seed in seeds:
            result = run(name, SPECS[name], seed, args.every)
            runs.append(result)
            print(
                f"[{time.perf_counter() - total:6.0f}s] {name:18s} seed {seed}: held-out reward "
                f"{result['before']:.3f} -> {result['after']:.3f} in {result['steps']} updates "
                f"({result['seconds']:.1f} s)",
                flush=True,
            )
        rows.append(summarize(name, SPECS[name], runs))
    text = table(rows)
    print(text)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} torch thread(s)"
    header = (
        f"`{command}`\n\nLetter task (share of 'e' in both agents' completions, chance ~0.12), two `tiny` "
        f"agents from random init, seeds {seeds}. Reward = the module's evaluation (task reward, one sampled "
        f"completion per agent, temperature 1.0, fixed evaluation seed) on {len(HELD_OUT)} held-out items, "
        f"before and after the update budget (steps = optimizer updates, reward-model updates included). "
        f"Mean ± std over seeds; Δ = after − before. Total {time.perf_counter() - total:.0f} s on {machine}. "
        f"Curves: learning.png.\n\n"
    )
    (out / "learning.md").write_text(header + text + "\n", encoding="utf-8")
    (out / "learning.json").write_text(
        json.dumps(
            {"command": command, "seeds": seeds, "held_out_items": len(HELD_OUT), "eval_seed": EVAL_SEED, "rows": rows},
            indent=1,
        ),
        encoding="utf-8",
    )
    plot(rows, out / "learning.png")
    print(f"wrote {out / 'learning.md'}, learning.json, learning.png")


if __name__ == "__main__":
    main()
