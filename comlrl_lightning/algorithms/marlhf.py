"""MARLHF: a learned joint reward model, then multi-agent RL on it (arXiv:2508.04652; docs/algorithms.md).

One Lightning fit, two stages:

1. **Reward model** (epoch 0). ``PreferenceDataModule`` collects preference pairs from the current agents exactly
   as MADPO does (task reward as the oracle). A fresh :class:`JointRewardModel` (``reward_model_name``, default the
   agents' own source) reads the joint text of each pair's winner and loser and learns the Bradley–Terry loss
   −log σ(s_w − s_l) for ``reward_num_train_epochs`` passes over the pairs, ``reward_train_batch_size`` pairs per
   update (``reward_learning_rate``; ``reward_freeze_backbone`` trains the head only). An update scores its pairs
   in micro-batches of at most ``micro_batch_size`` pairs and ``micro_batch_tokens`` tokens per forward (a pair is
   its winner's and loser's joint texts, one forward), each micro-batch's loss its share of the batch mean.
2. **RL** (epochs 1…). The reward model is frozen and replaces the task reward; its scores are used raw (no
   ``reward_processor``). The team trains with the objective of the backend ``rl_algorithm`` names — ``magrpo`` |
   ``mareinforce`` | ``marloo`` | ``maremax`` (the MAGRPO family's ``GroupRelative``, with the backend's baseline)
   or ``iac`` | ``maac`` (``ActorCritic``/``JointCritic``; critics from ``critic_model``/``critic_model_name``,
   default the agents' source) — with the backend's own defaults for the rollout fields left null. One module,
   one team: the RL objective is ``module.objective`` (the on-policy loop's); the reward-model stage's update is
   ``MARLHF.update_reward_model`` (:class:`BradleyTerry` as ``module.reward_objective``, the reward model a model
   part, :class:`RewardModelPart`), the pairs ``module.pairs``.
   Reference-KL shaping, when enabled, applies in the RL stage only.

Evaluation always uses the task reward. ``trainer.max_epochs`` counts the reward-model epoch plus the RL epochs;
``global_step`` counts reward-model updates and RL updates alike. Checkpoints hold the agents, critics, the reward
model, the optimizer, the collected pairs and the stage (the epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from torch import Tensor, nn

from comlrl_lightning.agents import JointRewardModel, RewardModelReward, check_model_sources
from comlrl_lightning.agents.reward_model import joint_texts
from comlrl_lightning.agents.sharding import full_state_dicts
from comlrl_lightning.algorithms.actor_critic import IAC, MAAC
from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.fields import (
    CriticFields,
    FieldGroup,
    JointActionFields,
    PreferenceFields,
    ReferenceKLFields,
    RolloutFields,
    check_choice,
    declared_fields,
    require,
    type_hints,
)
from comlrl_lightning.algorithms.iterative import Rounds, iterative_groups
from comlrl_lightning.algorithms.objective import ModelPart, Objective
from comlrl_lightning.algorithms.on_policy import OnPolicyModule
from comlrl_lightning.algorithms.pairs import Pairs, pair_micro_batches
from comlrl_lightning.algorithms.reinforce import MAGRPO, MAREINFORCE, MARLOO, MAReMax
from comlrl_lightning.choices import Choice
from comlrl_lightning.core.losses import assert_finite, bradley_terry_loss
from comlrl_lightning.core.pairs import PreferencePair
from comlrl_lightning.rollout.rewards import RewardCaller
from comlrl_lightning.rollout.sampling import take
from comlrl_lightning.runs import ranks

# rl_algorithm -> the module whose objective and defaults the RL stage takes (its keys are the field's choices).
BACKENDS: dict[str, type[MultiAgentModule]] = {
    "magrpo": MAGRPO,
    "mareinforce": MAREINFORCE,
    "maremax": MAReMax,
    "marloo": MARLOO,
    "maac": MAAC,
    "iac": IAC,
    "mareforce": MAREINFORCE,  # CoMLRL's spelling
}
ACTOR_CRITIC_BACKENDS = tuple(sorted(name for name, backend in BACKENDS.items() if issubclass(backend, IAC)))
RlAlgorithm = Literal[tuple(BACKENDS)]
BACKEND_DEFAULTED = ("num_generations", "discount", "rollout_buffer_size")  # null here: the backend's default


@dataclass
class RewardModelFields(FieldGroup):
    """MARLHF's joint reward model.

    Args:
        reward_model_name: the reward model's backbone (null: the agents' name).
        reward_model_device: where the reward model lives (null: the trainer's device).
        reward_learning_rate: its learning rate.
        reward_num_train_epochs: passes over the pairs in the reward-model epoch.
        reward_train_batch_size: pairs per reward-model update.
        reward_max_length: tokens of a joint text the reward model reads (null: the backbone's limit).
        reward_freeze_backbone: train the scalar head only.
    """

    reward_model_name: str | None = None
    reward_model_device: str | None = None
    reward_learning_rate: float = 1e-5
    reward_num_train_epochs: int = 1
    reward_train_batch_size: int = 1
    reward_max_length: int | None = None
    reward_freeze_backbone: bool = False

    def check(self) -> None:
        require(self.reward_learning_rate > 0, "reward_learning_rate must be > 0.")
        require(self.reward_num_train_epochs >= 1, "reward_num_train_epochs must be >= 1.")
        require(self.reward_train_batch_size >= 1, "reward_train_batch_size must be >= 1.")
        require(
            self.reward_max_length is None or self.reward_max_length >= 1, "reward_max_length must be >= 1 or null."
        )


@dataclass
class RLStageFields(RolloutFields):
    """The RL stage's rollouts: the backend's rollout fields, three of which default to the backend's own.

    Args:
        num_generations: samples per agent per prompt in the RL stage (null: the backend's default).
        discount: the RL stage's discount (null: the backend's default).
        rollout_buffer_size: the RL stage's buffer (null: the backend's default).
    """

    num_generations: int | None = None
    discount: float | None = None
    rollout_buffer_size: int | None = None


@dataclass
class MARLHFFields(FieldGroup):
    """The RL backend of MARLHF.

    Args:
        rl_algorithm: the RL backend: ``magrpo``, ``mareinforce`` (alias ``mareforce``), ``marloo``, ``maremax``,
            ``iac`` or ``maac``.
        critic_model_name: the critics' source for ``iac``/``maac`` (CoMLRL's name for ``critic_model``; null: the
            agents' name).
    """

    rl_algorithm: RlAlgorithm = "magrpo"
    critic_model_name: str | None = None


class BradleyTerry(Objective):
    """MARLHF's reward-model objective: −log σ(s_w − s_l) on each pair's winner and loser joint-text scores."""

    def loss(self, winner_scores: Tensor, loser_scores: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``winner_scores``, ``loser_scores`` [P]: the reward model's scores of each pair's joint texts. Returns
        mean_p −log σ(s_w − s_l) and the pairs' detached means ``reward_model/loss``, ``reward_model/accuracy``
        (share with s_w > s_l) and ``reward_model/margin_mean`` (a loop that splits a batch weights each part's by
        its share of the pairs, so they add up to the batch's)."""
        loss, diagnostics = bradley_terry_loss(winner_scores, loser_scores)
        return loss, {f"reward_model/{key}": diagnostics[key] for key in ("loss", "accuracy", "margin_mean")}


class RewardModelPart(ModelPart):
    """MARLHF's joint reward model as a model part: a fresh :class:`JointRewardModel` loaded from ``source``,
    registered as ``module.reward_model`` (checkpoint keys ``reward_model.*``), one parameter group
    ``reward_model`` at ``reward_learning_rate``, placed on ``reward_model_device``, exported to ``reward_model/``."""

    name = "reward_model"

    def __init__(
        self,
        source: Any,
        freeze_backbone: bool = False,
        max_length: int | None = None,
        learning_rate: float = 1e-5,
        device: str | None = None,
    ):
        super().__init__()
        self.source, self.freeze_backbone, self.max_length = source, freeze_backbone, max_length
        self.rate, self.device = learning_rate, device

    def build(self, tokenizers: list[Any], agents: nn.ModuleList) -> nn.Module:
        return JointRewardModel.from_pretrained(
            self.source, freeze_backbone=self.freeze_backbone, max_length=self.max_length
        ).train()  # from_pretrained gives eval mode; the reward-model stage trains it

    def learning_rate(self) -> float:
        return self.rate

    def metric_name(self, index: int) -> str:
        return "reward_model"

    def parameter_groups(self) -> list[dict[str, Any]]:
        # Every parameter, frozen backbone included (they get no gradient): the optimizer's layout of earlier runs.
        params = list(self.module.parameters())
        return [{"params": params, "name": "reward_model", "lr": self.rate, "agents": []}]

    def place(self) -> None:
        if self.device is not None:
            self.module.to(self.device)

    def save_pretrained(self, root: Path, tokenizers: list[Any]) -> None:
        """``reward_model/`` (backbone, tokenizer, head)."""
        state = full_state_dicts([self.module])[0]  # a sharded reward model: gathered whole (every rank)
        if ranks.rank() == 0:  # a data-parallel run: written once
            self.module.save_pretrained(root / "reward_model", state_dict=state)


class MARLHF(OnPolicyModule):
    """A learned joint reward model (epoch 0), then ``rl_algorithm``'s objective on its scores (module docstring).

    One team, one module: the RL objective (``module.objective``) trains the agents (and its critics) in the RL
    epochs through the on-policy loop; in epoch 0 :meth:`update_reward_model` trains the reward model
    (``module.reward_part``, :class:`RewardModelPart`; ``module.reward_model``) with :class:`BradleyTerry`
    (``module.reward_objective``) on the pairs ``module.pairs`` collects.

    The RL stage is the backend's loop: ``MARLHF(rl_algorithm="iac", ...)`` is an instance of
    ``with_backend(MARLHF, IAC)`` (set in ``prepare_fields``), a class whose bases are this one and the backend (its
    hooks: how a record is made and batched, its critics), with the fields declared here (``rl_backend`` names it).
    """

    algorithm_name = "MARLHF"
    aligned_only = "MARLHF reward model currently supports aligned joint_mode only."  # CoMLRL's words (pairs.py)
    field_groups = (
        *MultiAgentModule.field_groups,
        JointActionFields,
        PreferenceFields,
        RewardModelFields,
        CriticFields,
        RLStageFields,
        ReferenceKLFields,
        MARLHFFields,
    )
    rounds_class: ClassVar[type[Rounds] | None] = None  # the iterative variant: Rounds (module.rounds)
    keep_comparator_loaded = True
    rl_backend: ClassVar[type[OnPolicyModule] | None] = None  # the RL stage's loop (set by ``with_backend``)
    normalizes_components = False  # the RL stage's reward is the learned model's score, one float

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickled (a spawned process, ``ddp_spawn``) as MARLHF's class and its backend: the composed class is
        rebuilt by ``with_backend`` where it is unpickled (it is not importable by name)."""
        reduced = super().__reduce_ex__(protocol)
        if self.rl_backend is None:
            return reduced
        return (new_with_backend, (type(self).__bases__[0], self.rl_backend), *reduced[2:])

    @property
    def passes(self) -> int:
        return 1  # the RL stage's objective is the backend's default one (no ratio: one pass)

    def rollout_options(self) -> dict[str, Any]:
        return {}  # no dynamic sampling in the RL stage (its reward is the learned one)

    def prepare_fields(self, values: dict[str, Any]) -> dict[str, Any]:
        """The RL stage's rollout fields left null take the backend's defaults; the module becomes an instance of
        ``with_backend(its class, the backend)`` (the RL stage runs the backend's loop)."""
        backend = BACKENDS[
            check_choice(
                "rl_algorithm",
                type_hints(MARLHFFields)["rl_algorithm"],
                values.get("rl_algorithm", MARLHFFields.rl_algorithm),
            )
        ]
        own = type(self) if self.rl_backend is None else type(self).__bases__[0]
        self.__class__ = with_backend(own, backend)
        defaults = declared_fields(backend)
        return {**values, **{k: defaults[k].default for k in BACKEND_DEFAULTED if values.get(k) is None}}

    def make_objective(self) -> Objective:
        """The RL backend's objective (``module.objective``), built from this module's fields; beside it the
        reward-model stage's objective (``module.reward_objective``) and the reward model's part
        (``module.reward_part``)."""
        backend = self.rl_backend
        baseline = declared_fields(backend).get("advantage_mode")  # the MAGRPO family's group baseline
        self.advantage_mode = baseline.default if baseline is not None else None
        self.reward_objective = BradleyTerry.from_fields(self.__dict__)
        self.reward_part = RewardModelPart(
            self.reward_model_name or self.backbone,
            freeze_backbone=self.reward_freeze_backbone,
            max_length=self.reward_max_length,
            learning_rate=self.reward_learning_rate,
            device=self.reward_model_device,
        )
        return backend.objective_class.from_fields(self.__dict__)

    def model_parts(self) -> list[ModelPart]:
        """The RL stage's parts (an actor-critic backend's critics), then the reward model's."""
        return [*super().model_parts(), self.reward_part]

    def check_config(self) -> None:
        # The reward-model stage's pairs (the first epoch serves them); single turn. MARLHF's own rules come before
        # the backend's (``super``), which build the backend's parts from the sources settled here.
        self.pairs = Pairs(self, self.reward_train_batch_size, self.reward_num_train_epochs, pair_epochs=1)
        self.rounds = self.pairs.rounds
        self.pairs.check()
        actor_critic = issubclass(self.rl_backend, IAC)
        if not actor_critic:  # no critic trains: a critic setting given here would be silently ignored
            declared = declared_fields(type(self))
            critic = {**self.group(CriticFields).values(), "critic_model_name": self.critic_model_name}
            unused = [
                f"{name}={value!r}" if value is None or isinstance(value, (str, int, float, bool)) else name
                for name, value in critic.items()
                if value is not declared[name].default and value != declared[name].default
            ]
            require(
                not unused,
                f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} only used by rl_algorithm "
                f"{' or '.join(ACTOR_CRITIC_BACKENDS)} (got rl_algorithm={self.rl_algorithm!r}): remove "
                f"{'it' if len(unused) == 1 else 'them'}, or choose an actor-critic backend.",
            )
        require(
            actor_critic or self.num_generations >= 2, "num_generations must be >= 2 for MAGRPO-family MARLHF backends."
        )
        require(
            not (self.collaboration_mode == "centralized" and actor_critic),
            f"rl_algorithm={self.rl_algorithm!r} with collaboration_mode='centralized' is not supported: "
            "centralized MARLHF runs the MAGRPO-family backends (magrpo, mareinforce, marloo, maremax); CoMLRL's "
            "centralized IAC/MAAC backend is not built (docs/differences.md).",
        )
        check_model_sources(self.reward_model_name, "reward_model_name")
        check_model_sources(self.critic_model_name, "critic_model_name")
        self.backbone = backbone_source(self.agent_sources)  # what the reward model and critics default to
        require(
            self.reward_model_name is not None or self.backbone is not None,
            "reward_model_name must be provided: the agents are model objects without a name "
            "(config._name_or_path) to load the reward model's backbone from.",
        )
        if actor_critic:  # the critics' source: critic_model, else CoMLRL's critic_model_name, else the agents'
            default = None if self.critic_sources is not None else self.backbone
            self.critic_model = self.critic_model or self.critic_model_name or default
        needs_critic = self.rl_algorithm == "maac" or (self.rl_algorithm == "iac" and self.use_separate_critic)
        require(
            not needs_critic or self.critic_sources is not None or self.critic_model is not None,
            "critic_model_name must be provided for MARLHF with MAAC/IAC: the agents are model objects without "
            "a name (config._name_or_path) to load the critics from.",
        )
        super().check_config()
        self.pairs.check_rounds()

    # ------------------------------------------------------------------ the reward model
    @property
    def reward_model(self) -> JointRewardModel:
        if "reward_model" not in self._modules:
            self.configure_model()
        return self._modules["reward_model"]

    @property
    def learned_reward(self) -> RewardCaller:
        """The reward model's raw scores as a team reward (what the RL stage trains on); one caller per module."""
        model = self.reward_model  # loads it
        if getattr(self, "_learned_reward", None) is None:
            self._learned_reward = RewardCaller(RewardModelReward(model, formatters=self.prompt_formatters))
        return self._learned_reward

    def update_reward_model(self, pairs: list[PreferencePair]) -> dict[str, float]:
        """One reward-model update (one optimizer step, one ``global_step``; the agents do not train) on a batch
        of pairs; the batch's loss is the mean over its pairs whichever micro-batches score them."""
        with self.record.timed("update"):
            step = self.begin_update(len(pairs), parts=[self.reward_part], agents=[])
            # 1. The pairs were collected and ranked by the task reward (the data side; module docstring).
            for rows in self.reward_micro_batches(pairs):
                chunk = take(pairs, rows)
                # 2. The reward model scores the micro-batch's winner and loser joint texts, in one forward.
                scores = self.reward_model.score_joint(*self.joint_responses(chunk))
                # 3. Bradley–Terry −log σ(s_w − s_l), the micro-batch's share of the batch mean, backward.
                loss, metrics = self.reward_objective.loss(scores[: len(chunk)], scores[len(chunk) :])
                share = len(chunk) / len(pairs)
                assert_finite("reward model loss", loss, step=self.global_step)
                metrics = {key: value * share for key, value in metrics.items()}
                step.backward(loss * share, {**metrics, "reward_model/num_pairs": len(chunk)})
            # 4. Clip and step (the reward model's parameter group only).
            metrics = step.finish()
        return {**metrics, **self.record.take_timings()}

    def joint_responses(self, pairs: Sequence[PreferencePair]) -> tuple[list[list[str]], list[list[str]]]:
        """``score_joint``'s arguments for the pairs' winners then their losers (agent-major prompts, responses)."""
        prompts = [[p.prompts[i] for p in pairs] * 2 for i in range(self.num_agents)]
        responses = [
            [p.winner_completions[i] for p in pairs] + [p.loser_completions[i] for p in pairs]
            for i in range(self.num_agents)
        ]
        return prompts, responses

    def reward_micro_batches(self, pairs: Sequence[PreferencePair]) -> list[slice | Tensor]:
        """The pairs of each reward-model forward: ``micro_batch_size`` pairs at most (a pair is two rows, its
        winner's and its loser's joint text) and, with ``micro_batch_tokens``, at most that many tokens per forward
        (rows × the longest row: the texts are padded to it), counted with the reward model's tokenizer
        (``JointRewardModel.token_counts``). ``pairs.pair_micro_batches`` plans them."""
        if self.micro_batch_tokens is None or not pairs:
            return pair_micro_batches(len(pairs), self.micro_batch_size)
        counts = self.reward_model.token_counts(joint_texts(*self.joint_responses(pairs)))
        longest = [max(w, l) for w, l in zip(counts[: len(pairs)], counts[len(pairs) :])]
        return pair_micro_batches(len(pairs), self.micro_batch_size, self.micro_batch_tokens, prompt_lengths=longest)

    # ------------------------------------------------------------------ stages
    @property
    def in_reward_model_stage(self) -> bool:
        return self.current_epoch == 0

    def on_train_start(self) -> None:
        super().on_train_start()  # restores the RNG of a resumed run
        # A resumed run gets no on_train_epoch_start for the epoch it resumes in (Lightning 2.x): enter its stage here.
        self.on_train_epoch_start()

    def on_train_epoch_start(self) -> None:
        learning = self.in_reward_model_stage
        self.reward_model.train(learning).requires_grad_(learning and not self.reward_model.freeze_backbone)
        self.reward_model.reward_head.requires_grad_(learning)
        self.reward_override = None if learning else self.learned_reward

    def training_step(self, batch, batch_idx: int):
        if self.pairs.is_empty_round(batch):
            return
        if not self.in_reward_model_stage:
            return super().training_step(batch, batch_idx)  # the RL objective's on-policy step
        metrics = self.update_reward_model(batch)
        self.pairs.last_batch = batch
        self.record.log_step([metrics], progress={"rm_acc": "reward_model/accuracy", "loss": "reward_model/loss"})

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        return self.pairs.records(max_nodes) if self.in_reward_model_stage else super().completion_records(max_nodes)

    def parts(self) -> list[Any]:
        return [self.pairs]  # the reward-model stage's pairs: setup, callbacks, data attachment, checkpoint entry

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of the release that held the RL stage as a nested module (``rl.agents.*``): the same team.
        weights = checkpoint.get("state_dict", {})
        for key in [k for k in weights if k.startswith("rl.")]:
            weights[key.removeprefix("rl.")] = weights.pop(key)
        super().on_load_checkpoint(checkpoint)


SCORING_REWARD = Choice(
    "preference_scoring_reward", {"task": ("oracle", "environment", "env"), "reward_model": ("model", "learned")}
)


@dataclass
class MARLHFIterFields(FieldGroup):
    """MARLHFIter's rounds.

    Args:
        rl_epochs_per_round: RL epochs per round over the task set (CoMLRL's MARLHFIterConfig calls it
            ``num_train_epochs``).
        preference_scoring_reward: what scores comparisons: ``task`` (aliases oracle, environment, env) or
            ``reward_model`` (model, learned: the previous round's reward model; the task reward in round 1).
    """

    rl_epochs_per_round: int = 2
    preference_scoring_reward: SCORING_REWARD.Literal = "task"

    def check(self) -> None:
        require(self.rl_epochs_per_round >= 1, "rl_epochs_per_round must be >= 1.")
        self.preference_scoring_reward = SCORING_REWARD(self.preference_scoring_reward)


class MARLHFIter(MARLHF):
    """Iterative MARLHF: ``num_iterations`` rounds of collect (current agents vs a comparator) → replay shard → a
    *fresh* reward model trained on the round's replayed pairs → ``rl_epochs_per_round`` RL epochs over the task set
    on it. A round is ``1 + rl_epochs_per_round`` Lightning epochs (the first trains the reward model);
    ``trainer.max_epochs`` is set to ``num_iterations × (1 + rl_epochs_per_round)``. Evaluation always uses the task
    reward.

    Args:
        reward_num_train_epochs: passes over a round's pairs for its reward model (MARLHFIter's default: 2).
    """

    algorithm_name = "MARLHFIter"
    field_groups = (*iterative_groups(MARLHF.field_groups), MARLHFIterFields)
    field_defaults = {"reward_num_train_epochs": 2}
    rounds_class = Rounds
    keep_comparator_loaded = False  # free 'model' comparators after each collection: the RL stage needs the memory

    @property
    def epochs_per_iteration(self) -> int:
        return 1 + self.rl_epochs_per_round

    def init_state(self) -> None:
        super().init_state()
        self._initial_reward_state: dict[str, Tensor] | None = None
        self._reward_model_round = -1  # the round whose pairs trained the current reward model

    def configure_model(self) -> None:
        super().configure_model()
        if self._initial_reward_state is None:  # each round's reward model starts from the same initial weights
            self._initial_reward_state = {k: v.detach().clone() for k, v in self.reward_model.state_dict().items()}

    @property
    def in_reward_model_stage(self) -> bool:
        return self.current_epoch % self.epochs_per_iteration == 0

    def collection_reward(self) -> RewardCaller:
        """What scores a round's comparisons: the task reward, or (``preference_scoring_reward: reward_model``)
        the previous round's reward model, raw (no ``reward_processor``), once one has been trained."""
        if self.preference_scoring_reward == "reward_model" and self._reward_model_round >= 0:
            return self.learned_reward
        return self.task_reward

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.pairs.policy.reward = self.collection_reward()  # a resumed run may already have a trained reward model

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        # A round with pairs to train on starts from a fresh reward model (an empty round keeps the previous one,
        # as CoMLRL), once its collection — which may have used the previous reward model as the oracle — is done.
        report = getattr(self.trainer.datamodule, "last_round", None)
        if (
            report is not None
            and report.iteration == self.rounds.iteration != self._reward_model_round
            and report.train
        ):
            self.reset_reward_model()
            self._reward_model_round = self.rounds.iteration

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        self.pairs.policy.reward = self.collection_reward()  # for the next round's collection

    def reset_reward_model(self) -> None:
        """A fresh reward model for this round: initial weights and no optimizer state."""
        self.reward_model.load_state_dict(self._initial_reward_state)
        optimizer = self.optimizers(use_pl_optimizer=False)
        for param in self.reward_model.parameters():
            optimizer.state.pop(param, None)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["comlrl_lightning"]["reward_model_round"] = self._reward_model_round

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._reward_model_round = int(checkpoint.get("comlrl_lightning", {}).get("reward_model_round", -1))


def backbone_source(agents: Any) -> str | None:
    """The model source a reward model or critic defaults to: the agents' name (a string, or the first string of a
    list), else the ``config._name_or_path`` of the first agent object that has one; None when nothing is named."""
    entries = [agents] if isinstance(agents, str) or not isinstance(agents, (list, tuple)) else list(agents)
    for entry in entries:
        if isinstance(entry, str):
            return entry
    for entry in entries:
        name = getattr(getattr(entry, "config", None), "_name_or_path", None)
        if name:
            return str(name)
    return None


def with_backend(marlhf: type[MARLHF], backend: type[OnPolicyModule]) -> type[MARLHF]:
    """The class a MARLHF (or MARLHFIter, ...) of RL backend ``backend`` is: ``marlhf`` first, then the backend, whose
    methods run the RL stage's loop (records, advantages, critics). Its fields are ``marlhf``'s own (the backend only
    lends methods: ``fields.field_classes``). One class per pair, named as ``marlhf``."""
    key = (marlhf, backend)
    if key not in _WITH_BACKEND:
        lent = tuple(k for k in backend.__mro__ if not issubclass(marlhf, k))
        _WITH_BACKEND[key] = type(
            marlhf.__name__,
            (marlhf, backend),
            {
                "__module__": marlhf.__module__,
                "__qualname__": marlhf.__qualname__,
                "__doc__": marlhf.__doc__,
                "rl_backend": backend,
                "lends_methods": lent,
            },
        )
    return _WITH_BACKEND[key]


_WITH_BACKEND: dict[tuple[type, type], type] = {}


def new_with_backend(marlhf: type[MARLHF], backend: type[OnPolicyModule]) -> MARLHF:
    """An empty instance of ``with_backend(marlhf, backend)``, for unpickling (its state is set next)."""
    return object.__new__(with_backend(marlhf, backend))
