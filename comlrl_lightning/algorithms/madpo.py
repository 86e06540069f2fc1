"""MADPO: multi-agent direct preference optimization (REFERENCE §5.1–5.4).

Users give tasks, not preferences. For each task the agents sample ``preference_num_candidates`` (K_c)
completions each; joint candidate k pairs every agent's k-th sample (aligned); the oracle — the task reward after
``reward_processor`` — scores each joint candidate, and score differences become preference pairs (ties dropped,
``pair_selection`` and ``preference_pairs_per_sample`` choose which). Pairs keep the sampled token ids.

Per pair (w, l) and agent i, Δ_i = log π_i(a_i^w | h_i) − log π_i(a_i^l | h_i) over every generated token up to
and including EOS; the team margin Δ = Σ_i Δ_i and the loss is −log σ(η·Δ), η = ``dpo_beta``. Each agent's
gradient is −η·σ(−ηΔ)·∇Δ_i: the team margin sets the weight, the agent's own margin the direction. CoMLRL gets
this by stepping agents one after another with the others' margins detached; we take one simultaneous step on
the joint loss, whose gradient with respect to each agent's weights is the same. No reference model.

Collection happens in ``PreferenceDataModule.train_dataloader`` from the current agents (once per fit); each
Lightning epoch is one pass over the pairs in batches of ``train_batch_size`` pairs, one update each.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from comlrl_lightning.algorithms.base import MultiAgentModule, check_config, plain_hparams, team_for, team_size
from comlrl_lightning.algorithms.iterative import IterativePreference
from comlrl_lightning.core.losses import assert_finite, madpo_loss
from comlrl_lightning.core.pairs import PAIR_SELECTIONS, PreferencePair
from comlrl_lightning.core.replay import ITERATIVE_PAIR_SELECTIONS
from comlrl_lightning.rollout.preferences import collect_preference_pairs
from comlrl_lightning.rollout.rewards import RewardCaller, build_formatters
from comlrl_lightning.rollout.sampling import SamplingConfig, collate_rows, token_logprobs, validate_generation_kwargs
from comlrl_lightning.rollout.tree import RolloutEngine, normalize_joint_mode


class MADPO(MultiAgentModule):
    """Multi-agent DPO on preference pairs collected from the agents and scored by the task reward.

    Fields: ``preference_num_candidates`` (K_c ≥ 2 samples per agent per task), ``preference_pairs_per_sample``
    (pairs kept per task; null = all), ``pair_selection`` (``reward_gap`` | ``random`` | ``all``), ``dpo_beta`` (η),
    ``train_batch_size`` (pairs per update), ``micro_batch_size`` (pairs per forward; gradient accumulation),
    ``use_environment_step`` / ``environment_steps_per_pair`` (``env_step`` += that × pairs per update),
    ``num_turns`` (must be 1), ``joint_mode`` (must be aligned); sampling, formatters, reward, evaluation and
    optimizer fields as ``MAGRPO``. Training metrics: ``loss``, ``dpo/accuracy`` (share of pairs with Δ > 0),
    ``dpo/joint_margin_mean``, ``dpo/reward_gap_mean``, ``dpo/num_pairs``, ``turn_1/reward_mean`` (mean candidate
    reward at collection, CoMLRL's metric) — and the task reward of the current agents under ``eval/``.
    """

    algorithm_name = "MADPO"
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
        preference_num_candidates: int = 80,
        preference_pairs_per_sample: int | None = 16,
        pair_selection: str = "reward_gap",
        dpo_beta: float = 0.1,
        use_environment_step: bool = True,
        environment_steps_per_pair: int = 2,
        max_new_tokens: int = 256,
        temperature: float = 0.6,
        top_p: float = 0.6,
        top_k: int | None = 50,
        generation_kwargs: dict[str, Any] | None = None,
        num_turns: int = 1,
        joint_mode: str = "aligned",
        train_batch_size: int = 2,
        micro_batch_size: int | None = None,
        generation_batch_size: int | None = None,
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
        pair_selection = str(pair_selection).lower()
        check_preference_config(self.algorithm_name, reward_func=reward_func, num_turns=num_turns,
                                joint_mode=joint_mode, preference_num_candidates=preference_num_candidates,
                                preference_pairs_per_sample=preference_pairs_per_sample,
                                pair_selection=pair_selection, eval_interval=eval_interval,
                                eval_num_samples=eval_num_samples, eval_logger=eval_logger,
                                eval_aggregator=eval_aggregator, micro_batch_size=micro_batch_size,
                                reward_timeout=reward_timeout, num_agents=team_size(locals()),
                                formatters=formatters, selections=self.pair_selections, checks=[
            (dpo_beta > 0, "dpo_beta must be > 0."),
            (environment_steps_per_pair >= 1, "environment_steps_per_pair must be >= 1."),
            (train_batch_size >= 1, "train_batch_size must be >= 1."),
        ])
        validate_generation_kwargs(generation_kwargs)
        sampling = SamplingConfig(max_new_tokens, temperature, top_p, top_k)
        team = team_for(collaboration_mode, agents, num_agents, tokenizers, formatters, reward_func,
                        centralized_adapter)
        super().__init__(team.agents, team.num_agents, team.tokenizers, model_config, agent_learning_rate,
                         weight_decay, max_grad_norm, parallel_training, agent_devices)
        self.collaboration = team.collaboration
        self.save_hyperparameters(plain_hparams(locals()))
        self.preference_num_candidates = preference_num_candidates
        self.preference_pairs_per_sample = preference_pairs_per_sample
        self.pair_selection, self.dpo_beta = pair_selection, dpo_beta
        self.use_environment_step, self.environment_steps_per_pair = use_environment_step, environment_steps_per_pair
        self.train_batch_size, self.micro_batch_size = train_batch_size, micro_batch_size
        self.num_turns, self.discount, self.max_new_tokens = 1, 1.0, max_new_tokens
        self.eval_interval, self.eval_num_samples, self.log_completions = eval_interval, eval_num_samples, log_completions
        self.eval_logger, self.eval_aggregator = eval_logger, eval_aggregator
        self.engine = RolloutEngine(
            num_agents=self.num_agents,
            formatters=build_formatters(team.formatters, self.num_agents),
            reward=RewardCaller(team.reward_func, reward_processor, reward_timeout, where=self.describe_step),
            sampling=sampling,
            num_generations=preference_num_candidates,
            num_turns=1,
            joint_mode="aligned",
            use_chat_template=use_chat_template,
            generation_batch_size=generation_batch_size,
            generation_kwargs=generation_kwargs,
            parallel_agents=self.samples_concurrently,
        )
        self.last_batch: list[PreferencePair] = []

    # ================================================================== pair collection
    def collect_pairs(self, items: Sequence[Mapping[str, Any]]) -> list[PreferencePair]:
        """Sample K_c joint candidates per item with the current weights, score them, select pairs."""
        return collect_preference_pairs(self.engine, self.policy_models(), self.tokenizers, items,
                                        selection=self.pair_selection, limit=self.preference_pairs_per_sample,
                                        policy_version=self.global_step)

    @property
    def pair_batch_size(self) -> int:
        """Pairs per update (what PreferenceDataModule batches by)."""
        return self.train_batch_size

    @property
    def collection_engine(self) -> RolloutEngine:
        """Formatters, sampling and task reward of pair collection."""
        return self.engine

    def policy_models(self) -> list[torch.nn.Module]:
        return [self.policy_model(i) for i in range(self.num_agents)]

    # ================================================================== training
    def training_step(self, batch: list[PreferencePair], batch_idx: int):
        tic = time.perf_counter()
        optimizer = self.optimizers()
        optimizer.zero_grad()
        step = self.micro_batch_size or len(batch)
        margins = []
        for start in range(0, len(batch), step):
            chunk = batch[start : start + step]
            # with parallel_training="mp" each agent's margins live on its own device: gather them on ours
            chunk_margins = torch.stack([self.agent_margins(i, chunk).to(self.device) for i in range(self.num_agents)],
                                        dim=1)
            loss, _ = madpo_loss(chunk_margins, self.dpo_beta)
            loss = loss * (len(chunk) / len(batch))  # the batch loss is a mean over its pairs
            assert_finite("MADPO loss", loss, step=self.global_step)
            self.manual_backward(loss)
            margins.append(chunk_margins.detach())
        metrics = self.clip_and_measure_gradients()
        optimizer.step()
        if self.use_environment_step:
            self.env_step += self.environment_steps_per_pair * len(batch)
        self.last_batch = batch

        margins = torch.cat(margins)  # [P, N]
        loss, diagnostics = madpo_loss(margins.float().cpu(), self.dpo_beta)
        metrics.update({
            "loss": float(loss),
            "dpo/accuracy": float(diagnostics["accuracy"]),
            "dpo/joint_margin_mean": float(diagnostics["joint_margin_mean"]),
            "dpo/reward_gap_mean": sum(p.winner_reward - p.loser_reward for p in batch) / len(batch),
            "dpo/num_pairs": float(len(batch)),
            "turn_1/reward_mean": sum(p.candidate_reward_mean for p in batch) / len(batch),
            "turn_1/expected_return": sum(p.candidate_reward_mean for p in batch) / len(batch),
            "timing_s/update": time.perf_counter() - tic,
            "env_step": float(self.env_step),
        })
        for i in range(self.num_agents):
            metrics[f"agent_{i}/margin_mean"] = float(margins[:, i].mean())
        self.log_dict(metrics, batch_size=len(batch))
        self.log("dpo_acc", metrics["dpo/accuracy"], prog_bar=True, logger=False, batch_size=len(batch))

    def agent_margins(self, agent: int, pairs: Sequence[PreferencePair]) -> Tensor:
        """Δ_i per pair: Σ_t log π_i over the winner's generated tokens minus the loser's, one batched forward."""
        prompts = [p.prompt_ids[agent] for p in pairs] * 2
        completions = [p.winner_ids[agent] for p in pairs] + [p.loser_ids[agent] for p in pairs]
        inputs = collate_rows(prompts, [c[None] for c in completions],
                              [torch.ones(1, len(c), dtype=torch.bool) for c in completions],
                              self.tokenizers[agent].pad_token_id)
        sequence_logp = token_logprobs(self.policy_model(agent), inputs).sum(-1)  # [2P]
        return sequence_logp[: len(pairs)] - sequence_logp[len(pairs) :]

    def completion_records(self, max_nodes: int) -> list[dict[str, Any]]:
        return [{"env_step": self.env_step, "turn": 1, "prompts": p.prompts,
                 "completions": [[w, l] for w, l in zip(p.winner_completions, p.loser_completions)],
                 "rewards": [p.winner_reward, p.loser_reward]} for p in self.last_batch[:max_nodes]]


def check_preference_config(name: str, *, reward_func, num_turns, joint_mode, preference_num_candidates,
                            preference_pairs_per_sample, pair_selection, eval_interval, eval_num_samples,
                            eval_logger, eval_aggregator, micro_batch_size=None, selections=PAIR_SELECTIONS,
                            checks=(), reward_timeout=None, num_agents=None, formatters=None) -> None:
    """REFERENCE §5.2 / appendix C rules shared by MADPO and MARLHF (plus ``checks``); raised before models load."""
    check_config([
        (num_turns == 1, f"{name} currently supports num_turns=1 only."),
        (normalize_joint_mode(joint_mode) == "aligned",
         f"{name} preference generation currently supports aligned joint_mode only."),
        (preference_num_candidates >= 2, "preference_num_candidates must be >= 2."),
        (preference_pairs_per_sample is None or preference_pairs_per_sample >= 1,
         "preference_pairs_per_sample must be >= 1 or null."),
        (pair_selection in selections, f"pair_selection must be one of: {', '.join(selections)}."),
        (pair_selection != "all" or preference_pairs_per_sample is None,
         "preference_pairs_per_sample must be null when pair_selection='all'."),
        *checks,
    ], reward_func=reward_func, eval_interval=eval_interval, eval_num_samples=eval_num_samples,
        eval_logger=eval_logger, eval_aggregator=eval_aggregator, micro_batch_size=micro_batch_size,
        reward_timeout=reward_timeout, num_agents=num_agents, formatters=formatters)


class MADPOIter(IterativePreference, MADPO):
    """Iterative MADPO (REFERENCE §5.6–5.14): ``num_iterations`` rounds of collect (current agents vs a comparator)
    → replay shard → ``num_train_epochs`` DPO passes over the round's replayed pairs. One round is one Lightning
    epoch (``trainer.max_epochs`` is set to ``num_iterations``). The round machinery, comparators and replay are
    in ``algorithms/iterative.py``; the DPO update is MADPO's.

    Fields beyond MADPO's: ``num_iterations``, ``num_train_epochs`` (DPO passes per round), the replay fields
    (``preference_replay_mode`` current | nearest_k | all_history | lambda_decay, ``preference_replay_k``,
    ``preference_replay_lambda``, ``preference_replay_sample_size``, ``preference_replay_dir``),
    ``log_reward_distribution``, ``policy_checkpoint_dir``, and the comparator fields (``comparator_policy``
    current | current_copy | model | history | api, ``comparator_generation_mode``,
    ``comparator_centralized_agent_index``, ``comparator_model_name`` / ``comparator_agents``,
    ``comparator_devices``, ``comparator_num_candidates``, ``comparator_history_k``, ``comparator_api_*``,
    ``centralized_comparator_adapter``). ``pair_selection`` adds ``comparator_reward`` (the default).
    """

    algorithm_name = "MADPOIter"
    pair_selections = ITERATIVE_PAIR_SELECTIONS
    epochs_per_iteration = 1

    def __init__(
        self,
        num_train_epochs: int = 1,
        preference_num_candidates: int = 20,
        preference_pairs_per_sample: int | None = 4,
        pair_selection: str = "comparator_reward",
        **kwargs: Any,
    ):
        """``kwargs``: the iterative fields (``IterativePreference``) and every MADPO field."""
        if num_train_epochs < 1:
            raise ValueError("num_train_epochs must be >= 1.")
        super().__init__(preference_num_candidates=preference_num_candidates,
                         preference_pairs_per_sample=preference_pairs_per_sample,
                         pair_selection=pair_selection, **kwargs)
        self.num_train_epochs = num_train_epochs
        self.hparams.update(num_train_epochs=num_train_epochs)

    @property
    def pair_passes(self) -> int:
        """DPO passes over the round's pairs, served in one epoch."""
        return self.num_train_epochs

