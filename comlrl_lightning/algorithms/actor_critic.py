"""IAC and MAAC: multi-agent advantage actor-critic (docs/algorithms.md).

Per dataset item the agents play one episode through the same rollout engine as MAGRPO: every agent samples K
completions at turn 1 (single turn) or one completion per turn (multi-turn, K = 1, prompts of later turns from
``external_transition``). The team reward returns 1, K or N values per item and turn, expanded to one reward per
agent sample; with reference KL, r' = r − β·KL. A critic estimates values:

* **IAC** — one critic per agent: a separate critic LM with a value head (``use_separate_critic=True``) or a value
  head on the actor's own backbone (``False``). ``critic_type="v"``: V(h_i) from agent i's prompt;
  ``"q"``: Q(h_i, a_i) from its prompt and completion.
* **MAAC** — one centralized critic over the joint text: V(h) from all prompts, or Q(h, a) from all prompts and
  the joint action.

Targets: single turn r'; multi-turn TD(0) r'_t + γ·V_old(h_{t+1}) (last executed turn: r'_t). Advantages
A = target − V_old (rollout-time values), normalised per agent and turn group. Each update (one optimizer
step, one ``global_step``) minimises, over a mini-batch of joint samples,

    Σ_i  Σ_t w·ρ·(−Â·log π_i)  +  value_loss_coef · value_loss

with the value loss of every critic on its targets (PPO-style clipping with ``value_clip_range`` only for a value
head on the actor, as CoMLRL). ρ = 1, or the engine correction's π_train / π_engine (capped or masked) when a vLLM
engine sampled and ``vllm_importance_sampling_correction`` is on. No ratio, no policy clipping, no entropy bonus, no
GAE.

MAAC's shared critic is stepped **once per joint mini-batch**, on the joint samples of that mini-batch, with the
team target (the mean of the agents' targets): CoMLRL steps it once per agent on duplicated targets, an N-fold
step on the same data. IAC's critics each learn their own agent's targets.

Where each piece lives. The update is ``OnPolicyModule.update`` (on_policy.py); this module's :class:`IAC` says what
a record is (a :class:`JointSample`), computes values and targets on a fresh rollout (``after_rollout``) and the
advantages per turn group (``prepare_group``), builds each agent's :class:`PolicyBatch` (step 2, ``agent_batch``: its
rows, advantages, stored log-probs, value targets) and scores it with the critic's values (step 3, ``score``); the
objective :class:`ActorCritic` is the loss of those tensors. MAAC's joint critic learns in ``MAAC.extra_losses`` with
:meth:`JointCritic.critic_loss`. The critics are a model part, :class:`Critics` (``module.critics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comlrl_lightning.agents import CausalLMWithValueHead, check_model_sources, load_agents, resolve_devices
from comlrl_lightning.agents.memory import enable_checkpointing
from comlrl_lightning.agents.sharding import full_state_dicts
from comlrl_lightning.algorithms.evaluation import Evaluation, turn_table
from comlrl_lightning.algorithms.fields import CriticFields, require
from comlrl_lightning.algorithms.objective import ModelPart
from comlrl_lightning.algorithms.on_policy import OnPolicyModule, PolicyBatch
from comlrl_lightning.algorithms.reinforce import EngineCorrection, GroupRelative, KLTerm
from comlrl_lightning.algorithms.team import load_models, team_placement, trainable_parameters
from comlrl_lightning.core.advantages import critic_advantages, discounted_returns, td_targets
from comlrl_lightning.core.losses import assert_finite, policy_gradient_loss, token_loss_weights, value_loss
from comlrl_lightning.rollout.sampling import (
    ScoringInputs,
    build_scoring_inputs,
    collate_rows,
    micro_batches,
    take,
)
from comlrl_lightning.rollout.tree import Node, Rollout, episode
from comlrl_lightning.runs import ranks


@dataclass
class JointSample:
    """Joint action ``k`` of a node: what IAC/MAAC buffer, count (``rollout_buffer_size``) and train on. Its
    read-only views (``agents``, ``joint_target``, ...) give the per-sample fields CoMLRL's rollout samples had."""

    node: Node
    k: int

    @property
    def turn(self) -> int:
        return self.node.turn

    @property
    def policy_version(self) -> int:
        return self.node.policy_version

    @property
    def generation_idx(self) -> int:
        return self.k

    @property
    def env_step(self) -> int:
        """The env step this joint action counted as (joint actions are counted one by one)."""
        return self.node.env_step - self.node.rewards.shape[0] + self.k + 1

    @property
    def metadata(self) -> dict[str, Any]:
        return {"item_index": self.node.item_index}

    @property
    def agents(self) -> list[AgentStep]:
        return [AgentStep(self, i) for i in range(len(self.node.agents))]

    @property
    def critic_ids(self) -> Tensor | None:
        return None if self.node.critic_ids is None else self.node.critic_ids[self.k]

    @property
    def joint_target(self) -> float:
        """The team target MAAC's critic learns: the mean of the agents' targets."""
        return float(self.node.targets[:, self.k].mean())

    @property
    def joint_old_value(self) -> float:
        return float(self.node.values[0, self.k])

    def state_dict(self) -> dict[str, Any]:
        return {"node": self.node.state_dict(), "k": self.k}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "JointSample":
        return cls(Node.from_state_dict(state["node"]), int(state["k"]))


class AgentStep:
    """Agent ``agent_idx``'s part of a joint sample (a view of the node's tables; ``metrics_callback`` gets a list
    of these, with CoMLRL's rollout-sample field names)."""

    def __init__(self, sample: JointSample, agent_idx: int):
        self.sample, self.agent_idx = sample, agent_idx
        self._agent, self._node, self._k = sample.node.agents[agent_idx], sample.node, sample.k

    def _table(self, name: str) -> float:
        table = getattr(self._node, name)
        return 0.0 if table is None else float(table[self.agent_idx, self._k])

    prompt = property(lambda self: self._agent.prompt)
    completion = property(lambda self: self._agent.texts[self._k])
    prompt_ids = property(lambda self: self._agent.prompt_ids)
    completion_ids = property(lambda self: self._agent.completion_ids[self._k])
    completion_mask = property(lambda self: self._agent.completion_mask[self._k])
    environment_reward = property(lambda self: self._table("agent_rewards"))
    reward = property(lambda self: self._table("shaped_rewards"))  # r' = r − β·KL
    reference_kl = property(
        lambda self: 0.0 if self._agent.sequence_kl is None else float(self._agent.sequence_kl[self._k])
    )
    old_value = property(lambda self: self._table("values"))
    value_target = property(lambda self: self._table("targets"))
    returns = property(lambda self: self._table("mc_returns"))
    advantage = property(lambda self: self._table("targets") - self._table("values"))
    normalized_advantage = property(lambda self: self._table("advantages"))


class CriticEvaluation(Evaluation):
    """An actor-critic's evaluation also reports the critics: values and targets per turn of each episode."""

    @torch.no_grad()
    def rollout(self, items: Sequence[Mapping[str, Any]]) -> Rollout:
        rollout = super().rollout(items)
        self.module.after_rollout(rollout)  # values and targets
        return rollout

    def record_of(self, rollout: Rollout, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        record = super().record_of(rollout, items)
        for name in ("values", "targets"):
            record[name] = turn_table(rollout, len(items), self.turns, lambda n, t=name: getattr(n, t)[:, 0].mean())
        return record

    def metrics(self, records: list[dict[str, Any]]) -> dict[str, float]:
        metrics = super().metrics(records)
        values, targets = self.table(records, "values"), self.table(records, "targets")
        for t in range(values.shape[1]):
            metrics[f"eval/turn_{t + 1}/value_pred_mean"] = float(values[:, t].mean())
            metrics[f"eval/turn_{t + 1}/value_target_mean"] = float(targets[:, t].mean())
        return metrics


# ---------------------------------------------------------------------------------------------------- the objective
class ActorCritic(GroupRelative):
    """IAC's loss of one agent's micro-batch, a function of tensors (module docstring):

        loss = Σ_{b,t} w_{b,t}·ρ_{b,t}·(−Â_b · log π(y_{b,t}))  +  value_loss_coef · L_V
        L_V  = value_loss(V, target, V_old, value_clip_range) · Σ_b s_b

    ``logp`` [B, T] are the fresh log-probs, ``batch.advantages`` Â [B], ``batch.weights`` w [B, T]
    (``loss_aggregation`` over the whole mini-batch), ρ the engine correction's importance weights
    (:meth:`GroupRelative.weights`; 1 without it), ``batch.values`` V [B] the agent's critic with grad, and in
    ``batch.extras``: ``targets`` [B], ``old_values`` V_old [B] (rollout-time) and ``value_shares`` s [B] (each row's
    share of the mini-batch, 1/rows: ``value_loss`` is a mean over the micro-batch, so the micro-batches' terms add
    up to the mini-batch mean). Value clipping (``value_clip_range``) applies to a value head on the actor only: the
    module passes None otherwise. Metrics ``policy_loss`` and ``value_loss`` (L_V, before the coefficient)."""

    def __init__(
        self,
        value_loss_coef: float,
        value_clip_range: float | None = None,
        kl: KLTerm | None = None,
        correction: EngineCorrection | None = None,
    ):
        super().__init__(kl, correction)
        self.value_loss_coef, self.value_clip_range = value_loss_coef, value_clip_range

    def loss(self, logp: Tensor, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        policy, metrics = self.policy_loss(logp, batch)
        value = self.value_term(
            batch.values, batch.extras["targets"], batch.extras.get("old_values"), batch.extras["value_shares"]
        )
        return policy + self.value_loss_coef * value.to(policy.device), {**metrics, "value_loss": value.detach()}

    def policy_loss(self, logp: Tensor, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The REINFORCE part, Σ w·ρ·(−Â·log π) (with the reference KL when it is in the loss; IAC keeps it in the
        reward), and its metric ``policy_loss``."""
        weights = self.weights(logp, batch)
        policy, _ = policy_gradient_loss(logp, batch.advantages.to(logp.device), weights)
        return self.with_kl(policy, {"policy_loss": policy.detach()}, logp, batch, weights)

    def value_term(self, values: Tensor, targets: Tensor, old_values: Tensor | None, shares: Tensor) -> Tensor:
        """L_V of ``values`` [B] (with grad): the (clipped) squared error's mean over the rows times their share of the
        mini-batch, Σ_b s_b."""
        values = values.float()
        old = None if old_values is None else old_values.to(values.device)
        loss = value_loss(values, targets.to(values.device), old, self.value_clip_range)
        return loss * float(shares.sum())


class JointCritic(ActorCritic):
    """MAAC's objective: each agent's loss is the policy part only (no critic of its own); the one joint critic's loss
    is :meth:`critic_loss`, on the team target, which ``MAAC.extra_losses`` back-propagates per micro-batch."""

    def loss(self, logp: Tensor, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch)

    def critic_loss(self, values: Tensor, targets: Tensor, shares: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """value_loss_coef · L_V of the joint critic's ``values`` [B] on the team ``targets`` [B] (the mean of the
        agents' targets; never clipped); metric ``value_loss`` (L_V)."""
        value = self.value_term(values, targets, None, shares)
        return self.value_loss_coef * value, {"value_loss": value.detach()}


# ---------------------------------------------------------------------------------------------------- the critics
class Critics(ModelPart):
    """The critics a module trains besides its agents, registered as ``module.critics`` (checkpoint keys
    ``critics.*``): one separate critic LM with a value head per source (IAC: one per agent; MAAC: one over the joint
    text), or none (``sources`` empty: IAC's value heads sit on the actors, saved with them).

    Args:
        sources: one critic source per critic (factory name, hub id, path or model; None: the LoRA team's base).
        learning_rate: their parameter groups' rate (``critic_learning_rate``).
        field: the field the sources came from, for error messages (``critics`` or ``critic_model``).
        value_head_hidden_dim: hidden width of each critic's value head (``critic_value_head_hidden_dim``).
        lora_base: a LoRA team's base source; critics whose source is it (or None) are an adapter ``critic_j`` plus a
            value head on the team's one base instead of a full copy.
        gradient_checkpointing: ``model_config.gradient_checkpointing``.
        placement: each critic's device when a fit starts (None: where Lightning put the module).
        centralized: MAAC's joint critic, exported as ``critic/`` (IAC's: ``agent_{j}/critic/``).
    """

    name = "critics"

    def __init__(
        self,
        sources: Sequence[Any],
        learning_rate: float,
        field: str = "critic_model",
        value_head_hidden_dim: int | None = None,
        lora_base: str | None = None,
        gradient_checkpointing: bool = False,
        placement: Sequence[torch.device] | None = None,
        centralized: bool = False,
    ):
        super().__init__()
        self.sources, self.rate, self.field = list(sources), learning_rate, field
        self.value_head_hidden_dim, self.lora_base = value_head_hidden_dim, lora_base
        self.gradient_checkpointing, self.placement, self.centralized = gradient_checkpointing, placement, centralized

    def build(self, tokenizers: list[Any], agents: nn.ModuleList) -> nn.ModuleList:
        if not self.sources:  # value heads on the actors
            return nn.ModuleList()
        count, head = len(self.sources), self.value_head_hidden_dim
        if self.lora_base is not None and all(s in (None, self.lora_base) for s in self.sources):
            team = agents[0].team  # critics as adapters + value heads on the team's one base
            views = [team.add_view(f"critic_{j}") for j in range(count)]
            return nn.ModuleList([CausalLMWithValueHead(v, value_head_hidden_dim=head) for v in views]).train()
        models, _ = load_agents(
            self.sources,
            num_agents=count,
            tokenizers=tokenizers[:1] * count if any(not isinstance(s, str) for s in self.sources) else None,
            field=self.field,
        )
        critics = nn.ModuleList([CausalLMWithValueHead(c, value_head_hidden_dim=head) for c in models]).train()
        for i, critic in enumerate(critics):
            if self.gradient_checkpointing:
                enable_checkpointing(critic)
            vocab, tokens = critic.model.get_input_embeddings().num_embeddings, len(tokenizers[i])
            require(
                vocab >= tokens,
                f"critic {i} has {vocab} token embeddings but the agent's tokenizer has {tokens}: "
                "critics read the agent's token ids, so they must share its tokenizer (use the "
                "same model family).",
            )
        return critics

    def learning_rate(self) -> float:
        return self.rate

    def metric_name(self, index: int) -> str:
        return f"critic_{index}"

    def parameter_groups(self) -> list[dict[str, Any]]:
        """One group per critic; a LoRA critic's are its own adapter's and value head's (the base is shared)."""
        return [
            {"params": trainable_parameters(critic), "lr": self.rate, "name": self.metric_name(j), "agents": []}
            for j, critic in enumerate(self.models())
        ]

    def place(self) -> None:
        if self.placement is not None:
            for critic, device in zip(self.models(), self.placement):
                critic.to(device)

    def save_pretrained(self, root: Path, tokenizers: list[Any]) -> None:
        """IAC ``agent_{j}/critic/``, MAAC ``critic/`` (a value head on the actor is saved with the actor)."""
        critics = self.models()
        states = full_state_dicts(critics)  # sharded critics: gathered whole (on every rank)
        for j, critic in enumerate(critics if ranks.rank() == 0 else ()):  # data-parallel: written once
            target = root / "critic" if self.centralized else root / f"agent_{j}" / "critic"
            critic.save_pretrained(target, state_dict=states[j])
            tokenizers[j].save_pretrained(target)


def with_value_heads(models: list[nn.Module], hidden_dim: int | None) -> list[nn.Module]:
    """Each distinct model wrapped once in a :class:`CausalLMWithValueHead` (agents sharing weights share the
    wrapper): IAC's critics when they are value heads on the actors."""
    wrapped: dict[int, nn.Module] = {}
    for model in models:
        if id(model) not in wrapped:
            wrapped[id(model)] = CausalLMWithValueHead(model, value_head_hidden_dim=hidden_dim).train()
    return [wrapped[id(m)] for m in models]


def critic_view(inputs: ScoringInputs, critic_type: str) -> ScoringInputs:
    """What a per-agent critic reads of an agent's rows: ``q`` all of prompt + completion, ``v`` the (left-padded)
    prompt columns only."""
    if critic_type == "q":
        return inputs
    width = inputs.input_ids.shape[1] - inputs.completion_ids.shape[1]
    return ScoringInputs(
        inputs.input_ids[:, :width],
        inputs.attention_mask[:, :width],
        inputs.position_ids[:, :width],
        inputs.completion_ids[:, :0],
        inputs.completion_mask[:, :0],
    )


def values_of(model: nn.Module, inputs: ScoringInputs) -> Tensor:
    """The values [B] of a model with a value head at each row's last real token (the last prompt token without a
    completion), with grad when enabled."""
    width = inputs.input_ids.shape[1] - inputs.completion_ids.shape[1]
    positions = width + inputs.completion_mask.sum(-1) - 1
    device = next(model.parameters()).device
    return model.values_at(
        inputs.input_ids.to(device),
        inputs.attention_mask.to(device),
        inputs.position_ids.to(device),
        positions.to(device),
    )


def joint_rows(samples: Sequence[JointSample], agent: int, name: str, inputs: ScoringInputs) -> Tensor | None:
    """The per-token values ``name`` stored with agent ``agent``'s samples ([K, T] each), one row per joint sample
    (its k-th), right-padded to the width of ``inputs``; None when the samples store none."""
    stored = [getattr(s.node.agents[agent], name) for s in samples]
    if stored[0] is None:
        return None
    width = inputs.completion_ids.shape[1]
    return torch.stack([F.pad(rows[s.k], (0, width - rows.shape[1])) for rows, s in zip(stored, samples)])


# ---------------------------------------------------------------------------------------------------- the modules
class IAC(OnPolicyModule):
    """Independent actor-critic: one critic per agent (separate critic LM or a value head on the actor).

    ``rollout_buffer_size`` / ``train_batch_size`` count joint samples (one completion per agent each). Critics
    read the agent's token ids, so a separate critic must share the agent's tokenizer.

    Args:
        num_generations: samples per agent per prompt (IAC's default: 1; multi-turn needs 1).
        discount: gamma of the TD(0) targets (IAC's default: 0.9, as CoMLRL).
        top_k: sample among the k most likely tokens (IAC's default: all, as CoMLRL).
        rollout_buffer_size: joint samples collected before an update (IAC's default: 8, as CoMLRL).
    """

    algorithm_name = "IAC"
    field_groups = (*OnPolicyModule.field_groups, CriticFields)
    field_defaults = {"num_generations": 1, "discount": 0.9, "top_k": None, "rollout_buffer_size": 8}
    objective_class = ActorCritic
    evaluation_class = CriticEvaluation
    reward_per_node = True
    centralized: ClassVar[bool] = False  # MAAC: one critic over the joint text

    # ------------------------------------------------------------------ configuration and models
    def check_config(self) -> None:
        super().check_config()
        # Derived before the hyper-parameters are saved, so that they record what the run uses.
        self.use_separate_critic = self.use_separate_critic or self.centralized
        self.value_clip_range = None if self.use_separate_critic else self.value_clip_range
        self.critic_learning_rate = self.critic_learning_rate or self.team.learning_rates[0]
        name, separate, count, given = (
            self.algorithm_name,
            self.use_separate_critic,
            self.num_critics,
            self.critic_sources,
        )
        require(
            self.num_turns == 1 or self.num_generations == 1,
            f"Multi-turn {name} currently supports num_generations == 1.",
        )
        require(self.joint_mode == "aligned", f"{name} supports joint_mode aligned only (got {self.joint_mode!r}).")
        require(
            self.reference_kl_placement == "reward",
            f"{name} applies the reference KL to the reward only (reference_kl_placement must be reward).",
        )
        require(self.collaboration is None, f"{name} does not support collaboration_mode centralized.")
        require(separate or given is None, "critics can only be provided when use_separate_critic=True.")
        where = f"for {name}" if self.centralized else "when use_separate_critic=True"
        require(
            not separate or self.critic_model is not None or bool(given) or self.lora is not None,
            f"Either critic_model or critics must be provided {where}.",
        )
        if given is not None:
            require(
                len(given) == count,
                f"critics length ({len(given)}) must match 1 critic for {name}."
                if self.centralized
                else f"critics length ({len(given)}) must match the number of agents ({count}).",
            )
        mp = self.parallel_training == "mp"
        require(
            not (mp and separate and self.critic_devices is None),
            "parallel_training='mp' requires explicit critic_devices.",
        )
        if separate:
            check_model_sources(
                list(given) if given is not None else self.critic_model,
                "critics" if given is not None else "critic_model",
            )
        self.critic_placement = self.place_critics(mp)
        self.critic_part = self.make_critics()

    def place_critics(self, mp: bool) -> list[torch.device] | None:
        """Each critic's device: ``critic_devices`` under ``parallel_training='mp'``; otherwise actors and critics
        share ONE device, the first of ``agent_devices``, else of ``critic_devices`` (None: Lightning's)."""
        if mp:
            if self.critic_devices is None:
                return None
            return resolve_devices(self.critic_devices, self.num_critics, kind="critic_devices")
        if self.team.devices is None:
            self.team.devices = team_placement(self.critic_devices, self.num_agents, "critic_devices")
        return None if self.team.devices is None else [self.team.devices[0]] * self.num_critics

    def make_critics(self) -> Critics:
        """The critics' part: one separate critic per source (``critics``, else ``critic_model`` per critic), or
        none (value heads on the actors)."""
        given, count = self.critic_sources, self.num_critics
        sources = (
            (list(given) if given is not None else [self.critic_model] * count) if self.use_separate_critic else []
        )
        return Critics(
            sources,
            self.critic_learning_rate,
            field="critics" if given is not None else "critic_model",
            value_head_hidden_dim=self.critic_value_head_hidden_dim,
            lora_base=None if self.lora is None else self.lora["base"],
            gradient_checkpointing=self.team.gradient_checkpointing,
            placement=self.critic_placement,
            centralized=self.centralized,
        )

    @property
    def num_critics(self) -> int:
        return 1 if self.centralized else self.num_agents

    def model_parts(self) -> list[Critics]:
        return [self.critic_part]

    def configure_model(self) -> None:
        """Load the team and the critics (``team.load_models``); with ``use_separate_critic: false`` each distinct
        actor is wrapped in a value head first (the critics' part is then empty)."""
        load_models(self, None if self.use_separate_critic else self.wrap_agents)

    def wrap_agents(self, models: list[nn.Module]) -> list[nn.Module]:
        """The actors with a value head each (``value_head_hidden_dim``): the critics of ``use_separate_critic:
        false``."""
        return with_value_heads(models, self.value_head_hidden_dim)

    @property
    def critics(self) -> nn.ModuleList:
        """The critics (loading the team first if it has not loaded yet, as ``agents`` does); empty when the value
        heads sit on the actors."""
        if Critics.name not in self._modules:
            self.configure_model()
        return self._modules[Critics.name]

    def critic_for(self, critic: int) -> nn.Module:
        """Critic ``critic``'s model: MAAC's joint critic, IAC's separate critic, or the actor with its value head."""
        if self.centralized:
            return self.critics[0]
        return self.critics[critic] if self.use_separate_critic else self.agents[critic]

    # ------------------------------------------------------------------ values and targets at sampling
    def records(self, rollout: Rollout) -> list[JointSample]:
        return [JointSample(n, k) for n in rollout.nodes for k in range(n.rewards.shape[0])]

    def record_from_state(self, state: dict[str, Any]) -> JointSample:
        return JointSample.from_state_dict(state)

    @torch.no_grad()
    def after_rollout(self, rollout: Rollout) -> None:
        """Shaped rewards r' = r − β·KL, rollout-time values, TD(0) targets (multi-turn) or r' and MC returns."""
        nodes = rollout.nodes
        for node in nodes:
            kl = torch.stack([a.sequence_kl for a in node.agents]) if node.agents[0].sequence_kl is not None else 0.0
            node.shaped_rewards = node.agent_rewards - self.reference_kl_coef * kl  # [N, J]
        if self.centralized:
            self.tokenize_joint_texts(nodes)
        samples = self.records(rollout)
        values = torch.stack([self.old_values(c, samples) for c in range(self.num_critics)])  # [C, S]
        offset = 0
        for node in nodes:
            J = node.rewards.shape[0]
            node.values = values[:, offset : offset + J].expand(self.num_agents, J).clone()
            offset += J
        for root in rollout.levels[0] if rollout.levels else ():  # each item's episode (K = 1 after turn 1)
            turns = list(episode(root))
            rewards = torch.stack([node.shaped_rewards for node in turns], -1)  # [N, J, T]
            values = torch.stack([node.values for node in turns], -1)
            targets = td_targets(rewards, values.roll(-1, -1), self.discount)
            returns = discounted_returns(rewards, self.discount)
            for t, node in enumerate(turns):
                node.targets, node.mc_returns = targets[..., t], returns[..., t]

    def old_values(self, critic: int, samples: Sequence[JointSample]) -> Tensor:
        """V_old: critic ``critic``'s values [S] of ``samples`` in eval mode (CPU, float32)."""
        model = self.critic_for(critic)
        was_training = model.training
        model.eval()
        try:
            return values_of(model, self.critic_inputs(critic, samples)).float().cpu()
        finally:
            model.train(was_training)

    def tokenize_joint_texts(self, nodes: Sequence[Node]) -> None:
        """MAAC's critic reads ``[Agent i] prompt`` blocks (plus the joint action for Q), one text per action."""
        tok = self.tokenizers[0]
        texts = [
            self.joint_critic_text(
                [a.prompt for a in n.agents], [a.texts[k] for a in n.agents] if self.critic_type == "q" else None
            )
            for n in nodes
            for k in range(n.rewards.shape[0])
        ]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        offset = 0
        for node in nodes:
            J = node.rewards.shape[0]
            node.critic_ids = [torch.tensor(x, dtype=torch.long) for x in ids[offset : offset + J]]
            offset += J

    @staticmethod
    def joint_critic_text(step_prompts: Sequence[str], completions: Sequence[str] | None) -> str:
        text = "\n\n".join(f"[Agent {i}] {p}" for i, p in enumerate(step_prompts))
        if completions is not None:
            text += "\n\n[Joint Action]\n\n" + "\n\n".join(
                f"[Agent {i} action]\n{c}" for i, c in enumerate(completions)
            )
        return text

    def sample_inputs(self, agent: int, samples: Sequence[JointSample]) -> ScoringInputs:
        """Agent ``agent``'s rows of joint ``samples`` (one completion each). Not ``agent_inputs``: that one
        (``OnPolicyModule``) takes nodes and scores every completion of them, e.g. for the reference KL."""
        rows = [(s.node.agents[agent], s.k) for s in samples]
        return collate_rows(
            [a.prompt_ids for a, _ in rows],
            [a.completion_ids[k : k + 1] for a, k in rows],
            [a.completion_mask[k : k + 1] for a, k in rows],
            self.tokenizers[agent].pad_token_id,
        )

    def critic_inputs(self, critic: int, samples: Sequence[JointSample]) -> ScoringInputs:
        """What critic ``critic`` reads of ``samples``: MAAC the joint text, IAC its agent's rows (``critic_view``)."""
        if self.centralized:
            empty = torch.zeros((len(samples), 0), dtype=torch.long)
            ids = [s.node.critic_ids[s.k] for s in samples]
            return build_scoring_inputs(ids, empty, empty.bool(), self.tokenizers[0].pad_token_id)
        return critic_view(self.sample_inputs(critic, samples), self.critic_type)

    # ------------------------------------------------------------------ the update (OnPolicyModule.update)
    def prepare_group(self, group: list[JointSample]) -> None:
        """Â = normalize(target − V_old) per agent over the turn group (computed once per drained buffer)."""
        for node in {id(s.node): s.node for s in group}.values():
            node.advantages = torch.zeros_like(node.targets)
        for i in range(self.num_agents):
            targets = torch.stack([s.node.targets[i, s.k] for s in group])
            old = torch.stack([s.node.values[i, s.k] for s in group])
            for s, a in zip(group, critic_advantages(targets, old, self.advantage_normalization)):
                s.node.advantages[i, s.k] = a

    def agent_batch(self, samples: list[JointSample], agent: int) -> PolicyBatch:
        """Step 2: agent ``agent``'s rows of a mini-batch of joint samples (one completion each), their normalised
        advantages, the stored log-probs the engine correction reads (π_old when kept, the engine's), and for its
        critic the targets, the rollout-time values and each row's share of the mini-batch."""
        inputs = self.sample_inputs(agent, samples)
        rows = len(samples)
        extras = {
            "targets": torch.stack([s.node.targets[agent, s.k] for s in samples]),
            "old_values": torch.stack([s.node.values[agent, s.k] for s in samples]),
            "value_shares": torch.full((rows,), 1.0 / rows, dtype=torch.float64),
        }
        return PolicyBatch(
            inputs,
            torch.stack([s.node.advantages[agent, s.k] for s in samples]),
            token_loss_weights(inputs.completion_mask, self.loss_aggregation, self.max_new_tokens),
            None,  # the reference KL is in the reward (check_config)
            joint_rows(samples, agent, "sampling_logprobs", inputs) if self.keeps_old_logprobs else None,
            joint_rows(samples, agent, "engine_logprobs", inputs),
            fresh=torch.tensor([s.policy_version == self.global_step for s in samples]),
            extras=extras,
        )

    def score(self, agent: int, batch: PolicyBatch) -> Tensor:
        """Step 3's forward: the agent's log-probs, and (IAC) its critic's values of the same rows into
        ``batch.values``, with grad. MAAC's joint critic learns in :meth:`MAAC.extra_losses`."""
        logp = super().score(agent, batch)
        if not self.centralized:
            batch.values = values_of(self.critic_for(agent), critic_view(batch.inputs, self.critic_type))
        return logp

    def stage_models(self, agents: Sequence[int]) -> list[Any]:
        """A sequential stage steps its agents and, IAC, their separate critics (they learn in the agents' forwards)."""
        models = super().stage_models(agents)
        if self.use_separate_critic and not self.centralized:
            models += [self.critics[i] for i in agents]
        return models

    def extra_losses(self, samples: list[JointSample], step: Any) -> dict[str, Any]:
        """No forward of its own (each critic learned with its agent); the turn's losses as CoMLRL logs them."""
        return self.turn_losses(samples, step, ("policy_loss", "value_loss"))

    def turn_losses(self, samples: list[JointSample], step: Any, names: Sequence[str]) -> dict[str, float]:
        """``turn_t/<name>`` = Σ_i ``agent_i/<name>`` / N: the agents' losses of the update (summed over their
        micro-batches by ``step``), averaged over the agents, under the mini-batch's turn (one per mini-batch)."""
        turn, n = samples[0].turn + 1, self.num_agents
        return {
            f"turn_{turn}/{name}": sum(float(step.sums.get(f"agent_{i}/{name}", 0.0)) for i in range(n)) / n
            for name in names
        }

    def batch_metrics(self, samples: list[JointSample]) -> dict[str, float]:
        turn = samples[0].turn + 1

        def mean(table: str) -> float:
            return float(torch.stack([getattr(s.node, table)[:, s.k] for s in samples]).mean())

        metrics = {
            f"turn_{turn}/reward_mean": mean("shaped_rewards"),
            f"turn_{turn}/expected_return": mean("mc_returns"),
            f"turn_{turn}/value_pred_mean": mean("values"),
            f"turn_{turn}/value_target_mean": mean("targets"),
        }
        if self.metrics_callback is not None:
            for key, value in (self.metrics_callback(self.agent_steps(samples)) or {}).items():
                metrics[f"turn_{turn}/{key}"] = float(value)
        return {**super().batch_metrics(samples), **metrics}

    @staticmethod
    def agent_steps(samples: Sequence[JointSample]) -> list[AgentStep]:
        """Per-agent views of joint samples (``metrics_callback``'s argument)."""
        return [step for s in samples for step in s.agents]

    def node_record(self, node: Node) -> dict[str, Any]:
        return {"agent_rewards": node.agent_rewards.tolist(), "values": node.values.tolist()}


class MAAC(IAC):
    """Multi-agent actor-critic with one centralized critic over the joint text (``critic_type`` v or q).

    Same fields as ``IAC`` except the critic is always a separate model (``critic_model`` or a one-element
    ``critics``; tokenized with agent 0's tokenizer) and ``value_clip_range`` does not apply.
    """

    algorithm_name = "MAAC"
    objective_class = JointCritic
    centralized = True
    per_agent_rewards = False

    def extra_losses(self, samples: list[JointSample], step: Any) -> dict[str, Any]:
        """The shared critic, after the agents' forwards: on the team target (the mean of the agents' targets), over
        the whole joint mini-batch, micro-batch by micro-batch (rows planned as agent 0's; the critic reads whole
        rows). Logged ``critic/value_loss`` and ``turn_t/value_loss``."""
        turn, rows = samples[0].turn + 1, len(samples)
        plan = micro_batches(
            self.sample_inputs(0, samples), self.micro_batch_size, self.micro_batch_tokens, share_prompts=False
        )
        for part_rows in plan:
            part = take(samples, part_rows)
            values = values_of(self.critics[0], self.critic_inputs(0, part))
            targets = torch.stack([s.node.targets[:, s.k].mean() for s in part])
            loss, terms = self.objective.critic_loss(values, targets, torch.full((len(part),), 1.0 / rows))
            assert_finite("value loss", loss, step=self.global_step, agent="critic")
            value = terms["value_loss"]
            step.backward(loss, {"loss": loss, "critic/value_loss": value, f"turn_{turn}/value_loss": value})
        return self.turn_losses(samples, step, ("policy_loss",))
