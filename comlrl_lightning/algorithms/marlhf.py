"""MARLHF: a learned joint reward model, then multi-agent RL on it (REFERENCE §5.5, appendix A.3).

One Lightning fit, two stages:

1. **Reward model** (epoch 0). ``PreferenceDataModule`` collects preference pairs from the current agents exactly
   as MADPO does (task reward as the oracle). A fresh :class:`JointRewardModel` (``reward_model_name``, default the
   agents' own source) reads the joint text of each pair's winner and loser and learns the Bradley–Terry loss
   −log σ(s_w − s_l) for ``reward_num_train_epochs`` passes over the pairs, ``reward_train_batch_size`` pairs per
   update (``reward_learning_rate``; ``reward_freeze_backbone`` trains the head only).
2. **RL** (epochs 1…). The reward model is frozen and replaces the task reward; its scores are used raw (no
   ``reward_processor``). The learner is ``rl_algorithm``: ``magrpo`` | ``mareinforce`` | ``marloo`` | ``maremax``
   (the MAGRPO family, baseline set by the name) or ``iac`` | ``maac`` (actor-critic; critics from
   ``critic_model_name``, default the agents' source). Reference-KL shaping, when enabled, applies here only.

Evaluation always uses the task reward. ``trainer.max_epochs`` counts the reward-model epoch plus the RL epochs;
``global_step`` counts reward-model updates and RL updates alike. Checkpoints hold the agents, critics, the reward
model, the optimizer, the collected pairs and the stage (the epoch).

``MARLHF(rl_algorithm=...)`` turns itself into an instance of a class built from this one and the backend's
module (for example ``MARLHF[IAC]``, a subclass of both), so the backend's training step, update and metrics are
used unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Sequence


from comlrl_lightning.agents import JointRewardModel, RewardModelReward, check_model_sources
from comlrl_lightning.algorithms.actor_critic import CRITIC_TYPES, IAC, MAAC
from comlrl_lightning.algorithms.base import MultiAgentModule, plain_hparams, team_for, team_size
from comlrl_lightning.algorithms.iterative import IterativePreference
from comlrl_lightning.algorithms.madpo import check_preference_config
from comlrl_lightning.algorithms.reinforce import MAGRPO, MAREINFORCE, MARLOO, MAReMax
from comlrl_lightning.core.losses import assert_finite, bradley_terry_loss
from comlrl_lightning.core.pairs import PAIR_SELECTIONS, PreferencePair
from comlrl_lightning.core.replay import ITERATIVE_PAIR_SELECTIONS
from comlrl_lightning.rollout.preferences import collect_preference_pairs
from comlrl_lightning.rollout.rewards import RewardCaller
from comlrl_lightning.rollout.sampling import SamplingConfig
from comlrl_lightning.rollout.tree import RolloutEngine

BACKENDS: dict[str, type[MultiAgentModule]] = {
    "magrpo": MAGRPO, "mareinforce": MAREINFORCE, "mareforce": MAREINFORCE, "marloo": MARLOO,
    "maremax": MAReMax, "iac": IAC, "maac": MAAC,
}
RL_ALGORITHMS = ("magrpo", "mareinforce", "maremax", "marloo", "maac", "iac")


class MARLHF(MultiAgentModule):
    """Fields: the MADPO collection fields (``preference_num_candidates``, ``preference_pairs_per_sample``,
    ``pair_selection``), the reward-model fields (``reward_model_name``, ``reward_model_device``,
    ``reward_learning_rate``, ``reward_num_train_epochs``, ``reward_train_batch_size``, ``reward_max_length``,
    ``reward_freeze_backbone``), ``rl_algorithm`` and the RL fields of the chosen backend (``num_generations``,
    ``rollout_buffer_size``, ``train_batch_size``, reference KL, and for ``iac``/``maac`` the critic fields).
    Sampling, formatters, evaluation and optimizer fields as ``MAGRPO``.
    """

    algorithm_name = "MARLHF"
    pair_selections = PAIR_SELECTIONS

    def __init__(
        self,
        agents: str | Sequence[Any] = "tiny",
        num_agents: int | None = None,
        tokenizers: Any = None,
        model_config: dict[str, Any] | None = None,
        reward_func: Callable[..., Any] | None = None,
        reward_processor: Callable[[float], float] | None = None,
        reward_timeout: float | None = None,
        formatters: list[Callable[..., str]] | None = None,
        use_chat_template: bool = False,
        rl_algorithm: str = "magrpo",
        preference_num_candidates: int = 80,
        preference_pairs_per_sample: int | None = 16,
        pair_selection: str = "reward_gap",
        reward_model_name: str | None = None,
        reward_model_device: str | None = None,
        reward_learning_rate: float = 1e-5,
        reward_num_train_epochs: int = 1,
        reward_train_batch_size: int = 1,
        reward_max_length: int | None = None,
        reward_freeze_backbone: bool = False,
        num_generations: int = 4,
        max_new_tokens: int = 256,
        temperature: float = 0.6,
        top_p: float = 0.6,
        top_k: int | None = 50,
        generation_kwargs: dict[str, Any] | None = None,
        num_turns: int = 1,
        joint_mode: str = "aligned",
        discount: float = 1.0,
        rollout_buffer_size: int = 2,
        train_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        generation_batch_size: int | None = None,
        advantage_normalization: bool = True,
        loss_aggregation: str = "seq_sum",
        reference_kl_enabled: bool = False,
        reference_kl_coef: float = 0.1,
        reference_kl_estimator: str = "k3",
        reference_devices: str | list[str] | None = None,
        critic_model_name: str | None = None,
        critic_learning_rate: float | None = None,
        critic_devices: str | list[str] | None = None,
        use_separate_critic: bool = True,
        critic_type: str = "v",
        value_loss_coef: float = 0.6,
        value_clip_range: float | None = 0.2,
        critic_value_head_hidden_dim: int | None = None,
        value_head_hidden_dim: int | None = None,
        metrics_callback: Callable[..., Any] | None = None,
        eval_interval: int = 16,
        eval_num_samples: int = 4,
        eval_logger: Callable[..., Any] | None = None,
        eval_aggregator: Callable[..., Any] | None = None,
        log_completions: bool = True,
        agent_learning_rate: float | list[float] = 5e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float | None = None,
        parallel_training: str | None = "none",
        agent_devices: str | list[str] | None = None,
        collaboration_mode: str = "decentralized",
        centralized_adapter: Any = None,
    ):
        rl_algorithm = str(rl_algorithm).lower()
        if rl_algorithm not in BACKENDS:
            raise ValueError(f"rl_algorithm must be one of: {', '.join(RL_ALGORITHMS)} (got {rl_algorithm!r}).")
        # Become MARLHF[backend]: MARLHF's stages in front of the backend's RL (see the module docstring).
        self.__class__ = _with_backend(getattr(type(self), "_host", type(self)), BACKENDS[rl_algorithm])
        pair_selection = str(pair_selection).lower()
        actor_critic = rl_algorithm in ("iac", "maac")
        check_preference_config(self.algorithm_name, reward_func=reward_func, num_turns=num_turns,
                                joint_mode=joint_mode, preference_num_candidates=preference_num_candidates,
                                preference_pairs_per_sample=preference_pairs_per_sample,
                                pair_selection=pair_selection, eval_interval=eval_interval,
                                eval_num_samples=eval_num_samples, eval_logger=eval_logger,
                                eval_aggregator=eval_aggregator, selections=self.pair_selections,
                                reward_timeout=reward_timeout, num_agents=team_size(locals()),
                                formatters=formatters)
        checks = [
            (actor_critic or num_generations >= 2, "num_generations must be >= 2 for MAGRPO-family MARLHF backends."),
            (num_generations >= 1, "num_generations must be >= 1."),
            (reward_learning_rate > 0, "reward_learning_rate must be > 0."),
            (reward_num_train_epochs >= 1, "reward_num_train_epochs must be >= 1."),
            (reward_train_batch_size >= 1, "reward_train_batch_size must be >= 1."),
            (reward_max_length is None or reward_max_length >= 1, "reward_max_length must be >= 1 or null."),
            (critic_learning_rate is None or critic_learning_rate > 0, "critic_learning_rate must be > 0 or null."),
            (critic_type in CRITIC_TYPES, "critic_type must be one of: v, q."),
            (value_loss_coef > 0, "value_loss_coef must be > 0."),
            (value_clip_range is None or value_clip_range > 0, "value_clip_range must be > 0 or null."),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        check_model_sources(reward_model_name, "reward_model_name")
        check_model_sources(critic_model_name, "critic_model_name")
        agent_source = backbone_source(agents)  # what the reward model (and critics) default to
        if reward_model_name is None and agent_source is None:
            raise ValueError("reward_model_name must be provided: the agents are model objects without a name "
                             "(config._name_or_path) to load the reward model's backbone from.")
        needs_critic = rl_algorithm == "maac" or (rl_algorithm == "iac" and use_separate_critic)
        if needs_critic and critic_model_name is None and agent_source is None:
            raise ValueError("critic_model_name must be provided for MARLHF with MAAC/IAC: the agents are model "
                             "objects without a name (config._name_or_path) to load the critics from.")

        team = team_for(collaboration_mode, agents, num_agents, tokenizers, formatters, reward_func,
                        centralized_adapter)
        if team.collaboration is not None and actor_critic:
            raise ValueError(f"rl_algorithm={rl_algorithm!r} with collaboration_mode='centralized' is not supported: "
                             "centralized MARLHF runs the MAGRPO-family backends (magrpo, mareinforce, marloo, "
                             "maremax); CoMLRL's centralized IAC/MAAC backend is not built (docs/differences.md).")
        common = dict(agents=team.agents, num_agents=team.num_agents, tokenizers=team.tokenizers,
                      model_config=model_config, reward_func=team.reward_func, reward_processor=reward_processor,
                      reward_timeout=reward_timeout,
                      formatters=team.formatters,
                      use_chat_template=use_chat_template, num_generations=num_generations,
                      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                      generation_kwargs=generation_kwargs, num_turns=1, discount=discount,
                      rollout_buffer_size=rollout_buffer_size, train_batch_size=train_batch_size,
                      micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                      generation_batch_size=generation_batch_size,
                      advantage_normalization=advantage_normalization, loss_aggregation=loss_aggregation,
                      reference_kl_enabled=reference_kl_enabled, reference_kl_coef=reference_kl_coef,
                      reference_kl_estimator=reference_kl_estimator, reference_devices=reference_devices,
                      eval_interval=eval_interval, eval_num_samples=eval_num_samples, log_completions=log_completions,
                      agent_learning_rate=agent_learning_rate, weight_decay=weight_decay,
                      max_grad_norm=max_grad_norm, parallel_training=parallel_training, agent_devices=agent_devices)
        backend = self._backend
        if actor_critic:
            common.update(metrics_callback=metrics_callback, critic_type=critic_type,
                          critic_learning_rate=critic_learning_rate, critic_devices=critic_devices,
                          value_loss_coef=value_loss_coef, value_clip_range=value_clip_range,
                          critic_value_head_hidden_dim=critic_value_head_hidden_dim,
                          critic_model=critic_model_name or agent_source)
            if backend is IAC:
                common.update(use_separate_critic=use_separate_critic, value_head_hidden_dim=value_head_hidden_dim)
        else:
            common.update(joint_mode="aligned", eval_logger=eval_logger, eval_aggregator=eval_aggregator)
        backend.__init__(self, **common)
        self.save_hyperparameters(plain_hparams(locals()), logger=False)
        self.collaboration = team.collaboration

        self.rl_algorithm = rl_algorithm
        self.preference_pairs_per_sample, self.pair_selection = preference_pairs_per_sample, pair_selection
        self.reward_num_train_epochs, self.reward_train_batch_size = reward_num_train_epochs, reward_train_batch_size
        self.reward_learning_rate = reward_learning_rate
        self.reward_model_device = reward_model_device
        formatters_ = self.engine.formatters if hasattr(self, "engine") else self.formatters
        self.task_reward = self.engine.reward if hasattr(self, "engine") else self.reward
        # Stage 1 samples its candidates with the task reward as the oracle.
        self.pair_engine = RolloutEngine(
            num_agents=self.num_agents, formatters=formatters_, reward=self.task_reward,
            sampling=SamplingConfig(max_new_tokens, temperature, top_p, top_k),
            num_generations=preference_num_candidates, num_turns=1, joint_mode="aligned",
            use_chat_template=use_chat_template, generation_batch_size=generation_batch_size,
            generation_kwargs=generation_kwargs)
        self.reward_model = JointRewardModel.from_pretrained(
            reward_model_name or agent_source, freeze_backbone=reward_freeze_backbone, max_length=reward_max_length
        ).train()  # from_pretrained returns eval mode; epoch 0 trains it
        self.learned_reward = RewardCaller(RewardModelReward(self.reward_model, formatters=formatters_))
        self.last_pair_batch: list[PreferencePair] = []

    # ================================================================== stages
    @property
    def in_reward_model_stage(self) -> bool:
        return self.current_epoch == 0

    @property
    def pair_batch_size(self) -> int:
        return self.reward_train_batch_size

    @property
    def pair_passes(self) -> int:
        return self.reward_num_train_epochs

    @property
    def collection_engine(self) -> RolloutEngine:
        """Formatters, sampling and task reward of pair collection."""
        return self.pair_engine

    def collect_pairs(self, items) -> list[PreferencePair]:
        return collect_preference_pairs(self.pair_engine, [self.policy_model(i) for i in range(self.num_agents)],
                                        self.tokenizers, items, selection=self.pair_selection,
                                        limit=self.preference_pairs_per_sample, policy_version=self.global_step)

    def _set_reward(self, caller: RewardCaller) -> None:
        if hasattr(self, "engine"):
            self.engine.reward = caller
        else:
            self.reward = caller

    @contextlib.contextmanager
    def _task_reward(self):
        """Evaluation always scores with the task reward, whatever the stage."""
        current = self.engine.reward if hasattr(self, "engine") else self.reward
        self._set_reward(self.task_reward)
        try:
            yield
        finally:
            self._set_reward(current)

    def on_train_start(self) -> None:
        super().on_train_start()
        # A resumed run gets no on_train_epoch_start for the epoch it resumes in (Lightning 2.x): enter its stage here.
        self.on_train_epoch_start()

    def on_train_epoch_start(self) -> None:
        learning = self.in_reward_model_stage
        self.reward_model.train(learning).requires_grad_(learning and not self.reward_model.freeze_backbone)
        self.reward_model.reward_head.requires_grad_(learning)
        self._set_reward(self.task_reward if learning else self.learned_reward)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.reward_model_device is not None:
            self.reward_model.to(self.reward_model_device)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        optimizer.add_param_group({"params": list(self.reward_model.parameters()), "lr": self.reward_learning_rate,
                                   "agents": []})
        return optimizer

    def training_step(self, batch, batch_idx: int):
        if batch and isinstance(batch[0], PreferencePair):
            return self.reward_model_step(batch)
        return super().training_step(batch, batch_idx)

    def reward_model_step(self, pairs: list[PreferencePair]) -> None:
        """One Bradley–Terry update of the joint reward model on winner vs loser joint texts."""
        tic = time.perf_counter()
        optimizer = self.optimizers()
        optimizer.zero_grad()
        winners = self.reward_model.score_joint([[p.prompts[i] for p in pairs] for i in range(self.num_agents)],
                                                [[p.winner_completions[i] for p in pairs] for i in range(self.num_agents)])
        losers = self.reward_model.score_joint([[p.prompts[i] for p in pairs] for i in range(self.num_agents)],
                                               [[p.loser_completions[i] for p in pairs] for i in range(self.num_agents)])
        loss, diagnostics = bradley_terry_loss(winners, losers)
        assert_finite("reward model loss", loss, step=self.global_step)
        self.manual_backward(loss)
        optimizer.step()
        self.last_pair_batch = pairs
        metrics = {
            "reward_model/loss": float(loss.detach()),
            "reward_model/accuracy": float(diagnostics["accuracy"]),
            "reward_model/margin_mean": float(diagnostics["margin_mean"]),
            "reward_model/num_pairs": float(len(pairs)),
            "timing_s/reward_model": time.perf_counter() - tic,
            "env_step": float(self.env_step),
        }
        self.log_dict(metrics, batch_size=len(pairs))
        self.log("rm_acc", metrics["reward_model/accuracy"], prog_bar=True, logger=False, batch_size=len(pairs))

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        if self.in_reward_model_stage:
            return [{"env_step": self.env_step, "turn": 1, "prompts": p.prompts,
                     "completions": [[w, l] for w, l in zip(p.winner_completions, p.loser_completions)],
                     "rewards": [p.winner_reward, p.loser_reward]} for p in self.last_pair_batch[:max_nodes]]
        return super().completion_records(max_nodes)

    def evaluation_record(self, items):
        with self._task_reward():
            return super().evaluation_record(items)

    def save_pretrained(self, output_dir) -> None:
        """The backend's export plus ``reward_model/`` (backbone, tokenizer, head)."""
        from pathlib import Path

        super().save_pretrained(output_dir)
        self.reward_model.save_pretrained(Path(output_dir) / "reward_model")


@functools.lru_cache(maxsize=None)
def _with_backend(host: type[MARLHF], backend: type[MultiAgentModule]) -> type[MARLHF]:
    """``MARLHF[backend]`` (or ``MARLHFIter[backend]``): the host's stages in front of the backend's RL
    (MRO: host, backend, base)."""
    name = f"{host.__name__}[{backend.__name__}]"
    return type(name, (host, backend), {"_backend": backend, "_host": host, "__module__": host.__module__,
                                        "__qualname__": name})


SCORING_REWARDS = {**{a: "task" for a in ("task", "oracle", "environment", "env")},
                   **{a: "reward_model" for a in ("reward_model", "model", "learned")}}


class MARLHFIter(IterativePreference, MARLHF):
    """Iterative MARLHF (REFERENCE §5.7, appendix A.3): ``num_iterations`` rounds of collect (current agents vs a
    comparator) → replay shard → a *fresh* reward model trained on the round's replayed pairs → ``num_train_epochs``
    RL epochs over the task set on it. A round is ``1 + num_train_epochs`` Lightning epochs (the first trains the
    reward model); ``trainer.max_epochs`` is set to ``num_iterations × (1 + num_train_epochs)``.

    Fields: MARLHF's, the iterative ones of ``MADPOIter``, and ``preference_scoring_reward``: ``task`` (aliases
    oracle, environment, env) scores comparisons with the task reward; ``reward_model`` (model, learned) with the
    previous round's reward model (the task reward in round 1). Evaluation always uses the task reward.
    """

    algorithm_name = "MARLHFIter"
    pair_selections = ITERATIVE_PAIR_SELECTIONS
    keep_comparator_loaded = False  # free 'model' comparators after each collection: the RL stage needs the memory

    def __init__(
        self,
        num_train_epochs: int = 2,
        reward_num_train_epochs: int = 2,
        preference_scoring_reward: str = "task",
        preference_num_candidates: int = 20,
        preference_pairs_per_sample: int | None = 4,
        pair_selection: str = "comparator_reward",
        **kwargs: Any,
    ):
        """``kwargs``: the iterative fields (``IterativePreference``) and every MARLHF field."""
        scoring = str(preference_scoring_reward).strip().lower()
        if scoring not in SCORING_REWARDS:
            raise ValueError(f"preference_scoring_reward must be one of: task, reward_model. "
                             f"(got {preference_scoring_reward!r})")
        if num_train_epochs < 1:
            raise ValueError("num_train_epochs must be >= 1.")
        super().__init__(preference_num_candidates=preference_num_candidates,
                         preference_pairs_per_sample=preference_pairs_per_sample, pair_selection=pair_selection,
                         reward_num_train_epochs=reward_num_train_epochs, **kwargs)
        self.num_train_epochs, self.preference_scoring_reward = num_train_epochs, SCORING_REWARDS[scoring]
        self.epochs_per_iteration = 1 + num_train_epochs
        self.hparams.update(num_train_epochs=num_train_epochs, preference_scoring_reward=self.preference_scoring_reward)
        # Each round's reward model starts from the same initial weights (CoMLRL re-loads it from its source).
        self._initial_reward_state = {k: v.detach().clone() for k, v in self.reward_model.state_dict().items()}
        self._reward_model_round = -1  # the round whose pairs trained the current reward model

    @property
    def in_reward_model_stage(self) -> bool:
        return self.current_epoch % self.epochs_per_iteration == 0

    def oracle(self) -> RewardCaller:
        if self.preference_scoring_reward == "reward_model" and self._reward_model_round >= 0:
            return self.learned_reward  # raw reward-model scores: no reward_processor
        return super().oracle()

    def finish_collection(self, iteration, fresh, train, index) -> None:
        # After the collection (which may have used the previous round's reward model as its oracle), and only
        # when there is something to train it on: an empty round keeps the previous reward model, as CoMLRL.
        super().finish_collection(iteration, fresh, train, index)
        if train:
            self.reset_reward_model()
            self._reward_model_round = iteration

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
