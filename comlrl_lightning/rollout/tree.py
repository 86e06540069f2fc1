"""The multi-turn rollout tree (docs/algorithms.md#rollout-trees-and-joint-actions), built breadth-first and batched.

Every node holds K samples per agent for one prompt per agent. Its joint actions are either ``aligned``
(K actions: agent i's k-th sample with every other agent's k-th sample) or ``cross`` (the Kᴺ Cartesian
combinations). Each joint action gets one team reward; unless the node is the last turn or terminated early
(mean reward strictly greater than ``early_termination_threshold``), each joint action opens a child node
whose prompts come from ``external_transition``. Returns: G = r + γ·mean(child returns) (γ = ``discount``).

We expand one *level* of the tree at a time, for all prompts of the batch at once: one ``generate`` per agent
per level (micro-batched), one reward call per level. CoMLRL builds the same tree depth-first with one
generate per node and one reward call per joint action; the returns are the same.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from comlrl_lightning.choices import Choice
from comlrl_lightning.core.advantages import bootstrap_returns, cross_credit, cross_joint_indices, expand_rewards
from comlrl_lightning.rollout.generation import GenerationBackend
from comlrl_lightning.rollout.rewards import RewardCaller, call_external_transition, format_prompt
from comlrl_lightning.rollout.sampling import Completions, SamplingConfig
from comlrl_lightning.runs import stop

# align/aligned and cross/crossed: one semantics per name pair.
JOINT_MODE = Choice(
    "joint_mode",
    {"aligned": ("align",), "cross": ("crossed",)},
    message="Unsupported joint_mode: {value} (joint_mode must be one of: {allowed}{aliases}).",
)
normalize_joint_mode = JOINT_MODE


REMOVED_FIELDS = ("old_logprobs",)  # AgentSamples fields of an earlier release, dropped when a checkpoint loads


@dataclass
class AgentSamples:
    """One agent's K samples at one node."""

    prompt: str  # formatted prompt (before any chat template); what histories record
    prompt_ids: Tensor  # [P] unpadded model input ids
    completion_ids: Tensor  # [K, T] right-padded
    completion_mask: Tensor  # [K, T] bool
    texts: list[str]
    credit: Tensor | None = None  # [K] return credited to each completion (set after the tree)
    credit_components: Tensor | None = None  # [K, C] the same credit per reward component (None without components)
    sequence_kl: Tensor | None = None  # [K] Σ_t KL estimate (reference KL in the reward)
    ref_logprobs: Tensor | None = None  # [K, T] reference log-probs (reference KL in the loss)
    sampling_logprobs: Tensor | None = None  # [K, T] log π(token) read at sampling (``SamplingConfig.keep_logprobs``)
    engine_logprobs: Tensor | None = None  # [K, T] the inference engine's own log-probs of its samples (vLLM)
    extras: dict[str, Tensor] = field(default_factory=dict)  # a new algorithm's per-sample state, [K, ...] each


@dataclass
class Node:
    item: Mapping[str, Any]
    turn: int
    agents: list[AgentSamples]
    joint_index: Tensor  # [J, N] sample index of each agent in each joint action
    rewards: Tensor  # [J] processed team rewards
    raw_rewards: Tensor  # [J] before reward_processor
    env_step: int  # env steps counted after this node's rewards
    policy_version: int  # optimizer updates done when it was sampled
    item_index: int = 0  # position of its dataset item in the rollout's batch
    returns: Tensor | None = None  # [J]
    # a reward that returns named components (rollout/rewards.py): their raw values, names and returns
    reward_components: Tensor | None = None  # [J, C] before the weights and reward_processor
    component_names: list[str] | None = None  # [C], first-seen order
    component_returns: Tensor | None = None  # [J, C] G_c = r_c + γ·mean(child G_c)
    # actor-critic tables, [N, J] (agent i's part of joint action j):
    agent_rewards: Tensor | None = None  # processed environment rewards (the reward may return 1, J or N values)
    shaped_rewards: Tensor | None = None  # r' = r − β·KL
    values: Tensor | None = None  # the critics' values at sampling time
    targets: Tensor | None = None  # TD(0) targets (single turn: r')
    mc_returns: Tensor | None = None  # discounted Monte-Carlo returns (logged)
    advantages: Tensor | None = None  # normalised target − value, set when the buffer is drained
    critic_ids: list[Tensor] | None = None  # MAAC: the joint critic's input ids, one per joint action
    children: dict[int, "Node"] = field(default_factory=dict)  # joint action -> child

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors/lists (checkpoint-safe under ``weights_only`` loading); children are not kept."""
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("agents", "children")}
        state["item"] = dict(self.item)
        state["agents"] = [{f.name: getattr(a, f.name) for f in fields(a)} for a in self.agents]
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "Node":
        state = dict(state)
        state["agents"] = [
            AgentSamples(**{k: v for k, v in a.items() if k not in REMOVED_FIELDS}) for a in state["agents"]
        ]
        return cls(**state)

    @property
    def mean_reward(self) -> float:
        return float(self.rewards.mean())

    @property
    def mean_return(self) -> float:
        return float(self.returns.mean())


def _same_names(names: Sequence[list[str] | None]) -> list[str] | None:
    """The component names of one level's reward calls (actor-critic: one per node): all None or all the same."""
    if all(n is None for n in names):
        return None
    if any(n != names[0] for n in names):
        raise ValueError(
            f"the reward returned different components at nodes of the same turn ({names[0]} and "
            f"{next(n for n in names if n != names[0])}); return the same names, or numbers, for every call."
        )
    return names[0]


def episode(root: Node) -> Iterator[Node]:
    """The nodes of one trajectory, turn by turn: the root and its first child's line (an evaluation trajectory, a
    multi-turn actor-critic episode, both K = 1 after the first turn)."""
    node = root
    while node is not None:
        yield node
        node = node.children.get(0)


@dataclass
class _Pending:
    item_index: int
    item: Mapping[str, Any]
    external_prompts: list[str] | None
    prompt_history: list[list[str]]
    response_history: list[list[str]]
    parent: tuple[Node, int] | None


@dataclass
class Rollout:
    """The trees of a batch of items, as the engine built them — or a selection of the nodes of one or more rollouts
    (:meth:`of_nodes`; dynamic sampling keeps the nodes that can teach, ``data/dynamic_sampling.py``). In a selection
    ``levels[t]`` holds the selected nodes of turn t (possibly none, when a deeper turn has some), ``roots`` the
    selected first-turn nodes, and a node's ``children`` still name its original children, selected or not."""

    roots: list[Node]
    levels: list[list[Node]]  # levels[t] = nodes at turn t, in creation order
    num_joint_actions: int  # joint actions rewarded (env steps), selected or not
    timings: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)  # what made it reports (``rollout/...``), logged with it

    @property
    def nodes(self) -> list[Node]:
        return [n for level in self.levels for n in level]

    @classmethod
    def of_nodes(
        cls,
        nodes: Sequence[Node],
        num_joint_actions: int,
        timings: Mapping[str, float],
        metrics: Mapping[str, float] | None = None,
    ) -> "Rollout":
        """A rollout of ``nodes`` grouped by turn (levels up to the deepest turn among them, each in the given order)."""
        depth = max((n.turn for n in nodes), default=-1) + 1
        levels = [[n for n in nodes if n.turn == t] for t in range(depth)]
        return cls(levels[0] if levels else [], levels, num_joint_actions, dict(timings), dict(metrics or {}))


class RolloutEngine:
    """Samples, rewards and expands rollout trees for a batch of dataset items."""

    def __init__(
        self,
        *,
        num_agents: int,
        formatters: Sequence[Callable[..., str]],
        reward: RewardCaller,
        sampling: SamplingConfig,
        backend: GenerationBackend,
        num_generations: int,
        use_chat_template: bool,
        num_turns: int = 1,
        joint_mode: str = "aligned",
        discount: float = 1.0,
        early_termination_threshold: float | None = None,
        external_transition: Callable[..., Any] | None = None,
        external_prompt_passthrough: bool = False,
        reward_per_node: bool = False,
        per_agent_rewards: bool = True,
    ):
        """The module's settings, as its fields give them (``build_engine``); the tree's shape past the first turn
        (``num_turns`` … ``external_prompt_passthrough``) and the actor-critic reward form default to a single
        turn of one team reward per joint action: what evaluation and preference collection play."""
        self.num_agents = num_agents
        self.formatters = list(formatters)
        self.reward = reward
        self.sampling = sampling
        self.num_generations = num_generations
        self.num_turns = num_turns
        self.joint_mode = normalize_joint_mode(joint_mode)
        self.discount = discount
        self.early_termination_threshold = early_termination_threshold
        self.external_transition = external_transition
        self.external_prompt_passthrough = external_prompt_passthrough
        self.use_chat_template = use_chat_template
        self.backend = backend
        # Actor-critic: the reward is called per node and may return 1, J or (per_agent_rewards) N values.
        self.reward_per_node, self.per_agent_rewards = reward_per_node, per_agent_rewards

    # ------------------------------------------------------------------ public
    def rollout(
        self,
        models: Sequence[torch.nn.Module],
        tokenizers: Sequence[Any],
        items: Sequence[Mapping[str, Any]],
        *,
        num_generations: int | None = None,
        early_termination: bool = True,
        policy_version: int = 0,
        env_step: int = 0,
        reward: RewardCaller | None = None,
    ) -> Rollout:
        """Build the trees of ``items``; ``num_generations=1`` without early termination is an eval trajectory.
        ``reward`` replaces the engine's (MARLHF's learned reward; evaluation's task reward)."""
        K = num_generations or self.num_generations
        reward = reward or self.reward
        threshold = self.early_termination_threshold if early_termination else None
        timings: dict[str, float] = defaultdict(float)
        frontier = [
            _Pending(b, item, None, [[] for _ in range(self.num_agents)], [[] for _ in range(self.num_agents)], None)
            for b, item in enumerate(items)
        ]
        levels: list[list[Node]] = []
        start_step = env_step
        for turn in range(self.num_turns):
            if not frontier:
                break
            level, env_step = self._expand_level(
                models, tokenizers, frontier, turn, K, policy_version, env_step, timings, reward
            )
            levels.append(level)
            expanded, frontier = frontier, []
            if turn + 1 < self.num_turns:
                tic = time.perf_counter()
                for node, pending in zip(level, expanded):
                    if threshold is not None and node.mean_reward > threshold:
                        continue  # strictly greater: this branch ends here
                    frontier.extend(self._children(node, pending))
                timings["transition"] += time.perf_counter() - tic
        self._compute_returns(levels, K)
        return Rollout(levels[0] if levels else [], levels, env_step - start_step, dict(timings))

    # ------------------------------------------------------------------ steps
    def _expand_level(self, models, tokenizers, frontier, turn, K, policy_version, env_step, timings, reward):
        N = self.num_agents
        prompts = [[self._format(i, p) for p in frontier] for i in range(N)]  # [N][M]

        tic = time.perf_counter()
        samples = self.sample(models, tokenizers, prompts, K)
        timings["generate"] += time.perf_counter() - tic

        tic = time.perf_counter()
        if self.joint_mode == "cross" and N > 1:
            joint = cross_joint_indices(N, K)  # [K^N, N]
        else:
            joint = torch.arange(K).unsqueeze(1).expand(K, N)
        J, M = joint.shape[0], len(frontier)
        node_rows = torch.arange(M).repeat_interleave(J) * K  # [M*J] first sample row of each joint action's node
        agent_rows = node_rows.unsqueeze(1) + joint.repeat(M, 1)  # [M*J, N]
        agent_texts = [[samples[i].texts[r] for r in agent_rows[:, i].tolist()] for i in range(N)]
        reward_prompts = [prompts[0][m] for m in range(M) for _ in range(J)]
        reward_items = [frontier[m].item for m in range(M) for _ in range(J)]
        histories = [frontier[m].response_history for m in range(M) for _ in range(J)]
        if self.reward_per_node:  # actor-critic: one call per node; 1, J or N values (per agent)
            per_node = [
                self._node_rewards(
                    reward,
                    [t[m * J : (m + 1) * J] for t in agent_texts],
                    reward_prompts[m * J : (m + 1) * J],
                    reward_items[m * J : (m + 1) * J],
                    histories[m * J : (m + 1) * J],
                    J,
                )
                for m in range(M)
            ]
            agent_rewards = torch.stack([p[0] for p in per_node])  # [M, N, J]
            raw_t = torch.stack([p[1] for p in per_node])  # [M, J] team view: mean over agents
            rewards = agent_rewards.mean(dim=1)
            names = _same_names([p[3] for p in per_node])
            components = None if names is None else [p[2] for p in per_node]  # M x [J, C]
        else:
            out = reward.raw_rewards(agent_texts, reward_prompts, reward_items, histories=histories)
            raw_t = torch.tensor(out.values, dtype=torch.float32).view(M, J)
            rewards = torch.tensor(reward.process(out.values), dtype=torch.float32).view(M, J)
            agent_rewards = None
            names = out.names
            components = None if names is None else torch.tensor(out.components, dtype=torch.float32).view(M, J, -1)
        timings["reward"] += time.perf_counter() - tic

        level = []
        for m, pending in enumerate(frontier):
            env_step += J
            agents = []
            for i in range(N):
                rows = slice(m * K, (m + 1) * K)
                mask = samples[i].completion_mask[rows]
                width = max(int(mask.sum(-1).max()), 1)
                agents.append(
                    AgentSamples(
                        prompt=prompts[i][m],
                        prompt_ids=samples[i].prompt_ids[m],
                        completion_ids=samples[i].completion_ids[rows, :width],
                        completion_mask=mask[:, :width],
                        texts=samples[i].texts[rows],
                        sampling_logprobs=None if samples[i].logprobs is None else samples[i].logprobs[rows, :width],
                        engine_logprobs=(
                            None if samples[i].engine_logprobs is None else samples[i].engine_logprobs[rows, :width]
                        ),
                    )
                )
            node = Node(
                pending.item,
                turn,
                agents,
                joint,
                rewards[m],
                raw_t[m],
                env_step,
                policy_version,
                pending.item_index,
                agent_rewards=None if agent_rewards is None else agent_rewards[m],
                reward_components=None if components is None else components[m],
                component_names=None if names is None else list(names),
            )
            if pending.parent is not None:
                parent, j = pending.parent
                parent.children[j] = node
            level.append(node)
        return level, env_step

    def _node_rewards(
        self, reward: RewardCaller, texts, prompts, items, histories, J: int
    ) -> tuple[Tensor, Tensor, Tensor | None, list[str] | None]:
        """One node's per-agent processed rewards [N, J], its raw team rewards [J] and, for a reward that returns
        components, their team view [J, C] (spread like the rewards, then the mean over agents) and names
        (actor-critic)."""
        out = reward.raw_rewards(texts, prompts, items, check_count=False, histories=histories)
        per_agent = self.per_agent_rewards or J == 1
        processed = expand_rewards(reward.process(out.values), self.num_agents, J, per_agent=per_agent)
        raw = expand_rewards(out.values, self.num_agents, J, per_agent=per_agent).mean(0)
        if out.names is None:
            return processed, raw, None, None
        columns = torch.tensor(out.components, dtype=torch.float32).T  # [C, L]: L = 1, J or N values
        components = torch.stack(
            [expand_rewards(c, self.num_agents, J, per_agent=per_agent).mean(0) for c in columns], dim=-1
        )  # [J, C]
        return processed, raw, components, out.names

    def _format(self, agent: int, pending: _Pending) -> str:
        external = None if pending.external_prompts is None else pending.external_prompts[agent]
        return format_prompt(self.formatters[agent], pending.item, external, self.external_prompt_passthrough)

    def first_prompts(self, items: Sequence[Mapping[str, Any]]) -> list[list[str]]:
        """[N][M] formatted first-turn prompts of each agent for ``items``."""
        return [
            [format_prompt(self.formatters[i], item, None, self.external_prompt_passthrough) for item in items]
            for i in range(self.num_agents)
        ]

    def model_input(self, tokenizer, prompt: str) -> str:
        """What the model reads for a formatted prompt (the chat template applied when it is on)."""
        if not self.use_chat_template:
            return prompt
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )

    def take_weights(self, models, tokenizers) -> None:
        """The backend's engines that hold weights of their own (vLLM) take ``models``' current weights now: before
        sampling ahead, and in a data-parallel run where every rank passes (a server's weights are sent by rank 0
        while the others wait, so a rank with nothing to sample still takes part)."""
        pin = getattr(self.backend, "pin", None)
        if pin is not None:
            pin(models, tokenizers)

    def sample(self, models, tokenizers, prompts: Sequence[Sequence[str]], K: int) -> list[Completions]:
        """K samples per prompt: ``models[j]`` answers ``prompts[j]`` through the generation backend."""
        inputs = [[self.model_input(tokenizers[i], p) for p in prompts[i]] for i in range(len(prompts))]
        stop.check()  # a safe point per generation call (runs/stop.py); the hf backend checks per token too
        return self.backend.sample(models, tokenizers, inputs, K, self.sampling)

    def _children(self, node: Node, pending: _Pending) -> list[_Pending]:
        N = self.num_agents
        children = []
        # From turn 2 on, histories record the external prompt itself (not its formatted form).
        used = pending.external_prompts or [a.prompt for a in node.agents]
        prompt_history = [h + [p] for h, p in zip(pending.prompt_history, used)]
        raw_prompt = str(node.item.get("prompt", ""))
        for j, sample_idx in enumerate(node.joint_index.tolist()):
            responses = [node.agents[i].texts[sample_idx[i]] for i in range(N)]
            response_history = [h + [r] for h, r in zip(pending.response_history, responses)]
            stop.check()  # a safe point per transition (runs/stop.py): an environment may take long
            next_prompts = call_external_transition(
                self.external_transition,
                prompt=raw_prompt,
                agent_completions=responses,
                num_agents=N,
                prompt_history_per_agent=prompt_history,
                response_history_per_agent=response_history,
            )
            children.append(
                _Pending(pending.item_index, node.item, next_prompts, prompt_history, response_history, (node, j))
            )
        return children

    def _compute_returns(self, levels: list[list[Node]], K: int) -> None:
        """Bottom-up returns, then each completion's credit (aligned: its action's return; cross: the sum). A reward
        with components gets the same recursion and credit per component (``component_returns``,
        ``credit_components``), from their raw values."""
        for level in reversed(levels):
            for node in level:
                J = node.rewards.shape[0]
                child_mean = torch.zeros(J)
                has_child = torch.zeros(J, dtype=torch.bool)
                for j, child in node.children.items():
                    child_mean[j] = child.returns.mean()
                    has_child[j] = True
                node.returns = bootstrap_returns(node.rewards, child_mean, has_child, self.discount)
                credit = self._credit(node.returns, K)  # [N, K]
                for i, agent in enumerate(node.agents):
                    agent.credit = credit[i].clone()
                if node.reward_components is None:
                    continue
                C = node.reward_components.shape[-1]
                child_means = torch.zeros(J, C)
                for j, child in node.children.items():
                    if child.component_names != node.component_names:
                        raise ValueError(
                            f"the reward returned components {child.component_names} at turn {child.turn + 1} but "
                            f"{node.component_names} at turn {node.turn + 1} of the same episode; per-component "
                            "returns need the same names at every turn."
                        )
                    child_means[j] = child.component_returns.mean(dim=0)
                node.component_returns = bootstrap_returns(
                    node.reward_components, child_means, has_child.unsqueeze(-1), self.discount
                )  # [J, C]
                per_component = self._credit(node.component_returns.T, K)  # [C, N, K]
                for i, agent in enumerate(node.agents):
                    agent.credit_components = per_component[:, i].T.contiguous()  # [K, C]

    def _credit(self, returns: Tensor, K: int) -> Tensor:
        """[..., J] joint returns -> [..., N, K] per-completion credit (aligned: J = K, each agent's k-th sample
        gets joint action k's return; cross: the sum over the joint actions that use it)."""
        if self.joint_mode == "cross" and self.num_agents > 1:
            return cross_credit(returns, self.num_agents, K)
        return returns.unsqueeze(-2).expand(*returns.shape[:-1], self.num_agents, K)
