"""MAGRPO and the critic-free multi-agent REINFORCE family (REFERENCE §3).

For every dataset item the N agents build a rollout tree (``rollout/tree.py``): at each node every agent samples
K completions, joint actions get one team reward, and the return of a joint action is its reward plus the
discounted mean return of its child node. Agent i's K completions at a node form one group:

    G'_k = G_k − β·KL_k                       (reference KL on the returns, ``reference_kl_placement="reward"``)
    A_k  = normalize(G'_k − b(G'))            b = mean (MAGRPO) | leave-one-out mean (MARLOO)
                                              | group max (MAReMax) | 0 (MAREINFORCE)
    L_i  = Σ_{k,t} w_{k,t} · (−A_k · log π_i(y_{k,t} | x, y_{k,<t}))      w: ``loss_aggregation``

No importance ratio, no clipping, no entropy bonus (CoMLRL's objective). Log-probs cover exactly the generated
tokens up to and including EOS (CoMLRL skips the last token and scores padding; we do not).

Schedule: nodes go into a buffer; once it holds ``rollout_buffer_size`` nodes it is drained turn by turn,
shuffled, in mini-batches of ``train_batch_size`` nodes, one team update (one ``global_step``) per mini-batch.
Rollouts are sampled inside ``training_step`` from the current weights (the data module yields only dataset
items, so Lightning's prefetch cannot make them stale); every node records the update count it was sampled at.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from comlrl_lightning.agents import resolve_devices
from comlrl_lightning.algorithms.base import MultiAgentModule, check_config, plain_hparams, team_for, team_size
from comlrl_lightning.core.advantages import ADVANTAGE_MODES, compute_advantages
from comlrl_lightning.core.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    assert_finite,
    kl_estimate,
    policy_gradient_loss,
    token_loss_weights,
)
from comlrl_lightning.rollout.rewards import RewardCaller, build_formatters
from comlrl_lightning.rollout.sampling import (
    SamplingConfig,
    ScoringInputs,
    collate_rows,
    micro_batches,
    select_rows,
    token_logprobs,
    trim_prompt_padding,
    validate_generation_kwargs,
)
from comlrl_lightning.rollout.tree import Node, Rollout, RolloutEngine, normalize_joint_mode

KL_PLACEMENTS = ("reward", "loss")


@dataclass
class PolicyBatch:
    """One agent's rows of a mini-batch: inputs, per-row advantages, loss weights, reference log-probs."""

    inputs: ScoringInputs
    advantages: Tensor  # [B]
    weights: Tensor  # [B, T]
    ref_logprobs: Tensor | None  # [B, T]

    def rows(self, sl: slice) -> "PolicyBatch":
        ref = None if self.ref_logprobs is None else self.ref_logprobs[sl]
        return PolicyBatch(select_rows(self.inputs, sl), self.advantages[sl], self.weights[sl], ref)


class MAGRPO(MultiAgentModule):
    """Multi-Agent Group Relative Policy Optimization; the baseline is ``advantage_mode`` (default ``mean``).

    Rollout / reward: ``reward_func(*agent_completions, prompts=None, batch_items=None) -> list[float]`` (one team
    reward per joint action), ``reward_processor`` (float -> float), ``reward_timeout`` (seconds one reward call may
    take; a hang fails the run naming the step; None: no limit), ``formatters`` (``item -> str``: one per agent, or one
    for all), ``external_transition`` (required when ``num_turns > 1``), ``external_prompt_passthrough``,
    ``use_chat_template`` (wrap prompts in the tokenizer's chat template; off for CoMLRL parity).
    Sampling: ``num_generations`` (K ≥ 2), ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``generation_kwargs``. Tree: ``num_turns``, ``joint_mode`` (``aligned`` | ``cross``; ``align``/``crossed``
    are aliases), ``discount`` (applied, default 1.0), ``early_termination_threshold`` (None = never).
    Updates: ``rollout_buffer_size`` and ``train_batch_size`` (nodes), ``micro_batch_size`` (rows per forward;
    gradient accumulation), ``micro_batch_tokens`` (at most that many tokens per forward: bounds update memory
    for long prompts), ``generation_batch_size`` (prompts per ``generate``), ``advantage_normalization``,
    ``loss_aggregation`` (``seq_sum`` | ``token_mean`` | ``seq_mean_token_mean`` | ``dr_grpo``).
    Reference KL: ``reference_kl_enabled``, ``reference_kl_coef`` (β), ``reference_kl_estimator`` (k1|k2|k3),
    ``reference_kl_placement`` (``reward``: on returns before the baseline; ``loss``: per-token term),
    ``reference_devices``. Evaluation: ``eval_interval`` (training batches; 0 = off), ``eval_num_samples``,
    ``eval_logger``, ``eval_aggregator``. See ``MultiAgentModule`` for agents, optimizer and devices.
    """

    algorithm_name = "MAGRPO"
    default_advantage_mode = "mean"

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
        num_generations: int = 4,
        max_new_tokens: int = 256,
        temperature: float = 0.6,
        top_p: float = 0.6,
        top_k: int | None = 50,
        generation_kwargs: dict[str, Any] | None = None,
        num_turns: int = 1,
        joint_mode: str = "aligned",
        discount: float = 1.0,
        early_termination_threshold: float | None = None,
        rollout_buffer_size: int = 2,
        train_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        generation_batch_size: int | None = None,
        advantage_mode: str | None = None,
        advantage_normalization: bool = True,
        loss_aggregation: str = "seq_sum",
        reference_kl_enabled: bool = False,
        reference_kl_coef: float = 0.1,
        reference_kl_estimator: str = "k3",
        reference_kl_placement: str = "reward",
        reference_devices: str | list[str] | None = None,
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
        advantage_mode = advantage_mode or self.default_advantage_mode
        train_batch_size = rollout_buffer_size if train_batch_size is None else train_batch_size
        _validate_config(
            reward_func=reward_func, num_generations=num_generations, num_turns=num_turns,
            external_transition=external_transition, rollout_buffer_size=rollout_buffer_size,
            train_batch_size=train_batch_size, micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens, generation_batch_size=generation_batch_size,
            advantage_mode=advantage_mode,
            loss_aggregation=loss_aggregation, discount=discount, reference_kl_coef=reference_kl_coef,
            reference_kl_estimator=reference_kl_estimator, reference_kl_placement=reference_kl_placement,
            eval_interval=eval_interval, eval_num_samples=eval_num_samples, eval_logger=eval_logger,
            eval_aggregator=eval_aggregator, algorithm=self.algorithm_name, reward_timeout=reward_timeout,
            num_agents=team_size(dict(agents=agents, num_agents=num_agents, collaboration_mode=collaboration_mode)),
            formatters=formatters,
        )
        validate_generation_kwargs(generation_kwargs)
        joint_mode = normalize_joint_mode(joint_mode)
        sampling = SamplingConfig(max_new_tokens, temperature, top_p, top_k)
        team = team_for(collaboration_mode, agents, num_agents, tokenizers, formatters, reward_func,
                        centralized_adapter)
        if team.collaboration is not None and num_turns != 1:
            raise ValueError(f"Centralized {self.algorithm_name} currently supports num_turns=1 only.")
        super().__init__(team.agents, team.num_agents, team.tokenizers, model_config, agent_learning_rate,
                         weight_decay, max_grad_norm, parallel_training, agent_devices)
        self.collaboration = team.collaboration
        if reference_kl_enabled and reference_devices is not None:
            resolve_devices(reference_devices, self.num_agents, kind="reference_devices")  # validate 1 or N
        self.save_hyperparameters(plain_hparams(locals()))

        self.num_generations = num_generations
        self.num_turns = num_turns
        self.rollout_buffer_size = rollout_buffer_size
        self.train_batch_size = train_batch_size
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.max_new_tokens = max_new_tokens
        self.advantage_mode = advantage_mode
        self.advantage_normalization = advantage_normalization
        self.loss_aggregation = loss_aggregation
        self.reference_kl_enabled = reference_kl_enabled
        self.reference_kl_coef = reference_kl_coef
        self.reference_kl_estimator = reference_kl_estimator
        self.reference_kl_placement = reference_kl_placement
        self.reference_devices = reference_devices
        self.discount = discount
        self.eval_interval = eval_interval
        self.eval_num_samples = eval_num_samples
        self.eval_logger = eval_logger
        self.eval_aggregator = eval_aggregator
        self.log_completions = log_completions
        self.engine = RolloutEngine(
            num_agents=self.num_agents,
            formatters=build_formatters(team.formatters, self.num_agents),
            reward=RewardCaller(team.reward_func, reward_processor, reward_timeout, where=self.describe_step),
            sampling=sampling,
            num_generations=num_generations,
            num_turns=num_turns,
            joint_mode=joint_mode,
            discount=discount,
            early_termination_threshold=early_termination_threshold,
            external_transition=external_transition,
            external_prompt_passthrough=external_prompt_passthrough,
            use_chat_template=use_chat_template,
            generation_batch_size=generation_batch_size,
            generation_kwargs=generation_kwargs,
            parallel_agents=self.samples_concurrently,
        )
        self.buffer: list[Node] = []
        self.last_rollout: Rollout | None = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["comlrl_lightning"]["buffer"] = [n.state_dict() for n in self.buffer]  # awaiting an update

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.buffer = [Node.from_state_dict(n) for n in checkpoint.get("comlrl_lightning", {}).get("buffer", [])]

    # ================================================================== training
    def training_step(self, batch: list[Mapping[str, Any]], batch_idx: int):
        failures = self.collaboration.parse_failures if self.collaboration is not None else 0
        rollout = self.collect_rollout(batch)
        self.buffer.extend(rollout.nodes)
        metrics = self._rollout_metrics(rollout)
        if self.collaboration is not None:  # joint answers the adapter could not split (scored as empty roles)
            metrics["collaboration/parse_failure_rate"] = \
                (self.collaboration.parse_failures - failures) / max(rollout.num_joint_actions, 1)

        updates: list[dict[str, float]] = []
        last_batch = batch_idx + 1 >= self.trainer.num_training_batches
        if len(self.buffer) >= self.rollout_buffer_size or (last_batch and self.buffer):
            nodes, self.buffer = self.buffer, []
            for turn in sorted({n.turn for n in nodes}):  # a mini-batch never mixes turns
                group = [n for n in nodes if n.turn == turn]
                order = torch.randperm(len(group)).tolist()
                for start in range(0, len(group), self.train_batch_size):
                    updates.append(self.update([group[j] for j in order[start : start + self.train_batch_size]]))
        for key in {k for u in updates for k in u}:  # several updates in one step: log their mean
            values = [u[key] for u in updates if key in u]
            metrics[key] = sum(values) / len(values)
        metrics["env_step"] = float(self.env_step)
        self.log_dict(metrics, batch_size=len(batch))
        self.log("reward", metrics["rollout/turn_1/reward_mean"], prog_bar=True, logger=False, batch_size=len(batch))

    @torch.no_grad()
    def collect_rollout(self, items: Sequence[Mapping[str, Any]]) -> Rollout:
        """Sample, reward and expand the trees of ``items`` with the current weights."""
        rollout = self.engine.rollout(self.agents, self.tokenizers, items, policy_version=self.global_step,
                                      env_step=self.env_step)
        self.env_step += rollout.num_joint_actions
        if self.reference is not None:
            tic = time.perf_counter()
            self._attach_reference_kl(rollout.nodes)
            rollout.timings["score"] = time.perf_counter() - tic
        self.last_rollout = rollout
        return rollout

    def update(self, nodes: list[Node]) -> dict[str, float]:
        """One team update on a mini-batch of nodes (all of one turn): one optimizer step, one global_step."""
        tic = time.perf_counter()
        optimizer = self.optimizers()
        optimizer.zero_grad()
        batches = [self.policy_batch(nodes, i) for i in range(self.num_agents)]
        # Micro-batches (rows, or a token budget), without the prompt padding none of their rows needs.
        chunks = [[self.micro_batch(batch, rows) for rows in micro_batches(batch.inputs, self.micro_batch_size,
                                                                            self.micro_batch_tokens)]
                  for batch in batches]
        self.check_update_fits([(self.policy_model(i), c.inputs) for i, agent in enumerate(chunks) for c in agent])
        diagnostics: dict[str, list[Tensor]] = defaultdict(list)
        kl_coef = self.reference_kl_coef if self.reference_kl_placement == "loss" else 0.0
        for i, agent in enumerate(chunks):  # one agent's graph at a time: a backward per micro-batch
            for chunk in agent:
                logp = token_logprobs(self.policy_model(i), chunk.inputs)
                device = logp.device
                token_kl = None
                if chunk.ref_logprobs is not None:
                    token_kl = kl_estimate(logp, chunk.ref_logprobs.to(device), self.reference_kl_estimator)
                    token_kl = token_kl * chunk.inputs.completion_mask.to(device)
                loss, diag = policy_gradient_loss(logp, chunk.advantages.to(device), chunk.weights.to(device),
                                                  token_kl, kl_coef)
                assert_finite("policy loss", loss, step=self.global_step, agent=i)
                self.manual_backward(loss)
                diagnostics[f"agent_{i}/loss"].append(loss.detach())
        metrics = self.clip_and_measure_gradients()
        # Updates done before this one minus updates done at sampling: 0 = sampled by the weights being updated.
        metrics["rollout/policy_lag"] = float(self.global_step - min(n.policy_version for n in nodes))
        optimizer.step()

        turn = nodes[0].turn
        for key, values in diagnostics.items():
            metrics[key] = float(torch.stack([v.cpu() for v in values]).sum())
        metrics["loss"] = sum(metrics[f"agent_{i}/loss"] for i in range(self.num_agents))
        metrics[f"turn_{turn + 1}/reward_mean"] = sum(n.mean_reward for n in nodes) / len(nodes)
        metrics[f"turn_{turn + 1}/expected_return"] = sum(n.mean_return for n in nodes) / len(nodes)
        metrics["timing_s/update"] = time.perf_counter() - tic
        return metrics

    @staticmethod
    def micro_batch(batch: PolicyBatch, rows: slice) -> PolicyBatch:
        chunk = batch.rows(rows)
        return replace(chunk, inputs=trim_prompt_padding(chunk.inputs))

    def policy_batch(self, nodes: list[Node], agent: int) -> PolicyBatch:
        """Agent ``agent``'s rows of a mini-batch with group advantages computed per node (over its K)."""
        samples = [n.agents[agent] for n in nodes]
        inputs = collate_rows([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                              [s.completion_mask for s in samples], self.tokenizers[agent].pad_token_id)
        credit = torch.stack([s.credit for s in samples])  # [M, K]
        if self.reference_kl_placement == "reward" and samples[0].sequence_kl is not None:
            credit = credit - self.reference_kl_coef * torch.stack([s.sequence_kl for s in samples])
        advantages = compute_advantages(credit, self.advantage_mode, self.advantage_normalization).reshape(-1)
        weights = token_loss_weights(inputs.completion_mask, self.loss_aggregation, self.max_new_tokens)
        ref = None
        if samples[0].ref_logprobs is not None:
            width = inputs.completion_ids.shape[1]
            ref = torch.cat([torch.nn.functional.pad(s.ref_logprobs, (0, width - s.ref_logprobs.shape[1]))
                             for s in samples])
        return PolicyBatch(inputs, advantages, weights, ref)

    def _attach_reference_kl(self, nodes: list[Node]) -> None:
        """Reference log-probs (and, for the reward placement, Σ_t KL per completion), batched per agent."""
        for i in range(self.num_agents):
            samples = [n.agents[i] for n in nodes]
            inputs = collate_rows([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                                  [s.completion_mask for s in samples], self.tokenizers[i].pad_token_id)
            ref = self.reference.token_logprobs(i, inputs, self.agent_device(i))
            if self.reference_kl_placement == "reward":
                policy = self.score_no_grad(i, inputs)
                seq_kl = (kl_estimate(policy, ref, self.reference_kl_estimator) * inputs.completion_mask).sum(-1)
                for s, kl in zip(samples, seq_kl.split([s.completion_ids.shape[0] for s in samples])):
                    s.sequence_kl = kl
            else:
                offset = 0
                for s in samples:
                    K, T = s.completion_ids.shape
                    s.ref_logprobs = ref[offset : offset + K, :T]
                    offset += K

    def _rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        metrics: dict[str, float] = {"env_step": float(self.env_step)}
        for t, level in enumerate(rollout.levels):
            rewards = torch.cat([n.rewards for n in level])
            metrics[f"rollout/turn_{t + 1}/reward_mean"] = float(rewards.mean())
            metrics[f"rollout/turn_{t + 1}/reward_std"] = float(rewards.std(unbiased=False))
        lengths = torch.cat([a.completion_mask.sum(-1) for n in rollout.nodes for a in n.agents]).float()
        metrics["completions/mean_length"] = float(lengths.mean())
        metrics["completions/clipped_ratio"] = float((lengths >= self.max_new_tokens).float().mean())
        if self.reference is not None and self.reference_kl_placement == "reward":
            for t, level in enumerate(rollout.levels):
                kl = torch.cat([a.sequence_kl for n in level for a in n.agents])
                metrics[f"turn_{t + 1}/reference_kl_mean"] = float(kl.mean())
                metrics[f"turn_{t + 1}/reference_kl_penalty_mean"] = float(self.reference_kl_coef * kl.mean())
        for phase, seconds in rollout.timings.items():
            metrics[f"timing_s/{phase}"] = seconds
        return metrics

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        """What the agents wrote at the first ``max_nodes`` nodes of the last rollout (CompletionsLogger)."""
        if self.last_rollout is None:
            return []
        return [{
            "env_step": node.env_step,
            "turn": node.turn + 1,
            "prompts": [a.prompt for a in node.agents],
            "completions": [a.texts for a in node.agents],
            "joint_actions": node.joint_index.tolist(),
            "rewards": node.rewards.tolist(),
        } for node in self.last_rollout.nodes[:max_nodes]]

class MAREINFORCE(MAGRPO):
    """Multi-agent REINFORCE: ``advantage_mode="raw"`` (no baseline). Set ``advantage_normalization: false`` to
    see the difference — with normalization all four baselines give the same advantages (REFERENCE §3.8)."""

    algorithm_name = "MAREINFORCE"
    default_advantage_mode = "raw"


class MARLOO(MAGRPO):
    """Multi-agent REINFORCE leave-one-out: ``advantage_mode="rloo"``, A_k = K/(K−1)·(G_k − mean G)."""

    algorithm_name = "MARLOO"
    default_advantage_mode = "rloo"


class MAReMax(MAGRPO):
    """``advantage_mode="max"``: the baseline is the group MAXIMUM of the K sampled returns (all advantages ≤ 0).
    This is CoMLRL's MAReMax, not ReMax's greedy-decoding baseline: no extra greedy rollout is sampled."""

    algorithm_name = "MAReMax"
    default_advantage_mode = "max"


def _validate_config(*, reward_func, num_generations, num_turns, external_transition, rollout_buffer_size,
                     train_batch_size, micro_batch_size, micro_batch_tokens, generation_batch_size, advantage_mode,
                     loss_aggregation,
                     discount, reference_kl_coef, reference_kl_estimator, reference_kl_placement, eval_interval,
                     eval_num_samples, eval_logger, eval_aggregator, algorithm, reward_timeout, num_agents,
                     formatters):
    """CoMLRL's MAGRPOConfig rules (REFERENCE §3.1, appendix C) plus ours; raised before any model loads."""
    check_config([
        (num_generations >= 2, "num_generations must be >= 2 (group baseline requires multiple samples)."),
        (num_turns >= 1, "num_turns must be >= 1."),
        (rollout_buffer_size >= 1, "rollout_buffer_size must be >= 1."),
        (train_batch_size >= 1, "train_batch_size must be >= 1."),
        (generation_batch_size is None or generation_batch_size >= 1, "generation_batch_size must be >= 1 or null."),
        (0.0 <= discount <= 1.0, "discount must be in [0, 1]."),
        (reference_kl_coef >= 0, "reference_kl_coef must be >= 0."),
        (advantage_mode in ADVANTAGE_MODES, f"advantage_mode must be one of: {', '.join(ADVANTAGE_MODES)}."),
        (loss_aggregation in LOSS_AGGREGATIONS, f"loss_aggregation must be one of: {', '.join(LOSS_AGGREGATIONS)}."),
        (reference_kl_estimator in KL_ESTIMATORS,
         f"reference_kl_estimator must be one of: {', '.join(KL_ESTIMATORS)}."),
        (reference_kl_placement in KL_PLACEMENTS,
         f"reference_kl_placement must be one of: {', '.join(KL_PLACEMENTS)}."),
        (num_turns == 1 or external_transition is not None, f"Multi-turn {algorithm} requires an external_transition."),
    ], reward_func=reward_func, eval_interval=eval_interval, eval_num_samples=eval_num_samples,
        eval_logger=eval_logger, eval_aggregator=eval_aggregator, micro_batch_size=micro_batch_size,
        micro_batch_tokens=micro_batch_tokens, reward_timeout=reward_timeout, num_agents=num_agents,
        formatters=formatters)


class CentralizedMAGRPO(MAGRPO):
    """MAGRPO with ONE joint actor (REFERENCE §3.15): it reads the adapter's joint prompt (every role's prompt),
    writes all roles' outputs in one completion, and is trained on the team reward of the split roles.
    ``num_agents`` is the number of roles; ``agents`` one model; ``centralized_adapter`` defaults to the tagged
    ``<agent_i>…</agent_i>`` adapter; ``max_new_tokens`` is the joint budget; single turn. The loss scores every
    token of the joint completion (tags included); evaluation hands the user's logger per-role completions.
    """

    algorithm_name = "CentralizedMAGRPO"

    def __init__(self, collaboration_mode: str = "centralized", **kwargs: Any):
        """``kwargs``: every MAGRPO field."""
        if str(collaboration_mode).strip().lower() != "centralized":
            raise ValueError("CentralizedMAGRPO requires centralized collaboration (collaboration_mode='centralized').")
        super().__init__(collaboration_mode="centralized", **kwargs)
