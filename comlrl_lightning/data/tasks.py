"""TaskDataModule: the dataset items the agents act on, and the experience they produce.

For an on-policy module (the MAGRPO family, IAC/MAAC, MARLHF's RL stage) the training loader yields
``RolloutBatch``-es: the step's items plus the team policy the module handed over when the fit started
(``attach_rollouts``). The training step resolves the batch — the rollout trees are sampled then, by the current
weights. Sampling in the loader itself would be stale: Lightning fetches the next batch before running the current
step, so a rollout sampled in ``__iter__`` would come from the weights one update back. Without a policy the loader
yields plain lists of items (evaluation, a module used outside the CLI).

Sources (``dataset`` / ``eval_dataset``): a list of dicts; a local ``.json``/``.jsonl``(``.gz``)/``.csv``/
``.parquet`` file or a ``save_to_disk`` directory; the import path of a function returning items
(``comlrl_lightning.envs.toy.story_tasks``); or a Hugging Face dataset id loaded with ``split``.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from comlrl_lightning.data.dynamic_sampling import DynamicSampling, ExtraItems
from comlrl_lightning.rollout.policy import TeamPolicy
from comlrl_lightning.rollout.tree import Rollout
from comlrl_lightning.runs import ranks

DatasetSource = str | Sequence[Mapping[str, Any]] | Callable[[], Any] | None

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_items(source: DatasetSource, split: str = "train", field: str = "dataset", **load_kwargs: Any):
    """Resolve ``source`` to an indexable collection of dict items (list or ``datasets.Dataset``); errors name
    ``field`` (``dataset`` or ``eval_dataset``)."""
    if source is None:
        return None
    if callable(source):
        return _check_items(source(), source)
    if not isinstance(source, str):
        return _check_items(list(source), "dataset list")
    path = Path(source).expanduser()
    if path.exists():
        import datasets

        if path.is_dir():
            try:
                loaded = datasets.load_from_disk(str(path))
            except Exception as err:
                raise ValueError(
                    f"{field} {source!r} is a directory but not one written by Dataset.save_to_disk "
                    f"({type(err).__name__}: {err})."
                ) from err
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        suffixes = [s for s in path.suffixes if s != ".gz"]
        fmt = _FILE_FORMATS.get(suffixes[-1] if suffixes else "")
        if fmt is None:
            raise ValueError(
                f"{field} file {source!r}: unsupported extension {''.join(path.suffixes) or '(none)'}; "
                f"use one of {', '.join(sorted(_FILE_FORMATS))} (optionally .gz)."
            )
        if path.stat().st_size == 0:
            raise ValueError(f"{field} {source!r} has no items (the file is empty).")
        quiet = not datasets.utils.logging.is_progress_bar_enabled()
        verbosity = datasets.utils.logging.get_verbosity()
        datasets.utils.logging.disable_progress_bar()  # a local file: no "Generating train split" bars
        datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # its own "Failed to load JSON" line
        try:
            return datasets.load_dataset(fmt, data_files=str(path), split="train")
        except Exception as err:  # truncated JSON, bad CSV, ...: the datasets library's error, without its internals
            cause = err.__cause__ or err
            problem = (json_problem(path) if fmt == "json" else None) or f"{type(cause).__name__}: {str(cause)[:300]}"
            raise ValueError(f"{field} file {source!r} could not be read as {fmt}: {problem}") from err
        finally:
            datasets.utils.logging.set_verbosity(verbosity)
            if not quiet:
                datasets.utils.logging.enable_progress_bar()
    if _looks_like_path(source):
        raise FileNotFoundError(f"{field} {source!r} looks like a local path but does not exist.")
    function = _import_callable(source)
    if function is not None:
        return _check_items(function(), source)
    import datasets

    try:
        return datasets.load_dataset(source, split=split, **load_kwargs)
    except (ConnectionError, FileNotFoundError, OSError, ValueError) as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = " The machine is offline (HF_HUB_OFFLINE=1)." if offline else ""
        raise FileNotFoundError(
            f"{field} {source!r} (split {split!r}) could not be loaded: {err}.{hint} Point `{field}` at a local "
            "file (.json/.jsonl/.csv/.parquet), a save_to_disk directory, or a function's import path."
        ) from err


def json_problem(path: Path) -> str | None:
    """Where a ``.json``/``.jsonl`` file stops being what a dataset file must be (a JSON list of objects, or one
    object per line), as ``line N: ...`` in the file's own lines; None when Python's json finds nothing wrong."""
    import gzip
    import json

    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        return f"{type(err).__name__}: {err}"
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return "the file holds no JSON"
    if path.name.removesuffix(".gz").endswith(".jsonl"):
        return _json_lines_problem(lines)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as err:
        if not lines[first].lstrip().startswith("["):  # JSON lines in a .json file: say which line
            return _json_lines_problem(lines)
        message = err.msg.removesuffix(" starting at")
        return f"line {err.lineno}, column {err.colno}: {message} (a .json file holds one JSON list of objects)"
    if isinstance(whole, dict):
        return None
    rows = whole if isinstance(whole, list) else [whole]
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        return f"item {bad} is a JSON {type(rows[bad]).__name__}, not an object: every item must be a JSON object"
    return None


def _json_lines_problem(lines: list[str]) -> str | None:
    import json

    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            message = err.msg.removesuffix(" starting at")
            return f"line {number}, column {err.colno}: {message} (each line of a .jsonl file is one JSON object)"
        if not isinstance(row, dict):
            return f"line {number} is a JSON {type(row).__name__}, not an object (each line must be one JSON object)"
    return None


def _looks_like_path(text: str) -> bool:
    """A string that can only mean a file (a hub id is ``name`` or ``org/name``; an import path has no slash)."""
    return (
        text.startswith(("/", "./", "../", "~"))
        or text.count("/") > 1
        or any(text.endswith(ext) or text.endswith(ext + ".gz") for ext in _FILE_FORMATS)
    )


def _import_callable(path: str) -> Callable | None:
    """``pkg.module.function`` → the function, when ``path`` looks like one and imports; else None."""
    if "/" in path or "." not in path:
        return None
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    target = getattr(module, attr, None)
    return target if callable(target) else None


def _check_items(items: Any, origin: Any):
    if not hasattr(items, "__getitem__") or not hasattr(items, "__len__"):
        raise TypeError(
            f"dataset from {origin!r} must be a list of dicts or a datasets.Dataset, got {type(items).__name__}."
        )
    if len(items) and not isinstance(items[0], Mapping):
        raise TypeError(f"dataset items from {origin!r} must be dicts, got {type(items[0]).__name__}.")
    return items


class _Items(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int | list[int]) -> Mapping[str, Any] | list[Mapping[str, Any]]:
        if isinstance(index, list):  # a batch of indices (ShardedBatches)
            return [self.items[i] for i in index]
        return self.items[index]


class EpochSampler(Sampler[int]):
    """Dataset order for each epoch: fixed (CoMLRL) or a permutation seeded by ``seed + epoch``.

    ``skip`` drops the first indices of the next epoch only: a run resumed mid-epoch continues where the
    checkpointed run was instead of replaying the epoch's first items.
    """

    def __init__(self, size: int, shuffle: bool, seed: int, skip: int = 0, passes: int = 1):
        self.size, self.shuffle, self.seed, self.epoch, self.skip = size, shuffle, seed, 0, skip
        self.passes = passes  # whole passes over the data in one epoch, each in its own order

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at each epoch start
        self.epoch = epoch

    def order(self) -> list[int]:
        """This epoch's indices (every rank computes the same order)."""
        order = []
        for p in range(self.passes):
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch * self.passes + p)
                order += torch.randperm(self.size, generator=generator).tolist()
            else:
                order += range(self.size)
        return order

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return iter(self.order()[skip:])

    def __len__(self) -> int:
        return self.size * self.passes


class ShardedBatches(DistributedSampler):
    """Batches of indices for one rank: the epoch's order (:class:`EpochSampler`) cut into global batches of
    ``batch_size × world`` indices, of which rank r takes its even, contiguous part (``ranks.shard``). Every rank
    makes the same number of steps; within an epoch no index is dropped or repeated — the last global batch may be
    short, and a rank's part of it empty when it has fewer indices than there are ranks. One process: the order in
    batches of ``batch_size``, as a plain loader would give.

    A ``DistributedSampler`` by type, so Lightning keeps it instead of wrapping it in its own (which pads an epoch
    with repeated items). ``skip`` drops the next epoch's first global batches (a resumed run).
    """

    def __init__(
        self,
        size: int,
        batch_size: int,
        shuffle: bool,
        seed: int,
        skip: int = 0,
        passes: int = 1,
        num_replicas: int = 1,
        rank: int = 0,
    ):
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.order_of = EpochSampler(size, shuffle, seed, passes=passes)
        self.batch_size, self.skip = batch_size, skip

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.order_of.set_epoch(epoch)

    def __iter__(self):
        order, width = self.order_of.order(), self.batch_size * self.num_replicas
        skip, self.skip = self.skip, 0
        for start in range(skip * width, len(order), width):
            yield ranks.shard(order[start : start + width], self.rank, self.num_replicas)

    def __len__(self) -> int:
        return math.ceil(
            len(self.order_of) / (self.batch_size * self.num_replicas)
        )  # a whole epoch, as Lightning counts


def _as_list(batch: list) -> list:
    return batch


class RolloutBatch:
    """A batch of experience for an on-policy module: ``items`` whose rollout trees are sampled when the training
    step resolves the batch — by the weights of that moment. (Lightning fetches a batch one step ahead of its
    training step, so trees sampled in the loader would come from the weights one update back.) Iterating it
    gives the items. With ``dynamic`` (dynamic sampling, ``data/dynamic_sampling.py``) the tied nodes are dropped and
    refilled from extra items."""

    def __init__(self, items: list[Mapping[str, Any]], policy: TeamPolicy, dynamic: DynamicSampling | None = None):
        self.items, self.policy, self.dynamic = list(items), policy, dynamic
        self.ahead: Any = None  # one-step-off: the rollout sampled while the previous step updated (a Future)

    def resolve(self, **stamps: Any) -> Rollout:
        """The rollout trees of the items, sampled now (``stamps``: policy_version, env_step, reward) — or, started
        ahead (``max_staleness``), as that sampling finished (its own stamps: the weights it sampled with)."""
        if self.ahead is not None:
            return self.ahead.result()
        if self.dynamic is not None:
            return self.dynamic.resolve(self.policy, self.items, **stamps)
        return self.policy.rollout(self.items, **stamps)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


class _Rollouts:
    """The collate function of a rollout loader: a batch of items becomes a ``RolloutBatch`` of ``policy``. With
    ``stamps`` (one-step-off rollouts, ``max_staleness``) each batch starts sampling as it is made — the loader makes
    a batch one batch early (``ResumableDataLoader(ahead=True)``) — once the previous batch's sampling is done: it
    samples on the servers while the training step before it updates."""

    def __init__(self, policy: TeamPolicy, dynamic: DynamicSampling | None = None, stamps: Any = None):
        self.policy, self.dynamic, self.stamps = policy, dynamic, stamps
        self.previous: Any = None

    def __call__(self, items: list) -> RolloutBatch:
        batch = RolloutBatch(items, self.policy, self.dynamic)
        if self.stamps is not None:
            if self.previous is not None:
                self.previous.exception()  # one sampling at a time: the servers' weights change only between them
            batch.ahead = self.previous = self.policy.rollout_ahead(items, **self.stamps())
        return batch


def _one_ahead(batches: Any) -> Any:
    previous = next(batches, None)
    for batch in batches:  # made (and its sampling started) before the previous batch's step runs
        yield previous
        previous = batch
    if previous is not None:
        yield previous


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning treats as resumable mid-epoch.

    The position itself comes from Lightning's restored batch progress (``TaskDataModule._resume_offset``), so
    there is nothing of its own to save; the methods mark it as resumable for Lightning's resume check.
    """

    def __init__(self, *args: Any, seed: int = 0, ahead: bool = False, **kwargs: Any):
        # Its own generator: creating an iterator would otherwise draw from the global RNG, so a run resumed at
        # an epoch boundary would sample differently from an uninterrupted one.
        super().__init__(*args, generator=torch.Generator().manual_seed(seed), **kwargs)
        self.ahead = ahead

    def __iter__(self):
        """Batches in order; with ``ahead`` (one-step-off rollouts) each batch is made one batch early — making a
        rollout batch starts its sampling — so batch t+1 samples while the training step of batch t updates."""
        batches = super().__iter__()
        if not self.ahead:
            return batches
        return _one_ahead(batches)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class TaskDataModule(LightningDataModule):
    """Dataset items for rollouts and evaluation.

    Args:
        dataset: training items (see module docstring for the accepted sources).
        eval_dataset: evaluation items (default: none; periodic evaluation is then skipped with a warning).
        test_dataset: the items the ``test`` subcommand evaluates (null: the evaluation items).
        predict_dataset: the items the ``predict`` subcommand answers (null: the evaluation items, else the
            training items).
        split: the training split of a hub dataset.
        eval_split: the evaluation split of a hub dataset.
        test_split: the split of a hub ``test_dataset`` (and of a hub ``predict_dataset``).
        prompts_per_step: items per training step; their trees are sampled together (batched generation).
            1 reproduces CoMLRL's batch size of one.
        eval_batch_size: items per evaluation batch.
        shuffle: reshuffle the training order every epoch (seeded); False keeps CoMLRL's fixed order.
        seed: seed of the shuffled order.
        max_train_items: train on the first n items only (null: all).
        max_eval_items: evaluate on the first n items only (null: all).
        load_kwargs: extra arguments of ``datasets.load_dataset`` (e.g. ``name`` for a config).
    """

    def __init__(
        self,
        dataset: DatasetSource = None,
        eval_dataset: DatasetSource = None,
        test_dataset: DatasetSource = None,
        predict_dataset: DatasetSource = None,
        split: str = "train",
        eval_split: str = "test",
        test_split: str = "test",
        prompts_per_step: int = 1,
        eval_batch_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        max_train_items: int | None = None,
        max_eval_items: int | None = None,
        load_kwargs: dict[str, Any] | None = None,
    ):
        super().__init__()
        if dataset is None:
            raise ValueError(
                "dataset is required: a list of dicts, a local file, a function's import path "
                "or a Hugging Face dataset id."
            )
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1 (got {prompts_per_step}).")
        if eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1 (got {eval_batch_size}).")
        for name, value in (("max_train_items", max_train_items), ("max_eval_items", max_eval_items)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or null (got {value}).")
        self.dataset_source, self.eval_source = dataset, eval_dataset
        self.split, self.eval_split = split, eval_split
        self.prompts_per_step = prompts_per_step
        self.eval_batch_size = eval_batch_size
        self.shuffle, self.seed = shuffle, seed
        self.max_train_items, self.max_eval_items = max_train_items, max_eval_items
        self.load_kwargs = load_kwargs or {}
        self.rollout_policy: TeamPolicy | None = None  # set by an on-policy module when the fit starts
        self.rollout_ahead: Any = None  # one-step-off rollouts: the stamps of a batch started ahead (max_staleness)
        self.dynamic_sampling: DynamicSampling | None = None  # likewise, when its dynamic_sampling is on
        self.saved_world_size = 1  # processes of the run a checkpoint came from (resume)
        # Loaded now, so that a missing, empty or unreadable dataset is reported before any model loads.
        self.train_items = _head(load_items(self.dataset_source, self.split, **self.load_kwargs), self.max_train_items)
        if len(self.train_items) == 0:
            raise ValueError(f"dataset {self.dataset_source!r} has no items.")
        self.extra_items = ExtraItems(self.train_items, self.seed)  # dynamic sampling's refills (attach_rollouts)
        self.eval_items_ = None
        if self.eval_source is not None:
            self.eval_items_ = _head(
                load_items(self.eval_source, self.eval_split, "eval_dataset", **self.load_kwargs), self.max_eval_items
            )
            if len(self.eval_items_) == 0:
                raise ValueError(f"eval_dataset {self.eval_source!r} has no items.")
        self.test_items_, self.predict_items_ = (
            self._load_optional(source, field, test_split, self.max_eval_items)
            for source, field in ((test_dataset, "test_dataset"), (predict_dataset, "predict_dataset"))
        )

    def _load_optional(self, source: DatasetSource, field: str, split: str, limit: int | None):
        if source is None:
            return None
        items = _head(load_items(source, split, field, **self.load_kwargs), limit)
        if len(items) == 0:
            raise ValueError(f"{field} {source!r} has no items.")
        return items

    def setup(self, stage: str | None = None) -> None:
        """Nothing left to do: the items were loaded (and checked) when the module was built."""

    def attach_rollouts(
        self,
        policy: TeamPolicy | None,
        dynamic_sampling: bool = False,
        max_extra_prompts: int | None = None,
        tie_by_components: bool = True,
        ahead: Any = None,
    ) -> None:
        """Serve ``RolloutBatch``-es of ``policy`` (on-policy modules hand theirs over when the fit starts; None:
        plain lists of items). ``dynamic_sampling``: their tied nodes are dropped and refilled from this module's
        stream of extra training items, at most ``max_extra_prompts`` per step and rank (None: as many as the step's
        own items; ``tie_by_components``: a node ties only when its reward components tie too;
        ``data/dynamic_sampling.py``). ``ahead``: one-step-off rollouts, each batch sampled as it is made, with the
        stamps ``ahead()`` returns then (``max_staleness``)."""
        self.rollout_policy, self.rollout_ahead = policy, ahead
        self.dynamic_sampling = None
        if dynamic_sampling and policy is not None:
            self.dynamic_sampling = DynamicSampling(
                self.extra_items, max_extra_prompts, self.prompts_per_step, self._step_under_way, tie_by_components
            )

    def _step_under_way(self) -> int | None:
        """The key of the training step under way (the count of started steps; None between steps or outside a
        fit): what ``ExtraItems`` keys a step's draws by, so a checkpoint written mid-step keeps the position from
        before them."""
        trainer = self.trainer
        if trainer is None or getattr(trainer, "fit_loop", None) is None:
            return None
        total = trainer.fit_loop.epoch_loop.batch_progress.total
        return total.started if total.started > total.processed else None

    def train_dataloader(self) -> DataLoader:
        return self.sharded_loader(
            self.train_items,
            self.prompts_per_step,
            self.shuffle,
            _Rollouts(self.rollout_policy, self.dynamic_sampling, self.rollout_ahead)
            if self.rollout_policy
            else _as_list,
            ahead=self.rollout_policy is not None and self.rollout_ahead is not None,
        )

    def sharded_loader(
        self, items, batch_size: int, shuffle: bool, collate, passes: int = 1, ahead: bool = False
    ) -> DataLoader:
        """A resumable loader of this rank's batches of ``items`` (``ShardedBatches``), ``passes`` per epoch."""
        sampler = ShardedBatches(
            len(items),
            batch_size,
            shuffle,
            self.seed,
            passes=passes,
            num_replicas=ranks.world_size(),
            rank=ranks.rank(),
        )
        sampler.skip = self._resume_offset(batch_size, len(items) * passes)
        return ResumableDataLoader(
            _Items(items),
            seed=self.seed,
            ahead=ahead,
            batch_size=None,
            sampler=sampler,
            collate_fn=collate,
            num_workers=0,
        )

    def _resume_offset(self, batch_size: int, size: int) -> int:
        """Global batches of the current epoch already trained on, when Lightning is resuming a checkpoint
        mid-epoch.

        Lightning's own batch progress (restored from the checkpoint) says how many batches each rank consumed;
        the loader's prefetch makes counting yielded batches off by one, so we do not count them ourselves. A run
        resumed with a different number of processes converts that to items (batches × batch size × the
        checkpointed run's processes) and continues at the first whole global batch of its own after them
        (docs/scaling.md).
        """
        trainer = self.trainer
        if trainer is None or not trainer.fit_loop.restarting:
            return 0
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # training_step ran for these
        consumed = done * batch_size * self.saved_world_size
        # A checkpoint written by the epoch's last batch: Lightning starts the next epoch, from its beginning.
        return consumed // (batch_size * ranks.world_size()) if consumed < size else 0

    def state_dict(self) -> dict[str, Any]:
        """The run's process count; with dynamic sampling, every rank's position in its extra-item stream (gathered
        on every rank: rank 0 writes the checkpoint)."""
        state: dict[str, Any] = {"world_size": ranks.world_size()}
        if self.dynamic_sampling is not None:
            state["extra_items"] = ranks.gather(self.extra_items.saved_position(self._step_under_way()))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_world_size = int(state_dict.get("world_size", 1))
        if "extra_items" in state_dict:
            self.extra_items.load(state_dict["extra_items"])

    def val_dataloader(self):
        # During fit, evaluation runs in EvaluationCallback; the `validate` subcommand
        # evaluates the whole eval set through this loader.
        if self.eval_items_ is None or (self.trainer is not None and self.trainer.state.fn != "validate"):
            return []
        return DataLoader(
            _Items(self.eval_items_),
            batch_size=self.eval_batch_size,
            collate_fn=_as_list,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def test_dataloader(self) -> DataLoader:
        """The ``test`` subcommand's items: ``test_dataset``, else the evaluation items."""
        items = self.test_items_ if self.test_items_ is not None else self.eval_items_
        if items is None:
            raise ValueError("The test subcommand needs items: set data.init_args.test_dataset (or eval_dataset).")
        return self._items_loader(items)

    def predict_dataloader(self) -> DataLoader:
        """The ``predict`` subcommand's items: ``predict_dataset``, else the evaluation items, else the training
        items."""
        for items in (self.predict_items_, self.eval_items_, self.train_items):
            if items is not None:
                return self._items_loader(items)

    def _items_loader(self, items) -> DataLoader:
        """This rank's share of ``items`` in order, ``eval_batch_size`` per batch."""
        return DataLoader(_Items(items), batch_size=self.eval_batch_size, collate_fn=_as_list, shuffle=False)

    def first_items(self, stage: str | None = None) -> dict[str, Mapping[str, Any]]:
        """The first item of each split a run of ``stage`` reads, by the split's name (``fit``: the training and
        evaluation items; ``validate``: the evaluation items; ``test`` and ``predict``: theirs; None: every split):
        what ``algorithms.team.check_first_items`` formats before any model loads."""
        test = self.test_items_ if self.test_items_ is not None else self.eval_items_
        predict = next((s for s in (self.predict_items_, self.eval_items_, self.train_items) if s is not None), None)
        splits = {
            "training items (dataset)": (self.train_items, ("fit",)),
            "evaluation items (eval_dataset)": (self.eval_items_, ("fit", "validate")),
            "test items (test_dataset)": (test, ("test",)),
            "predict items (predict_dataset)": (predict, ("predict",)),
        }
        return {
            name: items[0]
            for name, (items, stages) in splits.items()
            if items is not None and len(items) and (stage is None or stage in stages)
        }

    def eval_items(self, n: int) -> list[Mapping[str, Any]]:
        """The first ``n`` evaluation items (CoMLRL evaluates a fixed head of the eval set)."""
        if self.eval_items_ is None:
            return []
        return [self.eval_items_[i] for i in range(min(n, len(self.eval_items_)))]


def _head(items, n: int | None):
    if items is None or n is None or n >= len(items):
        return items
    return items.select(range(n)) if hasattr(items, "select") else items[:n]
