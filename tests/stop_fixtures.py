"""Import paths for tests/test_stop_signals.py's CLI runs in a separate process (``PYTHONPATH`` includes ``tests/``):
the toy story reward and a callback that make one phase of a fit observable and slow, so that a test's SIGTERM lands
in it. ``$STOP_MARK`` names the file they create when the phase starts; without ``$STOP_AT_CALL`` (the reward) or
``$STOP_AT_UPDATE`` (the callback) they do nothing but the reward."""

import os
import time
from pathlib import Path

from lightning.pytorch import Callback

from comlrl_lightning.envs.toy import story_reward

PAUSE_S = 4.0  # the pause in the phase once it has started: the test's signal arrives within it


def _mark_and_pause() -> None:
    Path(os.environ["STOP_MARK"]).write_text(str(os.getpid()))
    time.sleep(PAUSE_S)  # a signal lands here; the phase goes on to its next safe point


def story_reward_slowed_at_call(*completions, batch_items=None):
    """The story reward; its call number ``$STOP_AT_CALL`` (counting calls with ``$STOP_JOINT`` joint actions,
    when set: evaluation calls have one per item, training calls K) marks the phase and pauses in it."""
    count = "STOP_JOINT" not in os.environ or len(completions[0]) == int(os.environ["STOP_JOINT"])
    if "STOP_AT_CALL" in os.environ and count:
        story_reward_slowed_at_call.calls += 1
        if story_reward_slowed_at_call.calls == int(os.environ["STOP_AT_CALL"]):
            _mark_and_pause()
    return story_reward(*completions, batch_items=batch_items)


story_reward_slowed_at_call.calls = 0


def letter_reward_slowed_at_call(*completions):
    """``letter_reward`` (any number of agents), its call number ``$STOP_AT_CALL`` marking the phase and pausing."""
    from comlrl_lightning.envs.toy import letter_reward

    if "STOP_AT_CALL" in os.environ:
        letter_reward_slowed_at_call.calls += 1
        if letter_reward_slowed_at_call.calls == int(os.environ["STOP_AT_CALL"]):
            _mark_and_pause()
    return letter_reward(*completions)


letter_reward_slowed_at_call.calls = 0


class PauseAfterUpdate(Callback):
    """After update ``$STOP_AT_UPDATE`` (the reward-model stage's, in a MARLHF run) marks the phase and pauses."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if "STOP_AT_UPDATE" in os.environ and trainer.global_step == int(os.environ["STOP_AT_UPDATE"]):
            _mark_and_pause()
