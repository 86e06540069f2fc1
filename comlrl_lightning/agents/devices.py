"""Device specifications for agents (and critics, reference and comparator models).

The grammar follows CoMLRL's ``DeviceScheduler`` (docs/algorithms.md#agents-and-devices):

- ``None`` or ``"auto"``: automatic — no CUDA: ``n × cpu``; fewer GPUs than ``n``: ``n × cuda:0``;
  otherwise ``cuda:0 … cuda:{n-1}``. (MPS is never chosen automatically; ask for ``"mps"``.)
- a single device (``"cpu"``, ``"cuda:1"``, ``torch.device``): the same device ``n`` times.
- a sequence of length 1: broadcast; of length ``n``: one device per model; an ``"auto"`` entry takes
  the automatic device of its position. Any other length or an empty sequence is an error.

Each entry is checked with ``torch.device`` so a typo (``"gpu0"``) fails at configuration time with a
message naming the field; whether the device exists is checked when a model is moved there.

``parallel_training`` selects how agents are placed (docs/algorithms.md#agents-and-devices): ``"none"`` puts
every agent on one device (:func:`resolve_single_device`); ``"mp"`` places each agent on its own device from
``agent_devices``. Data parallelism is Lightning's job (``Trainer(strategy="ddp")``), not a mode here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch

from comlrl_lightning.choices import Choice

__all__ = [
    "AUTO",
    "PARALLEL_MODES",
    "DeviceSpec",
    "auto_devices",
    "resolve_devices",
    "resolve_single_device",
    "normalize_parallel_training",
]

AUTO = "auto"
PARALLEL_TRAINING = Choice(
    "parallel_training",
    {"none": ("null",), "mp": ()},
    message="parallel_training only supports: {allowed}. Got {value!r}.",
)
PARALLEL_MODES = PARALLEL_TRAINING.values

DeviceSpec = Union[None, str, int, torch.device, Sequence[Union[str, int, torch.device]]]

_ALLOWED_HINT = "use e.g. 'cpu', 'cuda', 'cuda:1', 'mps' or 'auto'"


def auto_devices(n: int) -> list[torch.device]:
    """The automatic placement of ``n`` models (see the module docstring)."""
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * n
    if torch.cuda.device_count() < n:
        return [torch.device("cuda", 0)] * n
    return [torch.device("cuda", i) for i in range(n)]


def _parse_device(value: Any, kind: str) -> torch.device:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(
            f"{kind} entries must be device strings; got {value!r} ({type(value).__name__}); {_ALLOWED_HINT}."
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{kind} has an invalid device index {value!r}; {_ALLOWED_HINT}.")
        return torch.device("cuda", value)  # an int means a CUDA ordinal, as in torch / Lightning
    text = value.strip()
    try:
        return torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"{kind} has an invalid device {value!r}; {_ALLOWED_HINT}.") from err


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def resolve_devices(spec: DeviceSpec, n: int, kind: str = "agent_devices") -> list[torch.device]:
    """Resolve a device spec to exactly ``n`` ``torch.device`` objects (one per model).

    ``kind`` is the config field being resolved; it names the field in error messages.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"resolve_devices needs n >= 1 models; got n={n!r} for {kind}.")
    if spec is None or _is_auto(spec):
        return auto_devices(n)
    if isinstance(spec, (str, int, torch.device)):
        return [_parse_device(spec, kind)] * n
    if not isinstance(spec, Sequence) or isinstance(spec, (bytes, bytearray)):
        try:
            spec = list(spec)  # e.g. an omegaconf ListConfig or a generator
        except TypeError:
            raise ValueError(
                f"{kind} must be a device string, a list of them, or 'auto'; got {type(spec).__name__}."
            ) from None
    entries = list(spec)
    if not entries:
        raise ValueError(f"{kind} must be a non-empty list or 'auto'.")
    if len(entries) == 1:
        entries = entries * n
    elif len(entries) != n:
        raise ValueError(f"{kind} length ({len(entries)}) must be 1 or n. Here n = {n}; got {list(spec)!r}.")
    auto = None
    out = []
    for i, entry in enumerate(entries):
        if _is_auto(entry):
            auto = auto or auto_devices(n)
            out.append(auto[i])
        else:
            out.append(_parse_device(entry, kind))
    return out


def resolve_single_device(*specs: DeviceSpec, kind: str = "device") -> torch.device:
    """The one device used when ``parallel_training="none"``: the first non-None spec wins.

    A string resolves as itself (``"auto"``: the automatic device for one model); a sequence resolves
    to its first entry (so a multi-entry ``agent_devices`` collapses to its first device, as in CoMLRL);
    no spec at all gives ``cuda:0`` when CUDA is available, else ``cpu``.
    """
    for spec in specs:
        if spec is None:
            continue
        if _is_auto(spec):
            return auto_devices(1)[0]
        if isinstance(spec, (str, int, torch.device)):
            return _parse_device(spec, kind)
        entries = list(spec)
        if not entries:
            raise ValueError(f"{kind} must be a non-empty list or 'auto'.")
        first = entries[0]
        return auto_devices(1)[0] if _is_auto(first) else _parse_device(first, kind)
    return auto_devices(1)[0]


def normalize_parallel_training(value: Any) -> str:
    """``None``/``"none"``/``"null"`` -> ``"none"``; ``"mp"`` -> ``"mp"`` (case-insensitive); a data-parallel
    name says where data parallelism goes."""
    if value is None:
        return "none"
    try:
        return PARALLEL_TRAINING(value if isinstance(value, str) else repr(value))
    except ValueError as error:
        hint = ""
        if isinstance(value, str) and value.strip().lower() in ("ddp", "auto", "fsdp"):
            hint = (
                " Data-parallel training is the Lightning Trainer's job: launch one process per device with its "
                "strategy (YAML/CLI: trainer.strategy: ddp; Python: Trainer(strategy='ddp', devices=N)), "
                "docs/scaling.md."
            )
        raise ValueError(f"parallel_training only supports: none, mp. Got {value!r}.{hint}") from error
