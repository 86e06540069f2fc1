"""IAC and MAAC: multi-agent advantage actor-critic (REFERENCE §4).

Per dataset item the agents play one episode: every agent samples K completions at turn 1 (single turn) or one
completion per turn (multi-turn, K = 1, prompts of later turns from ``external_transition``). The team reward
returns 1, K or N values per item and turn, expanded to one reward per agent sample; with reference KL,
r' = r − β·KL. A critic estimates values:

* **IAC** — one critic per agent: a separate critic LM with a value head (``use_separate_critic=True``) or a value
  head on the actor's own backbone (``False``). ``critic_type="v"``: V(h_i) from agent i's prompt;
  ``"q"``: Q(h_i, a_i) from its prompt and completion.
* **MAAC** — one centralized critic over the joint text (REFERENCE §4.5 layout): V(h) from all prompts, or
  Q(h, a) from all prompts and the joint action.

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

import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from comlrl_lightning.agents import CausalLMWithValueHead, check_model_sources, load_agents, resolve_devices
from comlrl_lightning.algorithms.base import MultiAgentModule, check_config, plain_hparams, team_size
from comlrl_lightning.core.advantages import critic_advantages, expand_rewards, suffix_returns, td_targets
from comlrl_lightning.core.losses import (
    LOSS_AGGREGATIONS,
    assert_finite,
    kl_estimate,
    policy_gradient_loss,
    token_loss_weights,
    value_loss,
)
from comlrl_lightning.rollout.rewards import RewardCaller, build_formatters, call_external_transition, format_prompt
from comlrl_lightning.rollout.sampling import (
    SamplingConfig,
    ScoringInputs,
    build_scoring_inputs,
    collate_rows,
    micro_batches,
    select_rows,
    token_logprobs,
    trim_prompt_padding,
    validate_generation_kwargs,
)
from comlrl_lightning.rollout.tree import sample_agents

CRITIC_TYPES = ("v", "q")


@dataclass
class AgentStep:
    """One agent's completion at one joint sample (the CoMLRL ``RolloutSample`` fields, by name)."""

    agent_idx: int
    prompt: str
    completion: str
    prompt_ids: Tensor  # [P]
    completion_ids: Tensor  # [T]
    completion_mask: Tensor  # [T] bool
    environment_reward: float = 0.0  # processed task reward
    reference_kl: float = 0.0
    reward: float = 0.0  # r' = r − β·KL
    old_value: float = 0.0
    value_target: float = 0.0
    returns: float = 0.0  # discounted Monte-Carlo return (logging)
    advantage: float = 0.0
    normalized_advantage: float = 0.0


@dataclass
class JointStep:
    """Joint sample k of one item at one turn; MAAC's critic reads ``critic_ids``."""

    item: Mapping[str, Any]
    turn: int
    generation_idx: int
    agents: list[AgentStep]
    env_step: int
    policy_version: int
    critic_ids: Tensor | None = None  # MAAC joint text ids
    joint_old_value: float = 0.0
    joint_target: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and values (checkpoint-safe under ``weights_only`` loading)."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["item"], state["metadata"] = dict(self.item), dict(self.metadata)
        state["agents"] = [{f.name: getattr(a, f.name) for f in fields(a)} for a in self.agents]
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "JointStep":
        return cls(**{**state, "agents": [AgentStep(**a) for a in state["agents"]]})


class IAC(MultiAgentModule):
    """Independent actor-critic: one critic per agent (separate critic LM or a value head on the actor).

    Fields beyond the MAGRPO ones (see ``MAGRPO``): ``use_separate_critic``, ``critic_model`` (one source for
    every agent's critic) or ``critics`` (one per agent), ``critic_type`` (``v`` | ``q``), ``critic_learning_rate``
    (None = ``agent_learning_rate``), ``critic_value_head_hidden_dim`` / ``value_head_hidden_dim`` (None: a
    linear head), ``value_clip_range`` (value head on the actor only), ``value_loss_coef``, ``critic_devices``,
    ``metrics_callback(rollouts) -> dict`` (averaged into the training log as ``turn_t/<key>``).
    ``rollout_buffer_size`` / ``train_batch_size`` count joint samples (one completion per agent each).
    Critics read the agent's token ids, so a separate critic must share the agent's tokenizer.
    """

    algorithm_name = "IAC"
    centralized_critic = False

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
        external_transition: Callable[..., Any] | None = None,
        external_prompt_passthrough: bool = False,
        use_chat_template: bool = False,
        metrics_callback: Callable[..., Any] | None = None,
        num_generations: int = 1,
        max_new_tokens: int = 256,
        temperature: float = 0.6,
        top_p: float = 0.6,
        top_k: int | None = None,
        generation_kwargs: dict[str, Any] | None = None,
        num_turns: int = 1,
        discount: float = 0.9,
        early_termination_threshold: float | None = None,
        use_separate_critic: bool = True,
        critic_model: str | None = None,
        critics: Sequence[Any] | None = None,
        critic_type: str = "v",
        critic_learning_rate: float | None = 5e-6,
        critic_value_head_hidden_dim: int | None = None,
        value_head_hidden_dim: int | None = None,
        value_clip_range: float | None = 0.2,
        value_loss_coef: float = 0.6,
        rollout_buffer_size: int = 8,
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
        eval_interval: int = 16,
        eval_num_samples: int = 4,
        log_completions: bool = True,
        agent_learning_rate: float | list[float] = 5e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float | None = None,
        parallel_training: str | None = "none",
        agent_devices: str | list[str] | None = None,
        critic_devices: str | list[str] | None = None,
    ):
        train_batch_size = rollout_buffer_size if train_batch_size is None else train_batch_size
        self._validate(locals())
        validate_generation_kwargs(generation_kwargs)
        super().__init__(agents, num_agents, tokenizers, model_config, agent_learning_rate, weight_decay,
                         max_grad_norm, parallel_training, agent_devices)
        self.save_hyperparameters(plain_hparams(locals()))
        N = self.num_agents
        self.num_generations, self.num_turns, self.discount = num_generations, num_turns, discount
        self.early_termination_threshold = early_termination_threshold
        self.critic_type, self.value_loss_coef = critic_type, value_loss_coef
        self.use_separate_critic = use_separate_critic or self.centralized_critic
        self.value_clip_range = None if self.use_separate_critic else value_clip_range
        self.rollout_buffer_size, self.train_batch_size = rollout_buffer_size, train_batch_size
        self.micro_batch_size, self.generation_batch_size = micro_batch_size, generation_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.max_new_tokens, self.loss_aggregation = max_new_tokens, loss_aggregation
        self.advantage_normalization = advantage_normalization
        self.reference_kl_enabled, self.reference_kl_coef = reference_kl_enabled, reference_kl_coef
        self.reference_kl_estimator, self.reference_devices = reference_kl_estimator, reference_devices
        self.eval_interval, self.eval_num_samples, self.log_completions = eval_interval, eval_num_samples, log_completions
        self.external_transition, self.external_prompt_passthrough = external_transition, external_prompt_passthrough
        self.use_chat_template, self.metrics_callback = use_chat_template, metrics_callback
        self.formatters = build_formatters(formatters, N)
        self.reward = RewardCaller(reward_func, reward_processor, reward_timeout, where=self.describe_step)
        self.sampling = SamplingConfig(max_new_tokens, temperature, top_p, top_k)
        self.generation_kwargs = generation_kwargs or {}
        self.critic_learning_rate = critic_learning_rate or self.agent_learning_rates[0]
        self.critic_devices = resolve_devices(critic_devices, 1 if self.centralized_critic else N,
                                              kind="critic_devices") if critic_devices is not None else None
        # ---- critics
        if not self.use_separate_critic:  # value head on each actor's backbone (shared weights share the head)
            wrapped: dict[int, CausalLMWithValueHead] = {}
            for model in self.agents:
                if id(model) not in wrapped:
                    wrapped[id(model)] = CausalLMWithValueHead(model, value_head_hidden_dim=value_head_hidden_dim)
            self.agents = nn.ModuleList([wrapped[id(m)] for m in self.agents]).train()
            self.critics = nn.ModuleList()
        else:
            count = 1 if self.centralized_critic else N
            sources = list(critics) if critics is not None else [critic_model] * count
            models, _ = load_agents(sources, num_agents=count, tokenizers=self.tokenizers[:1] * count
                                    if any(not isinstance(s, str) for s in sources) else None,
                                    field="critics" if critics is not None else "critic_model")
            self.critics = nn.ModuleList([
                CausalLMWithValueHead(m, value_head_hidden_dim=critic_value_head_hidden_dim) for m in models]).train()
            for i, critic in enumerate(self.critics):
                self.apply_gradient_checkpointing(critic)
                vocab = critic.model.get_input_embeddings().num_embeddings
                if vocab < len(self.tokenizers[i if not self.centralized_critic else 0]):
                    raise ValueError(f"critic {i} has {vocab} token embeddings but the agent's tokenizer has "
                                     f"{len(self.tokenizers[i])}: critics read the agent's token ids, so they must "
                                     "share its tokenizer (use the same model family).")
        self.buffer: list[JointStep] = []
        self.last_rollout: list[JointStep] = []

    # ================================================================== config checks
    def _validate(self, cfg: dict[str, Any]) -> None:
        """REFERENCE §4.1–4.2, §4.4 and appendix C; raised before any model loads."""
        name = self.algorithm_name
        check_config([
            (cfg["num_generations"] >= 1, "num_generations must be >= 1."),
            (cfg["num_turns"] >= 1, "num_turns must be >= 1."),
            (cfg["num_turns"] == 1 or cfg["num_generations"] == 1,
             f"Multi-turn {name} currently supports num_generations == 1."),
            (cfg["num_turns"] == 1 or cfg["external_transition"] is not None,
             f"Multi-turn {name} requires an external_transition."),
            (cfg["critic_type"] in CRITIC_TYPES, "critic_type must be one of: 'v', 'q'."),
            (cfg["rollout_buffer_size"] >= 1, "rollout_buffer_size must be >= 1."),
            (cfg["train_batch_size"] >= 1, "train_batch_size must be >= 1."),
            (0.0 <= cfg["discount"] <= 1.0, "discount must be in [0, 1]."),
            (cfg["value_loss_coef"] > 0, "value_loss_coef must be > 0."),
            (cfg["value_clip_range"] is None or cfg["value_clip_range"] > 0, "value_clip_range must be > 0 or null."),
            (cfg["critic_learning_rate"] is None or cfg["critic_learning_rate"] > 0,
             "critic_learning_rate must be > 0 or null."),
            (cfg["reference_kl_coef"] >= 0, "reference_kl_coef must be >= 0."),
            (cfg["loss_aggregation"] in LOSS_AGGREGATIONS,
             f"loss_aggregation must be one of: {', '.join(LOSS_AGGREGATIONS)}."),
        ], reward_func=cfg["reward_func"], eval_interval=cfg["eval_interval"],
            eval_num_samples=cfg["eval_num_samples"], micro_batch_size=cfg["micro_batch_size"],
            micro_batch_tokens=cfg["micro_batch_tokens"], reward_timeout=cfg["reward_timeout"],
            num_agents=team_size(cfg), formatters=cfg["formatters"])
        for key in ("critic_value_head_hidden_dim", "value_head_hidden_dim"):
            if cfg[key] is not None and cfg[key] < 0:
                raise ValueError(f"{key} must be >= 0 or null.")
        separate = cfg["use_separate_critic"] or self.centralized_critic
        if not separate and cfg["critics"] is not None:
            raise ValueError("critics can only be provided when use_separate_critic=True.")
        if separate and cfg["critic_model"] is None and not cfg["critics"]:
            where = f"for {name}" if self.centralized_critic else "when use_separate_critic=True"
            raise ValueError(f"Either critic_model or critics must be provided {where}.")
        if cfg["critics"] is not None:
            expected = 1 if self.centralized_critic else None
            if expected and len(cfg["critics"]) != 1:
                raise ValueError(f"critics length ({len(cfg['critics'])}) must match 1 critic for {name}.")
        mp = str(cfg["parallel_training"] or "none").lower() == "mp"
        if mp and cfg["agent_devices"] is None:  # the actors' devices first: the base class would say the same
            raise ValueError("parallel_training='mp' requires explicit agent_devices.")
        if mp and separate and cfg["critic_devices"] is None:
            raise ValueError("parallel_training='mp' requires explicit critic_devices.")
        if not mp and cfg["critic_devices"] is not None:
            raise ValueError(f"critic_devices is used only with parallel_training='mp' (got parallel_training="
                             f"{cfg['parallel_training']!r}): set parallel_training: mp or remove critic_devices.")
        agents = team_size(cfg)
        if cfg["critics"] is not None and not self.centralized_critic and len(cfg["critics"]) != agents:
            raise ValueError(f"critics length ({len(cfg['critics'])}) must match the number of agents ({agents}).")
        if separate:
            if cfg["critics"] is not None:
                check_model_sources(list(cfg["critics"]), "critics")
            else:
                check_model_sources(cfg["critic_model"], "critic_model")

    # ================================================================== optimizer, devices
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()  # one group per distinct actor
        for critic in self.critics:
            optimizer.add_param_group({"params": [p for p in critic.parameters() if p.requires_grad],
                                       "lr": self.critic_learning_rate, "agents": []})
        return optimizer

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.parallel_training == "mp" and self.critic_devices is not None:
            for critic, device in zip(self.critics, self.critic_devices):
                critic.to(device)

    def critic_for(self, agent: int) -> CausalLMWithValueHead:
        if self.centralized_critic:
            return self.critics[0]
        return self.critics[agent] if self.use_separate_critic else self.agents[agent]

    # ================================================================== training
    def training_step(self, batch: list[Mapping[str, Any]], batch_idx: int):
        steps = self.collect_rollout(batch)
        self.buffer.extend(steps)
        metrics: dict[str, float] = {}
        updates: list[dict[str, float]] = []
        last_batch = batch_idx + 1 >= self.trainer.num_training_batches
        if len(self.buffer) >= self.rollout_buffer_size or (last_batch and self.buffer):
            pending, self.buffer = self.buffer, []
            for turn in sorted({s.turn for s in pending}):
                group = [s for s in pending if s.turn == turn]
                self._set_advantages(group)
                order = torch.randperm(len(group)).tolist()
                for start in range(0, len(group), self.train_batch_size):
                    updates.append(self.update([group[j] for j in order[start : start + self.train_batch_size]]))
        for key in {k for u in updates for k in u}:
            values = [u[key] for u in updates if key in u]
            metrics[key] = sum(values) / len(values)
        metrics.update(self._rollout_metrics(steps))
        self.log_dict(metrics, batch_size=len(batch))
        self.log("reward", metrics["rollout/turn_1/reward_mean"], prog_bar=True, logger=False, batch_size=len(batch))

    @torch.no_grad()
    def collect_rollout(self, items: Sequence[Mapping[str, Any]], *, num_generations: int | None = None,
                        early_termination: bool = True) -> list[JointStep]:
        """Play one episode per item with the current weights; returns joint samples with old values and targets."""
        K = num_generations or self.num_generations
        N = self.num_agents
        timings: dict[str, float] = defaultdict(float)
        active = list(range(len(items)))
        external: dict[int, list[str]] = {}
        prompt_history = {b: [[] for _ in range(N)] for b in active}
        response_history = {b: [[] for _ in range(N)] for b in active}
        steps: list[JointStep] = []
        for turn in range(self.num_turns):
            if not active:
                break
            prompts = [[format_prompt(self.formatters[i], items[b], external.get(b, [None] * N)[i],
                                      self.external_prompt_passthrough) for b in active] for i in range(N)]
            t0 = time.perf_counter()
            samples = sample_agents([self.policy_model(i) for i in range(N)], self.tokenizers,
                                    [[self._model_input(i, p) for p in prompts[i]] for i in range(N)], K,
                                    self.sampling, self.generation_batch_size, self.generation_kwargs,
                                    concurrent=self.samples_concurrently)
            timings["generate"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            still_active = []
            for m, b in enumerate(active):
                rows = slice(m * K, (m + 1) * K)
                texts = [samples[i].texts[rows] for i in range(N)]
                # Aligned lists as in the documented signature (CoMLRL passed [item] and per-agent prompts here).
                processed = self.reward(texts, prompts=[prompts[0][m]] * K, batch_items=[items[b]] * K,
                                        check_count=False)
                # MAAC (a team critic) with K > 1: N values for K joint actions is ambiguous (a list one short of K
                # when N = K - 1), so it is an error; per-agent rewards are read with K = 1 (multi-turn).
                rewards = expand_rewards(processed, N, K, per_agent=not self.centralized_critic or K == 1)  # [N, K]
                for k in range(K):
                    self.env_step += 1
                    agent_steps = [AgentStep(
                        agent_idx=i, prompt=prompts[i][m], completion=texts[i][k],
                        prompt_ids=samples[i].prompt_ids[m], completion_ids=samples[i].completion_ids[m * K + k],
                        completion_mask=samples[i].completion_mask[m * K + k],
                        environment_reward=float(rewards[i, k])) for i in range(N)]
                    steps.append(JointStep(items[b], turn, k, agent_steps, self.env_step, self.global_step,
                                           metadata={"item_index": b}))
                terminated = (early_termination and self.early_termination_threshold is not None
                              and sum(processed) / len(processed) > self.early_termination_threshold)
                if turn + 1 < self.num_turns and not terminated:
                    previous = [texts[i][0] for i in range(N)]
                    used = external.get(b) or [prompts[i][m] for i in range(N)]
                    prompt_history[b] = [h + [p] for h, p in zip(prompt_history[b], used)]
                    response_history[b] = [h + [r] for h, r in zip(response_history[b], previous)]
                    external[b] = call_external_transition(
                        self.external_transition, prompt=str(items[b].get("prompt", "")), agent_completions=previous,
                        num_agents=N, prompt_history_per_agent=prompt_history[b],
                        response_history_per_agent=response_history[b])
                    still_active.append(b)
            active = still_active
            timings["reward"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        self._shape_rewards(steps)
        self._old_values_and_targets(steps)
        timings["score"] += time.perf_counter() - t0
        self.last_rollout = steps
        self._last_timings = dict(timings)
        return steps

    def _model_input(self, agent: int, prompt: str) -> str:
        if not self.use_chat_template:
            return prompt
        return self.tokenizers[agent].apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                          add_generation_prompt=True)

    def _agent_inputs(self, agent: int, steps: Sequence[JointStep]) -> ScoringInputs:
        rows = [s.agents[agent] for s in steps]
        return collate_rows([r.prompt_ids for r in rows], [r.completion_ids[None] for r in rows],
                            [r.completion_mask[None] for r in rows], self.tokenizers[agent].pad_token_id)

    def _shape_rewards(self, steps: list[JointStep]) -> None:
        """r' = r − β·Σ_t KL_t per agent sample (reference KL on the reward, REFERENCE §3.10)."""
        for i in range(self.num_agents):
            kl = torch.zeros(len(steps))
            if self.reference is not None and steps:
                inputs = self._agent_inputs(i, steps)
                ref = self.reference.token_logprobs(i, inputs, self.agent_device(i))
                policy = self.score_no_grad(i, inputs)
                kl = (kl_estimate(policy, ref, self.reference_kl_estimator) * inputs.completion_mask).sum(-1)
            for s, value in zip(steps, kl.tolist()):
                a = s.agents[i]
                a.reference_kl = value
                a.reward = a.environment_reward - self.reference_kl_coef * value * (self.reference is not None)

    # ------------------------------------------------------------------ critics
    def critic_inputs(self, agent: int, steps: Sequence[JointStep]) -> tuple[ScoringInputs, Tensor]:
        """Critic rows and, per row, the position whose value is read (the last real token)."""
        if self.centralized_critic:
            pad = self.tokenizers[0].pad_token_id
            empty = torch.zeros((len(steps), 0), dtype=torch.long)
            inputs = build_scoring_inputs([s.critic_ids for s in steps], empty, empty.bool(), pad)
            return inputs, torch.full((len(steps),), inputs.input_ids.shape[1] - 1)
        inputs = self._agent_inputs(agent, steps)
        if self.critic_type == "v":  # V(h): the prompt only
            inputs = build_scoring_inputs([s.agents[agent].prompt_ids for s in steps],
                                          inputs.completion_ids[:, :0], inputs.completion_mask[:, :0],
                                          self.tokenizers[agent].pad_token_id)
        width = inputs.input_ids.shape[1] - inputs.completion_ids.shape[1]
        return inputs, width + inputs.completion_mask.sum(-1) - 1

    def critic_values(self, agent: int, steps: Sequence[JointStep]) -> Tensor:
        """Values [B] of agent ``agent``'s critic (MAAC: the joint critic) for ``steps``, with grad if enabled."""
        critic = self.critic_for(agent)
        inputs, positions = self.critic_inputs(agent, steps)
        device = next(critic.parameters()).device
        return critic.values_at(inputs.input_ids.to(device), inputs.attention_mask.to(device),
                                inputs.position_ids.to(device), positions.to(device))

    def joint_critic_text(self, step_prompts: Sequence[str], completions: Sequence[str] | None) -> str:
        """MAAC critic input (REFERENCE §4.5): ``[Agent i] prompt`` blocks, plus the joint action for Q."""
        text = "\n\n".join(f"[Agent {i}] {p}" for i, p in enumerate(step_prompts))
        if completions is not None:
            text += "\n\n[Joint Action]\n\n" + "\n\n".join(
                f"[Agent {i} action]\n{c}" for i, c in enumerate(completions))
        return text

    @torch.no_grad()
    def _old_values_and_targets(self, steps: list[JointStep]) -> None:
        """Rollout-time values, TD(0) targets (multi-turn) or r' (single turn), and MC returns for logging."""
        if not steps:
            return
        if self.centralized_critic:
            tok = self.tokenizers[0]
            for s in steps:
                text = self.joint_critic_text([a.prompt for a in s.agents],
                                              [a.completion for a in s.agents] if self.critic_type == "q" else None)
                s.critic_ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        for i in range(self.num_agents if not self.centralized_critic else 1):
            critic = self.critic_for(i)
            was_training = critic.training
            critic.eval()
            values = self.critic_values(i, steps).float().cpu()
            critic.train(was_training)
            for s, v in zip(steps, values.tolist()):
                for a in (s.agents if self.centralized_critic else [s.agents[i]]):
                    a.old_value = v
                s.joint_old_value = v if self.centralized_critic else s.joint_old_value
        # Episodes: joint steps of one item in turn order (multi-turn has K = 1).
        episodes: dict[tuple[int, int], list[JointStep]] = defaultdict(list)
        for s in steps:
            episodes[(s.metadata["item_index"], s.generation_idx)].append(s)
        for episode in episodes.values():
            for i in range(self.num_agents):
                rewards = torch.tensor([[s.agents[i].reward for s in episode]])
                values = torch.tensor([[s.agents[i].old_value for s in episode]])
                next_values = torch.cat([values[:, 1:], torch.zeros(1, 1)], dim=1)
                targets = td_targets(rewards, next_values, self.discount)[0]
                returns = suffix_returns(rewards, self.discount)[0]
                for s, target, ret in zip(episode, targets.tolist(), returns.tolist()):
                    s.agents[i].value_target, s.agents[i].returns = target, ret
            for s in episode:
                s.joint_target = sum(a.value_target for a in s.agents) / self.num_agents

    def _set_advantages(self, group: list[JointStep]) -> None:
        """Â = normalize(target − V_old) per agent over the turn group (computed once per drain)."""
        for i in range(self.num_agents):
            targets = torch.tensor([s.agents[i].value_target for s in group])
            old = torch.tensor([s.agents[i].old_value for s in group])
            raw = targets - old
            normalized = critic_advantages(targets, old, self.advantage_normalization)
            for s, a, n in zip(group, raw.tolist(), normalized.tolist()):
                s.agents[i].advantage, s.agents[i].normalized_advantage = a, n

    # ------------------------------------------------------------------ update
    def update(self, steps: list[JointStep]) -> dict[str, float]:
        """One update on a mini-batch of joint samples: every actor and every critic, one optimizer step."""
        tic = time.perf_counter()
        optimizer = self.optimizers()
        optimizer.zero_grad()
        rows = len(steps)
        inputs = [self._agent_inputs(i, steps) for i in range(self.num_agents)]
        weights = [token_loss_weights(x.completion_mask, self.loss_aggregation, self.max_new_tokens) for x in inputs]
        plans = [micro_batches(x, self.micro_batch_size, self.micro_batch_tokens) for x in inputs]
        self.check_update_fits([(self.policy_model(i), trim_prompt_padding(select_rows(inputs[i], r)))
                                for i in range(self.num_agents) for r in plans[i]])
        stats: dict[str, float] = defaultdict(float)
        for i in range(self.num_agents):  # one agent (actor and its critic) at a time: a backward per micro-batch
            for part_rows in plans[i]:
                part = steps[part_rows]
                share = len(part) / rows  # value losses are means over the mini-batch
                logp = token_logprobs(self.policy_model(i), trim_prompt_padding(select_rows(inputs[i], part_rows)))
                device = logp.device
                advantages = torch.tensor([s.agents[i].normalized_advantage for s in part], device=device)
                loss, _ = policy_gradient_loss(logp, advantages, weights[i][part_rows].to(device))
                assert_finite("policy loss", loss, step=self.global_step, agent=i)
                stats[f"agent_{i}/policy_loss"] += float(loss.detach())
                if not self.centralized_critic:
                    values = self.critic_values(i, part)
                    targets = torch.tensor([s.agents[i].value_target for s in part], device=values.device)
                    old = torch.tensor([s.agents[i].old_value for s in part], device=values.device)
                    vloss = value_loss(values.float(), targets, old, self.value_clip_range) * share
                    assert_finite("value loss", vloss, step=self.global_step, agent=i)
                    loss = loss + self.value_loss_coef * vloss.to(device)
                    stats[f"agent_{i}/value_loss"] += float(vloss.detach())
                self.manual_backward(loss)
        if self.centralized_critic:  # the shared critic: on the team target, over the whole joint mini-batch
            for part_rows in micro_batches(inputs[0], self.micro_batch_size, self.micro_batch_tokens):
                part = steps[part_rows]
                values = self.critic_values(0, part)
                targets = torch.tensor([s.joint_target for s in part], device=values.device)
                vloss = value_loss(values.float(), targets) * (len(part) / rows)
                assert_finite("value loss", vloss, step=self.global_step, agent="critic")
                self.manual_backward(self.value_loss_coef * vloss)
                stats["critic/value_loss"] += float(vloss.detach())
        metrics = self.clip_and_measure_gradients()
        metrics["rollout/policy_lag"] = float(self.global_step - min(s.policy_version for s in steps))
        optimizer.step()
        turn = steps[0].turn + 1
        metrics.update(stats)
        metrics[f"turn_{turn}/policy_loss"] = sum(stats[f"agent_{i}/policy_loss"]
                                                  for i in range(self.num_agents)) / self.num_agents
        value_keys = [k for k in stats if k.endswith("value_loss")]
        metrics[f"turn_{turn}/value_loss"] = sum(stats[k] for k in value_keys) / len(value_keys)
        agent_rows = [a for s in steps for a in s.agents]
        metrics[f"turn_{turn}/reward_mean"] = sum(a.reward for a in agent_rows) / len(agent_rows)
        metrics[f"turn_{turn}/expected_return"] = sum(a.returns for a in agent_rows) / len(agent_rows)
        metrics[f"turn_{turn}/value_pred_mean"] = sum(a.old_value for a in agent_rows) / len(agent_rows)
        metrics[f"turn_{turn}/value_target_mean"] = sum(a.value_target for a in agent_rows) / len(agent_rows)
        if self.metrics_callback is not None:
            for key, value in (self.metrics_callback(agent_rows) or {}).items():
                metrics[f"turn_{turn}/{key}"] = float(value)
        metrics["loss"] = float(sum(v for k, v in stats.items() if k.endswith("policy_loss"))
                                + self.value_loss_coef * sum(stats[k] for k in value_keys))
        metrics["timing_s/update"] = time.perf_counter() - tic
        return metrics

    def _rollout_metrics(self, steps: list[JointStep]) -> dict[str, float]:
        metrics: dict[str, float] = {"env_step": float(self.env_step)}
        for turn in sorted({s.turn for s in steps}):
            rewards = torch.tensor([a.environment_reward for s in steps if s.turn == turn for a in s.agents])
            metrics[f"rollout/turn_{turn + 1}/reward_mean"] = float(rewards.mean())
            if self.reference is not None:
                kl = torch.tensor([a.reference_kl for s in steps if s.turn == turn for a in s.agents])
                metrics[f"turn_{turn + 1}/reference_kl_mean"] = float(kl.mean())
                metrics[f"turn_{turn + 1}/reference_kl_penalty_mean"] = float(self.reference_kl_coef * kl.mean())
        lengths = torch.tensor([float(a.completion_mask.sum()) for s in steps for a in s.agents])
        metrics["completions/mean_length"] = float(lengths.mean())
        metrics["completions/clipped_ratio"] = float((lengths >= self.max_new_tokens).float().mean())
        for phase, seconds in getattr(self, "_last_timings", {}).items():
            metrics[f"timing_s/{phase}"] = seconds
        return metrics

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        return [{
            "env_step": s.env_step, "turn": s.turn + 1, "prompts": [a.prompt for a in s.agents],
            "completions": [[a.completion] for a in s.agents], "rewards": [a.environment_reward for a in s.agents],
            "values": [a.old_value for a in s.agents],
        } for s in self.last_rollout[:max_nodes]]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["comlrl_lightning"]["buffer"] = [s.state_dict() for s in self.buffer]  # awaiting an update

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.buffer = [JointStep.from_state_dict(s) for s in checkpoint.get("comlrl_lightning", {}).get("buffer", [])]

    # ================================================================== evaluation
    @torch.no_grad()
    def evaluation_record(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One sampled episode per item over all turns (no early termination), with values and targets."""
        env_step, last = self.env_step, self.last_rollout
        steps = self.collect_rollout(items, num_generations=1, early_termination=False)
        self.env_step, self.last_rollout = env_step, last  # evaluation does not count as training interaction
        T = self.num_turns
        table = {name: torch.zeros(len(items), T) for name in ("rewards", "values", "targets")}
        for s in steps:
            b = s.metadata["item_index"]
            table["rewards"][b, s.turn] = sum(a.environment_reward for a in s.agents) / self.num_agents
            table["values"][b, s.turn] = sum(a.old_value for a in s.agents) / self.num_agents
            table["targets"][b, s.turn] = sum(a.value_target for a in s.agents) / self.num_agents
        return table

    def evaluation_metrics(self, records: list[dict[str, Any]]) -> dict[str, float]:
        rewards = torch.cat([r["rewards"] for r in records])
        values = torch.cat([r["values"] for r in records])
        targets = torch.cat([r["targets"] for r in records])
        returns = suffix_returns(rewards, self.discount)
        metrics = {"env_step": float(self.env_step)}
        for t in range(self.num_turns):
            metrics[f"eval/turn_{t + 1}/reward_mean"] = float(rewards[:, t].mean())
            metrics[f"eval/turn_{t + 1}/expected_return"] = float(returns[:, t].mean())
            metrics[f"eval/turn_{t + 1}/value_pred_mean"] = float(values[:, t].mean())
            metrics[f"eval/turn_{t + 1}/value_target_mean"] = float(targets[:, t].mean())
        return metrics

    def save_pretrained(self, output_dir) -> None:
        """``agent_{i}/`` (with ``value_head`` files when the head is on the actor) and the critics:
        IAC ``agent_{i}/critic/``, MAAC ``critic/``."""
        from pathlib import Path

        super().save_pretrained(output_dir)
        root = Path(output_dir)
        if self.centralized_critic:
            self.critics[0].save_pretrained(root / "critic")
            self.tokenizers[0].save_pretrained(root / "critic")
        else:
            for i, critic in enumerate(self.critics):
                critic.save_pretrained(root / f"agent_{i}" / "critic")
                self.tokenizers[i].save_pretrained(root / f"agent_{i}" / "critic")


class MAAC(IAC):
    """Multi-agent actor-critic with one centralized critic over the joint text (``critic_type`` v or q).

    Same fields as ``IAC`` except the critic is always a separate model (``critic_model`` or a one-element
    ``critics``; tokenized with agent 0's tokenizer) and ``value_clip_range`` does not apply.
    """

    algorithm_name = "MAAC"
    centralized_critic = True
