"""The replay index of an iterative run: one JSON shard per non-empty round (``iteration_XXXX.json``, written
atomically) and the draw of a round's training pairs from them by ``preference_replay_mode`` (the weights and the
sampling rule are ``comlrl_lightning.core.replay``'s; see that module's docstring)."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from comlrl_lightning.core.pairs import PreferencePair
from comlrl_lightning.core.replay import normalize_replay_mode, replay_weights
from comlrl_lightning.runs.files import load_pairs, save_pairs

SHARD_NAME = "iteration_{:04d}.json"


@dataclass
class ReplayShard:
    """One non-empty round's replay file: ``iteration`` (1-based round), ``path``, ``num_pairs`` (> 0)."""

    iteration: int
    path: str
    num_pairs: int


class ReplayIndex:
    """The shard list of one trainer run (newest last) plus file writing and replay sampling.

    Checkpoint it with ``state_dict()`` / ``load_state_dict()`` (plain dicts/lists/ints/strs).
    """

    def __init__(self, shards: Sequence[ReplayShard] | None = None) -> None:
        self.shards: list[ReplayShard] = list(shards or [])

    def __len__(self) -> int:
        return len(self.shards)

    def state_dict(self) -> dict[str, Any]:
        return {"shards": [asdict(shard) for shard in self.shards]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or not isinstance(state.get("shards"), (list, tuple)):
            raise ValueError("replay index state must be a mapping with a 'shards' list.")
        self.shards = [
            ReplayShard(iteration=int(s["iteration"]), path=str(s["path"]), num_pairs=int(s["num_pairs"]))
            for s in state["shards"]
        ]

    def add(
        self, iteration: int, pairs: Sequence[PreferencePair], directory: str | os.PathLike, write: bool = True
    ) -> Path:
        """Write round ``iteration``'s pairs to ``directory/iteration_{iteration:04d}.json`` (atomic, via
        ``save_pairs(..., metadata={"iteration": iteration})``), also when empty; register it iff non-empty.
        ``write=False`` registers a shard another process writes (the ranks of a data-parallel run but rank 0).

        Re-adding an iteration replaces its earlier shard (e.g. a round re-run after a resume).
        """
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be an int >= 0. (got {iteration!r})")
        path = Path(directory) / SHARD_NAME.format(iteration)
        if write:
            path = save_pairs(pairs, path, metadata={"iteration": iteration})
        self.shards = [shard for shard in self.shards if shard.iteration != iteration]
        if len(pairs) > 0:
            self.shards.append(ReplayShard(iteration=iteration, path=str(path), num_pairs=len(pairs)))
        return path

    def eligible(self, mode: str, k: int | None = None) -> list[ReplayShard]:
        """Shards a mode may draw from: ``current`` the newest, ``nearest_k`` the last k, else all."""
        mode = normalize_replay_mode(mode)
        if mode == "current":
            return self.shards[-1:]
        if mode == "nearest_k":
            replay_weights(1, mode, k=k)  # validates k
            return self.shards[-int(k) :]
        return list(self.shards)

    def sample(
        self,
        mode: str,
        current_pairs: Sequence[PreferencePair],
        sample_size: int | None = None,
        k: int | None = None,
        lam: float | None = None,
        rng: random.Random | None = None,
    ) -> list[PreferencePair]:
        """Training pairs of this round (docs/algorithms.md#iterative-rounds; algorithm in the module docstring).

        ``current`` returns ``list(current_pairs)`` (the same objects, no file reads). Historical modes draw S
        records from the eligible shards' files; loaded pairs have empty token tensors (re-tokenise from text).
        ``rng`` defaults to the ``random`` module's global generator.
        """
        mode = normalize_replay_mode(mode)
        if mode == "current":
            return list(current_pairs)
        if sample_size is not None and (
            isinstance(sample_size, bool) or int(sample_size) != sample_size or sample_size < 1
        ):
            raise ValueError(f"preference_replay_sample_size must be an int >= 1 or null. (got {sample_size!r})")
        rng = rng if rng is not None else random  # the module-level functions share the global Random
        shards = self.eligible(mode, k)
        weights = replay_weights(len(shards), mode, k=k, lam=lam)
        if sample_size is not None:
            S = int(sample_size)
        elif len(current_pairs) > 0:
            S = len(current_pairs)
        elif self.shards:
            S = self.shards[-1].num_pairs
        else:
            S = 0
        if S == 0 or not shards:
            return []

        draws = rng.choices(range(len(shards)), weights=weights, k=S)
        counts = [0] * len(shards)
        for j in draws:
            counts[j] += 1
        out: list[PreferencePair] = []
        for shard, c in zip(shards, counts):
            if c == 0:
                continue
            records = load_pairs(shard.path)
            size = len(records)
            if size != shard.num_pairs:
                raise ValueError(f"{shard.path}: replay index says num_pairs={shard.num_pairs}, file holds {size}.")
            remaining = c
            while remaining >= size:  # nested copies: whole shuffled passes over the shard
                copy = list(records)
                rng.shuffle(copy)
                out.extend(copy)
                remaining -= size
            if remaining:
                out.extend(rng.sample(records, remaining))
        rng.shuffle(out)
        return out
