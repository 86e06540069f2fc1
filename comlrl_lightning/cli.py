"""``python -m comlrl_lightning {fit,validate} --config configs/magrpo.yaml`` — a LightningCLI.

Any MultiAgentModule subclass is a valid ``model.class_path`` (MAGRPO, MARLOO, MAReMax, MAREINFORCE, your own);
reward functions, formatters and transitions are given by import path; every field can be overridden with a
dotted flag (``--model.init_args.num_generations 8``).

Defaults: ``trainer.default_root_dir`` is ``outputs``; every logger whose ``save_dir`` is not given writes under
it (a config names the run with the logger's ``name``, the directory comes from ``default_root_dir``), so
``--trainer.default_root_dir DIR`` moves the whole run: ``DIR/<name>/version_<n>/`` holds ``metrics.csv``,
``hparams.yaml``, ``config.yaml``, ``completions.jsonl`` and ``checkpoints/``. A progress bar counts updates
(``max_steps`` runs) or epochs and shows the team reward.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from comlrl_lightning.algorithms import MultiAgentModule
from comlrl_lightning.callbacks.progress import progress_bar
from comlrl_lightning.data import TaskDataModule
from comlrl_lightning.quiet import quiet_known_noise

DEFAULT_ROOT_DIR = "outputs"
FOLLOW_ROOT_DIR = "<trainer.default_root_dir>"  # a logger's save_dir that follows trainer.default_root_dir


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
            # a logger without its own save_dir writes under trainer.default_root_dir (filled in before it is built)
            "trainer.logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": FOLLOW_ROOT_DIR, "name": "comlrl"}},
            "trainer.default_root_dir": DEFAULT_ROOT_DIR,
            "trainer.num_sanity_val_steps": 0,
            "trainer.log_every_n_steps": 1,
            "trainer.accelerator": "auto",
            "trainer.devices": 1,
        })

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = config.get("trainer.default_root_dir") or DEFAULT_ROOT_DIR
        config["trainer.default_root_dir"] = root
        loggers = config.get("trainer.logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init_args = getattr(logger, "init_args", None)
            if init_args is not None and init_args.get("save_dir") in (None, FOLLOW_ROOT_DIR):
                init_args.save_dir = root

    def instantiate_trainer(self, **kwargs: Any):
        trainer_config = self._get(self.config_init, "trainer", default={})
        epochs = self.model.fit_epochs() if isinstance(self.model, MultiAgentModule) else None
        if epochs is not None and trainer_config.get("max_epochs") is None:
            kwargs.setdefault("max_epochs", epochs)  # iterative rounds: the module knows how many epochs a fit is
        callbacks = trainer_config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if trainer_config.get("enable_progress_bar") is not False and \
                not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs.setdefault("callbacks", [*callbacks, progress_bar()])
        return super().instantiate_trainer(**kwargs)


def main(args: list[str] | None = None, run: bool = True) -> ComlrlCLI:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_known_noise()
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
