"""The state of the user's own objects in a checkpoint: a reward function object, formatters, an
``external_transition``, ``eval_logger``/``eval_aggregator``, a ``reward_processor`` or ``metrics_callback`` that
defines ``state_dict()``/``load_state_dict(state)`` (a reward that counts its calls, a curriculum, a logger's running
totals) is saved with the run and restored on resume, as CoMLRL 1.4.3 does — through the CLI's ``--ckpt_path`` and
``compat``'s ``train(resume_from_checkpoint=...)`` alike.

The states go in the Lightning checkpoint, which is loaded with ``torch.load(weights_only=True)``: keep them to
tensors, numbers, strings and lists/dicts of these. In a data-parallel run the checkpoint holds rank 0's objects.
A wrapper (``compat``'s CoMLRL reward forms) names the object it wraps in ``_checkpoint_source``.
"""

from __future__ import annotations

import copy
from typing import Any

# Module fields whose objects may carry state (``formatters``: each formatter, as ``formatters.<i>``).
STATEFUL_FIELDS = (
    "reward_func",
    "reward_processor",
    "external_transition",
    "eval_logger",
    "eval_aggregator",
    "metrics_callback",
)


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def user_objects(fields: dict[str, Any]) -> dict[str, Any]:
    """The objects among a module's ``fields`` that define ``state_dict``, by field name."""
    found = {name: fields.get(name) for name in STATEFUL_FIELDS}
    formatters = fields.get("formatters")
    if formatters is not None:
        for i, formatter in enumerate(formatters if isinstance(formatters, (list, tuple)) else [formatters]):
            found[f"formatters.{i}"] = formatter
    found = {name: getattr(obj, "_checkpoint_source", obj) for name, obj in found.items() if obj is not None}
    return {name: obj for name, obj in found.items() if callable(getattr(obj, "state_dict", None))}


def save_user_states(fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{field: {"class": ..., "state": obj.state_dict()}}`` of the stateful objects (a copy, not live values)."""
    saved = {}
    for name, obj in user_objects(fields).items():
        if not callable(getattr(obj, "load_state_dict", None)):
            raise ValueError(
                f"{name} ({_class_name(obj)}) defines state_dict but no load_state_dict: a checkpoint "
                "could save its state but never restore it; define both, or neither."
            )
        saved[name] = {"class": _class_name(obj), "state": copy.deepcopy(obj.state_dict())}
    return saved


def load_user_states(fields: dict[str, Any], saved: dict[str, dict[str, Any]] | None) -> None:
    """Restore ``saved`` into the module's objects; the checkpoint and the run must have the same stateful objects
    (a state nobody restores, or an object left without its state, would make the resumed run differ silently).
    ``saved`` None: a checkpoint from before states were saved; nothing to restore."""
    if saved is None:
        return
    current = user_objects(fields)
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            raise ValueError(
                f"The checkpoint holds the state of {name} (a {saved[name]['class']}), but this run's "
                f"{name} has no state_dict/load_state_dict: give the object the checkpointed run had."
            )
        if name not in saved:
            raise ValueError(
                f"{name} (a {_class_name(current[name])}) defines state_dict, but the checkpoint holds "
                f"no state for it (the checkpointed run's {name} had none): resume with the objects that "
                "run had."
            )
        if saved[name]["class"] != _class_name(current[name]):
            raise ValueError(
                f"The checkpoint holds the state of a {saved[name]['class']} as {name}, but this run's "
                f"{name} is a {_class_name(current[name])}: resume with the object the checkpointed run "
                "had."
            )
    for name, obj in current.items():
        obj.load_state_dict(copy.deepcopy(saved[name]["state"]))
