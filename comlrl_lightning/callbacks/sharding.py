"""Sharded models whole while they are used (``agents/sharding.py``): under FSDP2 every sharded model of the module
(agents, critics, a reward model) is gathered once per training step and once per ``validate``/``test``/``predict``
run, and kept whole for it; resharded after. Without sharded models it does nothing."""

from __future__ import annotations

import contextlib

from lightning.pytorch import Callback

from comlrl_lightning.agents.sharding import gathered


class WholeModels(Callback):
    def __init__(self) -> None:
        self._whole: contextlib.ExitStack | None = None

    def gather(self, trainer, pl_module, *_) -> None:
        self.release(trainer, pl_module)
        self._whole = contextlib.ExitStack()
        self._whole.enter_context(gathered(pl_module.sharded_models()))

    def release(self, trainer, pl_module, *_) -> None:
        whole, self._whole = self._whole, None
        if whole is not None:
            whole.close()

    on_train_batch_start = on_validation_epoch_start = on_test_epoch_start = on_predict_epoch_start = gather
    on_train_batch_end = on_validation_epoch_end = on_test_epoch_end = on_predict_epoch_end = release
