"""``python -m comlrl_lightning {fit,validate,test,predict} --config configs/magrpo.yaml`` — a LightningCLI.

Any MultiAgentModule subclass that names its learning rule is a valid ``model.class_path`` (MAGRPO, MARLOO, MAReMax,
MAREINFORCE, your own; the bases MultiAgentModule and OnPolicyModule are abstract: not listed, refused in one line);
reward functions, formatters and transitions are given by import path; every field can be overridden with a
dotted flag (``--model.init_args.num_generations 8``).

Defaults: ``trainer.default_root_dir`` is ``outputs``; every logger whose ``save_dir`` is not given writes under
it (a config names the run with the logger's ``name``, the directory comes from ``default_root_dir``), so
``--trainer.default_root_dir DIR`` moves the whole run: ``DIR/<name>/version_<n>/`` holds ``metrics.csv``,
``hparams.yaml``, ``config.yaml``, ``completions.jsonl`` and ``checkpoints/``. A progress bar counts updates
(``max_steps`` runs) or epochs and shows the team reward and the loss; in a log file, a line per update.

``--ckpt_path last|best|PATH`` means the same in every subcommand: ``last`` is the newest checkpoint of the newest
run of the config's name (CSV/TensorBoard: ``<name>/version_<n>/``; W&B: ``<project>/<run id>/``), ``best`` the
best one that run's ``ModelCheckpoint`` recorded (with no ``monitor``: its newest), ``PATH`` a checkpoint file (or a
sharded checkpoint's folder). A checkpoint that is missing, truncated or not a checkpoint stops the run before any
model loads, in one line; so does a ``default_root_dir`` that cannot be written. ``validate``, ``test`` and
``predict`` log into an evaluation folder of the run they evaluate, ``<run>/<subcommand>/version_<m>/`` (the run is
the checkpoint's ``version_<n>``; ``<default_root_dir>/<name>`` without a checkpoint), never a new ``version_<n>``
beside the training runs. Ctrl-C or SIGTERM during ``fit`` stops it within seconds, writes the checkpoint of the last
completed update and exits with 128 + the signal's number (``callbacks/checkpoints.py``).
"""

from __future__ import annotations

import gc
import os
import re
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from comlrl_lightning.agents.loading import ModelLoadError
from comlrl_lightning.algorithms import MultiAgentModule
from comlrl_lightning.algorithms.team import check_first_items
from comlrl_lightning.callbacks.checkpoints import (
    CHECKPOINT_EVERY,
    CheckpointNotWritten,
    RunCheckpoints,
    offer_save_pretrained,
)
from comlrl_lightning.callbacks.progress import progress_bar
from comlrl_lightning.config_errors import (
    CONFIG_ERRORS,
    SECRET_FIELDS,
    ConfigurationError,
    describe,
    fields_hint,
    redact,
    tidy,
    unknown_option_hint,
)
from comlrl_lightning.cpu_threads import fit_threads_to_free_cores, local_servers, runs_on_cpu
from comlrl_lightning.data import TaskDataModule
from comlrl_lightning.quiet import quiet_known_noise
from comlrl_lightning.runs.files import run_root
from comlrl_lightning.runs.stop import StopRequested

DEFAULT_ROOT_DIR = "outputs"
FOLLOW_ROOT_DIR = "<trainer.default_root_dir>"  # a logger's save_dir that follows trainer.default_root_dir
EVALUATION_SUBCOMMANDS = ("validate", "test", "predict")
# argparse reads "-1e-4" as an option (its negative numbers are -1 and -.5 only): any number in any notation.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


class SecretSafeSaveConfig(SaveConfigCallback):
    """Writes the run's ``config.yaml`` like Lightning does, with credential fields replaced by ``<redacted>``
    (give keys through ``comparator_api_key_env`` to keep them out of configs altogether)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["save_to_log_dir"] = False  # written to the run's own folder (save_config), not trainer.log_dir
        super().__init__(*args, **kwargs)

    def setup(self, trainer, pl_module, stage: str) -> None:
        config = self.config.clone()
        for key in list(config.keys()):
            if key.rsplit(".", 1)[-1] in SECRET_FIELDS and config[key] is not None:
                config[key] = "<redacted>"
        self.config = config
        # The run's folder (runs/files.py: with W&B, <save_dir>/<project>/<run id>; Lightning's trainer.log_dir
        # would be the save_dir every run shares); read on every rank, it is a collective.
        self.run_dir = run_root(trainer)
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.parser.save(
            self.config,
            str(self.run_dir / self.config_filename),
            skip_none=False,
            overwrite=self.overwrite,
            multifile=self.multifile,
        )


class ComlrlArgumentParser(LightningArgumentParser):
    """Reports a configuration mistake in one message (field, value, what is allowed), without the usage dump and
    never with a credential; reads a negative number after a flag as its value (``--x -1e-4``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(redact(message), ex)
        message = redact(tidy(message))
        message += unknown_option_hint(message, _option_names(self))  # trainer.max_stepz: did you mean ...?
        sys.stderr.write(f"error: {message}\n  ({fields_hint(message)}; `--print_config` shows a config's values)\n")
        sys.exit(2)


def _option_names(parser: Any) -> list[str]:
    """The dotted names a parser and its subcommands take (``trainer.max_steps``, ...)."""
    subcommands = getattr(parser, "_subcommands_action", None)
    parsers = [parser, *(subcommands._name_parser_map.values() if subcommands else ())]
    return [action.dest for p in parsers for action in p._actions]


def _secrets(config: Any) -> tuple[str, ...]:
    """Credential values in a parsed config (redacted verbatim wherever they would be printed)."""
    found = []
    for key in ("model", "data"):
        init_args = getattr(config.get(key) if hasattr(config, "get") else None, "init_args", None) or {}
        found += [str(init_args[f]) for f in SECRET_FIELDS if f in init_args and init_args[f]]
    return tuple(found)


class ComlrlCLI(LightningCLI):
    def __init__(self, *args: Any, **kwargs: Any):
        given = kwargs.get("args")
        given = sys.argv[1:] if given is None else given
        self.asked_subcommand = given[0] if isinstance(given, (list, tuple)) and given else None
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        """Lightning's four subcommands, or only the one the command line starts with: each one's parser is built at
        every start (~0.05 s of CPU each; a third of a configuration error's time)."""
        every = LightningCLI.subcommands()
        asked = getattr(self, "asked_subcommand", None)
        return {asked: every[asked]} if asked in every else every

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--checkpoint_every_n_updates",
            type=int,
            default=CHECKPOINT_EVERY,
            help="save a checkpoint every N updates, with checkpoints/last.ckpt always pointing at "
            "the newest (and one at the end of training); 0: only at the end. Ignored when "
            "trainer.callbacks has its own ModelCheckpoint or trainer.enable_checkpointing is "
            "false.",
        )
        parser.add_argument(
            "--checkpoint_total_limit",
            type=Optional[int],
            default=1,
            help="keep the newest N of those checkpoints (null: all); last.ckpt points at the newest.",
        )
        parser.set_defaults(
            {
                # a logger without its own save_dir writes under trainer.default_root_dir (filled in before it is built)
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": FOLLOW_ROOT_DIR, "name": "comlrl"},
                },
                "trainer.default_root_dir": DEFAULT_ROOT_DIR,
                "trainer.num_sanity_val_steps": 0,
                "trainer.log_every_n_steps": 1,
                "trainer.accelerator": "auto",
                "trainer.devices": 1,
            }
        )

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
        try:
            ckpt_path = resolve_ckpt_path(config.get("ckpt_path"), root, loggers)
        except (OSError, ValueError) as err:
            self._parser(self.subcommand).error(str(err))
        if "ckpt_path" in config:
            config["ckpt_path"] = ckpt_path
        if self.subcommand == "fit" and ckpt_path is not None:
            resume_wandb_run(loggers, ckpt_path)  # a resumed run logs into the checkpoint's W&B run
        if self.subcommand in EVALUATION_SUBCOMMANDS:  # log into the evaluated run, not a new version_<n>
            evaluated = evaluated_run(ckpt_path, root, loggers)
            for logger in loggers if isinstance(loggers, list) else [loggers]:
                init_args = getattr(logger, "init_args", None)
                if init_args is not None and init_args.get("save_dir") == root:  # not a save_dir the config chose
                    init_args.save_dir = str(evaluated)
                    if "name" in init_args:
                        init_args.name = self.subcommand
        share_run_folder(loggers)
        problem = folder_problem(root, loggers) or accelerator_problem(config.get("trainer.accelerator"))
        if problem:
            self._parser(self.subcommand).error(problem)
        if config.get("checkpoint_every_n_updates", 0) < 0:
            self._parser(self.subcommand).error(
                f"checkpoint_every_n_updates must be >= 0 (got {config.get('checkpoint_every_n_updates')})."
            )
        limit = config.get("checkpoint_total_limit", 1)
        if limit is not None and limit < 1:
            self._parser(self.subcommand).error(f"checkpoint_total_limit must be >= 1 or null (got {limit}).")
        if runs_on_cpu(config.get("trainer.accelerator")):
            # cores busy with other processes, or with the vLLM servers it samples from: fewer intra-op threads
            model = config.get("model.init_args") or {}
            serving = model.get("generation_backend") == "vllm" and model.get("vllm_mode") == "server"
            fit_threads_to_free_cores(servers=local_servers(model.get("vllm_server_urls") or []) if serving else 0)

    def instantiate_classes(self) -> None:
        """A class that rejects its configuration (the algorithms check every field before any model loads) ends
        the run with one message; ``COMLRL_DEBUG=1`` shows the traceback instead."""
        try:
            super().instantiate_classes()
            if isinstance(self.model, MultiAgentModule) and self.datamodule is not None:
                check_first_items(
                    self.datamodule, self.subcommand, self.model.prompt_formatters
                )  # each split's first item
        except (*CONFIG_ERRORS, MisconfigurationException) as err:
            if os.environ.get("COMLRL_DEBUG"):
                raise
            config = self.config[self.subcommand] if self.subcommand else self.config
            message = describe(err, config, _secrets(config))
            if isinstance(err, MisconfigurationException):  # Lightning's Trainer(...): name the trainer field
                field = re.search(r"`(\w+)`", message)
                message = f"trainer.{field.group(1)}: {message}" if field else f"trainer: {message}"
            self._parser(self.subcommand).error(message)

    def _run_subcommand(self, subcommand: str) -> None:
        """The models load when the run starts (``configure_model``): a source that cannot be loaded is a
        configuration mistake too, reported in one message."""
        try:
            with warnings.catch_warnings():
                if subcommand in EVALUATION_SUBCOMMANDS:  # evaluating needs none of the callbacks that trained it
                    warnings.filterwarnings("ignore", message=r"Be aware that when using `ckpt_path`, callbacks")
                super()._run_subcommand(subcommand)
        except StopRequested as stopped:  # Ctrl-C / SIGTERM discarded a phase; its checkpoint is written
            self.trainer.comlrl_interrupted_by = stopped.signum  # command() exits with 128 + it
            for callback in self.trainer.callbacks:
                if isinstance(callback, RunCheckpoints):  # Lightning's clean-up re-installed the fit's handlers
                    callback.restore_signal_handlers()
        except (ModelLoadError, ConfigurationError) as err:
            if os.environ.get("COMLRL_DEBUG"):
                raise
            config = self.config[subcommand] if subcommand else self.config
            self._parser(subcommand).error(describe(err, config, _secrets(config)))
        except CheckpointNotWritten as err:  # a full disk: where the weights are, not a traceback (checkpoints.py)
            if os.environ.get("COMLRL_DEBUG"):
                raise
            sys.stderr.write(f"error: {err}\n")
            offer_save_pretrained(self.model)  # at a terminal only
            sys.exit(1)
        except RuntimeError as err:  # a checkpoint of another team (other models, LoRA vs full copies, ...)
            if os.environ.get("COMLRL_DEBUG") or not str(err).startswith("Error(s) in loading state_dict"):
                raise
            config = self.config[subcommand] if subcommand else self.config
            first = str(err).splitlines()[0].rstrip(":")
            self._parser(subcommand).error(
                f"ckpt_path {config.get('ckpt_path')!r} does not fit the model this config "
                f"builds ({first}: {_state_dict_problem(err)}): give a checkpoint of a run "
                "with the same model fields."
            )

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
        for callback in callbacks:
            if isinstance(callback, ProgressBar):
                callback.chosen = True  # the config's choice: the module keeps it (callbacks/conventions.py)
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            callbacks.append(progress_bar())
        if (
            self.subcommand in (None, "fit")
            and trainer_config.get("enable_checkpointing") is not False
            and not any(isinstance(c, ModelCheckpoint) for c in callbacks)
        ):
            config = self.config[self.subcommand] if self.subcommand else self.config
            every = config.get("checkpoint_every_n_updates", CHECKPOINT_EVERY)
            keep = config.get("checkpoint_total_limit", 1)
            callbacks.append(RunCheckpoints(every, keep_last=keep))  # a crash leaves the last good checkpoint in place
        kwargs.setdefault("callbacks", callbacks)
        return super().instantiate_trainer(**kwargs)


def resume_wandb_run(loggers: Any, ckpt_path: str) -> None:
    """A ``WandbLogger`` of the config that names no run (``id``/``version``) continues the W&B run the checkpoint
    recorded (Lightning's ``WandbLogger`` resumes a given id, ``resume="allow"``), as CoMLRL 1.4.3 does."""
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = getattr(logger, "init_args", None)
        if (
            init_args is None
            or not str(getattr(logger, "class_path", "")).endswith("WandbLogger")
            or init_args.get("id")
            or init_args.get("version")
            or not Path(ckpt_path).is_file()
        ):
            continue
        import torch

        state = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True).get("comlrl_lightning", {})
        identity = state.get("wandb") or {}
        if identity.get("id"):
            init_args.id = identity["id"]


def run_name(loggers: Any) -> str:
    """The name of the run the config describes: its first logger's ``name``."""
    first = loggers[0] if isinstance(loggers, list) and loggers else loggers
    return getattr(getattr(first, "init_args", None), "name", None) or "lightning_logs"


def last_checkpoint(root: str, loggers: Any, given: str = "last") -> Path:
    """``--ckpt_path last``: the ``last.ckpt`` of the newest run of the config's name (:func:`run_checkpoints`; a
    resumed CSV/TensorBoard run logs into a new version directory, where Lightning's own "last" would find nothing
    and start over)."""
    found, where = run_checkpoints(root, loggers)
    if not found:
        raise FileNotFoundError(
            f"ckpt_path {given}: no checkpoint under {where} "
            "(pass the path of a .ckpt file, or start without --ckpt_path)."
        )
    return found[-1]


def run_checkpoints(root: str, loggers: Any) -> tuple[list[Path], str]:
    """The ``last.ckpt`` of every run of the config's name, oldest first, and where they were looked for: the run
    folder of the first logger (where ``ModelCheckpoint`` writes, runs/files.py). CSV and TensorBoard:
    ``<save_dir>/<name>/version_<n>/`` (the config's ``version`` only, when it names one), by version; W&B:
    ``<save_dir>/<project>/<run id>/`` of the runs whose ``config.yaml`` names the config's W&B ``name`` (or its
    ``id``'s folder), by time; no logger: ``<default_root_dir>/``."""
    first = loggers[0] if isinstance(loggers, list) and loggers else loggers
    if not first:  # logger: false
        folder = Path(root).expanduser()
        return [p for p in [folder / "checkpoints" / "last.ckpt"] if p.is_file()], f"{folder}/checkpoints/"
    init_args = getattr(first, "init_args", None) or {}
    save_dir = Path(init_args.get("save_dir") or root).expanduser()
    if str(getattr(first, "class_path", "")).endswith("WandbLogger"):
        folder = save_dir / (init_args.get("project") or os.environ.get("WANDB_PROJECT") or "lightning_logs")
        run_id, name = init_args.get("version") or init_args.get("id"), init_args.get("name")
        found = [
            p for p in folder.glob(f"{run_id or '*'}/checkpoints/last.ckpt") if _wandb_run_named(p.parents[1], name)
        ]
        named = f" of a W&B run named {name!r}" if name and not run_id else ""
        return sorted(found, key=lambda p: p.stat().st_mtime), f"{folder}/{run_id or '*'}/checkpoints/{named}"
    folder = save_dir / (init_args.get("name", "lightning_logs") or "")
    version = init_args.get("version")
    if version is not None:  # the config's own run folder
        folder = folder / (version if isinstance(version, str) else f"version_{version}")
        return [p for p in [folder / "checkpoints" / "last.ckpt"] if p.is_file()], f"{folder}/checkpoints/"

    def number(path: Path) -> int:
        suffix = path.parents[1].name.split("_")[-1]
        return int(suffix) if suffix.isdigit() else -1

    return sorted(folder.glob("version_*/checkpoints/last.ckpt"), key=number), f"{folder}/version_*/checkpoints/"


def _wandb_run_named(folder: Path, name: Any) -> bool:
    """Whether the W&B run folder ``folder`` is a run named ``name``: its ``config.yaml`` (the CLI writes one into
    every run folder) names it; a folder without one (a run of the Python API) counts as any name."""
    config = folder / "config.yaml"
    if not name or not config.is_file():
        return True
    import yaml

    try:
        loggers = ((yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("trainer") or {}).get("logger")
    except (OSError, yaml.YAMLError, AttributeError):
        return True
    names = [
        (logger.get("init_args") or {}).get("name")
        for logger in (loggers if isinstance(loggers, list) else [loggers])
        if isinstance(logger, dict) and str(logger.get("class_path", "")).endswith("WandbLogger")
    ]
    return not names or name in names


def best_checkpoint(root: str, loggers: Any) -> Path:
    """``--ckpt_path best``: the best checkpoint the newest run's ``ModelCheckpoint`` recorded in its ``last.ckpt``
    (with no ``monitor``, Lightning's best is the newest)."""
    import torch

    last = last_checkpoint(root, loggers, "best")
    check_checkpoint_file(last, "best")
    state = torch.load(last, map_location="cpu", weights_only=False, mmap=True)  # the run's own file
    for callback_state in (state.get("callbacks") or {}).values():
        best = callback_state.get("best_model_path") if isinstance(callback_state, dict) else None
        if best:
            for candidate in (Path(best), last.parent / Path(best).name):  # a run moved since: beside last.ckpt
                if candidate.is_file():
                    return candidate
            raise FileNotFoundError(
                f"ckpt_path best: {last} records {best} as the best checkpoint, which no longer "
                "exists (give a .ckpt file, or `last`)."
            )
    raise FileNotFoundError(f"ckpt_path best: {last} records no best checkpoint (give a .ckpt file, or `last`).")


def check_checkpoint_file(path: Path, given: Any) -> None:
    """A checkpoint torch can read: a zip archive with its pickle (torch.save's format since 1.6), which a truncated
    or foreign file is not. Reads only the archive's index (at the end of the file), not its tensors."""
    try:
        with zipfile.ZipFile(path) as archive:
            readable = any(name.endswith("data.pkl") for name in archive.namelist())
        problem = None if readable else "no data.pkl inside"
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        problem = str(err)
    if problem:
        raise ValueError(
            f"ckpt_path {str(given)!r} cannot be read as a checkpoint ({path}: {problem}): it is truncated "
            "(a copy or a write that did not finish) or not a checkpoint; give another .ckpt of the run "
            "(its checkpoints/ folder), or `last`."
        )


def resolve_ckpt_path(given: Any, root: str, loggers: Any) -> str | None:
    """``--ckpt_path`` as a file, the same in every subcommand (module docstring): ``last``, ``best``, a checkpoint
    file or a sharded checkpoint's folder; a URL and Lightning's ``hpc``/``registry`` pass through. Raises
    ``FileNotFoundError``/``ValueError`` with one line."""
    if given is None or str(given) == "hpc" or str(given).startswith("registry") or "://" in str(given):
        return given
    if given == "last":
        path = last_checkpoint(root, loggers)
    elif given == "best":
        path = best_checkpoint(root, loggers)
    else:
        path = Path(given).expanduser()
        if (path / ".metadata").is_file():  # a sharded (FSDP) checkpoint
            return str(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"ckpt_path {given!r} is not a checkpoint (give a .ckpt file or the .ckpt "
                "directory of a sharded run, `last` for the newest checkpoint of this run's name "
                "or `best`)."
            )
    check_checkpoint_file(path, given)
    return str(path)


def evaluated_run(ckpt_path: str | None, root: str, loggers: Any) -> Path:
    """Where a ``validate``/``test``/``predict`` run logs (its loggers' ``save_dir``; their ``name`` becomes the
    subcommand): the run folder of the checkpoint it evaluates (``<run>/checkpoints/x.ckpt`` -> ``<run>``; a
    checkpoint elsewhere: its folder), else ``<root>/<run name>``."""
    if ckpt_path is None or "://" in str(ckpt_path) or not Path(ckpt_path).exists():
        return Path(root, run_name(loggers))
    folder = Path(ckpt_path).parent if Path(ckpt_path).is_file() else Path(ckpt_path)
    return folder.parent if folder.name == "checkpoints" else folder


def share_run_folder(loggers: Any) -> None:
    """Several CSV/TensorBoard loggers of one ``save_dir`` and ``name`` log into ONE run folder: each would otherwise
    take the next free ``version_<n>`` after the other's (CSV in version_0, TensorBoard in version_1). The version
    they share is the next free one; a logger with its own ``version`` is left alone."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = getattr(logger, "init_args", None)
        if (
            init_args is not None
            and str(getattr(logger, "class_path", "")).rsplit(".", 1)[-1] in ("CSVLogger", "TensorBoardLogger")
            and init_args.get("version") is None
        ):
            key = (str(init_args.get("save_dir")), str(init_args.get("name") or ""))
            groups.setdefault(key, []).append(init_args)
    for (save_dir, name), members in groups.items():
        if len(members) > 1:
            taken = [int(p.name[8:]) for p in Path(save_dir, name).glob("version_*") if p.name[8:].isdigit()]
            for init_args in members:
                init_args.version = max(taken, default=-1) + 1


def folder_problem(root: str, loggers: Any) -> str | None:
    """``trainer.default_root_dir`` (or a logger's own ``save_dir``) that cannot be created or written to, in one
    line, before any model loads (Lightning would fail on it at the first write, with a traceback)."""
    folders = {"trainer.default_root_dir": root}
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        save_dir = (getattr(logger, "init_args", None) or {}).get("save_dir")
        if save_dir and str(save_dir) != str(root):
            folders.setdefault("trainer.logger.init_args.save_dir", save_dir)
    for field, folder in folders.items():
        if "://" in str(folder):  # a remote filesystem: its own permissions
            continue
        wanted = Path(str(folder)).expanduser().absolute()
        existing = next(p for p in (wanted, *wanted.parents) if p.exists())
        if not existing.is_dir():
            reason = f"{existing} is a file, not a folder"
        elif not os.access(existing, os.W_OK | os.X_OK):
            reason = f"{existing} is read-only for this user"
        else:
            continue
        return f"{field} {str(folder)!r} cannot be written ({reason}): give a folder you can write to."
    return None


def accelerator_problem(accelerator: Any) -> str | None:
    """``trainer.accelerator`` asking for a device this machine lacks, in one line (Lightning raises it from deep in
    the trainer's set-up)."""
    name = str(accelerator).lower() if isinstance(accelerator, str) else None
    if name in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            return (
                f"trainer.accelerator {accelerator!r}: no CUDA GPU is available here (torch.cuda.is_available() is "
                "False; a CPU build of torch has none); use cpu or auto."
            )
    if name == "mps":
        import torch

        if not torch.backends.mps.is_available():
            return "trainer.accelerator 'mps': Apple's MPS is not available here; use cpu or auto."
    return None


def _state_dict_problem(err: BaseException) -> str:
    """The first missing/unexpected keys of a ``load_state_dict`` error, briefly."""
    text = " ".join(str(err).split())
    match = re.search(r"(Missing key\(s\)|Unexpected key\(s\)|size mismatch)[^.]{0,160}", text)
    return match.group(0) if match else text[:160]


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
    Returns nothing, so a finished run exits with status 0; a fit stopped by Ctrl-C or SIGTERM (its checkpoint
    written) exits with 128 + the signal's number (130, 143), as the signal would have. ``serve`` starts a run's vLLM
    servers (``comlrl_lightning/serve.py``)."""
    if sys.argv[1:2] == ["serve"]:
        from comlrl_lightning.serve import main as serve

        serve(sys.argv[2:])
        return
    try:
        cli = main()
        signum = getattr(getattr(cli, "trainer", None), "comlrl_interrupted_by", None)
        if signum:  # Ctrl-C / SIGTERM: the checkpoint is written; say so in the exit status, as the signal would
            sys.exit(128 + signum)
    finally:
        # The command is done. Python's last garbage collections would walk every object torch, transformers and
        # Lightning created (seconds at every exit, on every rank); frozen objects are skipped and the
        # memory goes back to the system as the process ends. Exit handlers (loggers, the sandbox) still run.
        gc.freeze()


if __name__ == "__main__":  # pragma: no cover
    command()
