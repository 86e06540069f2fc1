"""OnPolicyModule: what the MAGRPO family and the actor-critic family share.

Every training step resolves the experience its data module serves, a ``RolloutBatch``: the rollout trees of its
dataset items, sampled at that moment by the current weights through the team policy this module handed over when
the fit started (one engine, ``rollout/tree.py``; one record type, the tree ``Node``). The step adds what they hold
to a buffer and, once the buffer holds ``rollout_buffer_size`` records (or the epoch ends), trains on it: turn by
turn, shuffled, in mini-batches of ``train_batch_size`` records, one team update (one ``global_step``) per
mini-batch (``schedule``). The reference-KL penalty (``reference_kl_*``) is attached to the sampled completions
here, for every algorithm.

One update is :meth:`OnPolicyModule.update`, the steps numbered as in the paper: (1) the rollout, sampled and
buffered by ``train_step``; (2) each agent's rows and advantages (``agent_batch``: the MAGRPO family's group
advantages, the actor-critic's normalised target − value); (3) for each agent × micro-batch: score (``score``), the
objective's loss (``module.objective.loss``, a function of tensors), backward; (4) clip and step; (5) log. A family
says what a record is (``records``), what it computes on a fresh rollout (``after_rollout``) and per turn group
(``prepare_group``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from comlrl_lightning.agents import resolve_devices
from comlrl_lightning.agents.memory import check_update_memory
from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.fields import JointActionFields, ReferenceKLFields, RolloutFields, require
from comlrl_lightning.core.losses import assert_finite, kl_estimate
from comlrl_lightning.core.schedules import ratio_product_weights, sequence_log_ratios
from comlrl_lightning.data.tasks import RolloutBatch, TaskDataModule
from comlrl_lightning.rollout.backends.vllm import finish_sampling_ahead
from comlrl_lightning.rollout.policy import TeamPolicy
from comlrl_lightning.rollout.sampling import (
    ScoringInputs,
    collate_rows,
    forward_tokens,
    micro_batches,
    select_rows,
    shares_prompts,
    token_logprobs,
    trim_prompt_padding,
)
from comlrl_lightning.rollout.tree import Node, Rollout, RolloutEngine
from comlrl_lightning.runs import ranks, stop


@dataclass
class PolicyBatch:
    """One agent's rows of a mini-batch, as tensors: inputs, per-row advantages, loss weights, stored log-probs (what
    an on-policy objective's ``loss`` reads beside the fresh log-probs)."""

    inputs: ScoringInputs
    advantages: Tensor  # [B]
    weights: Tensor  # [B, T]
    ref_logprobs: Tensor | None  # [B, T] the reference policy's (reference KL in the loss)
    old_logprobs: Tensor | None = None  # [B, T] the sampling policy's, under the training model (a ratio objective)
    engine_logprobs: Tensor | None = None  # [B, T] the inference engine's, where one sampled (vLLM)
    fresh: Tensor | None = None  # [B] bool: sampled by the weights this update starts from (policy lag 0)
    entropy: Tensor | None = None  # [B, T] the policy's entropy per position (``uses_entropy``), with grad
    values: Tensor | None = None  # [B] a critic's values, with grad (actor-critic)
    extras: dict[str, Tensor] = field(default_factory=dict)  # [B, ...] a family's per-row tensors

    def rows(self, sl: Any) -> "PolicyBatch":
        def part(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[sl]

        return PolicyBatch(
            trim_prompt_padding(select_rows(self.inputs, sl)),
            self.advantages[sl],
            self.weights[sl],
            part(self.ref_logprobs),
            part(self.old_logprobs),
            part(self.engine_logprobs),
            part(self.fresh),
            extras={name: value[sl] for name, value in self.extras.items()},
        )


class OnPolicyModule(MultiAgentModule):
    """Sample with the current weights, buffer, train on the buffer in mini-batches (module docstring)."""

    field_groups = (*MultiAgentModule.field_groups, JointActionFields, RolloutFields, ReferenceKLFields)
    reward_per_node: ClassVar[bool] = False  # one reward call per node, 1/J/N values (actor-critic)
    per_agent_rewards: ClassVar[bool] = True  # an N-value reward is one reward per agent
    passes: int = 1  # shuffled passes over every drained buffer
    steps_sequentially = True  # agent_update_schedule sequential: the update weighs advantages by earlier ratios

    def init_state(self) -> None:
        super().init_state()
        self.buffer: list[Any] = []
        self.last_rollout: Rollout | None = None
        self.reference = None  # set by the ReferenceModels callback when the reference-KL penalty is on
        self.reward_override = None  # a reward that replaces the task reward in rollouts (MARLHF's learned one)
        self.sampling.keep_logprobs = self.needs_sampling_logprobs

    @property
    def needs_sampling_logprobs(self) -> bool:
        """Whether training reads the sampling policy's token log-probs (the reference KL in the reward; a ratio
        objective's or the engine correction's π_old): then sampling keeps them (:meth:`sampling_logprobs`)."""
        reward_kl = self.uses_reference and self.reference_kl_placement == "reward"
        return self.keeps_old_logprobs or reward_kl

    @property
    def keeps_old_logprobs(self) -> bool:
        """Whether every fresh sample stores π_old, the training model's log-probs under the weights that sampled
        it (``attach_training_logprobs``): a ratio objective's denominator, the engine correction's numerator."""
        sequential = self.agent_update_schedule == "sequential"  # M: the earlier agents' new/old ratios
        return getattr(self.objective, "uses_old_logprobs", False) or self.corrects_engine_sampling or sequential

    @torch.no_grad()
    def score_no_grad(self, agent: int, inputs: ScoringInputs) -> Tensor:
        """Agent ``agent``'s token log-probs [B, T] (CPU) in eval mode, micro-batched."""
        model = self.policy_model(agent)
        was_training = model.training
        model.eval()
        rows = inputs.input_ids.shape[0]
        step = self.micro_batch_size or rows
        try:
            return torch.cat(
                [token_logprobs(model, select_rows(inputs, slice(s, s + step))).cpu() for s in range(0, rows, step)]
            )
        finally:
            model.train(was_training)

    def sampling_logprobs(self, agent: int, samples: Sequence[Any], inputs: ScoringInputs) -> Tensor:
        """The sampling policy's token log-probs of agent ``agent``'s ``samples`` ([rows, T], laid out as ``inputs``):
        read while sampling when it kept them, else one no-grad scoring forward."""
        kept = [s.sampling_logprobs for s in samples]
        if all(k is not None for k in kept):
            width = inputs.completion_ids.shape[1]
            return torch.cat([F.pad(k, (0, width - k.shape[1])) for k in kept])
        return self.score_no_grad(agent, inputs)

    def build_engine(self) -> RolloutEngine:
        """The rollout tree: K samples per prompt, turns, joint actions, returns, early termination, transitions."""
        return self.make_engine(
            num_generations=self.num_generations,
            num_turns=self.num_turns,
            joint_mode=self.joint_mode,
            discount=self.discount,
            early_termination_threshold=self.early_termination_threshold,
            external_transition=self.external_transition,
            external_prompt_passthrough=self.external_prompt_passthrough,
            reward_per_node=self.reward_per_node,
            per_agent_rewards=self.per_agent_rewards,
        )

    def check_config(self) -> None:
        super().check_config()
        require(
            self.num_turns == 1 or self.external_transition is not None,
            f"Multi-turn {self.algorithm_name} requires an external_transition.",
        )
        require(
            not self.max_staleness or (self.generation_backend == "vllm" and self.vllm_mode == "server"),
            f"max_staleness: {self.max_staleness} samples the next step on vLLM servers while this step updates: set "
            "generation_backend: vllm and vllm_mode: server (with vllm_server_urls), or max_staleness: 0.",
        )
        require(
            not (self.max_staleness and getattr(self, "dynamic_sampling", False)),
            "max_staleness > 0 with dynamic_sampling is not supported (its refills sample inside the step): turn one "
            "of them off.",
        )
        require(
            self.agent_update_schedule != "sequential" or self.joint_mode == "aligned" or self.num_agents == 1,
            "agent_update_schedule=sequential weighs each joint action by the ratios of the agents' own samples in "
            "it; joint_mode=cross pairs every sample with many partners: use joint_mode aligned.",
        )
        require(
            not self.vllm_importance_sampling_correction or self.generation_backend == "vllm",
            "vllm_importance_sampling_correction: true corrects for sampling by a vLLM engine, but "
            f"generation_backend is {self.generation_backend!r}: set generation_backend: vllm, or remove "
            "vllm_importance_sampling_correction (the other backends sample with the training weights).",
        )
        if self.reference_kl_enabled and self.reference_devices is not None:
            resolve_devices(self.reference_devices, self.num_agents, kind="reference_devices")  # 1 or N devices

    @property
    def uses_reference(self) -> bool:
        """The reference copies exist only when the penalty can act (never load a model nothing uses)."""
        return self.reference_kl_enabled and self.reference_kl_coef > 0

    def configure_callbacks(self):
        from comlrl_lightning.callbacks import ReferenceModels

        callbacks = list(super().configure_callbacks())
        if self.uses_reference:
            callbacks.append(ReferenceModels(self.reference_devices, self.micro_batch_size))
        return callbacks

    # ------------------------------------------------------------------ experience
    def training_step(self, batch: list[Mapping[str, Any]], batch_idx: int):
        self.record.log_step(*self.train_step(batch, batch_idx))

    def train_step(
        self, batch: list[Mapping[str, Any]], batch_idx: int
    ) -> tuple[list[dict[str, float]], dict[str, float], dict[str, str]]:
        """Sample ``batch``'s trees, buffer them, train on a full buffer; returns each update's metrics, the
        metrics of the fresh samples and what the progress bar shows (``record.log_step``'s arguments; MARLHF runs its
        backend's steps through this)."""
        rollout = self.collect_rollout(batch)
        sampled = {}
        if rollout is not None:  # None: this rank's share of the epoch's last batch is empty
            self.buffer.extend(self.records(rollout))
            sampled = self.rollout_metrics(rollout)
        last_batch = batch_idx + 1 >= self.trainer.num_training_batches
        drain = len(self.buffer) >= self.rollout_buffer_size or (last_batch and bool(self.buffer))
        updates = []
        if ranks.reduce_max(float(drain)):  # the ranks drain together, and make the same number of updates
            records, self.buffer = self.buffer, []
            if self.max_staleness:  # one-step-off: records older than the bound are not trained on
                kept = [r for r in records if self.global_step - r.policy_version <= self.max_staleness]
                sampled["rollout/stale_dropped"] = float(len(records) - len(kept))
                records = kept
            mini_batches = list(self.schedule(records))
            mini_batches += [[]] * (int(ranks.reduce_max(len(mini_batches))) - len(mini_batches))
            updates = [self.update(mini_batch) for mini_batch in mini_batches]
        return updates, sampled, {"reward": "rollout/turn_1/reward_mean", "loss": "loss"}

    @property
    def policy(self) -> TeamPolicy:
        """The team as the data side sees it: the live agents sampling through the rollout engine."""
        if getattr(self, "_policy", None) is None:
            self._policy = TeamPolicy(
                self.engine,
                self.policy_models(),
                self.tokenizers,
                reward=self.task_reward,
                collaboration=self.collaboration,
            )
        return self._policy

    def on_fit_start(self) -> None:
        super().on_fit_start()
        data = self.trainer.datamodule
        if isinstance(data, TaskDataModule):  # also MARLHF's data module, for its RL stage
            ahead = self.rollout_stamps if self.max_staleness else None  # one-step-off: sampled as batches are made
            data.attach_rollouts(self.policy, ahead=ahead, **self.rollout_options())  # this policy's rollouts

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.max_staleness:  # the batch made ahead of a step that never comes: its sampling ends first
            finish_sampling_ahead()

    def rollout_stamps(self) -> dict[str, Any]:
        """What a rollout is stamped with when it is sampled: the weights' version (updates done), env_step, the
        reward."""
        return dict(policy_version=self.global_step, env_step=self.env_step, reward=self.rollout_reward())

    def rollout_options(self) -> dict[str, Any]:
        """How the data module resolves this module's rollouts (``TaskDataModule.attach_rollouts``' options: the
        MAGRPO family's dynamic sampling)."""
        return {}

    @torch.no_grad()
    def collect_rollout(self, batch: RolloutBatch | Sequence[Mapping[str, Any]]) -> Rollout | None:
        """The step's experience, sampled now by the current weights: the data module's ``RolloutBatch``
        resolved, or (items from any other loader) the items' trees sampled here; rewarded and expanded. None for
        an empty batch (a rank's empty share in a data-parallel run)."""
        if ranks.world_size() > 1 and not self.max_staleness:  # every rank, even one with an empty share
            self.policy.take_weights()
        if not len(batch):
            self.count_env_steps(0)  # the other ranks' joint actions
            return None
        stamps = self.rollout_stamps()
        # Sampling changes nothing a checkpoint holds: Ctrl-C / SIGTERM may throw it away (runs/stop.py).
        with stop.discardable(f"the rollout of {len(batch)} task(s) after update {self.global_step}"):
            rollout = (
                batch.resolve(**stamps) if isinstance(batch, RolloutBatch) else self.policy.rollout(batch, **stamps)
            )
        self.count_env_steps(rollout.num_joint_actions)
        for phase, seconds in rollout.timings.items():
            self.record.phase_seconds[phase] += seconds
        with self.record.timed("score"):
            if self.keeps_old_logprobs:
                self.attach_training_logprobs(rollout.nodes)
            if self.reference is not None:
                self.attach_reference_kl(rollout.nodes)
            self.after_rollout(rollout)
        self.last_rollout = rollout
        return rollout

    def rollout_reward(self):
        """The reward rollouts are scored with: the task reward, unless overridden (MARLHF's learned reward)."""
        return self.reward_override or self.task_reward

    def after_rollout(self, rollout: Rollout) -> None:
        """What a family computes on fresh nodes before they are buffered (actor-critic: values and targets)."""

    def records(self, rollout: Rollout) -> list[Any]:
        """What the buffer holds and ``rollout_buffer_size`` counts: nodes (actor-critic: joint samples)."""
        return rollout.nodes

    def record_from_state(self, state: dict[str, Any]) -> Any:
        """A buffered record back from a checkpoint (``record.state_dict()``)."""
        return Node.from_state_dict(state)

    def prepare_group(self, group: list[Any]) -> None:
        """Per drained turn group, before its mini-batches (actor-critic: advantages over the group)."""

    def node_record(self, node: Node) -> dict[str, Any]:
        """What the completions log adds for a node (actor-critic: per-agent rewards and values)."""
        return {}

    def schedule(self, records: list[Any]) -> Iterator[list[Any]]:
        """The mini-batches of one drained buffer: ``passes`` passes, each turn by turn (a mini-batch never mixes
        turns), shuffled, ``train_batch_size`` records each."""
        for _ in range(self.passes):
            for turn in sorted({r.turn for r in records}):
                group = [r for r in records if r.turn == turn]
                self.prepare_group(group)
                order = torch.randperm(len(group)).tolist()
                for start in range(0, len(group), self.train_batch_size):
                    yield [group[j] for j in order[start : start + self.train_batch_size]]

    def agent_inputs(self, nodes: Sequence[Node], agent: int) -> tuple[list[Any], ScoringInputs]:
        """Agent ``agent``'s samples at ``nodes`` and their model inputs, one row per completion (node by node, K
        rows each): what scoring them with any model needs."""
        samples = [n.agents[agent] for n in nodes]
        inputs = collate_rows(
            [s.prompt_ids for s in samples],
            [s.completion_ids for s in samples],
            [s.completion_mask for s in samples],
            self.tokenizers[agent].pad_token_id,
        )
        return samples, inputs

    @property
    def corrects_engine_sampling(self) -> bool:
        """Whether the loss weights the engine's samples by π_train / π_engine (``vllm_importance_sampling_*``)."""
        return self.vllm_importance_sampling_correction and self.generation_backend == "vllm"

    @torch.no_grad()
    def attach_training_logprobs(self, nodes: list[Node]) -> None:
        """π_old: the training model's log-probs of the fresh samples under the weights that sampled them (kept
        while sampling, else one no-grad forward per agent): a ratio objective's denominator and the engine
        correction's π_train, whatever the policy lag at the update."""
        stale = [n for n in nodes if n.policy_version != self.global_step]  # sampled ahead (max_staleness)
        if stale and stale[0].agents[0].engine_logprobs is not None:
            # the weights that sampled them are gone: π_old is the engine's log-probs of its samples
            for node in stale:
                for a in node.agents:
                    a.sampling_logprobs = a.engine_logprobs
            nodes = [n for n in nodes if n.policy_version == self.global_step]
        for i in range(self.num_agents if nodes else 0):
            samples = [n.agents[i] for n in nodes]
            inputs = collate_rows(
                [s.prompt_ids for s in samples],
                [s.completion_ids for s in samples],
                [s.completion_mask for s in samples],
                self.tokenizers[i].pad_token_id,
            )
            logp = self.sampling_logprobs(i, samples, inputs)
            for s, rows in zip(samples, logp.split([s.completion_ids.shape[0] for s in samples])):
                s.sampling_logprobs = rows[:, : s.completion_ids.shape[1]]

    @torch.no_grad()
    def attach_reference_kl(self, nodes: list[Node]) -> None:
        """Reference log-probs of every sampled completion, batched per agent: ``reward`` placement stores
        Σ_t KL per completion (``sequence_kl``), ``loss`` placement the per-token reference log-probs."""
        for i in range(self.num_agents):
            samples, inputs = self.agent_inputs(nodes, i)
            ref = self.reference.token_logprobs(i, inputs, self.agent_device(i))
            sizes = [s.completion_ids.shape[0] for s in samples]
            if self.reference_kl_placement == "reward":
                policy = self.sampling_logprobs(i, samples, inputs)
                kl = (kl_estimate(policy, ref, self.reference_kl_estimator) * inputs.completion_mask).sum(-1)
                for s, sequence_kl in zip(samples, kl.split(sizes)):
                    s.sequence_kl = sequence_kl
            else:
                for s, rows in zip(samples, ref.split(sizes)):
                    s.ref_logprobs = rows[:, : s.completion_ids.shape[1]]

    # ------------------------------------------------------------------ the update
    def update(self, records: list[Any]) -> dict[str, float]:
        """One team update on a mini-batch of ``records`` (possibly empty on a data-parallel rank): one optimizer
        step, one ``global_step``. Step 1, the rollout, happened in ``train_step``. The agents that step are the
        schedule's (``module.agent_schedule``): every trained agent in one stage, an alternating block's, or — a
        sequential schedule — one agent per stage, each stepped before the next (HAPPO)."""
        with self.record.timed("update"):
            stages = self.agent_schedule.stages()
            stepping = [i for stage in stages for i in stage]
            step, batch_metrics = self.begin_update(len(records), agents=stepping), {}
            if records:
                # 2. returns and advantages: each stepping agent's rows of the mini-batch
                batches = {i: self.agent_batch(records, i) for i in stepping}
                gaps = {i: EngineGap() for i in stepping}
                earlier: list[Tensor] = []  # a sequential update: the log-ratios of the agents already stepped
                for s, stage in enumerate(stages):
                    if earlier:  # weigh this agent's advantages by the clipped ratio product M of those before it
                        self.weigh_by_earlier_agents(batches, stage, earlier)
                    # 3. for each agent x micro-batch: score, loss, backward
                    for i, _, _, rows in self.agent_micro_batches({i: batches[i].inputs for i in stage}):
                        chunk = batches[i].rows(rows)
                        logp = self.score(i, chunk)
                        loss, metrics = self.objective.loss(logp, chunk)
                        assert_finite("policy loss", loss, step=self.global_step, agent=i)
                        gaps[i].add(logp, chunk)
                        step.backward(loss, {"loss": loss, **prefixed(f"agent_{i}/", {"loss": loss, **metrics})})
                    if s + 1 < len(stages):  # sequential: this agent steps before the next
                        step.step_now(self.stage_models(stage))
                        earlier += [self.log_ratios_after_step(i, batches[i]) for i in stage]
                step.add(self.extra_losses(records, step))
                batch_metrics = {**self.batch_metrics(records), **update_metrics(batches, gaps)}
            # 4. clip and step
            metrics = self.objective.summarize(step.finish())
            self.agent_schedule.advance()
        # 5. log
        return {**metrics, **batch_metrics, **self.agent_schedule.metrics(stepping), **self.record.take_timings()}

    def stage_models(self, agents: Sequence[int]) -> list[Any]:
        """The models a sequential stage of ``agents`` steps (IAC: each agent's critic learns with it)."""
        return [self.agents[i] for i in agents]

    @torch.no_grad()
    def log_ratios_after_step(self, agent: int, batch: PolicyBatch) -> Tensor:
        """log π_new − log π_old per row of ``agent``'s ``batch`` [B], its new weights against the sampling policy's
        (``m_log_ratio``: the sequence's sum or its tokens' mean): one no-grad forward."""
        new = self.score_no_grad(agent, batch.inputs)
        return sequence_log_ratios(new, batch.old_logprobs, batch.inputs.completion_mask, self.m_log_ratio)

    def weigh_by_earlier_agents(self, batches: dict[int, PolicyBatch], stage: Sequence[int], earlier: list) -> None:
        """A sequential update: ``stage``'s advantages times M = clip(Π π_new/π_old of the agents before it,
        ``m_clip_min``, ``m_clip_max``), row by row (a row is the same joint action for every agent: aligned joint
        mode); logged as ``agent_i/sequential_weight_mean``."""
        weight = ratio_product_weights(earlier, self.m_clip_min, self.m_clip_max)
        for i in stage:
            batches[i].advantages = batches[i].advantages * weight.to(batches[i].advantages.dtype)
            batches[i].extras["sequential_weight"] = weight

    def agent_batch(self, records: list[Any], agent: int) -> PolicyBatch:
        """Step 2: agent ``agent``'s rows of a mini-batch with their advantages (a family defines it)."""
        raise TypeError(f"{type(self).__name__} does not define agent_batch (an on-policy family must)")

    def score(self, agent: int, batch: PolicyBatch) -> Tensor:
        """Step 3's forward: agent ``agent``'s token log-probs [B, T] of ``batch`` with grad (and the entropy per
        position into ``batch.entropy`` when the objective uses it)."""
        if getattr(self.objective, "uses_entropy", False):
            logp, batch.entropy = token_logprobs(self.policy_model(agent), batch.inputs, entropy=True)
            return logp
        return token_logprobs(self.policy_model(agent), batch.inputs)

    def extra_losses(self, records: list[Any], step: Any) -> dict[str, Tensor]:
        """Step 3's forwards after the agents' (MAAC: the joint critic's), back-propagated through ``step``;
        returns metrics to add. None by default."""
        return {}

    # ------------------------------------------------------------------ the per-agent x micro-batch loop
    def agent_micro_batches(self, inputs: Mapping[int, ScoringInputs]) -> Iterator[tuple[int, int, int, Any]]:
        """The one loop of an update's forwards: agent by agent (the agents of ``inputs``, in its order),
        micro-batch by micro-batch (``micro_batch_size``, ``micro_batch_tokens``; a prompt shared by K rows counted
        once), after the memory pre-check of every forward. Yields ``(agent, index, count, rows)``: the micro-batch's
        rows of ``inputs[agent]``, its index and the agent's number of micro-batches."""
        plans = {
            i: micro_batches(x, self.micro_batch_size, self.micro_batch_tokens, shares_prompts(self.policy_model(i)))
            for i, x in inputs.items()
        }
        self.check_update_fits(
            [
                (self.policy_model(i), trim_prompt_padding(select_rows(inputs[i], r)))
                for i, p in plans.items()
                for r in p
            ]
        )
        for agent, plan in plans.items():
            for index, rows in enumerate(plan):
                yield agent, index, len(plan), rows

    def check_update_fits(self, forwards: Sequence[tuple[Any, ScoringInputs]]) -> None:
        """Raise a clear ``MemoryError`` before the backward when the update's largest forward plus the optimizer
        state not allocated yet clearly exceeds the memory left on the device (``agents/memory.py``)."""
        check_update_memory(
            [
                (m, forward_tokens(m, x), x.input_ids.shape[0] * (x.completion_ids.shape[1] + 1), x.input_ids.shape)
                for m, x in forwards
            ],
            self.agent_device(0),
            [p for p in self.parameters() if p.requires_grad],
            self.optimizers() if self._trainer is not None else None,
            f"micro_batch_tokens (tokens per forward, now {self.micro_batch_tokens}), micro_batch_size (rows per "
            f"forward, now {self.micro_batch_size}), model_config.gradient_checkpointing (now "
            f"{self.team.gradient_checkpointing}; ~2.5x less), or shorter sequences (max_new_tokens, now "
            f"{self.max_new_tokens})",
        )

    # ------------------------------------------------------------------ metrics
    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        """Rewards of the fresh nodes per turn, completion lengths, the reference KL when it is on, and what the
        rollout reports itself (``rollout.metrics``: dynamic sampling's, ``data/dynamic_sampling.py``)."""
        metrics: dict[str, float] = dict(rollout.metrics)
        for t, level in enumerate(rollout.levels):
            if not level:  # dynamic sampling dropped every node of this turn (a deeper turn kept some)
                continue
            rewards = torch.cat([n.rewards for n in level])
            metrics[f"rollout/turn_{t + 1}/reward_mean"] = float(rewards.mean())
            metrics[f"rollout/turn_{t + 1}/reward_std"] = float(rewards.std(unbiased=False))
            if self.reference is not None and self.reference_kl_placement == "reward":
                kl = torch.cat([a.sequence_kl for n in level for a in n.agents])
                metrics[f"turn_{t + 1}/reference_kl_mean"] = float(kl.mean())
                metrics[f"turn_{t + 1}/reference_kl_penalty_mean"] = float(self.reference_kl_coef * kl.mean())
        lengths = torch.cat([a.completion_mask.sum(-1) for n in rollout.nodes for a in n.agents]).float()
        metrics["completions/mean_length"] = float(lengths.mean())
        metrics["completions/clipped_ratio"] = float((lengths >= self.max_new_tokens).float().mean())
        if self.collaboration is not None:  # joint answers the adapter could not split (scored as empty roles)
            metrics["collaboration/parse_failure_rate"] = self.collaboration.take_parse_failures() / max(
                rollout.num_joint_actions, 1
            )
        return metrics

    def batch_metrics(self, records: list[Any]) -> dict[str, float]:
        """Metrics of the mini-batch itself, taken before the optimizer step (a family adds its own)."""
        # Updates done before this one minus updates done at sampling: 0 = sampled by the weights being updated.
        return {"rollout/policy_lag": float(self.global_step - min(r.policy_version for r in records))}

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        """What the agents wrote at the first ``max_nodes`` nodes of the last rollout (CompletionsLogger)."""
        if self.last_rollout is None:
            return []
        return [
            {
                "step": node.policy_version,
                "env_step": node.env_step,
                "turn": node.turn + 1,
                "prompts": [a.prompt for a in node.agents],
                "completions": [a.texts for a in node.agents],
                "joint_actions": node.joint_index.tolist(),
                "rewards": node.rewards.tolist(),
                **self.node_record(node),
            }
            for node in self.last_rollout.nodes[:max_nodes]
        ]

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        self.save_buffer(checkpoint["comlrl_lightning"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.load_buffer(checkpoint.get("comlrl_lightning", {}))

    def save_buffer(self, state: dict[str, Any]) -> None:
        """The records awaiting an update, into the checkpoint's ``state``: this rank's, and every rank's (rank r's
        list at index r)."""
        state["buffer"] = [r.state_dict() for r in self.buffer]
        state["rank_buffers"] = ranks.gather(state["buffer"])

    def load_buffer(self, state: dict[str, Any]) -> None:
        saved = state.get("rank_buffers") or [state.get("buffer", [])]
        # Resumed with a different number of processes: old rank r's records go to rank r mod D (none is lost).
        mine = [records for r, records in enumerate(saved) if r % ranks.world_size() == ranks.rank()]
        self.buffer = [self.record_from_state(s) for records in mine for s in records]


def stored_rows(samples: list, name: str, inputs: ScoringInputs) -> Tensor | None:
    """The per-token values ``name`` stored with each sample (log-probs of some policy, [K_s, T_s] each), one row per
    completion, right-padded to the width of ``inputs``; None when the samples store none."""
    if getattr(samples[0], name) is None:
        return None
    width = inputs.completion_ids.shape[1]
    return torch.cat([F.pad(getattr(s, name), (0, width - getattr(s, name).shape[1])) for s in samples])


def prefixed(prefix: str, metrics: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}{name}": value for name, value in metrics.items()}


class EngineGap:
    """Mean |log π_engine − log π_train| per token over an agent's rows of one update that the weights being
    updated sampled (policy lag 0): how far the inference engine's probabilities are from the training model's
    (``rollout/engine_logprob_gap``; vLLM only)."""

    def __init__(self):
        self.total, self.tokens = 0.0, 0

    def add(self, logp: Tensor, batch: PolicyBatch) -> None:
        if batch.engine_logprobs is None:
            return
        mask = batch.inputs.completion_mask.to(logp.device) & batch.fresh.to(logp.device).unsqueeze(-1)
        self.total += float(((logp.detach() - batch.engine_logprobs.to(logp.device)).abs() * mask).sum())
        self.tokens += int(mask.sum())


def advantage_metrics(advantages: Tensor) -> dict[str, float]:
    """Mean and spread of one agent's advantages in an update, and the share of its samples with advantage 0."""
    a = advantages.float()
    return {
        "advantage_mean": float(a.mean()),
        "advantage_std": float(a.std(unbiased=False)),
        "zero_advantage_ratio": float((a == 0).float().mean()),
    }


def update_metrics(batches: Mapping[int, PolicyBatch], gaps: Mapping[int, EngineGap]) -> dict[str, float]:
    """Per stepping agent, :func:`advantage_metrics` (a zero advantage: a group whose returns were all equal, no
    learning signal, trl's ``frac_reward_zero_std``) and a sequential update's mean weight M; the engine gap averaged
    over the agents (vLLM)."""
    metrics = {}
    for i, batch in batches.items():
        metrics.update(prefixed(f"agent_{i}/", advantage_metrics(batch.advantages)))
        if "sequential_weight" in batch.extras:
            metrics[f"agent_{i}/sequential_weight_mean"] = float(batch.extras["sequential_weight"].mean())
    measured = [g.total / g.tokens for g in gaps.values() if g.tokens]
    if measured:
        metrics["rollout/engine_logprob_gap"] = sum(measured) / len(batches)
    return metrics
