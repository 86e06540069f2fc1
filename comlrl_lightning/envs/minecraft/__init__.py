"""Minecraft environments, StrBuild, HouseBuild, BridgeBuild and ResourceGathering (OpenMLRL/LLM_Collab_Minecraft, MIT).

Two agents write Minecraft commands; the commands are checked and applied to a simulated block world (no Minecraft
server), and the team reward says how much of the target structure their joint build reproduces:

* :mod:`~comlrl_lightning.envs.minecraft.strbuild` — StrBuild: spell a word (5 × 5 letters) with ``/setblock``; two
  palettes, a coverage / extra-block / same-texture-neighbour / palette-use reward in [−3, 2].
* :mod:`~comlrl_lightning.envs.minecraft.housebuild` — HouseBuild: build a house from layered blueprints with
  ``/fill``, under per-agent resource limits and a spider threat (``/kill``); the share of matching cells minus
  a spider penalty, in [−0.1, 1].
* :mod:`~comlrl_lightning.envs.minecraft.bridgebuild` — BridgeBuild: two workers with partial views join two anchors
  across water with JSON actions (messages, probes, ``/fill``, moves); a per-turn reward in [−18, 15] replayed from
  the trajectory's history (``response_history_per_agent``).
* :mod:`~comlrl_lightning.envs.minecraft.resourcegathering` — ResourceGathering: two workers with asymmetric tools
  gather wood, stone and iron on a partly seen grid, messaging each other; a shaped per-turn reward replayed from
  the trajectory.

Each module has a loader that stores the rules in every item (``strbuild_tasks`` / ``housebuild_tasks``, with
``*_train_tasks`` / ``*_eval_tasks`` defaults and ``StrBuildTasks`` / ``HouseBuildTasks`` for YAML), one
formatter per agent, the reward (``reward_range`` set; ``*_reward_components`` returns its terms as named
components), a multi-turn external transition with the repository's feedback modes
(``StrBuildFeedback``, ``HouseBuildFeedback``; use ``external_prompt_passthrough: true``) and an eval
logger/aggregator. Completions are parsed without ever raising: malformed text only scores low.

Data: ``../shared/data/minecraft`` (or ``$COMLRL_MINECRAFT_DATA``, e.g. a clone of the repository).
"""

from comlrl_lightning.envs.minecraft.bridgebuild import (
    BridgeBuildFeedback,
    BridgeBuildMode,
    BridgeBuildTasks,
    bridgebuild_agent0_prompt,
    bridgebuild_agent1_prompt,
    bridgebuild_eval_aggregator,
    bridgebuild_eval_logger,
    bridgebuild_eval_tasks,
    bridgebuild_reward,
    bridgebuild_reward_components,
    bridgebuild_tasks,
    bridgebuild_train_tasks,
)
from comlrl_lightning.envs.minecraft.housebuild import (
    HouseBuildFeedback,
    HouseBuildMode,
    HouseBuildTasks,
    housebuild_agent0_prompt,
    housebuild_agent1_prompt,
    housebuild_eval_aggregator,
    housebuild_eval_logger,
    housebuild_eval_tasks,
    housebuild_reward,
    housebuild_reward_components,
    housebuild_tasks,
    housebuild_train_tasks,
)
from comlrl_lightning.envs.minecraft.resourcegathering import (
    ResourceGatheringFeedback,
    ResourceGatheringMode,
    ResourceGatheringReward,
    ResourceGatheringTasks,
    generate_resourcegathering_tasks,
    resourcegathering_agent0_prompt,
    resourcegathering_agent1_prompt,
    resourcegathering_eval_aggregator,
    resourcegathering_eval_logger,
    resourcegathering_eval_tasks,
    resourcegathering_reward,
    resourcegathering_reward_components,
    resourcegathering_tasks,
    resourcegathering_train_tasks,
)
from comlrl_lightning.envs.minecraft.strbuild import (
    StrBuildFeedback,
    StrBuildMode,
    StrBuildTasks,
    strbuild_agent0_prompt,
    strbuild_agent1_prompt,
    strbuild_eval_aggregator,
    strbuild_eval_logger,
    strbuild_eval_tasks,
    strbuild_reward,
    strbuild_reward_components,
    strbuild_tasks,
    strbuild_train_tasks,
)

__all__ = [
    "BridgeBuildFeedback",
    "BridgeBuildMode",
    "BridgeBuildTasks",
    "HouseBuildFeedback",
    "HouseBuildMode",
    "HouseBuildTasks",
    "ResourceGatheringFeedback",
    "ResourceGatheringMode",
    "ResourceGatheringReward",
    "ResourceGatheringTasks",
    "StrBuildFeedback",
    "StrBuildMode",
    "StrBuildTasks",
    "bridgebuild_agent0_prompt",
    "bridgebuild_agent1_prompt",
    "bridgebuild_eval_aggregator",
    "bridgebuild_eval_logger",
    "bridgebuild_eval_tasks",
    "bridgebuild_reward",
    "bridgebuild_reward_components",
    "bridgebuild_tasks",
    "bridgebuild_train_tasks",
    "generate_resourcegathering_tasks",
    "housebuild_agent0_prompt",
    "housebuild_agent1_prompt",
    "housebuild_eval_aggregator",
    "housebuild_eval_logger",
    "housebuild_eval_tasks",
    "housebuild_reward",
    "housebuild_reward_components",
    "housebuild_tasks",
    "housebuild_train_tasks",
    "resourcegathering_agent0_prompt",
    "resourcegathering_agent1_prompt",
    "resourcegathering_eval_aggregator",
    "resourcegathering_eval_logger",
    "resourcegathering_eval_tasks",
    "resourcegathering_reward",
    "resourcegathering_reward_components",
    "resourcegathering_tasks",
    "resourcegathering_train_tasks",
    "strbuild_agent0_prompt",
    "strbuild_agent1_prompt",
    "strbuild_eval_aggregator",
    "strbuild_eval_logger",
    "strbuild_eval_tasks",
    "strbuild_reward",
    "strbuild_reward_components",
    "strbuild_tasks",
    "strbuild_train_tasks",
]
