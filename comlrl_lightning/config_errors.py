"""Configuration errors as a person reads them: one message naming the field, the value given and what is allowed —
no usage dump, no traceback through the argument parser, and never a credential.

The argument parser (jsonargparse) reports a bad field inside a union error that lists every subtype it tried and
echoes the whole ``model`` section (credentials included); a bad value rejected by an algorithm's own checks
reaches the user as an 80-line traceback. :func:`describe` reduces both to the message that matters.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Iterable, Iterator
from typing import Any

SECRET_FIELDS = ("comparator_api_key",)  # literal credentials: never printed, logged or saved
_SECRET = re.compile(r"(\b(?:%s)\b['\"]?\s*[=:]\s*)('[^']*'|\"[^\"]*\"|[^\s,)}\]]+)" % "|".join(SECRET_FIELDS))
# Lines of jsonargparse's union reports that say nothing about the mistake.
_NOISE = (
    re.compile(r"^\s*-?\s*Expected a <class 'NoneType'>"),
    re.compile(r"^\s*Subtypes: "),
    re.compile(r"^\s*Given value( type)?: "),
    re.compile(r"^\s*Errors:\s*$"),
    re.compile(r"Does not validate against any of the Union subtypes"),
)
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*?)\]\.?\s*Got value:\s*(.*)$")
_OPTIONAL_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*?)\]")  # a Literal | None field: value given apart
_GIVEN = re.compile(r"^\s*Given value:\s*(.*)$")
# a class_path naming an abstract class (MultiAgentModule, OnPolicyModule: bases without a learning rule)
_ABSTRACT = re.compile(r"Expected an instantiatable class, but (?:(\S+) )?is abstract")
_PATH_GIVEN = re.compile(r"Expected a path but (\S+) either|'class_path': '([^']+)'")
_SUBTYPES = re.compile(r"Subtypes: \[<class '([^']+)'>")
# CoMLRL config names that are not module fields here, and where the setting lives (docs/compat.md).
COMLRL_RUN_SETTINGS = {
    "num_train_epochs": "trainer.max_epochs (MADPOIter: model.init_args.dpo_epochs_per_round, DPO passes per round; "
    "MARLHFIter: model.init_args.rl_epochs_per_round, RL epochs per round)",
    "logging_steps": "trainer.log_every_n_steps (every update is one metrics row anyway)",
    "output_dir": "trainer.default_root_dir",
    "save_steps": "--checkpoint_every_n_updates",
}
_NOT_ACCEPTED = re.compile(r"Option '([A-Za-z_][A-Za-z0-9_]*)' is not accepted")
# a key of a config file or a flag the parser does not know (trainer.max_stepz, ...)
_UNKNOWN_OPTION = re.compile(r"does not accept option '([A-Za-z_][\w.]*)'|unrecognized arguments: --([A-Za-z_][\w.]*)")
_CLASS_NAMED = re.compile(r"[(\[]((?:[A-Za-z_][A-Za-z0-9_]*\.)+[A-Za-z_][A-Za-z0-9_]*)[)\]]")
DEFAULT_MODEL_CLASS = "comlrl_lightning.MAGRPO"  # the class the fields hint names when a message names none
# Exceptions that, raised while the config's classes are built, mean "this configuration is wrong".
CONFIG_ERRORS = (ValueError, TypeError, OSError, ImportError, LookupError, MemoryError)


class ConfigurationError(ValueError):
    """A configuration mistake found when the run starts (not when the classes are built): the CLI reports it in
    one message, like the others."""


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with every credential field's value, and every given secret string, replaced by ``<redacted>``."""
    text = _SECRET.sub(lambda m: m.group(1) + "<redacted>", str(text))
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "<redacted>")
    return text


def tidy(message: str) -> str:
    """The lines of a parser report that describe the mistake, with its nested ``Parser key`` / ``class_path``
    headers folded into one dotted field name: ``model.init_args.num_iterations (comlrl_lightning.MADPOIter):
    Expected a <class 'int'>. Got value: abc``."""
    given = next((m.group(1) for line in str(message).splitlines() if (m := _GIVEN.match(line))), None)
    lines = [
        line.strip() for line in str(message).splitlines() if line.strip() and not any(p.search(line) for p in _NOISE)
    ]
    keys, classes, rest = [], [], []
    for line in lines:
        key = re.fullmatch(r'-?\s*Parser key "([^"]+)":?', line)
        klass = re.fullmatch(r"-?\s*Problem with given class_path '([^']+)':?", line)
        if key:
            keys.append(key.group(1) if not keys or not classes else f"init_args.{key.group(1)}")
        elif klass:
            classes.append(klass.group(1))
        else:
            rest.append(line.lstrip("- "))
    head = ".".join(keys)
    abstract = _ABSTRACT.search(" ".join(rest))
    if abstract:
        path = abstract.group(1) or next((g for m in _PATH_GIVEN.finditer(str(message)) for g in m.groups() if g), "")
        base = _SUBTYPES.search(str(message))
        problem = abstract_class_problem(path or str(given), base.group(1) if base else "")
        return f"{head}: {problem}" if head else problem
    choice = _LITERAL.search(" ".join(rest))
    optional = _OPTIONAL_LITERAL.search(" ".join(rest)) if choice is None and given is not None else None
    if head and (choice or optional):  # a typo in an enumeration: name the allowed values, as the algorithms' checks do
        allowed = ", ".join(v.strip().strip("'\"") for v in (choice or optional).group(1).split(","))
        value = choice.group(2).strip() if choice else given.strip()
        where = f" [{classes[-1]}]" if classes else ""
        return f"{head} must be one of: {allowed} (got {value!r}){where}"
    if classes:
        head = f"{head} ({classes[-1]})" if head else classes[-1]
    body = " ".join(rest)
    unknown = _NOT_ACCEPTED.search(body)
    if unknown and unknown.group(1) in COMLRL_RUN_SETTINGS:  # a CoMLRL config name: say where it lives here
        body += f"; CoMLRL's {unknown.group(1)} is {COMLRL_RUN_SETTINGS[unknown.group(1)]} here"
    elif unknown and classes:  # a misspelt field: the closest of the class's own
        body += did_you_mean(unknown.group(1), init_fields(classes[-1]))
    return f"{head}: {body}" if head and body else head or body


def abstract_class_problem(class_path: str, base_path: str = "") -> str:
    """Why the abstract class ``class_path`` (a path, or the name of a subclass of the section's ``base_path``)
    cannot be configured, and the classes that can: its concrete subclasses, by the name the parser also takes."""
    base = _imported_class(base_path)
    klass = _imported_class(class_path) or next((k for k in _family(base) if k.__name__ == class_path), None)
    if klass is None:
        return f"{class_path} is abstract: give the class_path of a class that can be built."
    found = [k.__name__ for k in _family(klass) if not inspect.isabstract(k) and "<locals>" not in k.__qualname__]
    lacks = ", ".join(sorted(getattr(klass, "__abstractmethods__", ()))) or "what its subclasses define"
    choices = ", ".join(dict.fromkeys(found))
    return f"{class_path} is a base class, not one to run (it has no {lacks}); choose one of: {choices}."


def _family(klass: type | None) -> Iterator[type]:
    """``klass`` and its subclasses, depth first (the order ``--help`` lists them in)."""
    if klass is not None:
        yield klass
        for sub in klass.__subclasses__():
            yield from _family(sub)


def _imported_class(class_path: str) -> type | None:
    module_name, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if inspect.isclass(found) else None


def init_fields(class_path: str) -> list[str]:
    """The keyword fields of the class at ``class_path`` (what its ``init_args`` take); [] if it does not import."""
    module_name, _, name = class_path.rpartition(".")
    try:
        parameters = inspect.signature(getattr(importlib.import_module(module_name), name)).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]


def did_you_mean(unknown: str, names: Iterable[str]) -> str:
    """``"; did you mean 'num_generations'?"`` for the name closest to ``unknown`` (case-insensitive), or ``""``."""
    names = list(names)
    lowered = {n.lower(): n for n in names}
    close = difflib.get_close_matches(unknown.lower(), list(lowered), n=1, cutoff=0.75)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


def unknown_option_hint(message: str, options: Iterable[str]) -> str:
    """For a parser's "does not accept option 'trainer.max_stepz'": the closest of ``options`` (dotted names)."""
    unknown = _UNKNOWN_OPTION.search(str(message))
    if not unknown:
        return ""
    name = unknown.group(1) or unknown.group(2)
    return did_you_mean(name, [o for o in options if o.rpartition(".")[0] == name.rpartition(".")[0]])


def _named_class(message: str) -> str | None:
    """The first ``(pkg.Class)``/``[pkg.Class]`` of a message that imports as a class."""
    for match in _CLASS_NAMED.finditer(message):
        module_name, _, name = match.group(1).rpartition(".")
        try:
            if inspect.isclass(getattr(importlib.import_module(module_name), name)):
                return match.group(1)
        except (ImportError, AttributeError, ValueError):
            continue
    return None


def fields_hint(message: str) -> str:
    """The command that lists the fields a message is about. ``fit --help`` lists the trainer's and the run's fields
    but shows the model and the data only as ``--model CONFIG | CLASS_PATH_OR_NAME``: their fields are listed by
    ``fit --model.help <class>`` / ``fit --data.help <class>`` (the class the message names, else MAGRPO's or
    TaskDataModule's)."""
    message = str(message)
    unknown = _UNKNOWN_OPTION.search(message)
    section = ((unknown.group(1) or unknown.group(2)) if unknown else message).split(".")[0].split(" ")[0]
    section = section.split(":")[0]
    if section not in ("model", "data"):
        return "`python -m comlrl_lightning fit --help` lists the trainer's and the run's fields"
    default = DEFAULT_MODEL_CLASS if section == "model" else "comlrl_lightning.TaskDataModule"
    return f"`python -m comlrl_lightning fit --{section}.help {_named_class(message) or default}` lists its fields"


def _raised_in_package(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "/comlrl_lightning/" in tb.tb_frame.f_code.co_filename.replace("\\", "/")


def root_cause(error: BaseException) -> BaseException:
    """The exception that says what is wrong: down the ``raise ... from ...`` chain (through the argument
    parser's wrappers) to the first one raised by this package's own checks (which may wrap a library's error,
    e.g. the ``datasets`` one for a truncated file), else the bottom of the chain."""
    chain, seen = [error], {id(error)}
    while chain[-1].__cause__ is not None and id(chain[-1].__cause__) not in seen:
        chain.append(chain[-1].__cause__)
        seen.add(id(chain[-1]))
    ours = [e for e in chain if _raised_in_package(e)]
    return ours[0] if ours else chain[-1]


def with_given_value(message: str, config: Any) -> str:
    """Prefix the section and class of the field a message starts with (``"dpo_beta must be > 0."``) and append the
    value the config gave it."""
    match = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)\b", message)
    if not match or config is None or not hasattr(config, "get"):
        return message
    field = match.group(1)
    for key in ("model", "data"):
        section = config.get(key)
        init_args = getattr(section, "init_args", None)
        if init_args is not None and field in init_args:
            value = "<redacted>" if field in SECRET_FIELDS else repr(init_args[field])
            said = "got " in message or value in message or str(init_args[field]) in message
            plain = not callable(init_args[field]) and len(value) <= 80
            given = f" (got {value})" if plain and not said else ""
            return f"{key}.init_args.{message.rstrip()}{given} [{getattr(section, 'class_path', key)}]"
    return message


def describe(error: BaseException, config: Any = None, secrets: tuple[str, ...] = ()) -> str:
    """One readable message for an error raised while the configured classes were built."""
    cause = root_cause(error)
    text = tidy(str(cause)) or type(cause).__name__
    return redact(with_given_value(text, config), secrets)


def require_config(ok: bool, message: str) -> None:
    """Raise :class:`ConfigurationError` (one line, no traceback at the CLI) unless ``ok``."""
    if not ok:
        raise ConfigurationError(message)
