"""One round of iterative preference collection (docs/iterative.md), owned by ``PreferenceDataModule``.

The module hands the data side a :class:`RoundPlan` (its comparator and replay fields, resolved) and its
:class:`~comlrl_lightning.rollout.policy.TeamPolicy`; a :class:`RoundCollector` then, per round ν:

1. prepares the comparator (``comparators.sources``: current, current_copy, model, history, api);
2. per chunk of tasks, samples K_c candidates per agent from the policy and K_cmp from the comparator, scores both
   sides in one call of the policy's reward (the oracle), pairs candidate k of one side with candidate k of the
   other (either side can win, ties dropped, ``pair_selection``/``preference_pairs_per_sample`` choose), keeps
   text, processed and raw scores, and tokenises the pairs from text;
3. reports the round (:class:`RoundReport`: pairs, win/tie counts, both sides' raw rewards, parse failures), which
   the ``RoundMetrics`` callback logs.

The comparator's random stream (``IndependentRNG``) is part of the collector's state, so resumed runs repeat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from comlrl_lightning.comparators.api import ApiComparatorConfig
from comlrl_lightning.comparators.sources import IndependentRNG, build_comparator
from comlrl_lightning.core.pairs import PreferencePair
from comlrl_lightning.core.replay import select_comparison_pairs
from comlrl_lightning.rollout.centralized import joint_prompt, split_joint
from comlrl_lightning.rollout.policy import TeamPolicy
from comlrl_lightning.rollout.preferences import tokenize_pairs
from comlrl_lightning.runs import ranks


@dataclass
class ComparatorSpec:
    """The other side of each comparison (the ``comparator_*`` fields, checked and normalised)."""

    kind: str  # current | current_copy | model | history | api
    model_sources: list[Any] | None = None
    model_tokenizers: Any = None
    model_field: str = "comparator_agents"
    devices: Any = None
    num_candidates: int | None = None  # K_cmp (None: the policy's K_c)
    history_k: int = 1
    keep_loaded: bool = True
    api_config: ApiComparatorConfig | None = None
    centralized: bool = False  # one comparator writes every role's part of a joint answer
    centralized_index: int = 0
    adapter: Any = None  # builds the joint prompt and splits the joint answer (centralized)


@dataclass
class RoundPlan:
    """What an iterative module hands its data module: rounds, pairs, comparator, replay and directories."""

    num_rounds: int
    epochs_per_round: int
    comparator: ComparatorSpec
    num_candidates: int  # K_c
    selection: str
    limit: int | None
    replay_mode: str = "current"
    replay_k: int | None = None
    replay_lambda: float | None = None
    replay_sample_size: int | None = None
    replay_dir: str | None = None  # null: <log dir>/preference_replay
    history_dir: Path | None = None  # the policy checkpoints the history comparator reads


@dataclass
class RoundReport:
    """What one round's collection produced, for logging (``iter/*``) and reward-distribution files."""

    iteration: int  # 0-based
    num_rounds: int
    fresh: list[PreferencePair]
    train: list[PreferencePair]
    total_pairs: int
    outcomes: list[float]  # current wins, comparator wins, ties
    target_raw: list[float] = field(default_factory=list)
    comparator_raw: list[float] = field(default_factory=list)
    comparator_parse_failures: int | None = None  # centralized comparator answers without any role section
    collaboration_parse_failures: int | None = None  # joint answers (either side) the team's adapter could not split
    logged: bool = False


class RoundCollector:
    """Current-policy candidates against a comparator's, for the rounds of one fit (module docstring)."""

    def __init__(self, plan: RoundPlan, policy: TeamPolicy, rng: IndependentRNG):
        self.plan, self.policy, self.rng = plan, policy, rng
        self.comparator = None  # built at the first round
        self._reset_stats()

    def _reset_stats(self) -> None:
        self.target_raw: list[float] = []
        self.comparator_raw: list[float] = []
        self.outcomes = torch.zeros(3)
        self.parse_failures = 0
        collaboration = self.policy.collaboration
        self._collaboration_start = collaboration.parse_failures if collaboration is not None else 0

    def start_round(self, iteration: int) -> None:
        spec, N = self.plan.comparator, self.policy.num_agents
        if self.comparator is None:
            self.comparator = build_comparator(
                spec.kind,
                self.policy,
                self.rng,
                roles=[spec.centralized_index] if self.centralized else list(range(N)),
                model_sources=spec.model_sources,
                model_tokenizers=spec.model_tokenizers,
                model_field=spec.model_field,
                devices=spec.devices,
                history_dir=self.plan.history_dir,
                history_k=spec.history_k,
                keep_loaded=spec.keep_loaded,
                api_config=spec.api_config,
            )
        self._reset_stats()
        self.comparator.start_round(iteration)

    def end_round(self) -> None:
        self.comparator.end_round()

    @property
    def centralized(self) -> bool:
        return self.plan.comparator.centralized and self.policy.num_agents > 1

    @torch.no_grad()
    def collect_pairs(self, items: Sequence[Mapping[str, Any]], policy_version: int = 0) -> list[PreferencePair]:
        """Current vs comparator candidates for ``items``, scored in one oracle call, selected per item."""
        policy, N, M = self.policy, self.policy.num_agents, len(items)
        K_cur = self.plan.num_candidates
        K_cmp = self.plan.comparator.num_candidates or K_cur
        prompts = policy.first_prompts(items)  # [N][M]
        current_texts = [c.texts for c in policy.sample(prompts, K_cur)]  # [N][M*K_cur]
        comparator_texts = self.comparator_candidates(items, prompts, K_cmp)  # [N][M*K_cmp]
        rows = [m for m in range(M) for _ in range(K_cur)] + [m for m in range(M) for _ in range(K_cmp)]
        raw = policy.reward.raw(
            [current_texts[i] + comparator_texts[i] for i in range(N)],
            prompts=[prompts[0][m] for m in rows],
            batch_items=[items[m] for m in rows],
        )
        raw = torch.tensor(raw, dtype=torch.float64)
        scores = torch.tensor(policy.reward.process(raw.tolist()), dtype=torch.float64)
        split = M * K_cur
        cur_raw, cmp_raw = raw[:split].view(M, K_cur), raw[split:].view(M, K_cmp)
        cur, cmp = scores[:split].view(M, K_cur), scores[split:].view(M, K_cmp)
        self.target_raw += cur_raw.flatten().tolist()
        self.comparator_raw += cmp_raw.flatten().tolist()
        gaps = cur[:, : min(K_cur, K_cmp)] - cmp[:, : min(K_cur, K_cmp)]
        self.outcomes += torch.stack([(gaps > 0).sum(), (gaps < 0).sum(), (gaps == 0).sum()]).float()

        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))  # via the global RNG
        item_means = torch.cat([cur, cmp], dim=1).mean(dim=1).tolist()  # [M] over both sides' candidates
        pairs = []
        for m in range(M):
            for k, current_wins in select_comparison_pairs(
                cur[m], cmp[m], self.plan.selection, self.plan.limit, generator
            ):
                cur_side = ([t[m * K_cur + k] for t in current_texts], float(cur[m, k]), float(cur_raw[m, k]))
                cmp_side = ([t[m * K_cmp + k] for t in comparator_texts], float(cmp[m, k]), float(cmp_raw[m, k]))
                winner, loser = (cur_side, cmp_side) if current_wins else (cmp_side, cur_side)
                pairs.append(
                    PreferencePair(
                        prompts=[prompts[i][m] for i in range(N)],
                        winner_completions=winner[0],
                        loser_completions=loser[0],
                        winner_reward=winner[1],
                        loser_reward=loser[1],
                        candidate_reward_mean=item_means[m],
                        raw_rewards=[winner[2], loser[2]],
                        target_raw_reward=cur_side[2],
                        comparator_raw_reward=cmp_side[2],
                    )
                )
        tokenize_pairs(pairs, policy.tokenizers, policy.model_input)
        return pairs

    def comparator_candidates(self, items, prompts: list[list[str]], K: int) -> list[list[str]]:
        """[N][M*K] comparator texts; centralized generation writes every role in one joint completion."""
        N = self.policy.num_agents
        if not self.centralized:
            return self.comparator.sample(list(range(N)), prompts, K, items)
        spec = self.plan.comparator
        joint = [joint_prompt(spec.adapter, item, [prompts[i][m] for i in range(N)]) for m, item in enumerate(items)]
        texts = self.comparator.sample([spec.centralized_index], [joint], K, items)[0]
        # An unparsable joint answer becomes empty role outputs; counted in iter/comparator_parse_failures.
        roles = [
            split_joint(spec.adapter, text, items[r // K], N, on_parse_error="empty") for r, text in enumerate(texts)
        ]
        self.parse_failures += sum(1 for parts in roles if not any(parts))
        return [[parts[i] for parts in roles] for i in range(N)]

    def report(
        self, iteration: int, fresh: list[PreferencePair], train: list[PreferencePair], total_pairs: int
    ) -> RoundReport:
        """The round over every rank's share of the tasks (each rank counted its own comparisons)."""
        collaboration = self.policy.collaboration
        own = (
            self.outcomes.tolist(),
            self.target_raw,
            self.comparator_raw,
            self.parse_failures,
            collaboration.parse_failures - self._collaboration_start if collaboration is not None else 0,
        )
        shares = ranks.gather(own)
        return RoundReport(
            iteration=iteration,
            num_rounds=self.plan.num_rounds,
            fresh=fresh,
            train=train,
            total_pairs=total_pairs,
            outcomes=[sum(s[0][k] for s in shares) for k in range(3)],
            target_raw=[r for s in shares for r in s[1]],
            comparator_raw=[r for s in shares for r in s[2]],
            comparator_parse_failures=sum(s[3] for s in shares) if self.centralized else None,
            collaboration_parse_failures=sum(s[4] for s in shares) if collaboration is not None else None,
        )
