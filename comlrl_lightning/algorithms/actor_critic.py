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

    Σ_i  Σ_t w·(−Â·log π_i)  +  value_loss_coef · value_loss

with the value loss of every critic on its targets (PPO-style clipping with ``value_clip_range`` only for a value
head on the actor, as CoMLRL). No ratio, no policy clipping, no entropy bonus, no GAE.

MAAC's shared critic is stepped **once per joint mini-batch**, on the joint samples of that mini-batch, with the
team target (the mean of the agents' targets): CoMLRL steps it once per agent on duplicated targets, an N-fold
step on the same data. IAC's critics each learn their own agent's targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from comlrl_lightning.agents import CausalLMWithValueHead, check_model_sources, load_agents, resolve_devices
from comlrl_lightning.agents.sharding import full_state_dicts
from comlrl_lightning.algorithms.evaluation import Evaluation, turn_table
from comlrl_lightning.algorithms.fields import CriticFields, require
from comlrl_lightning.algorithms.objective import Objective
from comlrl_lightning.algorithms.on_policy import OnPolicyModule
from comlrl_lightning.algorithms.team import apply_gradient_checkpointing, team_placement, trainable_parameters
from comlrl_lightning.core.advantages import critic_advantages, discounted_returns, td_targets
from comlrl_lightning.core.losses import assert_finite, policy_gradient_loss, token_loss_weights, value_loss
from comlrl_lightning.rollout.sampling import (
    ScoringInputs,
    build_scoring_inputs,
    collate_rows,
    micro_batches,
    select_rows,
    take,
    token_logprobs,
    trim_prompt_padding,
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
        self.module.objective.after_rollout(rollout)  # values and targets
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


class ActorCritic(Objective):
    """IAC's objective (module docstring): one critic per agent (a separate critic LM or a value head on the
    actor), rollout-time values and targets, advantages per turn group, the policy and value losses."""

    evaluation_class = CriticEvaluation
    reward_per_node = True
    centralized = False  # MAAC: one critic over the joint text (JointCritic)

    def check(self) -> None:
        m = self.host
        # Derived before the hyper-parameters are saved, so that they record what the run uses.
        m.use_separate_critic = m.use_separate_critic or self.centralized
        m.value_clip_range = None if m.use_separate_critic else m.value_clip_range
        m.critic_learning_rate = m.critic_learning_rate or m.team.learning_rates[0]
        name, separate = m.algorithm_name, m.use_separate_critic
        require(
            m.num_turns == 1 or m.num_generations == 1, f"Multi-turn {name} currently supports num_generations == 1."
        )
        require(m.joint_mode == "aligned", f"{name} supports joint_mode aligned only (got {m.joint_mode!r}).")
        require(
            m.reference_kl_placement == "reward",
            f"{name} applies the reference KL to the reward only (reference_kl_placement must be reward).",
        )
        require(m.collaboration is None, f"{name} does not support collaboration_mode centralized.")
        require(separate or m.critic_sources is None, "critics can only be provided when use_separate_critic=True.")
        where = f"for {name}" if self.centralized else "when use_separate_critic=True"
        require(
            not separate or m.critic_model is not None or bool(m.critic_sources) or m.lora is not None,
            f"Either critic_model or critics must be provided {where}.",
        )
        count, given = self.num_critics, m.critic_sources
        if given is not None:
            require(
                len(given) == count,
                f"critics length ({len(given)}) must match 1 critic for {name}."
                if self.centralized
                else f"critics length ({len(given)}) must match the number of agents ({count}).",
            )
        mp = m.parallel_training == "mp"
        require(
            not (mp and separate and m.critic_devices is None),
            "parallel_training='mp' requires explicit critic_devices.",
        )
        if separate:
            check_model_sources(
                list(given) if given is not None else m.critic_model, "critics" if given is not None else "critic_model"
            )
        if mp:
            self.critic_placement = (
                resolve_devices(m.critic_devices, count, kind="critic_devices")
                if m.critic_devices is not None
                else None
            )
        else:  # actors and critics on ONE device, the first of agent_devices, else of critic_devices
            if m.team.devices is None:
                m.team.devices = team_placement(m.critic_devices, m.num_agents, "critic_devices")
            self.critic_placement = None if m.team.devices is None else [m.team.devices[0]] * count

    # ------------------------------------------------------------------ models
    def build_models(self) -> None:
        m = self.host
        if not m.use_separate_critic:  # a value head on each actor's backbone
            wrapped: dict[int, CausalLMWithValueHead] = {}
            for model in m.agents:
                if id(model) not in wrapped:
                    wrapped[id(model)] = CausalLMWithValueHead(model, value_head_hidden_dim=m.value_head_hidden_dim)
            m._modules["agents"] = nn.ModuleList([wrapped[id(a)] for a in m.agents]).train()
            m._modules["critics"] = nn.ModuleList()
            return
        count, given = self.num_critics, m.critic_sources
        sources = list(given) if given is not None else [m.critic_model] * count
        if m.lora is not None and all(s in (None, m.lora["base"]) for s in sources):
            team = m.agents[0].team  # critics as adapters + value heads on the team's one base
            m._modules["critics"] = nn.ModuleList(
                [
                    CausalLMWithValueHead(
                        team.add_view(f"critic_{j}"), value_head_hidden_dim=m.critic_value_head_hidden_dim
                    )
                    for j in range(count)
                ]
            ).train()
            return
        models, _ = load_agents(
            sources,
            num_agents=count,
            tokenizers=m.tokenizers[:1] * count if any(not isinstance(s, str) for s in sources) else None,
            field="critics" if given is not None else "critic_model",
        )
        m._modules["critics"] = nn.ModuleList(
            [CausalLMWithValueHead(c, value_head_hidden_dim=m.critic_value_head_hidden_dim) for c in models]
        ).train()
        for i, critic in enumerate(self.critics):
            apply_gradient_checkpointing(m.team, critic)
            vocab, tokens = critic.model.get_input_embeddings().num_embeddings, len(m.tokenizers[i])
            require(
                vocab >= tokens,
                f"critic {i} has {vocab} token embeddings but the agent's tokenizer has {tokens}: "
                "critics read the agent's token ids, so they must share its tokenizer (use the "
                "same model family).",
            )

    @property
    def critics(self) -> nn.ModuleList:
        """The critics (loaded with the agents; empty when the value heads sit on the actors)."""
        if "critics" not in self.host._modules:
            self.host.configure_model()
        return self.host._modules["critics"]

    @property
    def num_critics(self) -> int:
        return 1 if self.centralized else self.host.num_agents

    def critic_for(self, agent: int) -> nn.Module:
        if self.centralized:
            return self.critics[0]
        return self.critics[agent] if self.host.use_separate_critic else self.host.agents[agent]

    def models(self) -> list[nn.Module]:
        return list(self.critics)

    def parameter_groups(self) -> list[dict[str, Any]]:
        rate = self.host.critic_learning_rate
        return [
            {"params": trainable_parameters(critic), "lr": rate, "name": f"critic_{j}", "agents": []}
            for j, critic in enumerate(self.critics)
        ]

    def trained_models(self) -> list[tuple[list[str], nn.Module]]:
        return [([f"critic_{j}"], critic) for j, critic in enumerate(self.critics)]

    def place_models(self) -> None:
        if self.critic_placement is not None:
            for critic, device in zip(self.critics, self.critic_placement):
                critic.to(device)

    def save_pretrained(self, root: Path) -> None:
        """The critics: IAC ``agent_{i}/critic/``, MAAC ``critic/`` (a value head on the actor is saved with it)."""
        states = full_state_dicts(list(self.critics))  # sharded critics: gathered whole (on every rank)
        for j, critic in enumerate(self.critics if ranks.rank() == 0 else ()):  # data-parallel: written once
            target = root / "critic" if self.centralized else root / f"agent_{j}" / "critic"
            critic.save_pretrained(target, state_dict=states[j])
            self.host.tokenizers[j].save_pretrained(target)

    # ------------------------------------------------------------------ values and targets at sampling
    @torch.no_grad()
    def after_rollout(self, rollout: Rollout) -> None:
        """Shaped rewards r' = r − β·KL, rollout-time values, TD(0) targets (multi-turn) or r' and MC returns."""
        m, nodes = self.host, rollout.nodes
        for node in nodes:
            kl = torch.stack([a.sequence_kl for a in node.agents]) if node.agents[0].sequence_kl is not None else 0.0
            node.shaped_rewards = node.agent_rewards - m.reference_kl_coef * kl  # [N, J]
        if self.centralized:
            self._tokenize_joint_texts(nodes)
        samples = [JointSample(n, k) for n in nodes for k in range(n.rewards.shape[0])]
        values = torch.stack([self._old_values(i, samples) for i in range(self.num_critics)])  # [C, S]
        offset = 0
        for node in nodes:
            J = node.rewards.shape[0]
            node.values = values[:, offset : offset + J].expand(m.num_agents, J).clone()
            offset += J
        for root in rollout.levels[0] if rollout.levels else ():  # each item's episode (K = 1 after turn 1)
            turns = list(episode(root))
            rewards = torch.stack([node.shaped_rewards for node in turns], -1)  # [N, J, T]
            values = torch.stack([node.values for node in turns], -1)
            targets = td_targets(rewards, values.roll(-1, -1), m.discount)
            returns = discounted_returns(rewards, m.discount)
            for t, node in enumerate(turns):
                node.targets, node.mc_returns = targets[..., t], returns[..., t]

    def _old_values(self, critic: int, samples: Sequence[JointSample]) -> Tensor:
        model = self.critic_for(critic)
        was_training = model.training
        model.eval()
        try:
            return self.critic_values(critic, samples).float().cpu()
        finally:
            model.train(was_training)

    def _tokenize_joint_texts(self, nodes: Sequence[Node]) -> None:
        """MAAC's critic reads ``[Agent i] prompt`` blocks (plus the joint action for Q), one text per action."""
        tok = self.host.tokenizers[0]
        texts = [
            self.joint_critic_text(
                [a.prompt for a in n.agents], [a.texts[k] for a in n.agents] if self.host.critic_type == "q" else None
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
            self.host.tokenizers[agent].pad_token_id,
        )

    def critic_inputs(self, critic: int, samples: Sequence[JointSample]) -> tuple[ScoringInputs, Tensor]:
        """Critic rows and, per row, the position whose value is read (the last real token)."""
        pad = self.host.tokenizers[0 if self.centralized else critic].pad_token_id
        if self.centralized:
            empty = torch.zeros((len(samples), 0), dtype=torch.long)
            inputs = build_scoring_inputs([s.node.critic_ids[s.k] for s in samples], empty, empty.bool(), pad)
            return inputs, torch.full((len(samples),), inputs.input_ids.shape[1] - 1)
        inputs = self.sample_inputs(critic, samples)
        if self.host.critic_type == "v":  # V(h): the prompt only
            inputs = build_scoring_inputs(
                [s.node.agents[critic].prompt_ids for s in samples],
                inputs.completion_ids[:, :0],
                inputs.completion_mask[:, :0],
                pad,
            )
        width = inputs.input_ids.shape[1] - inputs.completion_ids.shape[1]
        return inputs, width + inputs.completion_mask.sum(-1) - 1

    def critic_values(self, critic: int, samples: Sequence[JointSample]) -> Tensor:
        """Values [B] of critic ``critic`` (MAAC: the joint critic) for ``samples``, with grad when enabled."""
        model = self.critic_for(critic)
        inputs, positions = self.critic_inputs(critic, samples)
        device = next(model.parameters()).device
        return model.values_at(
            inputs.input_ids.to(device),
            inputs.attention_mask.to(device),
            inputs.position_ids.to(device),
            positions.to(device),
        )

    # ------------------------------------------------------------------ the update
    def records(self, rollout: Rollout) -> list[JointSample]:
        return [JointSample(n, k) for n in rollout.nodes for k in range(n.rewards.shape[0])]

    def prepare_group(self, group: list[JointSample]) -> None:
        """Â = normalize(target − V_old) per agent over the turn group (computed once per drained buffer)."""
        for node in {id(s.node): s.node for s in group}.values():
            node.advantages = torch.zeros_like(node.targets)
        for i in range(self.host.num_agents):
            targets = torch.stack([s.node.targets[i, s.k] for s in group])
            old = torch.stack([s.node.values[i, s.k] for s in group])
            for s, a in zip(group, critic_advantages(targets, old, self.host.advantage_normalization)):
                s.node.advantages[i, s.k] = a

    def losses(self, samples: list[JointSample]) -> Iterator[tuple[Tensor, dict[str, Tensor]]]:
        """Agent by agent (actor and its critic), micro-batch by micro-batch; then MAAC's joint critic."""
        m, rows, turn = self.host, len(samples), samples[0].turn + 1
        N, coef = m.num_agents, m.value_loss_coef
        inputs = [self.sample_inputs(i, samples) for i in range(N)]
        weights = [token_loss_weights(x.completion_mask, m.loss_aggregation, m.max_new_tokens) for x in inputs]
        for i, _, _, part_rows in m.agent_micro_batches(inputs):
            part = take(samples, part_rows)
            logp = token_logprobs(m.policy_model(i), trim_prompt_padding(select_rows(inputs[i], part_rows)))
            advantages = torch.stack([s.node.advantages[i, s.k] for s in part]).to(logp.device)
            loss, _ = policy_gradient_loss(logp, advantages, weights[i][part_rows].to(logp.device))
            assert_finite("policy loss", loss, step=m.global_step, agent=i)
            diagnostics = {f"agent_{i}/policy_loss": loss.detach(), f"turn_{turn}/policy_loss": loss.detach() / N}
            if not self.centralized:
                vloss = self._value_loss(i, part, rows)
                diagnostics[f"agent_{i}/value_loss"] = vloss.detach()
                diagnostics[f"turn_{turn}/value_loss"] = vloss.detach() / N
                loss = loss + coef * vloss.to(loss.device)
            yield loss, {**diagnostics, "loss": loss.detach()}
        if self.centralized:  # the shared critic: on the team target, over the whole joint mini-batch
            # the critic reads whole rows
            for part_rows in micro_batches(inputs[0], m.micro_batch_size, m.micro_batch_tokens, share_prompts=False):
                vloss = self._value_loss(0, take(samples, part_rows), rows)
                losses = {"critic/value_loss": vloss.detach(), f"turn_{turn}/value_loss": vloss.detach()}
                yield coef * vloss, {**losses, "loss": coef * vloss.detach()}

    def _value_loss(self, critic: int, part: Sequence[JointSample], rows: int) -> Tensor:
        """Critic ``critic``'s loss on ``part`` of a mini-batch of ``rows`` (a mean over the mini-batch)."""
        values = self.critic_values(critic, part).float()
        if self.centralized:  # the team target: the mean of the agents' targets
            targets = torch.stack([s.node.targets[:, s.k].mean() for s in part])
            old = None
        else:
            targets = torch.stack([s.node.targets[critic, s.k] for s in part])
            old = torch.stack([s.node.values[critic, s.k] for s in part]).to(values.device)
        loss = value_loss(values, targets.to(values.device), old, self.host.value_clip_range) * (len(part) / rows)
        assert_finite("value loss", loss, step=self.host.global_step, agent="critic" if self.centralized else critic)
        return loss

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
        if self.host.metrics_callback is not None:
            for key, value in (self.host.metrics_callback(self.agent_steps(samples)) or {}).items():
                metrics[f"turn_{turn}/{key}"] = float(value)
        return metrics

    def agent_steps(self, samples: Sequence[JointSample]) -> list[AgentStep]:
        """Per-agent views of joint samples (``metrics_callback``'s argument)."""
        return [step for s in samples for step in s.agents]

    def node_record(self, node: Node) -> dict[str, Any]:
        return {"agent_rewards": node.agent_rewards.tolist(), "values": node.values.tolist()}

    def record_from_state(self, state: dict[str, Any]) -> JointSample:
        return JointSample.from_state_dict(state)


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

    @property
    def critics(self) -> nn.ModuleList:
        """The critics (loading the team first if it has not loaded yet, as ``agents`` does); empty when the value
        heads sit on the actors."""
        return self.objective.critics


class JointCritic(ActorCritic):
    """MAAC's objective: one centralized critic over the joint text, on the team target."""

    centralized = True
    per_agent_rewards = False


class MAAC(IAC):
    """Multi-agent actor-critic with one centralized critic over the joint text (``critic_type`` v or q).

    Same fields as ``IAC`` except the critic is always a separate model (``critic_model`` or a one-element
    ``critics``; tokenized with agent 0's tokenizer) and ``value_clip_range`` does not apply.
    """

    algorithm_name = "MAAC"
    objective_class = JointCritic
