"""PreferenceDataModule: task items in, preference pairs collected from the current agents out.

``train_dataloader`` asks the LightningModule (``collect_pairs(items)``, e.g. MADPO) to sample and score joint
candidates for every task — ``prompts_per_step`` tasks per batched generation, with a progress bar — and serves
the pairs in shuffled batches of the module's ``train_batch_size``. Lightning builds the train loader once per fit,
so the pairs are collected once and every epoch is one pass over them (``reload_dataloaders_every_n_epochs=1``
would recollect each epoch: the iterative variants' rounds).

Iterative modules (MADPOIter, MARLHFIter) make every round a reload: ``collect_round`` collects the round's pairs
(current vs comparator), writes them as the round's replay shard ``iteration_XXXX.json``, registers the shard in
the replay index and serves the pairs the module's replay mode chooses (REFERENCE §5.12).

The served pairs and the replay index are part of the data module's state: a checkpoint holds them (prompts,
texts, scores and token ids) and a resumed run trains on the same pairs instead of sampling new ones.
``pairs_file`` writes the collected pairs of a non-iterative run as JSON (REFERENCE §5.1 records).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from comlrl_lightning.core.pairs import PreferencePair, remove_orphaned_writes, save_pairs
from comlrl_lightning.core.replay import ReplayIndex
from comlrl_lightning.data.tasks import EpochSampler, ResumableDataLoader, TaskDataModule, _as_list, _Items

log = logging.getLogger(__name__)

_TENSOR_FIELDS = ("prompt_ids", "winner_ids", "loser_ids")


class PreferenceDataModule(TaskDataModule):
    """``TaskDataModule`` fields, plus ``pairs_file`` (write the collected pairs as JSON) and ``show_progress``."""

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
        self.pairs: list[PreferencePair] | None = None
        self.replay = ReplayIndex()  # iterative modules: one shard per non-empty round of this run
        self._restored = False  # pairs came from a checkpoint and no loader has served them yet

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None and (hasattr(module, "in_reward_model_stage") or getattr(module, "iterative", False)):
            # Two-stage modules (MARLHF) switch between pairs and tasks, iterative ones recollect every round:
            # rebuild the loader each epoch.
            self.trainer.reload_dataloaders_every_n_epochs = 1
        if module is not None and getattr(module, "iterative", False) and self.pairs_file:
            log.warning("pairs_file is not written by %s: every round's pairs are in its replay shards "
                        "(preference_replay_dir, default <log dir>/preference_replay/iteration_XXXX.json).",
                        module.algorithm_name)

    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module
        restored, self._restored = self._restored, False
        iterative = getattr(module, "iterative", False)
        reward_model_stage = getattr(module, "in_reward_model_stage", True)
        if reward_model_stage and (self.pairs is None or not restored):  # each (re)load collects, except on resume
            self.pairs = self.collect_round(module) if iterative else self.collect(module)
        if iterative and not self.pairs:
            # An empty round trains nothing (not even MARLHF's RL epochs) and the run goes on to the next round.
            # Lightning ends a fit at an empty loader, so every epoch of the round gets one no-op batch instead.
            if reward_model_stage:
                log.warning("round %d: no pairs to train on; skipping this round's training.", module.iteration + 1)
            return DataLoader(_Items([[]]), batch_size=None, collate_fn=_as_list)
        if not reward_model_stage:
            return super().train_dataloader()  # MARLHF's RL stage: task items
        if not self.pairs:
            log.warning("%s: no non-tied preference pairs were generated; there is nothing to train on.",
                        getattr(module, "algorithm_name", type(module).__name__))
        # ``pair_passes`` passes over the pairs in one epoch (MARLHF's reward_num_train_epochs, MADPOIter's
        # num_train_epochs), each in its own shuffled order.
        passes = getattr(module, "pair_passes", 1)
        skip = self._resume_offset(batch_size=module.pair_batch_size, size=len(self.pairs) * passes)
        sampler = EpochSampler(len(self.pairs), shuffle=True, seed=self.seed, skip=skip, passes=passes)
        return ResumableDataLoader(_Items(self.pairs), seed=self.seed, batch_size=module.pair_batch_size,
                                   sampler=sampler, collate_fn=_as_list, num_workers=0)

    def collect_round(self, module) -> list[PreferencePair]:
        """One round of an iterative module: collect, write and register the shard, choose the training pairs."""
        iteration = module.iteration
        module.start_round(iteration)
        try:
            fresh = self.collect(module, desc=f"round {iteration + 1}/{module.num_iterations}: collecting pairs")
        finally:
            module.end_round()
        self.replay.add(iteration + 1, fresh, module.run_dir("preference_replay", module.preference_replay_dir))
        train = module.replay_pairs(self.replay, fresh)
        module.finish_collection(iteration, fresh, train, self.replay)
        return train

    def collect(self, module, desc: str = "collecting preference pairs") -> list[PreferencePair]:
        items = self.train_items
        pairs: list[PreferencePair] = []
        bar = tqdm(total=len(items), desc=desc, unit="task",
                   disable=not self.show_progress or not rank_zero_only.rank == 0)
        for start in range(0, len(items), self.prompts_per_step):
            chunk = [items[i] for i in range(start, min(start + self.prompts_per_step, len(items)))]
            pairs.extend(module.collect_pairs(chunk))
            bar.update(len(chunk))
            bar.set_postfix(pairs=len(pairs))
        bar.close()
        log.info("collected %d preference pairs from %d tasks", len(pairs), len(items))
        if self.pairs_file and not getattr(module, "iterative", False):
            save_pairs(pairs, self.pairs_file)
        return pairs

    def state_dict(self) -> dict[str, Any]:
        if self.pairs is None:
            return {}
        return {"pairs": [{**p.to_record(), **{f: list(getattr(p, f)) for f in _TENSOR_FIELDS}} for p in self.pairs],
                "replay": self.replay.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "replay" in state_dict:
            self.replay.load_state_dict(state_dict["replay"])
        if "pairs" in state_dict:
            self.pairs = []
            for record in state_dict["pairs"]:
                pair = PreferencePair.from_record({k: v for k, v in record.items() if k not in _TENSOR_FIELDS})
                for f in _TENSOR_FIELDS:
                    setattr(pair, f, [torch.as_tensor(t) for t in record[f]])
                self.pairs.append(pair)
            self._restored = True
