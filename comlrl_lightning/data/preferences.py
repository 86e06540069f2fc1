"""PreferenceDataModule: task items in, preference pairs collected from the current agents out.

The data module owns pair collection, the round's comparator and the replay. Its module hands it one explicit
interface when the fit starts (:meth:`PreferenceDataModule.attach`): a :class:`PairPlan` — the team's
:class:`~comlrl_lightning.rollout.policy.TeamPolicy` (current weights, sampling, the oracle reward) and the rules
of collection and serving — never the module itself.

* **MADPO**: the loader samples K_c joint candidates per task from the policy (``prompts_per_step`` tasks per
  batched generation, with a progress bar), scores them with the oracle, turns score differences into pairs and
  serves them in shuffled batches of ``batch_size`` pairs. Lightning builds the train loader once per fit, so the
  pairs are collected once and every epoch is one pass over them.
* **MARLHF**: the first ``pair_epochs`` epoch(s) serve pairs (the reward-model stage), later epochs serve task
  items (the RL stage); the loader is rebuilt every epoch.
* **Iterative** (MADPOIter, MARLHFIter; a ``RoundPlan``): every round's first epoch collects the round's pairs
  (current agents vs the comparator, ``data/rounds.py``), writes them as the replay shard ``iteration_XXXX.json``,
  registers the shard in the replay index and serves the pairs the replay mode draws (docs/iterative.md). The
  round's report (``last_round``) is logged by the ``RoundMetrics`` callback.

The served pairs, the replay index, the comparator's random stream and the run directories are part of the data
module's state: a checkpoint holds them and a resumed run trains on the same pairs instead of sampling new ones.
``pairs_file`` writes the collected pairs of a non-iterative run as JSON (docs/algorithms.md).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from comlrl_lightning.agents.sharding import gathered
from comlrl_lightning.comparators.sources import IndependentRNG
from comlrl_lightning.core.pairs import PreferencePair
from comlrl_lightning.data.replay import ReplayIndex
from comlrl_lightning.data.rounds import RoundCollector, RoundPlan, RoundReport
from comlrl_lightning.data.tasks import TaskDataModule, _as_list, _Items
from comlrl_lightning.rollout.policy import TeamPolicy
from comlrl_lightning.rollout.preferences import collect_preference_pairs, tokenize_pairs
from comlrl_lightning.runs import ranks, stop
from comlrl_lightning.runs.files import RunDirectories, remove_orphaned_writes, save_pairs

log = logging.getLogger(__name__)

_TENSOR_FIELDS = ("prompt_ids", "winner_ids", "loser_ids")


@dataclass
class PairPlan:
    """What a preference module hands its data module: the policy and the rules of collection and serving.

    Args:
        policy: the team now (sampling and the oracle reward that scores candidates).
        num_candidates: K_c, each agent's candidates per task.
        selection / limit: ``pair_selection`` and ``preference_pairs_per_sample``.
        batch_size: pairs per update.
        passes: passes over the pairs in one pair epoch, each in its own shuffled order.
        pair_epochs: of each round's epochs (of the fit's, without rounds), how many serve pairs; the rest serve
            task items (MARLHF's RL stage). None: every epoch serves pairs.
        rounds: iterative collection (None: collect once per fit).
        name: the algorithm's name, for messages.
        whole: the models to hold whole (gathered) while collecting, when FSDP shards them: the agents, and a
            reward model that scores candidates (empty: the policy's models).
    """

    policy: TeamPolicy
    num_candidates: int
    selection: str
    limit: int | None
    batch_size: int
    passes: int = 1
    pair_epochs: int | None = None
    rounds: RoundPlan | None = None
    name: str = "module"
    whole: Sequence[Any] = ()

    def round_epoch(self, epoch: int) -> int:
        return epoch % self.rounds.epochs_per_round if self.rounds is not None else epoch

    def serves_pairs(self, epoch: int) -> bool:
        return self.pair_epochs is None or self.round_epoch(epoch) < self.pair_epochs


class PreferenceDataModule(TaskDataModule):
    """Task items in, preference pairs out (module docstring); the ``TaskDataModule`` fields, plus:

    Args:
        pairs_file: write the pairs a non-iterative run collects to this JSON file (null: don't).
        show_progress: a progress bar while pairs are collected.
    """

    def __init__(self, *args: Any, pairs_file: str | None = None, show_progress: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if pairs_file is not None:
            target = Path(pairs_file).expanduser()
            if target.is_dir():
                raise ValueError(f"pairs_file must be a file path; {pairs_file!r} is a directory.")
            for orphan in remove_orphaned_writes(target.parent, target.name):  # left by a killed run's write
                log.info("removed %s, left by an interrupted write", orphan)
        self.pairs_file = pairs_file
        self.show_progress = show_progress
        self.plan: PairPlan | None = None
        self.pairs: list[PreferencePair] | None = None
        self.replay = ReplayIndex()  # iterative: one shard per non-empty round of this run
        self.dirs = RunDirectories()  # the replay directory, kept in checkpoints so a resumed run finds it
        self.comparator_rng = IndependentRNG(seed=_comparator_seed())
        self.rounds: RoundCollector | None = None
        self.last_round: RoundReport | None = None
        self._restored = False  # pairs came from a checkpoint and no loader has served them yet

    def attach(self, plan: PairPlan) -> None:
        """Called by the module when the fit starts (its models are loaded): what to collect and serve."""
        self.plan = plan
        if plan.rounds is not None:
            self.rounds = RoundCollector(plan.rounds, plan.policy, self.comparator_rng)
            if self.pairs_file:
                log.warning(
                    "pairs_file is not written by %s: every round's pairs are in its replay shards "
                    "(preference_replay_dir, default <log dir>/preference_replay/iteration_XXXX.json).",
                    plan.name,
                )
        if self.trainer is not None and (plan.rounds is not None or plan.pair_epochs is not None):
            # Rounds recollect and stages switch between pairs and tasks: rebuild the loader each epoch.
            self.trainer.reload_dataloaders_every_n_epochs = 1

    def train_dataloader(self) -> DataLoader:
        plan = self._attached()
        restored, self._restored = self._restored, False
        epoch = self.trainer.current_epoch
        serves_pairs = plan.serves_pairs(epoch)
        if serves_pairs and not restored:  # every (re)load collects afresh, except the first after a resume
            self.pairs = self.collect_round(epoch) if plan.rounds is not None else self.collect()
        if plan.rounds is not None and not self.pairs:
            # An empty round trains nothing (not even MARLHF's RL epochs) and the run goes on to the next round.
            # Lightning ends a fit at an empty loader, so every epoch of the round gets one no-op batch instead.
            if serves_pairs:
                log.warning(
                    "round %d: no pairs to train on; skipping this round's training.",
                    epoch // plan.rounds.epochs_per_round + 1,
                )
            return DataLoader(_Items([[]]), batch_size=None, collate_fn=_as_list)
        if not serves_pairs:
            return super().train_dataloader()  # MARLHF's RL stage: task items
        if not self.pairs:
            log.warning("%s: no non-tied preference pairs were generated; there is nothing to train on.", plan.name)
        return self.sharded_loader(self.pairs, plan.batch_size, True, _as_list, passes=plan.passes)

    def _attached(self) -> PairPlan:
        if self.plan is None:
            raise RuntimeError(
                "PreferenceDataModule serves preference modules (MADPO, MARLHF and their iterative "
                "variants): the module attaches its pair plan when the fit starts."
            )
        return self.plan

    # ------------------------------------------------------------------ collection
    def collect_pairs(self, items) -> list[PreferencePair]:
        """Pairs for ``items``: the round's comparisons (iterative), else the policy's own candidates."""
        plan, version = self._attached(), self.trainer.global_step if self.trainer is not None else 0
        if self.rounds is not None:
            return self.rounds.collect_pairs(items, policy_version=version)
        policy = plan.policy
        return collect_preference_pairs(
            policy.engine,
            policy.models,
            policy.tokenizers,
            items,
            selection=plan.selection,
            limit=plan.limit,
            policy_version=version,
            reward=policy.reward,
        )

    def collect(self, desc: str = "collecting preference pairs", name: str = "pair collection") -> list[PreferencePair]:
        """The pairs of every task: each rank collects from its share of the tasks (its comparator requests with
        them), then every rank holds all pairs, in task order. ``pairs_file`` is written once. ``desc``: the
        progress bar's label; ``name``: the phase's, in the log line of a stop."""
        indices = ranks.shard(range(len(self.train_items)))
        pairs: list[PreferencePair] = []
        bar = tqdm(
            total=len(indices), desc=desc, unit="task", disable=not self.show_progress or not rank_zero_only.rank == 0
        )
        plan = self._attached()
        # Nothing the data module keeps changes before the collection ends: Ctrl-C / SIGTERM may throw it away at a
        # task's end or inside one (runs/stop.py).
        discardable = stop.discardable(name, len(indices), "tasks")
        with bar, discardable as phase, gathered(list(plan.whole or plan.policy.models)):  # sharded: whole models
            for start in range(0, len(indices), self.prompts_per_step):
                chunk = [self.train_items[i] for i in indices[start : start + self.prompts_per_step]]
                pairs.extend(self.collect_pairs(chunk))
                bar.update(len(chunk))
                bar.set_postfix(pairs=len(pairs))
                phase.done += len(chunk)
        pairs = [pair for share in ranks.gather(pairs) for pair in share]
        log.info("collected %d preference pairs from %d tasks", len(pairs), len(self.train_items))
        if self.pairs_file and self.rounds is None:
            with ranks.rank_zero_first() as writer:
                if writer:
                    save_pairs(pairs, self.pairs_file)
        return pairs

    def collect_round(self, epoch: int) -> list[PreferencePair]:
        """One round: collect, write and register the shard, draw the training pairs, report."""
        plan = self.plan.rounds
        iteration = epoch // plan.epochs_per_round
        comparator_rng = self.comparator_rng.state_dict()
        self.rounds.start_round(iteration)
        try:
            fresh = self.collect(
                f"round {iteration + 1}/{plan.num_rounds}: collecting pairs",
                f"round {iteration + 1}/{plan.num_rounds}'s pair collection",
            )
        except stop.StopRequested:  # the round is thrown away: its comparator draws too (a checkpoint holds them)
            self.comparator_rng.load_state_dict(comparator_rng)
            raise
        finally:
            self.rounds.end_round()
        directory = ranks.broadcast(self.dirs.get(self.trainer, "preference_replay", plan.replay_dir))
        with ranks.rank_zero_first() as writer:  # one shard file, written once; every rank registers it
            self.replay.add(iteration + 1, fresh, directory, write=writer)
        train = self.replay_pairs(fresh)
        self.last_round = self.rounds.report(iteration, fresh, train, sum(s.num_pairs for s in self.replay.shards))
        wins, losses, ties = self.last_round.outcomes
        log.info(
            "round %d/%d: %d new pairs (current wins %.0f, comparator wins %.0f, ties %.0f), %d to train on",
            iteration + 1,
            plan.num_rounds,
            len(fresh),
            wins,
            losses,
            ties,
            len(train),
        )
        return train

    def replay_pairs(self, fresh: list[PreferencePair]) -> list[PreferencePair]:
        """The round's training pairs by ``preference_replay_mode`` (drawn with a seed from the global RNG, so
        runs and resumes repeat), tokenised from text where they came from files."""
        plan, policy = self.plan.rounds, self.plan.policy
        rng = random.Random(ranks.broadcast(int(torch.randint(0, 2**31 - 1, ()))))  # the same draw on every rank
        pairs = self.replay.sample(
            plan.replay_mode, fresh, plan.replay_sample_size, k=plan.replay_k, lam=plan.replay_lambda, rng=rng
        )
        tokenize_pairs([p for p in pairs if not p.prompt_ids], policy.tokenizers, policy.model_input)
        return pairs

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "replay": self.replay.state_dict(),
            "comparator_rng": self.comparator_rng.state_dict(),
            "run_dirs": self.dirs.state_dict(),
        }
        if self.pairs is not None:
            state["pairs"] = [{**p.to_record(), **{f: list(getattr(p, f)) for f in _TENSOR_FIELDS}} for p in self.pairs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "replay" in state_dict:
            self.replay.load_state_dict(state_dict["replay"])
        if "comparator_rng" in state_dict:
            self.comparator_rng.load_state_dict(state_dict["comparator_rng"])
        self.dirs.load_state_dict(state_dict.get("run_dirs", {}))
        if "pairs" in state_dict:
            self.pairs = []
            for record in state_dict["pairs"]:
                pair = PreferencePair.from_record({k: v for k, v in record.items() if k not in _TENSOR_FIELDS})
                for f in _TENSOR_FIELDS:
                    setattr(pair, f, [torch.as_tensor(t) for t in record[f]])
                self.pairs.append(pair)
            self._restored = True


def _comparator_seed() -> int:
    """A seed for the comparator's stream that differs from the policy's but follows ``seed_everything``."""
    return (torch.initial_seed() * 6364136223846793005 + 1442695040888963407) % (2**63)
