"""Iterative preference learning: rounds of collect → replay → train (REFERENCE §5.6–5.14, appendix A.2–A.3).

``IterativePreference`` is mixed into MADPO (``MADPOIter``) and MARLHF (``MARLHFIter``). One round ν:

1. **Collect** (``PreferenceDataModule`` walks the task set and calls ``collect_pairs``): per item the current
   agents sample K_c candidates, the comparator K_cmp (``comlrl_lightning.comparators.sources``); both sides are
   scored by the oracle (task reward after ``reward_processor``, or MARLHFIter's previous reward model); candidate
   k of one side meets candidate k of the other, either side can win, ties are dropped, ``pair_selection`` and
   ``preference_pairs_per_sample`` choose (``core.replay.select_comparison_pairs``). Pairs hold text, processed
   and raw scores; their token ids are rebuilt from text (``rollout.preferences.tokenize_pairs``).
2. **Shard**: ``<preference_replay_dir>/iteration_{ν+1:04d}.json``, written atomically, also for empty rounds.
3. **Replay**: the round's training pairs by ``preference_replay_mode`` (``core.replay``).
4. **Train**: MADPO: ``num_train_epochs`` passes over them; MARLHF: a fresh reward model on them, then
   ``num_train_epochs`` RL epochs on the task set with it.
5. **Checkpoint** the policy (``PolicyCheckpoints``) when ``policy_checkpoint_dir`` is set or the comparator is
   ``history``.

Lightning mapping: a round is ``epochs_per_iteration`` Lightning epochs (MADPOIter 1, MARLHFIter 1 + RL
epochs), so ``trainer.max_epochs`` is set to ``num_iterations × epochs_per_iteration``; loggers, callbacks and
checkpoints see every round. ``iter/*`` metrics are logged when a round's pairs are ready. The replay index lives
in the data module's state, the comparator's random stream and the run's directories in the module's, so
``ckpt_path`` resume continues exactly.
"""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from comlrl_lightning.agents import check_model_sources
from comlrl_lightning.comparators.api import ApiComparatorConfig
from comlrl_lightning.config_errors import SECRET_FIELDS  # never saved as a hyper-parameter, logged or written
from comlrl_lightning.comparators.sources import (
    IndependentRNG,
    build_comparator,
    normalize_comparator_policy,
    normalize_generation_mode,
)
from comlrl_lightning.core.distributions import distribution_metrics, distribution_record, reward_range_of, svg_chart
from comlrl_lightning.core.pairs import PreferencePair, remove_orphaned_writes, write_json_atomic
from comlrl_lightning.core.replay import ReplayIndex, normalize_replay_mode, select_comparison_pairs
from comlrl_lightning.rollout.centralized import TaggedCentralizedAdapter, check_adapter, joint_prompt, split_joint
from comlrl_lightning.rollout.preferences import tokenize_pairs
from comlrl_lightning.rollout.rewards import RewardCaller

log = logging.getLogger(__name__)



def check_iterative_config(cfg: Mapping[str, Any], *, num_agents: int, reward_func: Any,
                           collaboration_mode: str = "decentralized") -> dict[str, Any]:
    """REFERENCE §5.6 validation (messages of appendix C); returns the normalised fields. Runs before any model
    loads, so a typo fails in a second."""
    cfg = dict(cfg)

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    def positive_or_none(name: str) -> None:
        value = cfg[name]
        require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                f"{name} must be >= 1 or null.")

    require(isinstance(cfg["num_iterations"], int) and cfg["num_iterations"] >= 1, "num_iterations must be >= 1.")
    mode = cfg["preference_replay_mode"] = normalize_replay_mode(cfg["preference_replay_mode"])
    k, lam = cfg["preference_replay_k"], cfg["preference_replay_lambda"]
    historical = "preference_replay_sample_size is only valid when preference_replay_mode is 'nearest_k', " \
                 "'all_history', or 'lambda_decay'."
    if mode == "current":
        require(k in (None, 1), "preference_replay_k is only valid when preference_replay_mode='nearest_k'.")
        require(cfg["preference_replay_sample_size"] is None, historical)
    elif mode == "nearest_k":
        require(k is not None, "preference_replay_k is required when preference_replay_mode='nearest_k'.")
        require(isinstance(k, int) and k >= 1, "preference_replay_k must be >= 1.")
    else:
        require(k is None, "preference_replay_k is only valid when preference_replay_mode='nearest_k'.")
    if mode == "lambda_decay":
        require(lam is not None, "preference_replay_lambda is required when preference_replay_mode='lambda_decay'.")
        require(isinstance(lam, (int, float)) and 0.0 <= float(lam) <= 1.0,
                "preference_replay_lambda must be in [0, 1].")
    else:
        require(lam is None, "preference_replay_lambda is only valid when preference_replay_mode='lambda_decay'.")
    positive_or_none("preference_replay_sample_size")
    for name in ("preference_replay_dir", "policy_checkpoint_dir"):
        given = cfg[name]
        require(given is None or not Path(given).expanduser().exists() or Path(given).expanduser().is_dir(),
                f"{name} must be a directory; {given!r} is a file.")

    policy = cfg["comparator_policy"] = normalize_comparator_policy(cfg["comparator_policy"])
    generation = cfg["comparator_generation_mode"] = normalize_generation_mode(cfg["comparator_generation_mode"])
    index = cfg["comparator_centralized_agent_index"]
    if generation == "centralized":
        require(index >= 0, "comparator_centralized_agent_index must be >= 0.")
        require(index < num_agents, "comparator_centralized_agent_index must be smaller than num_agents.")
    if str(collaboration_mode).strip().lower() == "centralized":
        # One joint actor: its comparator answers the same joint prompt, keeping joint text.
        require(index == 0, "Centralized collaboration has only actor index 0.")
        cfg["comparator_generation_mode"] = "centralized"
    positive_or_none("comparator_num_candidates")
    positive_or_none("comparator_api_max_n_per_request")
    named_model = cfg["comparator_model_name"] is not None or cfg["comparator_agents"] is not None
    if policy == "model":
        require(named_model, "comparator_model_name or comparator_agents is required when comparator_policy='model'.")
        agents = cfg["comparator_agents"]
        require(agents is None or (isinstance(agents, (list, tuple)) and len(agents) in (1, num_agents)),
                f"comparator_agents must list 1 or num_agents ({num_agents}) models.")
        check_model_sources(agents, "comparator_agents")
        check_model_sources(cfg["comparator_model_name"], "comparator_model_name")
        tokenizers = cfg["comparator_tokenizers"]
        if isinstance(tokenizers, (list, tuple)):
            require(len(tokenizers) in (1, num_agents),
                    f"comparator_tokenizers must list 1 or num_agents ({num_agents}) tokenizers "
                    f"(got {len(tokenizers)}).")
    else:
        require(not named_model,
                "comparator_model_name and comparator_agents are only valid when comparator_policy='model'.")
        require(cfg["comparator_tokenizers"] is None,
                "comparator_tokenizers is only valid when comparator_policy='model'.")
    if policy == "history":
        cfg["comparator_history_k"] = 1 if cfg["comparator_history_k"] is None else cfg["comparator_history_k"]
        require(cfg["comparator_history_k"] >= 1, "comparator_history_k must be >= 1.")
    else:
        require(cfg["comparator_history_k"] is None,
                "comparator_history_k is only valid when comparator_policy='history'.")
    if policy == "api":
        require(bool(cfg["comparator_api_url"]), "comparator_api_url is required when comparator_policy='api'.")
        api_config(cfg)  # every comparator_api_* check, now rather than at round 1
    if cfg["log_reward_distribution"]:
        reward_range_of(reward_func)
    cfg["centralized_comparator_adapter"] = check_adapter(
        cfg["centralized_comparator_adapter"] or TaggedCentralizedAdapter(), "centralized_comparator_adapter")
    return cfg


def api_config(cfg: Mapping[str, Any]) -> ApiComparatorConfig:
    return ApiComparatorConfig(**{name[len("comparator_api_"):]: value for name, value in cfg.items()
                                  if name.startswith("comparator_api_")})


class IterativePreference:
    """Rounds of collect → shard → replay → train, mixed in front of MADPO / MARLHF (module docstring).

    ``MADPOIter(IterativePreference, MADPO)``: this ``__init__`` takes the iterative fields and passes the rest on.
    The host provides ``collection_engine`` (the rollout engine whose formatters, sampling and task reward the
    collection uses), ``policy_model``, ``tokenizers``, ``preference_num_candidates``, ``pair_selection``,
    ``preference_pairs_per_sample`` and ``epochs_per_iteration``. Choices accept CoMLRL's aliases, any case.

    Args:
        num_iterations: rounds of collect → replay → train.
        preference_replay_mode: which stored rounds a round trains on: ``current``, ``nearest_k``, ``all_history``
            or ``lambda_decay`` (aliases latest, recent_k, lambda, ...).
        preference_replay_k: rounds ``nearest_k`` draws from.
        preference_replay_lambda: weight decay per round back for ``lambda_decay``, in [0, 1].
        preference_replay_sample_size: pairs drawn from the history per round (null: as many as the round has).
        preference_replay_dir: where the rounds' pairs are stored (null: ``<log dir>/preference_replay``).
        log_reward_distribution: per round, histograms of both sides' rewards (needs ``reward_func.reward_range``).
        policy_checkpoint_dir: save the agents every round here (null: only when the comparator is ``history``).
        comparator_policy: the other side of each comparison: ``current``, ``current_copy``, ``model``,
            ``history`` or ``api``.
        comparator_generation_mode: ``decentralized`` (a comparator per role) or ``centralized`` (one writes all).
        comparator_centralized_agent_index: the role whose comparator writes the joint answer (centralized).
        comparator_model_name: the ``model`` comparator's source, for every role.
        comparator_agents: ``model`` comparators, one source or model per role (or one for all).
        comparator_tokenizers: tokenizers of ``comparator_agents`` given as models (default: the agents').
        comparator_devices: where comparator models sample (default: the agents' devices).
        comparator_num_candidates: the comparator's samples per task (null: ``preference_num_candidates``).
        comparator_history_k: ``history``: compare with the policy as it was k rounds back.
        comparator_api_url: the ``api`` comparator's endpoint.
        comparator_api_format: ``generic``, ``openai``, ``anthropic`` or ``openai_responses``.
        comparator_api_model: the model name sent to the API.
        comparator_api_max_n_per_request: completions per request (null: all at once where the format allows).
        comparator_api_timeout: seconds per request.
        comparator_api_headers: extra HTTP headers.
        comparator_api_key: the API key itself (never saved or logged; prefer ``comparator_api_key_env``).
        comparator_api_key_env: the environment variable holding the API key.
        comparator_api_key_header: the header the key is sent in.
        comparator_api_key_prefix: the key's prefix in that header (``Bearer``).
        comparator_api_response_field: where the completions are in a ``generic`` response.
        comparator_api_extra_body: extra fields of every request body.
        comparator_api_max_retries: retries of a request on timeouts, 429 and 5xx.
        comparator_api_backoff_s: first retry wait, doubled each retry.
        comparator_api_max_concurrency: requests in flight at once.
        comparator_api_max_retry_after_s: the longest ``Retry-After`` honoured (longer ones are capped, logged).
        comparator_api_deadline_s: the total time one request may take with its retries (null: no limit).
        centralized_comparator_adapter: builds the joint prompt and splits the joint answer (default: tags).
    """

    iterative = True
    keep_comparator_loaded = True  # MARLHFIter frees 'model' comparators after each collection (RL needs memory)

    def __init__(
        self,
        num_iterations: int = 6,
        preference_replay_mode: str = "current",
        preference_replay_k: int | None = None,
        preference_replay_lambda: float | None = None,
        preference_replay_sample_size: int | None = None,
        preference_replay_dir: str | None = None,
        log_reward_distribution: bool = False,
        policy_checkpoint_dir: str | None = None,
        comparator_policy: str = "current",
        comparator_generation_mode: str = "decentralized",
        comparator_centralized_agent_index: int = 0,
        comparator_model_name: str | None = None,
        comparator_agents: list[Any] | None = None,
        comparator_tokenizers: Any = None,
        comparator_devices: str | list[str] | None = None,
        comparator_num_candidates: int | None = None,
        comparator_history_k: int | None = None,
        comparator_api_url: str | None = None,
        comparator_api_format: str = "generic",
        comparator_api_model: str | None = None,
        comparator_api_max_n_per_request: int | None = None,
        comparator_api_timeout: float = 120.0,
        comparator_api_headers: dict[str, str] | None = None,
        comparator_api_key: str | None = None,
        comparator_api_key_env: str | None = None,
        comparator_api_key_header: str = "Authorization",
        comparator_api_key_prefix: str | None = "Bearer",
        comparator_api_response_field: str = "completions",
        comparator_api_extra_body: dict[str, Any] | None = None,
        comparator_api_max_retries: int = 3,
        comparator_api_backoff_s: float = 1.0,
        comparator_api_max_concurrency: int = 4,
        comparator_api_max_retry_after_s: float = 60.0,
        comparator_api_deadline_s: float | None = None,
        centralized_comparator_adapter: Any = None,
        **kwargs: Any,
    ):
        fields = dict(locals())  # the arguments above (a comprehension would see its own locals)
        self._iterative_fields = {name: value for name, value in fields.items()
                                  if name not in ("self", "kwargs", "__class__")}
        super().__init__(**kwargs)  # the host checks every field (check_config below) before any model loads
        cfg = self._iterative_fields
        for name, value in cfg.items():
            if name not in SECRET_FIELDS:
                setattr(self, name, value)
        self.hparams.update({k: v for k, v in cfg.items() if k not in SECRET_FIELDS and k not in
                             ("comparator_agents", "comparator_tokenizers", "centralized_comparator_adapter")})
        self._api_config = api_config(cfg) if cfg["comparator_policy"] == "api" else None
        self.comparator_rng = IndependentRNG(seed=_comparator_seed())
        self.comparator = None  # built at the first round (needs the run directories)
        self.run_dirs: dict[str, str] = {}  # resolved once, kept in checkpoints so a resumed run finds its files
        self._checked_dirs: set[str] = set()  # run directories cleaned of interrupted writes in this process
        self._round_raw: dict[str, list[float]] = {"target": [], "comparator": []}
        self._round_outcomes = torch.zeros(3)  # current wins, comparator wins, ties (this round)
        self._round_parse_failures = 0  # joint comparator answers without any role section (this round)

    def check_config(self) -> None:
        super().check_config()
        roles = self.collaboration.num_roles if self.collaboration is not None else self.num_agents
        self._iterative_fields = check_iterative_config(self._iterative_fields, num_agents=roles,
                                                        reward_func=self.reward_func,
                                                        collaboration_mode=self.collaboration_mode)

    # ------------------------------------------------------------------ rounds and directories
    @property
    def iteration(self) -> int:
        """0-based round of the current Lightning epoch."""
        return self.current_epoch // self.epochs_per_iteration

    @property
    def centralized_comparator(self) -> bool:
        return self.comparator_generation_mode == "centralized" and self.num_agents > 1

    @property
    def checkpoints_policy(self) -> bool:
        return self.policy_checkpoint_dir is not None or self.comparator_policy == "history"

    def run_dir(self, name: str, explicit: str | None = None) -> Path:
        """``explicit`` if given, else ``<trainer.log_dir or default_root_dir>/<name>``; absolute, created."""
        first_use = name not in self._checked_dirs
        if name not in self.run_dirs:
            base = explicit or Path(self.trainer.log_dir or self.trainer.default_root_dir) / name
            self.run_dirs[name] = str(Path(base).expanduser().resolve())
        path = Path(self.run_dirs[name])
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"{name}: {path} is a file, not a directory.")
        path.mkdir(parents=True, exist_ok=True)
        if first_use:  # a run killed mid-write (also the one being resumed) may have left temporary files
            self._checked_dirs.add(name)
            for orphan in remove_orphaned_writes(path):
                log.info("removed %s, left by an interrupted write", orphan)
        return path

    def fit_epochs(self) -> int:
        """A fit is ``num_iterations`` rounds of ``epochs_per_iteration`` epochs (the CLI sets max_epochs to it)."""
        return self.num_iterations * self.epochs_per_iteration

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            epochs = self.fit_epochs()
            if self.trainer.max_epochs not in (None, -1, 1000, epochs):
                log.warning("%s runs num_iterations=%d rounds of %d epoch(s): trainer.max_epochs=%s is replaced by %d.",
                            self.algorithm_name, self.num_iterations, self.epochs_per_iteration,
                            self.trainer.max_epochs, epochs)
            self.trainer.fit_loop.max_epochs = epochs

    def configure_callbacks(self):
        from comlrl_lightning.callbacks import PolicyCheckpoints

        callbacks = list(super().configure_callbacks())
        if self.checkpoints_policy:
            callbacks.append(PolicyCheckpoints())
        return callbacks

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["comlrl_lightning"]["iterative"] = {"comparator_rng": self.comparator_rng.state_dict(),
                                                       "run_dirs": dict(self.run_dirs)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("comlrl_lightning", {}).get("iterative")
        if state:
            self.comparator_rng.load_state_dict(state["comparator_rng"])
            self.run_dirs.update(state["run_dirs"])

    def training_step(self, batch, batch_idx: int):
        if not batch:  # the no-op batch of an empty round (PreferenceDataModule)
            return None
        return super().training_step(batch, batch_idx)

    # ------------------------------------------------------------------ collection (called by the data module)
    def start_round(self, iteration: int) -> None:
        if self.comparator is None:
            roles = [self.comparator_centralized_agent_index] if self.centralized_comparator else \
                list(range(self.num_agents))
            sources = self.comparator_agents or [self.comparator_model_name]
            self.comparator = build_comparator(
                self.comparator_policy, self, self.comparator_rng, roles=roles, model_sources=sources,
                model_tokenizers=self.comparator_tokenizers,
                model_field="comparator_agents" if self.comparator_agents else "comparator_model_name",
                devices=self.comparator_devices or self.agent_devices,
                history_dir=self.run_dir("policy_checkpoints", self.policy_checkpoint_dir) if
                self.checkpoints_policy else None,
                history_k=self.comparator_history_k or 1, keep_loaded=self.keep_comparator_loaded,
                api_config=self._api_config)
        self._round_raw = {"target": [], "comparator": []}
        self._round_outcomes = torch.zeros(3)
        self._round_parse_failures = 0
        self._collaboration_failures = self.collaboration.parse_failures if self.collaboration is not None else 0
        self.comparator.start_round(iteration)

    def end_round(self) -> None:
        self.comparator.end_round()

    def oracle(self) -> RewardCaller:
        """What scores candidates: the task reward (MARLHFIter may use its reward model)."""
        return self.collection_engine.reward

    @torch.no_grad()
    def collect_pairs(self, items: Sequence[Mapping[str, Any]]) -> list[PreferencePair]:
        """Current vs comparator candidates for ``items``, scored in one oracle call, selected per item."""
        engine, N, M = self.collection_engine, self.num_agents, len(items)
        K_cur = engine.num_generations  # preference_num_candidates
        K_cmp = self.comparator_num_candidates or K_cur
        prompts = engine.first_prompts(items)  # [N][M]
        current = engine.sample([self.policy_model(i) for i in range(N)], self.tokenizers, prompts, K_cur)
        current_texts = [c.texts for c in current]  # [N][M*K_cur]
        comparator_texts = self.comparator_candidates(items, prompts, K_cmp)  # [N][M*K_cmp]

        oracle = self.oracle()
        rows = [m for m in range(M) for _ in range(K_cur)] + [m for m in range(M) for _ in range(K_cmp)]
        raw = oracle.raw([current_texts[i] + comparator_texts[i] for i in range(N)],
                         prompts=[prompts[0][m] for m in rows], batch_items=[items[m] for m in rows])
        raw = torch.tensor(raw, dtype=torch.float64)
        scores = torch.tensor(oracle.process(raw.tolist()), dtype=torch.float64)
        split = M * K_cur
        cur_raw, cmp_raw = raw[:split].view(M, K_cur), raw[split:].view(M, K_cmp)
        cur, cmp = scores[:split].view(M, K_cur), scores[split:].view(M, K_cmp)
        self._round_raw["target"] += cur_raw.flatten().tolist()
        self._round_raw["comparator"] += cmp_raw.flatten().tolist()
        n = min(K_cur, K_cmp)
        gaps = cur[:, :n] - cmp[:, :n]
        self._round_outcomes += torch.stack([(gaps > 0).sum(), (gaps < 0).sum(), (gaps == 0).sum()]).float()

        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))  # via the global RNG
        item_means = torch.cat([cur, cmp], dim=1).mean(dim=1).tolist()  # [M] over both sides' candidates
        pairs = []
        for m in range(M):
            for k, current_wins in select_comparison_pairs(cur[m], cmp[m], self.pair_selection,
                                                           self.preference_pairs_per_sample, generator):
                cur_side = ([t[m * K_cur + k] for t in current_texts], float(cur[m, k]), float(cur_raw[m, k]))
                cmp_side = ([t[m * K_cmp + k] for t in comparator_texts], float(cmp[m, k]), float(cmp_raw[m, k]))
                winner, loser = (cur_side, cmp_side) if current_wins else (cmp_side, cur_side)
                pairs.append(PreferencePair(
                    prompts=[prompts[i][m] for i in range(N)],
                    winner_completions=winner[0], loser_completions=loser[0],
                    winner_reward=winner[1], loser_reward=loser[1], candidate_reward_mean=item_means[m],
                    raw_rewards=[winner[2], loser[2]],
                    target_raw_reward=cur_side[2], comparator_raw_reward=cmp_side[2],
                ))
        tokenize_pairs(pairs, self.tokenizers, engine.model_input)
        return pairs

    def comparator_candidates(self, items, prompts: list[list[str]], K: int) -> list[list[str]]:
        """[N][M*K] comparator texts; centralized generation writes every role in one joint completion."""
        if not self.centralized_comparator:
            return self.comparator.sample(list(range(self.num_agents)), prompts, K, items)
        adapter, N = self.centralized_comparator_adapter, self.num_agents
        joint = [joint_prompt(adapter, item, [prompts[i][m] for i in range(N)]) for m, item in enumerate(items)]
        texts = self.comparator.sample([self.comparator_centralized_agent_index], [joint], K, items)[0]
        # An unparsable joint answer becomes empty role outputs (CoMLRL aborts training here); counted in iter/*.
        roles = [split_joint(adapter, text, items[r // K], N, on_parse_error="empty") for r, text in enumerate(texts)]
        self._round_parse_failures += sum(1 for parts in roles if not any(parts))
        return [[parts[i] for parts in roles] for i in range(N)]

    # ------------------------------------------------------------------ replay and logging
    def replay_pairs(self, index: ReplayIndex, fresh: list[PreferencePair]) -> list[PreferencePair]:
        """The round's training pairs by ``preference_replay_mode`` (drawn with a seed from the global RNG, so
        runs and resumes repeat), tokenised from text where they came from files."""
        rng = random.Random(int(torch.randint(0, 2**31 - 1, ())))
        pairs = index.sample(self.preference_replay_mode, fresh, self.preference_replay_sample_size,
                             k=self.preference_replay_k, lam=self.preference_replay_lambda, rng=rng)
        tokenize_pairs([p for p in pairs if not p.prompt_ids], self.tokenizers, self.collection_engine.model_input)
        return pairs

    def finish_collection(self, iteration: int, fresh: list[PreferencePair], train: list[PreferencePair],
                          index: ReplayIndex) -> None:
        """Round ``iteration``'s pairs are collected and its training pairs chosen; training starts next."""
        self.log_round(iteration, fresh, train, index)

    def log_round(self, iteration: int, fresh: list[PreferencePair], train: list[PreferencePair],
                  index: ReplayIndex) -> None:
        """``iter/*`` metrics (and reward distributions) of round ``iteration``, straight to the loggers."""
        wins, losses, ties = self._round_outcomes.tolist()
        target, comparator = self._round_raw["target"], self._round_raw["comparator"]
        metrics = {
            "iter/current_iteration": float(iteration + 1),
            "iter/current_preference_pairs": float(len(fresh)),
            "iter/total_preference_pairs": float(sum(s.num_pairs for s in index.shards)),
            "iter/train_preference_pairs": float(len(train)),
            "iter/target_reward_mean": _mean(target),
            "iter/comparator_reward_mean": _mean(comparator),
            "iter/current_win_rate": wins / max(wins + losses + ties, 1),
            "iter/tie_rate": ties / max(wins + losses + ties, 1),
            "env_step": float(self.env_step),
        }
        if self.centralized_comparator:
            metrics["iter/comparator_parse_failures"] = float(self._round_parse_failures)
        if self.collaboration is not None:  # joint answers (either side) the adapter could not split
            metrics["iter/collaboration_parse_failures"] = \
                float(self.collaboration.parse_failures - self._collaboration_failures)
        plots = {}
        if self.log_reward_distribution:
            low, high = reward_range_of(self.collection_engine.reward.reward_func)
            record = distribution_record(
                iteration + 1, low, high, target=target, comparator=comparator,
                selected_target=[p.target_raw_reward for p in train if p.target_raw_reward is not None],
                selected_comparator=[p.comparator_raw_reward for p in train if p.comparator_raw_reward is not None])
            directory = self.run_dir("reward_distributions")
            write_json_atomic(record, directory / f"iteration_{iteration + 1:04d}.json")
            metrics.update(distribution_metrics(record, pair_count=len(train)))
            for part, prefix in (("candidate", "iter/reward_distribution"),
                                 ("selected", "iter/selected_reward_distribution")):
                for kind in ("line", "bar"):
                    svg = svg_chart(record[part], record["bin_edges"], kind)
                    plots[f"{prefix}/iteration_{iteration + 1:04d}/{kind}_plot"] = svg
                    # The same chart as a file, for loggers without HTML panels (CSV, TensorBoard).
                    (directory / f"iteration_{iteration + 1:04d}_{part}_{kind}.svg").write_text(svg, encoding="utf-8")
        metrics = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
        log.info("round %d/%d: %d new pairs (current wins %.0f, comparator wins %.0f, ties %.0f), %d to train on",
                 iteration + 1, self.num_iterations, len(fresh), wins, losses, ties, len(train))
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=self.trainer.global_step)
            if plots and type(logger).__name__ == "WandbLogger":
                import wandb

                logger.experiment.log({k: wandb.Html(v) for k, v in plots.items()}, commit=False)
            if plots and type(logger).__name__ == "TensorBoardLogger":
                for side, values in (("target", target), ("comparator", comparator)):
                    if values:
                        logger.experiment.add_histogram(f"iter/reward_distribution/{side}", torch.tensor(values),
                                                        global_step=iteration + 1)
        self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _comparator_seed() -> int:
    """A seed for the comparator's stream that differs from the policy's but follows ``seed_everything``."""
    return (torch.initial_seed() * 6364136223846793005 + 1442695040888963407) % (2**63)
