"""``python -m comlrl_lightning {fit,validate} --config configs/magrpo.yaml`` — a LightningCLI.

Any MultiAgentModule subclass is a valid ``model.class_path`` (MAGRPO, MARLOO, MAReMax, MAREINFORCE, your own);
reward functions, formatters and transitions are given by import path; every field can be overridden with a
dotted flag (``--model.init_args.num_generations 8``). Defaults: CSVLogger under ``outputs/``, a progress bar
showing the team reward, and a checkpoint at the end of training.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from comlrl_lightning.algorithms import MultiAgentModule
from comlrl_lightning.data import TaskDataModule


SECRET_KEYS = ("comparator_api_key",)  # literal credentials: never written to the run's config.yaml


class SecretSafeSaveConfig(SaveConfigCallback):
    """Writes the run's ``config.yaml`` like Lightning does, with credential fields replaced by ``<redacted>``
    (give keys through ``comparator_api_key_env`` to keep them out of configs altogether)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        config = self.config.clone()
        for key in list(config.keys()):
            if key.rsplit(".", 1)[-1] in SECRET_KEYS and config[key] is not None:
                config[key] = "<redacted>"
        self.config = config
        super().setup(trainer, pl_module, stage)


class ComlrlCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({
            "trainer.logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": "outputs", "name": "comlrl"}},
            "trainer.num_sanity_val_steps": 0,
            "trainer.log_every_n_steps": 1,
            "trainer.accelerator": "auto",
            "trainer.devices": 1,
        })


def main(args: list[str] | None = None, run: bool = True) -> ComlrlCLI:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return ComlrlCLI(
        MultiAgentModule,
        TaskDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_callback=SecretSafeSaveConfig,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
