"""Two agents tell a story together: the second writes 2-3x as much as the first.

CoMLRL's quick start with only the import lines changed (the `comlrl` imports became `comlrl_lightning.compat`).
Agent 1 sets up the story, agent 2 expands it; the team reward is 1.0 when len(c2) / len(c1) is in [2, 3] and
decays as exp(-distance) outside, scaled by 100 with ``RewardProcessors.scale``.

    python examples/compat/story_length_ratio.py                                  # two Qwen/Qwen2.5-0.5B (a GPU)
    python examples/compat/story_length_ratio.py --model tiny --epochs 1 --max-new-tokens 8   # a CPU check

``--model`` (or $COMPAT_MODEL) is any hub id, local path or comlrl_lightning factory name (``tiny``).
"""

import argparse
import math
import os
from functools import partial

from datasets import Dataset

from comlrl_lightning.compat import MAGRPOConfig, MAGRPOTrainer, RewardProcessors

STORY_PROMPTS = [
    "Describe a lighthouse that only shines on Tuesdays:",
    "Write about a librarian who can hear books whisper:",
    "Invent a festival held at the bottom of a lake:",
    "Tell the story of a clock that runs backwards:",
    "Describe a garden that grows musical notes:",
    "Write about a robot learning to bake bread:",
    "Explain how clouds choose their shapes:",
    "Tell a tale about a map that redraws itself:",
    "Describe a train that travels between dreams:",
    "Write about a cat who runs a post office:",
]


def length_ratio_reward(completions1, completions2, target_min=2.0, target_max=3.0):
    """1.0 when agent 2's text is target_min..target_max times as long as agent 1's, exp(-distance) otherwise."""
    rewards = []
    for first, second in zip(completions1, completions2):
        if not first:
            rewards.append(0.0)
            continue
        ratio = len(second) / len(first)
        distance = max(target_min - ratio, ratio - target_max, 0.0)
        rewards.append(1.0 if distance == 0.0 else math.exp(-distance))
    return rewards


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("COMPAT_MODEL", "Qwen/Qwen2.5-0.5B"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=len(STORY_PROMPTS))
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output-dir", default="./magrpo_story_output")
    parser.add_argument("--wandb-project", default=None, help="log to this W&B project (default: CSV files)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    train_dataset = Dataset.from_dict({"prompt": STORY_PROMPTS[: args.num_prompts]})

    config = MAGRPOConfig(
        num_train_epochs=args.epochs,
        agent_learning_rate=5e-5,
        logging_steps=10,
        num_generations=args.num_generations,
        num_turns=1,
        max_new_tokens=args.max_new_tokens,
        output_dir=args.output_dir,
    )
    wandb_config = {"project": args.wandb_project, "name": "story-length-ratio"} if args.wandb_project else None

    trainer = MAGRPOTrainer(
        agent_model=args.model,
        num_agents=2,
        reward_func=partial(length_ratio_reward, target_min=2, target_max=3),
        reward_processor=RewardProcessors.scale(factor=100.0),
        args=config,
        train_dataset=train_dataset,
        wandb_config=wandb_config,
    )
    trainer.train()
    trainer.save_model(f"{args.output_dir}/models")
    print(f"Training complete: {trainer.env_step} joint actions; agents saved under {args.output_dir}/models")


if __name__ == "__main__":
    main()
