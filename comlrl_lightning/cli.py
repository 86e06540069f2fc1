"""``python -m comlrl_lightning {fit,validate,test,predict} --config configs/magrpo.yaml`` — a LightningCLI.

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

import gc
import os
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from comlrl_lightning.agents.loading import ModelLoadError
from comlrl_lightning.algorithms import MultiAgentModule
from comlrl_lightning.callbacks.checkpoints import RunCheckpoints
from comlrl_lightning.callbacks.progress import progress_bar
from comlrl_lightning.config_errors import CONFIG_ERRORS, ConfigurationError, SECRET_FIELDS, describe, redact, tidy
from comlrl_lightning.data import TaskDataModule
from comlrl_lightning.quiet import quiet_known_noise

DEFAULT_ROOT_DIR = "outputs"
CHECKPOINT_EVERY = 50  # updates between checkpoints during a CLI run
FOLLOW_ROOT_DIR = "<trainer.default_root_dir>"  # a logger's save_dir that follows trainer.default_root_dir


class SecretSafeSaveConfig(SaveConfigCallback):
    """Writes the run's ``config.yaml`` like Lightning does, with credential fields replaced by ``<redacted>``
    (give keys through ``comparator_api_key_env`` to keep them out of configs altogether)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        config = self.config.clone()
        for key in list(config.keys()):
            if key.rsplit(".", 1)[-1] in SECRET_FIELDS and config[key] is not None:
                config[key] = "<redacted>"
        self.config = config
        super().setup(trainer, pl_module, stage)


class ComlrlArgumentParser(LightningArgumentParser):
    """Reports a configuration mistake in one message (field, value, what is allowed), without the usage dump and
    never with a credential."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(redact(message), ex)
        sys.stderr.write(f"error: {redact(tidy(message))}\n"
                         "  (`python -m comlrl_lightning fit --help` lists the fields; `--print_config` shows a config's "
                         "values)\n")
        sys.exit(2)


def _secrets(config: Any) -> tuple[str, ...]:
    """Credential values in a parsed config (redacted verbatim wherever they would be printed)."""
    found = []
    for key in ("model", "data"):
        init_args = getattr(config.get(key) if hasattr(config, "get") else None, "init_args", None) or {}
        found += [str(init_args[f]) for f in SECRET_FIELDS if f in init_args and init_args[f]]
    return tuple(found)


class ComlrlCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--checkpoint_every_n_updates", type=int, default=CHECKPOINT_EVERY,
                            help="save a checkpoint every N updates, with checkpoints/last.ckpt always pointing at "
                                 "the newest (and one at the end of training); 0: only at the end. Ignored when "
                                 "trainer.callbacks has its own ModelCheckpoint or trainer.enable_checkpointing is "
                                 "false.")
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

    def add_core_arguments_to_parser(self, parser) -> None:
        """Lightning's trainer/model/data sections, with ``data`` built before ``model``: a bad dataset field is
        reported before any model is loaded."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = config.get("trainer.default_root_dir") or DEFAULT_ROOT_DIR
        config["trainer.default_root_dir"] = root
        loggers = config.get("trainer.logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init_args = getattr(logger, "init_args", None)
            if init_args is not None and init_args.get("save_dir") in (None, FOLLOW_ROOT_DIR):
                init_args.save_dir = root
        ckpt_path = config.get("ckpt_path")
        if self.subcommand == "fit" and ckpt_path == "last":
            try:
                config["ckpt_path"] = str(last_checkpoint(root, loggers))
            except FileNotFoundError as err:
                self._parser(self.subcommand).error(str(err))
        elif ckpt_path not in (None, "last", "best", "hpc", "registry") and "://" not in str(ckpt_path) \
                and not Path(ckpt_path).expanduser().is_file() \
                and not (Path(ckpt_path).expanduser() / ".metadata").is_file():  # a sharded (FSDP) checkpoint
            self._parser(self.subcommand).error(f"ckpt_path {ckpt_path!r} is not a checkpoint (give a .ckpt file or "
                                                "the .ckpt directory of a sharded run, or `last` for the newest "
                                                "checkpoint of this run's name).")
        if config.get("checkpoint_every_n_updates", 0) < 0:
            self._parser(self.subcommand).error(
                f"checkpoint_every_n_updates must be >= 0 (got {config.get('checkpoint_every_n_updates')}).")

    def instantiate_classes(self) -> None:
        """A class that rejects its configuration (the algorithms check every field before any model loads) ends
        the run with one message; ``COMLRL_DEBUG=1`` shows the traceback instead."""
        try:
            super().instantiate_classes()
        except CONFIG_ERRORS as err:
            if os.environ.get("COMLRL_DEBUG"):
                raise
            config = self.config[self.subcommand] if self.subcommand else self.config
            self._parser(self.subcommand).error(describe(err, config, _secrets(config)))

    def _run_subcommand(self, subcommand: str) -> None:
        """The models load when the run starts (``configure_model``): a source that cannot be loaded is a
        configuration mistake too, reported in one message."""
        try:
            super()._run_subcommand(subcommand)
        except (ModelLoadError, ConfigurationError) as err:
            if os.environ.get("COMLRL_DEBUG"):
                raise
            config = self.config[subcommand] if subcommand else self.config
            self._parser(subcommand).error(describe(err, config, _secrets(config)))

    def _parse_ckpt_path(self) -> None:
        """``--ckpt_path`` resumes the run the config describes; the checkpoint holds the state (weights, optimizer,
        counters, RNG, data position), the config holds the fields. (Lightning would re-parse the checkpoint's
        hyper-parameters as a config; ours record plain values and import paths, not a config section.)"""

    def instantiate_trainer(self, **kwargs: Any):
        trainer_config = self._get(self.config_init, "trainer", default={})
        epochs = self.model.fit_epochs() if isinstance(self.model, MultiAgentModule) else None
        if epochs is not None and trainer_config.get("max_epochs") is None:
            kwargs.setdefault("max_epochs", epochs)  # iterative rounds: the module knows how many epochs a fit is
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if trainer_config.get("enable_progress_bar") is not False and \
                not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(progress_bar())
        if trainer_config.get("enable_checkpointing") is not False and \
                not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            config = self.config[self.subcommand] if self.subcommand else self.config
            every = config.get("checkpoint_every_n_updates", CHECKPOINT_EVERY)
            callbacks.append(RunCheckpoints(every))  # a crash leaves the last good checkpoint in place
        kwargs.setdefault("callbacks", callbacks)
        return super().instantiate_trainer(**kwargs)


def last_checkpoint(root: str, loggers: Any) -> Path:
    """``--ckpt_path last``: the ``last.ckpt`` of the newest run version under ``<root>/<logger name>/`` (a resumed
    run logs into a new version directory, where Lightning's own "last" would find nothing and start over)."""
    first = loggers[0] if isinstance(loggers, list) and loggers else loggers
    name = getattr(getattr(first, "init_args", None), "name", None) or "lightning_logs"
    found = sorted(Path(root, name).glob("version_*/checkpoints/last.ckpt"),
                   key=lambda p: int(p.parent.parent.name.split("_")[-1]) if p.parent.parent.name.split("_")[-1]
                   .isdigit() else -1)
    if not found:
        raise FileNotFoundError(f"ckpt_path last: no checkpoint under {Path(root, name)}/version_*/checkpoints/ "
                                "(pass the path of a .ckpt file, or start without --ckpt_path).")
    return found[-1]


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
        parser_class=ComlrlArgumentParser,
        save_config_callback=SecretSafeSaveConfig,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def command() -> None:
    """The ``comlrl-lightning`` command and ``python -m comlrl_lightning``: ``main`` on the command line's arguments.
    Returns nothing, so a finished run exits with status 0."""
    try:
        main()
    finally:
        # The command is done. Python's last garbage collections would walk every object torch, transformers and
        # Lightning created (~2.5 s at every exit, on every rank, on a 2-core CPU); frozen objects are skipped and the
        # memory goes back to the system as the process ends. Exit handlers (loggers, the sandbox) still run.
        gc.freeze()


if __name__ == "__main__":  # pragma: no cover
    command()
