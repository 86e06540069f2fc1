"""Messages every run would print that a user cannot act on, silenced once at import.

* Lightning's advertisements for its cloud products ("Tip: ... litlogger / litmodels").
* A deprecation inside Lightning's own pytree helper with recent torch (``isinstance(treespec, LeafSpec)``):
  raised by Lightning's code, not ours or the user's, and harmless.
* Lightning's advice to keep the pre-optimizer-step weights for step checkpoints under manual optimization: our
  checkpoints deliberately hold the state after the update (what an exact resume needs).
* Lightning's advice to lower ``log_every_n_steps`` for short epochs: every update is logged here regardless.

Only these exact messages are filtered; every other warning is shown as usual.
"""

from __future__ import annotations

import logging
import warnings


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


def quiet_known_noise() -> None:
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train_steps")
    # Each update is one row whatever log_every_n_steps says (runs/record.py): the advice does not apply.
    warnings.filterwarnings(
        "ignore",
        message=r"The number of training batches \(\d+\) is smaller than the logging "
        r"interval",
    )
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
