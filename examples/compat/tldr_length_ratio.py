"""Two IAC agents summarise Reddit posts: a concise TL;DR and a detailed one 2-3x as long.

Written against CoMLRL's API (``IACConfig`` / ``IACTrainer``) with only the import lines pointing at
``comlrl_lightning.compat``. Each agent learns with its own critic: a value head on its own backbone by default, a
separate critic model with ``--critic-model``. The team reward scores the detailed/concise character ratio.

    python examples/compat/tldr_length_ratio.py                                   # Qwen/Qwen2.5-0.5B agents
    python examples/compat/tldr_length_ratio.py --model tiny --train-items 2 --eval-items 1 --epochs 1 \\
        --max-new-tokens 8                                                         # a CPU check

Data (``--data`` or $COMPAT_TLDR_DATA): a local ``.jsonl``/``.jsonl.gz`` file, e.g. the repository's offline
sample ``../shared/data/tldr/tldr_sample.jsonl.gz`` (used when present), or the hub id ``trl-lib/tldr``.
"""

import argparse
import os

from comlrl_lightning.compat import IACConfig, IACTrainer
from comlrl_lightning.envs.writing import TLDR_HUB_ID, local_tldr_file, tldr_tasks


def ratio_reward(concise, detailed, ratio_min=2.0, ratio_max=3.0):
    """1.0 when the detailed summary is ratio_min..ratio_max times as long as the concise one; linear ramps down to 0
    at ratio 0 and at 2 x ratio_max; 0 when either summary is empty."""
    rewards = []
    for short, long in zip(concise, detailed):
        short, long = short.strip(), long.strip()
        if not short or not long:
            rewards.append(0.0)
            continue
        ratio = len(long) / len(short)
        if ratio < ratio_min:
            rewards.append(ratio / ratio_min)
        else:
            rewards.append(max(0.0, 1.0 - max(ratio - ratio_max, 0.0) / ratio_max))
    return rewards


def concise_prompt(item):
    return f"{item['prompt'].strip()}\n\nWrite a one-sentence TL;DR of the post above.\nTL;DR:"


def detailed_prompt(item):
    return (
        f"{item['prompt'].strip()}\n\nWrite a detailed TL;DR of the post above, two to three times as long as a "
        "one-sentence summary.\nTL;DR:"
    )


def completion_lengths(rollouts):
    """Logged with every update: the mean character length of the agents' completions."""
    lengths = [len(sample.completion) for sample in rollouts]
    return {"completion_char_length_mean": sum(lengths) / max(len(lengths), 1)}


def parse_args(argv=None):
    default_data = str(local_tldr_file()) if local_tldr_file().exists() else TLDR_HUB_ID
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("COMPAT_MODEL", "Qwen/Qwen2.5-0.5B"))
    parser.add_argument("--critic-model", default=None, help="a separate critic per agent (default: value heads)")
    parser.add_argument("--data", default=os.environ.get("COMPAT_TLDR_DATA", default_data))
    parser.add_argument("--train-items", type=int, default=320)
    parser.add_argument("--eval-items", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--output-dir", default="./iac_tldr")
    parser.add_argument("--wandb-project", default=None, help="log to this W&B project (default: CSV files)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    items = tldr_tasks(args.data, split="train", limit=args.eval_items + args.train_items)
    eval_dataset, train_dataset = items[: args.eval_items], items[args.eval_items :]

    config = IACConfig(
        num_train_epochs=args.epochs,
        agent_learning_rate=1e-6,
        critic_learning_rate=1e-6,
        value_loss_coef=0.5,
        rollout_buffer_size=8,
        max_new_tokens=args.max_new_tokens,
        use_separate_critic=args.critic_model is not None,
        num_agents=2,
        num_turns=1,
        eval_interval=0,
        eval_num_samples=args.eval_items,
        output_dir=args.output_dir,
    )
    wandb_config = {"project": args.wandb_project, "name": "iac-tldr-length-ratio"} if args.wandb_project else None

    trainer = IACTrainer(
        agent_model=args.model,
        critic_model=args.critic_model,
        reward_func=ratio_reward,
        formatters=[concise_prompt, detailed_prompt],
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        wandb_config=wandb_config,
        metrics_callback=completion_lengths,
    )
    trainer.train()
    metrics = trainer.evaluate()
    print("evaluation:", {key: round(value, 4) for key, value in metrics.items()})
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
