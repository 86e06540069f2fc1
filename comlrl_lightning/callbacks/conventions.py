"""The CLI's conventions for a module fitted from Python with a plain ``lightning.Trainer``.

``Trainer(max_steps=20).fit(module, datamodule=...)`` would show Lightning's own bar (``Epoch 4/-2 8/4 v_num``) and
keep one checkpoint per epoch, without ``last.ckpt``. Every module of this package returns from
``configure_callbacks`` (Lightning's hook for the callbacks a model needs) what the CLI sets up:

* our progress bar (``callbacks/progress.py``: updates counted, reward and loss shown, lines in a log file), in
  place of the bar ``Trainer`` adds by default — a bar you configured (``callbacks=[TQDMProgressBar(refresh_rate=10)]``,
  another class, ``enable_progress_bar=False``) is kept;
* ``RunCheckpoints`` (every 50 updates, at the end and on Ctrl-C, with ``last.ckpt``) in place of the
  ``ModelCheckpoint()`` ``Trainer`` adds by default — a ``ModelCheckpoint`` you configured, or
  ``enable_checkpointing=False``, is kept.

Each update is one row of metrics whatever ``log_every_n_steps`` says (``runs/record.py``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

from comlrl_lightning.callbacks.checkpoints import CHECKPOINT_EVERY, RunCheckpoints
from comlrl_lightning.callbacks.progress import progress_bar

DEFAULT_BARS: tuple[type, ...] = (TQDMProgressBar,)
if _RICH_AVAILABLE:
    from lightning.pytorch.callbacks import RichProgressBar

    DEFAULT_BARS += (RichProgressBar,)


def is_default_bar(bar: Any) -> bool:
    """The bar ``Trainer`` adds when none is given: Lightning's class itself, at its default refresh rate (and not
    one a config chose: the CLI marks those ``chosen``)."""
    return (
        type(bar) in DEFAULT_BARS and bar.refresh_rate == type(bar)().refresh_rate and not getattr(bar, "chosen", False)
    )


def is_default_checkpoint(callback: Any) -> bool:
    """The ``ModelCheckpoint()`` ``Trainer`` adds when none is given (Lightning's class, nothing configured)."""
    return (
        type(callback) is ModelCheckpoint
        and callback.dirpath is None
        and callback.filename is None
        and callback.monitor is None
        and not callback.save_last
        and callback.save_top_k == 1
        and not callback._every_n_train_steps
        and callback._every_n_epochs == 1
        and callback._train_time_interval is None
    )


def run_conventions(trainer: Any) -> list[Callback]:
    """The callbacks that replace Lightning's defaults on ``trainer`` (none when it has its own, or no trainer)."""
    if trainer is None:
        return []
    callbacks: list[Callback] = []
    bar = trainer.progress_bar_callback
    if bar is not None and is_default_bar(bar):
        trainer.callbacks.remove(bar)  # one bar at a time; Lightning replaces only callbacks of the same class
        callbacks.append(progress_bar())
    checkpoints = trainer.checkpoint_callbacks
    if trainer.state.fn == "fit" and checkpoints and all(is_default_checkpoint(c) for c in checkpoints):
        callbacks.append(RunCheckpoints(CHECKPOINT_EVERY))  # replaces ModelCheckpoint (a subclass's instance)
    return callbacks


def module_callbacks(module: Any) -> list[Callback]:
    """What a module's ``configure_callbacks`` returns: phase timing, the periodic evaluation (``eval_interval``,
    ``eval_num_samples``), the completions log (``log_completions``), predictions, validate/test rows, sharded models
    kept whole (after those that evaluate), and the CLI's conventions (:func:`run_conventions`)."""
    from comlrl_lightning.callbacks import CompletionsLogger, EvaluationCallback, PhaseTimer, PredictionWriter
    from comlrl_lightning.callbacks.evaluation import EvaluationRows
    from comlrl_lightning.callbacks.sharding import WholeModels

    callbacks: list[Callback] = [PhaseTimer()]
    if module.eval_interval > 0 and module.eval_num_samples > 0:
        callbacks.append(EvaluationCallback(module.eval_interval, module.eval_num_samples, at_end=module.eval_at_end))
    if module.log_completions:
        callbacks.append(CompletionsLogger())
    callbacks += [PredictionWriter(), EvaluationRows(), WholeModels()]
    return callbacks + run_conventions(module._trainer)
