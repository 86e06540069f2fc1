"""Two agents write code together over two turns: a helper ``aux`` and the main function, revised with feedback.

Written against CoMLRL's API (``MAGRPOConfig`` / ``MAGRPOTrainer``) with only the import lines pointing at
``comlrl_lightning.compat``; the task side comes from ``comlrl_lightning.envs.coding``, as CoMLRL's code-generation
environment repository provides it: agent 1 writes ``aux``, agent 2 the entry-point function; the leveled execution
reward (tests run in a sandbox, max 4.5) is shifted by -4; after turn 1 each agent sees level feedback (static checks
and the failing tests) and revises. Joint actions whose turn-1 mean reward exceeds -0.2 stop early.

    python examples/compat/coding_two_turn.py                        # CoopHumanEval, Qwen/Qwen2.5-Coder-3B (a GPU)
    python examples/compat/coding_two_turn.py --benchmark mbpp
    python examples/compat/coding_two_turn.py --model tiny --train-items 1 --eval-items 1 --epochs 1 \\
        --num-generations 2 --max-new-tokens 8                       # a CPU check

Data (``--data`` or $COMPAT_CODING_DATA): a local file (CoopHumanEval ``che_raw.json``, MBPP ``sanitized-mbpp.json``;
the repository's offline copies under ``../shared/data`` are used when present) or the hub id.
"""

import argparse
import os

from comlrl_lightning.compat import MAGRPOConfig, MAGRPOTrainer, RewardProcessors
from comlrl_lightning.envs.coding import (
    LevelFeedbackTransition,
    aux_formatter,
    coding_eval_aggregator,
    coding_eval_logger,
    coding_reward,
    coophumaneval_tasks,
    main_formatter,
    mbpp_tasks,
)
from comlrl_lightning.envs.datasets import CHE_HUB_ID, MBPP_HUB_ID, local_che_file, local_mbpp_file

CHE_EVAL_HEAD = 16  # CoopHumanEval: the first 16 tasks are the eval set, the rest the training set


def load_tasks(benchmark, source, train_items, eval_items):
    """(train, eval) task lists with prompt / entry_point / test."""
    if benchmark == "che":
        tasks = coophumaneval_tasks(source, "test")
        return tasks[CHE_EVAL_HEAD:][:train_items], tasks[:CHE_EVAL_HEAD][:eval_items]
    return mbpp_tasks(source, "train", limit=train_items), mbpp_tasks(source, "test", limit=eval_items)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmark", choices=("che", "mbpp"), default="che")
    parser.add_argument(
        "--data",
        default=os.environ.get("COMPAT_CODING_DATA"),
        help="a local task file or a hub id (default: the offline copy when present, else the hub)",
    )
    parser.add_argument("--model", default=os.environ.get("COMPAT_MODEL", "Qwen/Qwen2.5-Coder-3B"))
    parser.add_argument("--train-items", type=int, default=None)
    parser.add_argument("--eval-items", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--output-dir", default="./magrpo_coding_2turn")
    parser.add_argument("--wandb-project", default=None, help="log to this W&B project (default: CSV files)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    local, hub = (local_che_file(), CHE_HUB_ID) if args.benchmark == "che" else (local_mbpp_file(), MBPP_HUB_ID)
    source = args.data or (str(local) if local.exists() else hub)
    train_dataset, eval_dataset = load_tasks(args.benchmark, source, args.train_items, args.eval_items)

    config = MAGRPOConfig(
        num_train_epochs=args.epochs,
        agent_learning_rate=2e-5,
        logging_steps=1,
        num_agents=2,
        num_turns=2,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
        temperature=0.6,
        top_p=0.6,
        early_termination_threshold=-0.2,
        external_prompt_passthrough=True,
        eval_interval=16,
        eval_num_samples=args.eval_items,
        output_dir=args.output_dir,
    )
    wandb_config = None
    if args.wandb_project:
        wandb_config = {
            "project": args.wandb_project,
            "name": f"{args.benchmark}-magrpo-2turn",
            "config_sections": {
                "dataset": {"name": args.benchmark, "type": args.benchmark},
                "external": {"mode": "level_feedback"},
            },
        }

    trainer = MAGRPOTrainer(
        agent_model=args.model,
        num_agents=2,
        reward_func=coding_reward,
        reward_processor=RewardProcessors.shift(-4.0),
        formatters=[aux_formatter, main_formatter],
        external_transition=LevelFeedbackTransition(tasks=train_dataset + eval_dataset, sandbox_slice=1),
        eval_logger=coding_eval_logger,
        eval_aggregator=coding_eval_aggregator,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        wandb_config=wandb_config,
    )
    trainer.train()
    metrics = trainer.evaluate()
    print("evaluation:", {key: round(value, 4) for key, value in metrics.items()})
    trainer.save_model(f"{args.output_dir}/models")


if __name__ == "__main__":
    main()
