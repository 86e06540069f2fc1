"""Import paths for CLI tests that run in a separate process (``PYTHONPATH`` includes ``tests/``)."""

import glob
import os
import time

from comlrl_lightning.envs.toy import story_reward


def story_reward_that_hangs_after_a_checkpoint(*completions, batch_items=None):
    """The story reward, until a checkpoint matching ``$HANG_AFTER`` exists: then it hangs (the test kills the
    process), so the kill always falls after that checkpoint and before the run ends."""
    if glob.glob(os.environ["HANG_AFTER"]):
        time.sleep(600)
    return story_reward(*completions, batch_items=batch_items)


def story_reward_without_range(openings, closings):
    """A team reward that does not declare ``reward_range``."""
    return story_reward(openings, closings)
