"""Every shipped environment config trained with MAGRPO on the embedded SmolLM2 for a small, fixed budget.

Each environment's config (``configs/<env>.yaml``) is loaded by the project's own CLI (``comlrl_lightning.cli.main``,
the LightningCLI that ``python -m comlrl_lightning fit --config ...`` runs), so the run trains what the config says:
its reward, formatters, transitions, turns, sampling, group size, learning rate, data. Only the budget is
overridden, with the same dotted flags a user would pass:

    --seed_everything S --data.init_args.seed S         the seed (initial sampling, data order)
    --trainer.max_steps U --trainer.max_epochs -1       U optimizer updates (max_steps alone ends the run)
    --model.init_args.agents smollm2-135m-instruct      the embedded SmolLM2 (every config already names it)
    --model.init_args.max_new_tokens T                  the env's budget below, never more than its config's
    --model.init_args.eval_interval 0                   the periodic evaluation off: this script evaluates
    --trainer.enable_checkpointing false ...            no checkpoints, progress bar or model summary

Every run is measured the same way: the module's own evaluation (``module.evaluate``: one sampled trajectory per
held-out item over all turns, scored with the task reward and its ``reward_processor``, the config's sampling
settings, its ``eval_logger``/``eval_aggregator`` breakdown) on held-out items — the first ``--held-out`` items of
the config's evaluation set, which training never sees; a set smaller than that (TravelPlanner 5, StrBuild and
HouseBuild 2) is repeated to give as many independent draws — with a fixed evaluation seed (in a forked RNG:
training's stream is untouched), before the first update, every ``--every`` updates and after the last. The
headline number is the reward of the last turn (turn 1 for single-turn envs; for two-turn envs the answer after
feedback); the breakdown (format, syntax, pass rates, levels, coverage, ...) shows which part of the reward's
partial credit moved, and the share of samples with a zero advantage (all K samples of a group tied) says whether
the run had any signal to learn from.

    .venv/bin/python benchmarks/environments.py --seeds 0                # every env, one seed: ~12-14 h on 2 idle CPUs
    .venv/bin/python benchmarks/environments.py --only tldr,mbpp --seeds 0 --updates 10
    .venv/bin/python benchmarks/environments.py --tiny --updates 2 --seeds 0 --out /tmp/envs   # random tiny models

Each (env, seed) run is a fresh worker process of this script (``--no-isolate``: all in this process), so that one
run's memory, sandbox workers or crash do not reach the next; the results are rewritten after every run
(``--resume`` reuses the finished runs of a previous ``environments.json`` with the same settings). An env whose
config does not exist is skipped with the reason printed. Writes ``benchmarks/results/environments.md`` (the
table), ``environments.json`` (every number, every curve, a sample completion per run) and ``environments.png``
(one panel per env).

``--variant dynamic`` trains the same configs with MAGRPO's answer to tied groups, adding to the flags above

    --model.init_args.dynamic_sampling=true                      tied rollout-tree nodes (every agent's K returns
    --model.init_args.dynamic_sampling_max_extra_prompts=N       equal: zero advantage) dropped and refilled with up
                                                                 to N (--extra-prompts, 3) extra prompts per step
    --model.init_args.reward_aggregation=normalize_components    each named reward component normalised in its group
    --model.init_args.reward_func=<the reward's components twin> (the config's reward, its terms as a dict)

(an env whose reward has no components twin — BFCL, TravelPlanner — gets dynamic sampling only, its reward summed as
the config says; the output says so). Each run also records, from its ``metrics.csv``, the mean share of the step's
own nodes that tied (``rollout/zero_advantage_ratio_before``), of the nodes trained on
(``rollout/zero_advantage_ratio``), and the extra prompts rolled out per update (counted at every step). It writes
``environments_dynamic.md``/``.json`` (``--name``; no plot) next to, never over, the baseline's files;
``--compare BASELINE.json`` (a ``--variant baseline`` run's JSON with the same budget) puts the baseline's numbers
beside them as the "without" column:

    .venv/bin/python benchmarks/environments.py --only mbpp --seeds 0 --updates 3 --out /tmp/base
    .venv/bin/python benchmarks/environments.py --only mbpp --seeds 0 --updates 3 --variant dynamic \\
        --compare /tmp/base/environments.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EMBEDDED = "smollm2-135m-instruct"
EVAL_SEED = 1234  # every evaluation samples with this seed (in a forked RNG)
TINY_TOKENS = 8  # --tiny: new tokens per completion unless --max-new-tokens says otherwise

CODING_CREDIT = [
    ("gate + defs (L1 reward)", "avg_level_1_reward"),
    ("L2: main defined, compiles", "syntax_rate"),
    ("test pass ratio", "pass_rate"),
    ("all tests pass", "all_passed_rate"),
    ("main calls aux", "aux_usage_rate"),
]
CODING_NEVER = [
    ("earns level-1 credit (format gate passed, aux or entry point defined)", "avg_level_1_reward"),
    ("reaches level 2 (entry point defined, the program compiles)", "syntax_rate"),
    ("passes a single test", "pass_rate"),
]
CODING_READING = (
    "coding_reward, shifted by -4: a format gate (each agent one `def` with a `return`, else 0 → -4), "
    "L1 +0.4/+0.6 for aux/main defined, L2 +0.5 when everything compiles, L3 + the share of the "
    "item's asserts passed, L4 up to +2 for a main that calls aux and does more; penalties down to "
    "-0.7. A team that writes nothing usable scores -4; compiling code with no passing test -2.5."
)
WRITING_CREDIT = [
    ("L1 length gate", "level_1_pass_rate"),
    ("L2 length ratio", "level_2_pass_rate"),
    ("L3 unique words", "level_3_pass_rate"),
    ("L4 style", "level_4_pass_rate"),
    ("ungated total", "avg_ungated_total_reward"),
]
WRITING_NEVER = [("passes the length gate (level 1)", "level_1_pass_rate")]
# --variant dynamic: each config's reward_func -> the same reward with its terms as named components (the
# ``*_reward_components`` twins); a reward not listed (BFCL, TravelPlanner) has none: dynamic sampling only.
COMPONENT_TWINS = {
    "comlrl_lightning.envs.coding.coding_reward": "comlrl_lightning.envs.coding.coding_reward_components",
    "comlrl_lightning.envs.classeval.classeval_reward": "comlrl_lightning.envs.classeval.classeval_reward_components",
    "comlrl_lightning.envs.writing.tldr_reward": "comlrl_lightning.envs.writing.tldr_reward_components",
    "comlrl_lightning.envs.writing.arxiv_reward": "comlrl_lightning.envs.writing.arxiv_reward_components",
    "comlrl_lightning.envs.minecraft.strbuild.strbuild_reward": (
        "comlrl_lightning.envs.minecraft.strbuild.strbuild_reward_components"
    ),
    "comlrl_lightning.envs.minecraft.housebuild.housebuild_reward": (
        "comlrl_lightning.envs.minecraft.housebuild.housebuild_reward_components"
    ),
}
DYNAMIC_ROLLOUT = {  # metrics.csv column -> the run's key (mean over the rows that logged it)
    "rollout/zero_advantage_ratio_before": "zero_nodes_before",  # dynamic sampling: the step's own nodes that tied
    "rollout/zero_advantage_ratio": "zero_nodes",  # the nodes trained on that tie (baseline: every node)
    "rollout/dynamic_sampling_extra_prompts": "extra_prompts_row",
    "rollout/dynamic_sampling_fill_ratio": "fill_ratio",
}


@dataclass
class Env:
    """One row: the config, the completion budget, and the breakdown metrics (``eval/turn_<t>/<suffix>``) that say
    what the reward's partial credit is made of."""

    config: str
    tokens: int  # new tokens per completion (SmolLM2); never more than the config's own max_new_tokens
    credit: list[tuple[str, str]]  # (label, metric suffix) shown before -> after
    never: list[tuple[str, str]] = field(default_factory=list)  # (what it would do, suffix): "never ..." when 0
    reading: str = ""  # what the reward's partial credit means
    tokens_why: str = ""


ENVS: dict[str, Env] = {
    "tldr": Env(
        "writing_tldr_magrpo.yaml",
        64,
        WRITING_CREDIT,
        WRITING_NEVER,
        "tldr_reward 0-3, gated levels: both summaries 8-256 tokens, detailed/concise length ratio 1.6-3.2, "
        "unique-word ratio >= 2, style (transition words). `ungated` scores every level as if the gates "
        "before it passed.",
        "96 in the config; a concise and a detailed TL;DR fit in 64",
    ),
    "arxiv": Env(
        "writing_arxiv_magrpo.yaml",
        192,
        WRITING_CREDIT,
        WRITING_NEVER,
        "arxiv_reward 0-3, gated levels: both sections 128-256 whitespace tokens, length ratio 1.0-1.3, "
        "unique-word ratio 0.7-1.3, style. Level 1 needs >= 128 words per agent.",
        "256 in the config; level 1 needs >= 128 words (~170 tokens), so not below 192",
    ),
    "mbpp": Env("coding_mbpp_magrpo.yaml", 128, CODING_CREDIT, CODING_NEVER, CODING_READING, "the config's"),
    "che": Env("coding_che_magrpo.yaml", 128, CODING_CREDIT, CODING_NEVER, CODING_READING, "the config's"),
    "che-2turn": Env(
        "coding_che_magrpo_2turn.yaml",
        128,
        CODING_CREDIT,
        CODING_NEVER,
        CODING_READING + " Turn 2 rewrites after the sandbox's level feedback; the headline is turn 2.",
        "the config's",
    ),
    "humaneval": Env("humaneval_magrpo.yaml", 128, CODING_CREDIT, CODING_NEVER, CODING_READING, "the config's"),
    "classeval": Env(
        "classeval_magrpo.yaml",
        192,
        [
            ("compiles", "syntax_rate"),
            ("test pass ratio", "pass_rate"),
            ("all tests pass", "all_passed_rate"),
            ("both agents contribute", "cooperation_rate"),
        ],
        [("earns the syntax level (the merged class compiles)", "syntax_rate"), ("passes a single test", "pass_rate")],
        "classeval_reward 0-6 shifted by -6: syntax, each agent's methods present, the share of the "
        "class's tests passed; turn 2 rewrites after test feedback (headline: turn 2).",
        "256 in the config; 192 still fits the methods of one agent's share",
    ),
    "travel": Env(
        "travel_magrpo.yaml",
        192,
        [
            ("parses (JSON)", "avg_parse_rate"),
            ("valid slots", "avg_validity"),
            ("coverage", "avg_coverage"),
            ("slot quality", "avg_slot_quality"),
            ("exact plan", "avg_exact_match"),
        ],
        [("writes a parsable slot JSON", "avg_parse_rate"), ("matches the annotated plan", "avg_exact_match")],
        "travel_reward v3 in [-0.5, 1.2]: parse (A), validity (V), contribution (C), coverage and slot "
        "quality against the annotated plan, an exact-match bonus; penalties for overlap, conflicts, "
        "invalid or duplicate slots. 5 held-out items.",
        "256 in the config; a slot JSON for a 3-day plan fits in 192",
    ),
    "bfcl": Env(
        "bfcl_magrpo.yaml",
        96,
        [
            ("parses", "avg_parse"),
            ("function-name F1", "avg_name_f1"),
            ("argument match", "avg_arg_match"),
            ("exact call set", "avg_exact"),
            ("cross-agent overlap", "avg_overlap_rate"),
        ],
        [("names a right function", "avg_name_f1"), ("answers the exact call set", "avg_exact")],
        "bfcl_reward in [-0.4, 1.2]: parse, function-name F1, argument match, call count, balance between "
        "the agents, exact bonus; minus overlap, lazy agents, extra and duplicate calls.",
        "128 in the config; a few Python-style calls fit in 96",
    ),
    "strbuild": Env(
        "strbuild_magrpo.yaml",
        128,
        [
            ("coverage", "avg_coverage"),
            ("IoU", "avg_iou"),
            ("blocks off the letters", "avg_extra_ratio"),
            ("accepted commands", "avg_accepted_commands"),
        ],
        [("covers a letter cell", "avg_coverage")],
        "strbuild_reward in [-3, 2] shifted by -2: 2 x coverage of the letters - 1.5 x blocks off them "
        "- same-texture neighbours - 0.25 per palette not fully used; turn 2 after position feedback "
        "(headline: turn 2). 2 held-out words.",
        "160 in the config; ~10 /setblock commands fit in 128",
    ),
    "housebuild": Env(
        "housebuild_magrpo.yaml",
        128,
        [
            ("cells matched", "avg_match"),
            ("IoU", "avg_iou"),
            ("spider penalty", "avg_spider_penalty"),
            ("answered /kill", "avg_killed"),
            ("accepted commands", "avg_accepted_commands"),
        ],
        [("places a block of the house", "avg_iou")],
        "housebuild_reward in [-0.1, 1] shifted by -1: the share of the box's cells holding the right "
        "block (air included, so an empty build already matches the air cells) - a spider penalty "
        "unless someone answered /kill; turn 2 after score feedback (headline: turn 2). 2 held-out "
        "houses.",
        "192 in the config; ~8 /fill commands fit in 128",
    ),
}


# ------------------------------------------------------------------------------------------------ one run
def cli_args(env: Env, seed: int, settings: dict[str, Any], root: str) -> list[str]:
    """The flags on top of the env's config: only the budget (module docstring)."""
    config = REPO / "configs" / env.config
    args = [
        "--config",
        str(config),
        f"--seed_everything={seed}",
        f"--data.init_args.seed={seed}",
        f"--trainer.max_steps={settings['updates']}",
        "--trainer.max_epochs=-1",
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--model.init_args.agents={settings['model']}",
        f"--model.init_args.max_new_tokens={settings['tokens']}",
        "--model.init_args.eval_interval=0",
    ]
    if settings["tiny"]:  # random tiny models: no chat template; a different initialisation per seed
        import yaml

        model_config = yaml.safe_load(config.read_text())["model"]["init_args"].get("model_config") or {}
        model_config = {**model_config, "model_kwargs": {**model_config.get("model_kwargs", {}), "seed": seed}}
        args += [
            "--model.init_args.use_chat_template=false",
            f"--model.init_args.model_config={json.dumps(model_config)}",
        ]
    if settings.get("variant") == "dynamic":
        args += [
            "--model.init_args.dynamic_sampling=true",
            f"--model.init_args.dynamic_sampling_max_extra_prompts={settings['extra_prompts']}",
        ]
        if settings["reward_twin"]:
            args += [
                "--model.init_args.reward_aggregation=normalize_components",
                f"--model.init_args.reward_func={settings['reward_twin']}",
            ]
    return args + list(settings["cli_args"])


def config_reward(env: Env) -> str:
    import yaml

    return str(yaml.safe_load((REPO / "configs" / env.config).read_text())["model"]["init_args"]["reward_func"])


def config_tokens(env: Env) -> int:
    import yaml

    return int(yaml.safe_load((REPO / "configs" / env.config).read_text())["model"]["init_args"]["max_new_tokens"])


def held_out(items: list[Any], n: int) -> tuple[list[Any], int, int]:
    """The first ``n`` evaluation items; a smaller set repeated to ``n`` draws (items, distinct items, draws each)."""
    distinct = list(items[:n])
    repeats = max(1, math.ceil(n / len(distinct)))
    return distinct * repeats, len(distinct), repeats


def run_one(name: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Train the env's config for the budget (seed ``seed``) and measure it on the held-out items."""
    import logging

    import torch
    from lightning.pytorch import Callback

    from comlrl_lightning.cli import main as cli_main

    for logger in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.WARNING)
    env = ENVS[name]
    module_curve: list[tuple[int, dict[str, float]]] = []
    eval_seconds = [0.0]
    marks: dict[str, float] = {}  # perf_counter at the start and end of training (around the first/last evaluation)
    start = time.perf_counter()

    class HeldOutCurve(Callback):
        """The module's evaluation of the held-out items before training, every ``every`` updates and at the end."""

        def __init__(self, items, batch_size, every):
            self.items, self.batch_size, self.every = items, batch_size, every

        def measure(self, trainer, module) -> None:
            if module_curve and module_curve[-1][0] == trainer.global_step:
                return
            t0 = time.perf_counter()
            with torch.random.fork_rng():
                torch.manual_seed(EVAL_SEED)
                metrics = module.evaluation.evaluate(self.items, batch_size=self.batch_size)
            eval_seconds[0] += time.perf_counter() - t0
            module_curve.append((trainer.global_step, {k: float(v) for k, v in metrics.items()}))
            print(
                f"    {name} seed {seed}: update {trainer.global_step:3d}, held-out reward "
                f"{metrics[headline_key(module)]:+.3f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )

        def on_train_start(self, trainer, module) -> None:
            marks["loaded"] = time.perf_counter()  # the models are loaded (configure_model) by now
            self.measure(trainer, module)
            marks["train_start"], eval_seconds[0] = time.perf_counter(), 0.0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if self.every and trainer.global_step % self.every == 0:
                self.measure(trainer, module)

        def on_train_end(self, trainer, module) -> None:
            marks["train_end"], intermediate = time.perf_counter(), eval_seconds[0]
            self.measure(trainer, module)
            marks["intermediate_eval"] = intermediate

    class RolloutLog(Callback):
        """Each training step's rollout metrics (``module.last_rollout.metrics``: dynamic sampling's extra prompts,
        exactly; metrics.csv averages the steps pooled into one update)."""

        def __init__(self):
            self.steps: list[dict[str, float]] = []
            self.seen = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            rollout = getattr(module, "last_rollout", None)
            if rollout is not None and rollout is not self.seen:
                self.seen = rollout
                self.steps.append({k: float(v) for k, v in rollout.metrics.items()})

    logs = f"{name}_seed{seed}" + ("_dynamic" if settings.get("variant") == "dynamic" else "")
    with tempfile.TemporaryDirectory() as tmp:
        root = settings.get("keep_logs") and str(Path(settings["keep_logs"], logs)) or tmp
        argv, sys.argv = sys.argv, sys.argv[:1]  # the CLI reads its flags from args= only (Lightning warns otherwise)
        try:
            cli = cli_main(cli_args(env, seed, settings, root), run=False)
        finally:
            sys.argv = argv
        module, data, trainer = cli.model, cli.datamodule, cli.trainer
        eval_items = getattr(data, "eval_items_", None)
        if not eval_items:
            raise RuntimeError(f"{env.config} has no evaluation items (data.init_args.eval_dataset)")
        items, distinct, repeats = held_out(eval_items, settings["held_out"])
        rollout_log = RolloutLog()
        trainer.callbacks += [HeldOutCurve(items, settings["eval_batch"], settings["every"]), rollout_log]
        trainer.fit(module, datamodule=data)
        fit_end = time.perf_counter()
        log_dir = Path(trainer.logger.log_dir) if trainer.logger is not None else None
        train_curve, zero_adv, rollout_stats = read_metrics(log_dir)
        examples = read_examples(log_dir)
        turns = int(getattr(module, "num_turns", 1))
        updates = int(trainer.global_step)
    # Training time: from after the first evaluation to before the last, less the evaluations in between.
    train_seconds = marks["train_end"] - marks["train_start"] - marks["intermediate_eval"]
    key = f"eval/turn_{turns}/reward_mean"
    extra = [step.get("rollout/dynamic_sampling_extra_prompts", 0.0) for step in rollout_log.steps]
    rollout_stats.update(
        rollout_steps=len(rollout_log.steps),
        extra_prompts=sum(extra),
        extra_prompts_per_update=sum(extra) / max(updates, 1),
        extra_prompts_per_step=statistics.mean(extra) if extra else 0.0,
    )
    return {
        "env": name,
        "seed": seed,
        "updates": updates,
        "turns": turns,
        "seconds": fit_end - start,
        "setup_seconds": marks["loaded"] - start,
        "train_seconds": train_seconds,
        "eval_seconds": fit_end - start - train_seconds - (marks["loaded"] - start),
        "seconds_per_update": train_seconds / max(updates, 1),
        "held_out_items": distinct,
        "held_out_draws": repeats,
        "before": module_curve[0][1][key],
        "after": module_curve[-1][1][key],
        "before_turn_1": module_curve[0][1]["eval/turn_1/reward_mean"],
        "after_turn_1": module_curve[-1][1]["eval/turn_1/reward_mean"],
        "curve": [(step, m[key]) for step, m in module_curve],
        "evaluations": module_curve,
        "train_curve": train_curve,
        "zero_advantage_ratio": zero_adv,
        "rollout_stats": rollout_stats,
        "examples": examples,
        "reward_range": reward_range(module),
        "settings": settings,
    }


def headline_key(module) -> str:
    return f"eval/turn_{int(getattr(module, 'num_turns', 1))}/reward_mean"


def reward_range(module) -> list[float] | None:
    """The team reward's declared range after the config's ``reward_processor`` (a ``ScaleShift``)."""
    declared = getattr(module.team.reward_func, "reward_range", None)
    if declared is None:
        return None
    lo, hi = declared
    processor = getattr(module, "reward_processor", None)
    if processor is not None:
        if not hasattr(processor, "scale"):
            return None  # a processor we cannot map: no range claimed
        lo, hi = sorted((lo * processor.scale + processor.shift, hi * processor.scale + processor.shift))
    return [float(lo), float(hi)]


def read_metrics(
    log_dir: Path | None,
) -> tuple[dict[str, list[tuple[int, float]]], float | None, dict[str, float | None]]:
    """From the run's ``metrics.csv``: the training rollout reward per turn against the update; the mean share of
    samples with a zero advantage (every sample of its group scored the same) over updates and agents (the
    ``agent_<i>/zero_advantage_ratio`` columns); and the means of the rollout-tree node metrics
    (``DYNAMIC_ROLLOUT``: the share of nodes that tied, before and after dynamic sampling's refill; None when not
    logged)."""
    path = log_dir / "metrics.csv" if log_dir is not None else None
    stats: dict[str, float | None] = dict.fromkeys(DYNAMIC_ROLLOUT.values())
    if path is None or not path.is_file():
        return {}, None, stats
    curve: dict[str, list[tuple[int, float]]] = {}
    zero: list[float] = []
    nodes: dict[str, list[float]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            for col, value in row.items():
                if not value:
                    continue
                if col.startswith("rollout/turn_") and col.endswith("/reward_mean"):
                    curve.setdefault(col.split("/")[1], []).append((int(row["step"]), float(value)))
                elif col in DYNAMIC_ROLLOUT:
                    nodes.setdefault(DYNAMIC_ROLLOUT[col], []).append(float(value))
                elif col.startswith("agent_") and col.endswith("/zero_advantage_ratio"):
                    zero.append(float(value))
    stats.update({key: statistics.mean(values) for key, values in nodes.items()})
    return curve, (statistics.mean(zero) if zero else None), stats


def read_examples(log_dir: Path | None, chars: int = 400) -> list[dict[str, Any]]:
    """The first sample of the first and of the last logged training step (``completions.jsonl``): each agent's first
    completion (cut to ``chars``) and the team reward, so the table's reading can say what the agents write."""
    path = log_dir / "completions.jsonl" if log_dir is not None else None
    if path is None or not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    picked = [rows[0], rows[-1]] if len(rows) > 1 else rows
    return [
        {
            "step": r.get("step"),
            "turn": r.get("turn"),
            "rewards": r.get("rewards", [])[:1],
            "completions": [(c[0] if isinstance(c, list) and c else str(c))[:chars] for c in r.get("completions", [])],
        }
        for r in picked
    ]


# ------------------------------------------------------------------------------------------------ summary
def summarize(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    env = ENVS[name]
    ok = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {"env": name, "config": f"configs/{env.config}", "runs": runs}
    if not ok:
        row["note"] = "failed: " + (runs[0]["error"].strip().splitlines() or ["?"])[-1][:200] if runs else "no runs"
        return row

    def mean_sd(values):
        return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)

    (before, before_sd), (after, after_sd) = mean_sd([r["before"] for r in ok]), mean_sd([r["after"] for r in ok])
    turns = ok[0]["turns"]
    credit = {}
    for label, suffix in env.credit:
        for t in sorted({1, turns}):
            key = f"eval/turn_{t}/{suffix}"
            b = [r["evaluations"][0][1].get(key) for r in ok]
            a = [r["evaluations"][-1][1].get(key) for r in ok]
            if all(v is not None for v in b + a):
                credit[f"turn_{t}/{suffix}"] = {
                    "label": label,
                    "before": statistics.mean(b),
                    "after": statistics.mean(a),
                    "before_all": b,
                    "after_all": a,
                }
    zero = [r["zero_advantage_ratio"] for r in ok if r.get("zero_advantage_ratio") is not None]
    settings = ok[0]["settings"]
    row["variant"] = settings.get("variant", "baseline")
    if row["variant"] == "dynamic":
        row["reward_twin"] = settings["reward_twin"]
        row["extra_prompts_budget"] = settings["extra_prompts"]
    for key in (*DYNAMIC_ROLLOUT.values(), "extra_prompts_per_update", "extra_prompts_per_step"):
        values = [r["rollout_stats"][key] for r in ok if (r.get("rollout_stats") or {}).get(key) is not None]
        row[key] = statistics.mean(values) if values else None
    row.update(
        turns=turns,
        reward_range=ok[0]["reward_range"],
        before_mean=before,
        before_std=before_sd,
        after_mean=after,
        after_std=after_sd,
        delta=after - before,
        deltas=[r["after"] - r["before"] for r in ok],
        seeds=[r["seed"] for r in ok],
        before_turn_1_mean=statistics.mean(r["before_turn_1"] for r in ok),
        after_turn_1_mean=statistics.mean(r["after_turn_1"] for r in ok),
        failed_seeds=[r["seed"] for r in runs if "error" in r],
        updates=span([r["updates"] for r in ok]),
        seconds_mean=statistics.mean(r["seconds"] for r in ok),
        seconds_per_update=statistics.mean(r["seconds_per_update"] for r in ok),
        held_out=f"{ok[0]['held_out_items']}×{ok[0]['held_out_draws']}",
        tokens=ok[0]["settings"]["tokens"],
        zero_advantage_ratio=statistics.mean(zero) if zero else None,
        credit=credit,
    )
    row["note"] = note(env, row)
    return row


def note(env: Env, row: dict[str, Any]) -> str:
    """A plain reading of the numbers: the direction over seeds, what moved in the breakdown, what never happened,
    whether training had a signal."""
    deltas, n = row["deltas"], len(row["deltas"])
    lo, hi = row["reward_range"] or (None, None)
    width = (hi - lo) if lo is not None else None
    parts = []
    if width and max(abs(d) for d in deltas) < 0.005 * width:
        parts.append("flat")
    elif n == 1:
        parts.append(("up" if deltas[0] > 0 else "down") + " (one seed: no spread to judge it by)")
    else:
        up = sum(d > 0 for d in deltas)
        spread = statistics.stdev(deltas)
        trend = (
            f"up in all {n} seeds" if up == n else f"down in all {n} seeds" if up == 0 else f"up in {up} of {n} seeds"
        )
        if abs(row["delta"]) < spread:
            trend += ", within the seed spread"
        parts.append(trend)
    if width:
        parts[-1] += f" (Δ = {100 * row['delta'] / width:+.1f}% of the range)"
    turn = row["turns"]
    if turn > 1:
        parts.append(f"turn 1 {row['before_turn_1_mean']:+.3f}→{row['after_turn_1_mean']:+.3f}")
    moves = []
    for key, c in row["credit"].items():
        if key.startswith(f"turn_{turn}/") and (c["before"] or c["after"]):
            moves.append(f"{c['label']} {c['before']:.2f}→{c['after']:.2f}")
    if moves:
        parts.append(", ".join(moves))
    never = [
        phrase
        for phrase, suffix in env.never
        if (c := row["credit"].get(f"turn_{turn}/{suffix}")) is not None
        and not any(c["before_all"])
        and not any(c["after_all"])
    ]
    if never:
        parts.append("never " + " or ".join(never) + " (0 before and after)")
    if row["zero_advantage_ratio"] is not None and row["zero_advantage_ratio"] >= 0.5:
        parts.append(
            f"{100 * row['zero_advantage_ratio']:.0f}% of training samples had a zero advantage "
            "(their group tied): little signal"
        )
    if row["failed_seeds"]:
        parts.append(f"seed(s) {row['failed_seeds']} failed")
    return "; ".join(parts)


def span(values: list[int]) -> str:
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def fmt_range(r: list[float] | None) -> str:
    return f"[{r[0]:g}, {r[1]:g}]" if r else "?"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| env | reward range | before | after | Δ | updates | new tokens | held-out | wall s / run | "
            "s / update | note |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "before_mean" not in r:
            lines.append(f"| {r['env']} | | | | | | | | | | {r['note']} |")
            continue
        lines.append(
            f"| {r['env']} | {fmt_range(r['reward_range'])} | {r['before_mean']:+.3f} ± {r['before_std']:.3f} "
            f"| {r['after_mean']:+.3f} ± {r['after_std']:.3f} | {r['delta']:+.3f} | {r['updates']} | "
            f"{r['tokens']} | {r['held_out']} | {r['seconds_mean']:.0f} | {r['seconds_per_update']:.1f} | "
            f"{r['note']} |"
        )
    return "\n".join(lines)


def credit_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| env | turn | metric | before | after |", "|---|---|---|---|---|"]
    for r in rows:
        for key, c in (r.get("credit") or {}).items():
            lines.append(
                f"| {r['env']} | {key.split('/')[0][5:]} | {c['label']} (`{key.split('/')[1]}`) | "
                f"{c['before']:.3f} | {c['after']:.3f} |"
            )
    return "\n".join(lines)


def examples_text(rows: list[dict[str, Any]], chars: int = 240) -> str:
    """Per env, the first seed's last logged training sample: each agent's completion (cut) and the team reward."""
    out = []
    for r in rows:
        run = next((x for x in r["runs"] if "error" not in x and x.get("examples")), None)
        if run is None:
            continue
        ex = run["examples"][-1]
        reward = f"{ex['rewards'][0]:+.3f}" if ex.get("rewards") else "?"
        out.append(
            f"<details><summary>{r['env']}: seed {run['seed']}, update {ex['step']}, turn {ex['turn']}, team "
            f"reward {reward}</summary>\n"
        )
        for i, text in enumerate(ex["completions"]):
            out.append(f"agent {i}:\n\n````text\n{text[:chars]}\n````\n")  # 4 backticks: completions hold fences
        out.append("</details>\n")
    return "\n".join(out) or "(none logged)"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
    for ax, row in zip(axes.flat, rows):
        ok = [r for r in row["runs"] if "error" not in r]
        if not ok:
            ax.text(
                0.5, 0.5, row["note"][:120], ha="center", va="center", wrap=True, fontsize=8, transform=ax.transAxes
            )
            ax.set_title(row["env"], fontsize=10)
            ax.set_xticks([]), ax.set_yticks([])
            continue
        per_seed = [dict(r["curve"]) for r in ok]
        xs = [s for s in sorted({s for c in per_seed for s in c}) if all(s in c for c in per_seed)]
        values = [[c[s] for c in per_seed] for s in xs]
        ax.plot(
            xs, [statistics.mean(v) for v in values], "o-", color="C0", ms=3, label=f"held-out, turn {row['turns']}"
        )
        ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color="C0", alpha=0.25)
        for turn, color in (("turn_1", "C7"), (f"turn_{row['turns']}", "C1")):
            curves = [dict(r["train_curve"].get(turn, [])) for r in ok]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if all(curves) else []
            if steps:
                ax.plot(
                    steps,
                    [statistics.mean(c[s] for c in curves) for s in steps],
                    ".-",
                    color=color,
                    ms=2,
                    lw=0.8,
                    alpha=0.8,
                    label=f"training rollouts, {turn.replace('_', ' ')}",
                )
            if row["turns"] == 1:
                break
        ax.set_title(f"{row['env']}  {fmt_range(row['reward_range'])}", fontsize=10)
        ax.set_xlabel("update")
        low, high = ax.get_ylim()
        if high - low < 1e-3:  # flat curves: show their value on a readable scale, not float noise
            ax.set_ylim(low - 0.05, high + 0.05)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    for ax in axes[:, 0]:
        ax.set_ylabel("team reward")
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ driver
def env_settings(name: str, args: argparse.Namespace) -> dict[str, Any]:
    env = ENVS[name]
    tokens = (TINY_TOKENS if args.tiny else env.tokens) if args.max_new_tokens is None else args.max_new_tokens
    return {
        "updates": args.updates,
        "tokens": min(tokens, config_tokens(env)),
        "held_out": args.held_out,
        "eval_batch": args.eval_batch,
        "every": args.every,
        "tiny": args.tiny,
        "model": "tiny" if args.tiny else EMBEDDED,
        "cli_args": list(args.cli_arg),
        "eval_seed": EVAL_SEED,
        "threads": args.threads,
        "keep_logs": args.keep_logs,
        # --variant dynamic only (a baseline's settings stay those of earlier JSONs: --resume still matches them)
        **(
            {
                "variant": "dynamic",
                "extra_prompts": args.extra_prompts,
                "reward_twin": COMPONENT_TWINS.get(config_reward(env)),
            }
            if args.variant == "dynamic"
            else {}
        ),
    }


def same_settings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ignore = {"threads", "keep_logs"}
    return {k: v for k, v in a.items() if k not in ignore} == {k: v for k, v in b.items() if k not in ignore}


def worker_argv(name: str, seed: int, result: Path, args: argparse.Namespace) -> list[str]:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--seed",
        str(seed),
        "--result",
        str(result),
        "--updates",
        str(args.updates),
        "--held-out",
        str(args.held_out),
        "--eval-batch",
        str(args.eval_batch),
        "--every",
        str(args.every),
    ]
    if args.max_new_tokens is not None:
        argv += ["--max-new-tokens", str(args.max_new_tokens)]
    if args.tiny:
        argv.append("--tiny")
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.keep_logs:
        argv += ["--keep-logs", args.keep_logs]
    argv += ["--variant", args.variant, "--extra-prompts", str(args.extra_prompts)]
    return argv + [f"--cli-arg={a}" for a in args.cli_arg]


def run_isolated(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        done = subprocess.run(
            worker_argv(name, seed, result, args),
            cwd=REPO,
            check=False,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            },
        )
        if result.is_file():
            return json.loads(result.read_text())
        return {"env": name, "seed": seed, "error": f"worker exited with status {done.returncode} (its output above)"}


def run_here(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    try:
        return run_one(name, seed, env_settings(name, args))
    except Exception:  # noqa: BLE001  one env's failure is reported in its row; the others still run
        text = traceback.format_exc()
        print(text, file=sys.stderr)
        return {"env": name, "seed": seed, "error": text}


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help=f"comma-separated envs (default all: {', '.join(ENVS)})")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--updates", type=int, default=30, help="optimizer updates per run (trainer.max_steps)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="new tokens per completion for every env (never more than its config's); default: "
        f"each env's budget (SmolLM2) or {TINY_TOKENS} (--tiny)",
    )
    parser.add_argument(
        "--held-out",
        type=int,
        default=16,
        help="held-out evaluation draws: the first N items of the eval set (a smaller set repeated)",
    )
    parser.add_argument("--eval-batch", type=int, default=8, help="items per evaluation batch")
    parser.add_argument("--every", type=int, default=15, help="also evaluate every N updates (0: before/after only)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="random tiny models instead of SmolLM2 (a smoke run of the script, not a result)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--cli-arg",
        action="append",
        default=[],
        help="an extra CLI flag for every run, e.g. --cli-arg=--model.init_args.agent_learning_rate=1e-4",
    )
    parser.add_argument(
        "--variant",
        choices=("baseline", "dynamic"),
        default="baseline",
        help="baseline: the configs as shipped; dynamic: + dynamic sampling and per-component reward normalisation "
        "(module docstring)",
    )
    parser.add_argument(
        "--extra-prompts",
        type=int,
        default=3,
        help="--variant dynamic: dynamic_sampling_max_extra_prompts (extra prompts one step may roll out)",
    )
    parser.add_argument(
        "--compare",
        default=None,
        help="--variant dynamic: a --variant baseline run's JSON, shown beside the results as the 'without' column",
    )
    parser.add_argument("--out", default=str(RESULTS), help="directory for <name>.md/.png (and .json)")
    parser.add_argument(
        "--name",
        default=None,
        help="file name stem of the results (default environments; environments_dynamic for --variant dynamic)",
    )
    parser.add_argument("--json", default=None, help="the JSON's path (default <out>/<name>.json)")
    parser.add_argument(
        "--resume", action="store_true", help="reuse the runs of an existing JSON made with the same settings"
    )
    parser.add_argument(
        "--no-isolate",
        dest="isolate",
        action="store_false",
        help="run every (env, seed) in this process instead of a fresh worker process each",
    )
    parser.add_argument("--keep-logs", default=None, help="keep each run's CSV logs and completions under this folder")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser, args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:  # one (env, seed) run, its result written as JSON for the parent
        result = run_here(args.worker, args.seed, args)
        Path(args.result).write_text(json.dumps(result), encoding="utf-8")
        return [result]

    names = list(ENVS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENVS]
    if unknown:
        parser.error(f"--only: unknown env(s) {unknown}; choose from: {', '.join(ENVS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    args.name = args.name or ("environments" if args.variant == "baseline" else "environments_dynamic")
    json_path = Path(args.json) if args.json else out / f"{args.name}.json"
    if args.compare and args.variant != "dynamic":
        parser.error("--compare: only with --variant dynamic")
    if args.compare and Path(args.compare).resolve() == json_path.resolve():
        parser.error("--compare: the baseline JSON cannot be the one this run writes")
    previous, args.history = {}, []
    if args.resume and json_path.is_file():
        earlier = json.loads(json_path.read_text())
        args.history = earlier.get("commands") or [earlier.get("command", "?")]  # whose runs --resume may reuse
        for row in earlier.get("rows", []):
            for r in row.get("runs", []):
                if "error" not in r:
                    previous[(r["env"], r["seed"])] = r
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    script = os.path.relpath(__file__) if __file__.startswith(os.getcwd()) else __file__
    command = " ".join([python, script, *(sys.argv[1:] if argv is None else argv)])

    rows, total = [], time.perf_counter()
    for name in names:
        env = ENVS[name]
        if not (REPO / "configs" / env.config).is_file():
            reason = f"skipped: configs/{env.config} does not exist (yet)"
            print(f"[{time.perf_counter() - total:6.0f}s] {name}: {reason}", flush=True)
            rows.append({"env": name, "config": f"configs/{env.config}", "runs": [], "note": reason, "skipped": True})
            continue
        settings = env_settings(name, args)
        print(
            f"[{time.perf_counter() - total:6.0f}s] {name}: configs/{env.config}, {settings['model']}, "
            f"{args.updates} updates, {settings['tokens']} new tokens, seeds {seeds}",
            flush=True,
        )
        if args.variant == "dynamic":
            print(f"    {name}: {variant_text(settings)}", flush=True)
        runs = []
        for seed in seeds:
            old = previous.get((name, seed))
            if old is not None and same_settings(old["settings"], settings):
                result = old
                print(f"    {name} seed {seed}: reused from {json_path}", flush=True)
            else:
                result = run_isolated(name, seed, args) if args.isolate else run_here(name, seed, args)
            runs.append(result)
            if "error" in result:
                print(
                    f"[{time.perf_counter() - total:6.0f}s] {name} seed {seed}: FAILED "
                    f"({result['error'].strip().splitlines()[-1][:200]})",
                    flush=True,
                )
            else:
                print(
                    f"[{time.perf_counter() - total:6.0f}s] {name} seed {seed}: held-out reward "
                    f"{result['before']:+.3f} -> {result['after']:+.3f} in {result['updates']} updates "
                    f"({result['seconds']:.0f} s, {result['seconds_per_update']:.1f} s/update)",
                    flush=True,
                )
            write(rows + [summarize(name, runs)], out, json_path, command, seeds, args, total, final=False)
        rows.append(summarize(name, runs))
    write(rows, out, json_path, command, seeds, args, total, final=True)
    return rows


def write(rows, out: Path, json_path: Path, command: str, seeds, args, total: float, final: bool) -> None:
    """The table, the JSON and the PNG (rewritten after every run, so a long run leaves its results so far)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    threads = args.threads or torch.get_num_threads()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {threads} torch thread(s)"
    model = "random `tiny` models (a smoke run, not a result)" if args.tiny else f"two `{EMBEDDED}` agents"
    text = table(rows)
    runs_seconds = sum(r.get("seconds", 0.0) for row in rows for r in row.get("runs", []))  # reused runs too
    dynamic = args.variant == "dynamic"
    what = (
        "MAGRPO with dynamic sampling and per-component reward normalisation (`--variant dynamic`: "
        f"dynamic_sampling=true, dynamic_sampling_max_extra_prompts={args.extra_prompts}, "
        "reward_aggregation=normalize_components with the reward's components twin; see the section below), "
        "each env's shipped config otherwise as it is"
        if dynamic
        else "MAGRPO, each env's shipped config as it is"
    )
    curves = "" if dynamic else f"Curves: {args.name}.png; "
    header = (
        f"`{command}`\n\n{what}, {model}, {args.updates} updates "
        f"(trainer.max_steps), seeds "
        f"{seeds}; only the budget {'and the variant are' if dynamic else 'is'} overridden "
        f"(benchmarks/environments.py). Reward = the module's "
        f"evaluation (task reward after the config's reward_processor, one sampled trajectory per draw, the "
        f"config's sampling, fixed evaluation seed {EVAL_SEED}) on held-out items (items × draws each) before "
        f"the first and after the last update; for two-turn envs the reward of turn 2. Mean ± std over seeds; "
        f"Δ = after − before. wall s / run includes loading the models and the evaluations; s / update "
        f"excludes both. "
        f"{'Total' if final else 'So far'}: {runs_seconds:.0f} s of runs ({time.perf_counter() - total:.0f} s in "
        f"this invocation; --resume reuses earlier runs) on {machine}. "
        f"{curves}every number: {json_path.name}.\n\n"
    )
    reading = "\n".join(f"- **{r['env']}** (`{r['config']}`): {ENVS[r['env']].reading}" for r in rows)
    baseline = read_compare(args.compare) if dynamic else None
    body = (
        header
        + text
        + (dynamic_section(rows, baseline, args) if dynamic else "")
        + "\n\n## Partial credit (held-out, mean over seeds)\n\n"
        + credit_table(rows)
        + "\n\n## What each reward credits\n\n"
        + reading
        + "\n\n## What the agents write\n\n"
        + examples_text(rows)
        + "\n"
    )
    md = out / f"{args.name}.md"
    md.write_text(body, encoding="utf-8")
    json_path.write_text(
        json.dumps(
            {
                "command": command,
                "commands": [*args.history, command],
                "variant": args.variant,
                **({"extra_prompts": args.extra_prompts, "compare": args.compare} if dynamic else {}),
                "seeds": seeds,
                "updates": args.updates,
                "tiny": args.tiny,
                "eval_seed": EVAL_SEED,
                "machine": machine,
                "total_seconds": time.perf_counter() - total,
                "runs_seconds": runs_seconds,
                "complete": final,
                "rows": rows,
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    title = (
        f"MAGRPO on each shipped env config, {'tiny random models' if args.tiny else 'SmolLM2-135M-Instruct'}, "
        f"{args.updates} update(s)\nheld-out team reward (mean over seeds {seeds}, band = min..max); the training "
        "rollouts' reward (mean over seeds) at the update that sampled them"
    )
    written = [md, json_path]
    if not dynamic:  # the variant writes its table and JSON only (its curves are in the JSON)
        plot(rows, out / f"{args.name}.png", title)
        written.append(out / f"{args.name}.png")
    if final:
        print(text)
        if dynamic:
            print(dynamic_table(rows, baseline))
        print("wrote " + ", ".join(str(p) for p in written))


# ------------------------------------------------------------------------------------------------ --variant dynamic
def variant_text(settings: dict[str, Any]) -> str:
    """What ``--variant dynamic`` changes for one env (printed, and in the table)."""
    text = f"dynamic sampling (up to {settings['extra_prompts']} extra prompts per step)"
    if settings["reward_twin"]:
        return text + f", reward_aggregation=normalize_components with reward_func={settings['reward_twin']}"
    return text + " only: its reward has no components twin, reward_aggregation stays sum"


def read_compare(path: str | None) -> dict[str, dict[str, Any]] | None:
    """The rows (by env) of a ``--variant baseline`` run's JSON, or None."""
    if not path:
        return None
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {"command": data.get("commands") or [data.get("command")], "rows": {r["env"]: r for r in data["rows"]}}


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def num(value: float | None, spec: str = "+.3f") -> str:
    return "—" if value is None else format(value, spec)


def dynamic_table(rows: list[dict[str, Any]], baseline: dict[str, Any] | None) -> str:
    """Per env: the zero-advantage shares and the held-out reward without (``--compare``) and with the variant."""
    lines = [
        (
            "| env | reward aggregation | tied nodes, without (baseline) | tied nodes with: the step's own "
            "(before refill) | with: trained on (after refill) | fill ratio | extra prompts / update | samples "
            "with advantage 0, without → with | held-out without: before → after | held-out with: before → after "
            "| wall s / run without / with | s / update without / with |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = (baseline or {}).get("rows", {}).get(r["env"], {})
        if "before_mean" not in r:
            lines.append(f"| {r['env']} | | | | | | | | | | | {r.get('note', '')} |")
            continue
        twin = r.get("reward_twin")
        aggregation = f"normalize_components (`{twin.rsplit('.', 1)[1]}`)" if twin else "sum (no components twin)"
        held_b = f"{b['before_mean']:+.3f} → {b['after_mean']:+.3f}" if "before_mean" in b else "—"
        lines.append(
            f"| {r['env']} | {aggregation} | {pct(b.get('zero_nodes'))} | {pct(r.get('zero_nodes_before'))} | "
            f"{pct(r.get('zero_nodes'))} | {num(r.get('fill_ratio'), '.2f')} | "
            f"{num(r.get('extra_prompts_per_update'), '.2f')} | {pct(b.get('zero_advantage_ratio'))} → "
            f"{pct(r.get('zero_advantage_ratio'))} | {held_b} | {r['before_mean']:+.3f} → {r['after_mean']:+.3f} | "
            f"{num(b.get('seconds_mean'), '.0f')} / {r['seconds_mean']:.0f} | "
            f"{num(b.get('seconds_per_update'), '.1f')} / {r['seconds_per_update']:.1f} |"
        )
    done = {r["env"] for r in rows}
    for name, b in (baseline or {}).get("rows", {}).items():  # run without the variant only: its numbers alone
        if name not in done and "before_mean" in b:
            lines.append(
                f"| {name} | not run with the variant | {pct(b.get('zero_nodes'))} | — | — | — | — | "
                f"{pct(b.get('zero_advantage_ratio'))} → — | {b['before_mean']:+.3f} → {b['after_mean']:+.3f} | — | "
                f"{b['seconds_mean']:.0f} / — | {b['seconds_per_update']:.1f} / — |"
            )
    return "\n".join(lines)


def dynamic_section(rows: list[dict[str, Any]], baseline: dict[str, Any] | None, args: argparse.Namespace) -> str:
    without = (
        "the baseline (`--variant baseline`, the configs as shipped) from "
        + f"`{args.compare}`, run by "
        + "; ".join(f"`{c}`" for c in baseline["command"])
        if baseline
        else "no baseline given (`--compare`): the 'without' columns are empty"
    )
    return (
        "\n\n## Dynamic sampling: without and with\n\n"
        + f"Without: {without}. With: these runs, by "
        + "; ".join(f"`{c}`" for c in [*args.history])
        + ("; " if args.history else "")
        + "this file's command (top).\n\n"
        + dynamic_table(rows, baseline)
        + "\n\nTied nodes: the mean over updates of the share of rollout-tree nodes (one prompt's K joint actions "
        "at one turn) whose every agent's K returns tie, so that every agent's advantage is 0 (metrics.csv: "
        "`rollout/zero_advantage_ratio` without; with, `rollout/zero_advantage_ratio_before` for the step's own "
        "nodes and `rollout/zero_advantage_ratio` for the nodes trained on after the refill). With "
        "normalize_components a node ties only when every reward component ties too, so its 'before' can be below "
        "the baseline's share even on the same samples. Fill ratio: untied nodes trained on / the step's node "
        "count (1: refilled completely). Extra prompts / update: extra prompts rolled out over the run (counted "
        "at every training step) / optimizer updates. Samples with advantage 0: the mean of "
        "`agent_<i>/zero_advantage_ratio` (the main table's measure). Both variants start from the same weights and "
        "evaluate with the same seed, so their 'before' agree.\n"
    )


if __name__ == "__main__":
    main()
