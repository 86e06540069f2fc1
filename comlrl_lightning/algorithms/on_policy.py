"""OnPolicyModule: what the MAGRPO family and the actor-critic family share.

Every training step resolves the experience its data module serves, a ``RolloutBatch``: the rollout trees of its
dataset items, sampled at that moment by the current weights through the team policy this module handed over when
the fit started (one engine, ``rollout/tree.py``; one record type, the tree ``Node``). The step adds what they hold
to a buffer and, once the buffer holds ``rollout_buffer_size`` records (or the epoch ends), trains on it: turn by
turn, shuffled, in mini-batches of ``train_batch_size`` records, one team update (one ``global_step``) per
mini-batch (``schedule``). The reference-KL penalty (``reference_kl_*``) is attached to the sampled completions
here, for every algorithm. The objective (``module.objective``, ``objective.py``) says what it computes on a fresh
rollout (``after_rollout``), what a record is (``records``), what it prepares per turn group (``prepare_group``)
and the losses of an update (``losses``).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from comlrl_lightning.agents import resolve_devices
from comlrl_lightning.agents.memory import check_update_memory
from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.fields import JointActionFields, ReferenceKLFields, RolloutFields, require
from comlrl_lightning.algorithms.objective import Objective
from comlrl_lightning.core.losses import kl_estimate
from comlrl_lightning.data.tasks import RolloutBatch, TaskDataModule
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


class OnPolicyModule(MultiAgentModule):
    """Sample with the current weights, buffer, train on the buffer in mini-batches (module docstring)."""

    field_groups = (*MultiAgentModule.field_groups, JointActionFields, RolloutFields, ReferenceKLFields)

    def init_state(self) -> None:
        super().init_state()
        self.buffer: list[Any] = []
        self.last_rollout: Rollout | None = None
        self.reference = None  # set by the ReferenceModels callback when the reference-KL penalty is on
        self.reward_override = None  # a reward that replaces the task reward in rollouts (MARLHF's learned one)
        self.sampling.keep_logprobs = self.needs_sampling_logprobs

    @property
    def needs_sampling_logprobs(self) -> bool:
        """Whether training reads the sampling policy's token log-probs (the reference KL in the reward; a
        PPO-style objective's old log-probs): then sampling keeps them (:meth:`sampling_logprobs`)."""
        reward_kl = self.uses_reference and self.reference_kl_placement == "reward"
        return self.objective.needs_sampling_logprobs or reward_kl

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
            reward_per_node=self.objective.reward_per_node,
            per_agent_rewards=self.objective.per_agent_rewards,
        )

    def check_config(self) -> None:
        super().check_config()
        require(
            self.num_turns == 1 or self.external_transition is not None,
            f"Multi-turn {self.algorithm_name} requires an external_transition.",
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
            self.buffer.extend(self.objective.records(rollout))
            sampled = self.rollout_metrics(rollout)
        last_batch = batch_idx + 1 >= self.trainer.num_training_batches
        drain = len(self.buffer) >= self.rollout_buffer_size or (last_batch and bool(self.buffer))
        updates = []
        if ranks.reduce_max(float(drain)):  # the ranks drain together, and make the same number of updates
            records, self.buffer = self.buffer, []
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
            data.attach_rollouts(self.policy)  # its loader now yields RolloutBatch-es of this policy

    @torch.no_grad()
    def collect_rollout(self, batch: RolloutBatch | Sequence[Mapping[str, Any]]) -> Rollout | None:
        """The step's experience, sampled now by the current weights: the data module's ``RolloutBatch``
        resolved, or (items from any other loader) the items' trees sampled here; rewarded and expanded. None for
        an empty batch (a rank's empty share in a data-parallel run)."""
        if not len(batch):
            self.count_env_steps(0)  # the other ranks' joint actions
            return None
        stamps = dict(policy_version=self.global_step, env_step=self.env_step, reward=self.rollout_reward())
        # Sampling changes nothing a checkpoint holds: Ctrl-C / SIGTERM may throw it away (runs/stop.py).
        with stop.discardable(f"the rollout of {len(batch)} task(s) after update {self.global_step}"):
            rollout = (
                batch.resolve(**stamps) if isinstance(batch, RolloutBatch) else self.policy.rollout(batch, **stamps)
            )
        self.count_env_steps(rollout.num_joint_actions)
        for phase, seconds in rollout.timings.items():
            self.record.phase_seconds[phase] += seconds
        with self.record.timed("score"):
            if self.corrects_engine_sampling:
                self.attach_training_logprobs(rollout.nodes)
            if self.reference is not None:
                self.attach_reference_kl(rollout.nodes)
            self.objective.after_rollout(rollout)
        self.last_rollout = rollout
        return rollout

    def rollout_reward(self):
        """The reward rollouts are scored with: the task reward, unless overridden (MARLHF's learned reward)."""
        return self.reward_override or self.task_reward

    def schedule(self, records: list[Any]) -> Iterator[list[Any]]:
        """The mini-batches of one drained buffer: ``objective.passes`` passes, each turn by turn (a mini-batch
        never mixes turns), shuffled, ``train_batch_size`` records each."""
        for _ in range(self.objective.passes):
            for turn in sorted({r.turn for r in records}):
                group = [r for r in records if r.turn == turn]
                self.objective.prepare_group(group)
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
        """The training model's log-probs of the fresh samples, under the weights that sampled them (one no-grad
        forward per agent): π_train of the importance weights, whatever the policy lag at the update."""
        for i in range(self.num_agents):
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

    # ------------------------------------------------------------------ the per-agent x micro-batch loop
    def agent_micro_batches(self, inputs: Sequence[ScoringInputs]) -> Iterator[tuple[int, int, int, Any]]:
        """The one loop of an update's forwards: agent by agent, micro-batch by micro-batch (``micro_batch_size``,
        ``micro_batch_tokens``; a prompt shared by K rows counted once), after the memory pre-check of every
        forward. Yields ``(agent, index, count, rows)``: the micro-batch's rows of ``inputs[agent]``, its index and
        the agent's number of micro-batches."""
        plans = [
            micro_batches(x, self.micro_batch_size, self.micro_batch_tokens, shares_prompts(self.policy_model(i)))
            for i, x in enumerate(inputs)
        ]
        self.check_update_fits(
            [
                (self.policy_model(i), trim_prompt_padding(select_rows(inputs[i], r)))
                for i, p in enumerate(plans)
                for r in p
            ]
        )
        for agent, plan in enumerate(plans):
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
        """Rewards of the fresh nodes per turn, completion lengths, and the reference KL when it is on."""
        metrics: dict[str, float] = {}
        for t, level in enumerate(rollout.levels):
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

    def batch_metrics(self, records: list[Any], objective: Objective) -> dict[str, float]:
        if objective is not self.objective:  # another stage's batch (MARLHF's pairs)
            return super().batch_metrics(records, objective)
        # Updates done before this one minus updates done at sampling: 0 = sampled by the weights being updated.
        lag = float(self.global_step - min(r.policy_version for r in records))
        return {"rollout/policy_lag": lag, **super().batch_metrics(records, objective)}

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
                **self.objective.node_record(node),
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
        self.buffer = [self.objective.record_from_state(s) for records in mine for s in records]
