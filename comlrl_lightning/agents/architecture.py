"""An agent's architecture read without its weights (a tiny preset's numbers, a ``config.json``, a model object's
``config``): what the checks made before any model loads need -- the attention head size an engine must support,
the positions a completion must fit in. None where it cannot be known cheaply (a hub id not in the local cache)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .factories import TINY_PRESETS


def architecture(source: Any, model_kwargs: Mapping[str, Any] | None = None) -> dict[str, int] | None:
    """``{"head_size", "positions"}`` of the model ``source`` (an ``agents`` entry) loads as, with ``model_kwargs``
    applied to a tiny preset; None when unknown."""
    config = getattr(source, "config", None)
    if config is not None:
        return _from_config(config)
    if not isinstance(source, (str, os.PathLike)):
        return None
    name = str(source)
    if name in TINY_PRESETS:
        preset = {
            **TINY_PRESETS[name],
            **{k: v for k, v in dict(model_kwargs or {}).items() if k in TINY_PRESETS[name]},
        }
        return {
            "head_size": preset["hidden_size"] // preset["num_heads"],
            "positions": preset["max_position_embeddings"],
        }
    if os.path.isfile(os.path.join(name, "config.json")):
        from transformers import AutoConfig

        try:
            return _from_config(AutoConfig.from_pretrained(name, local_files_only=True))
        except (OSError, ValueError):
            return None
    return None


def _from_config(config: Any) -> dict[str, int] | None:
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_size = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if head_size is None and positions is None:
        return None
    return {"head_size": head_size, "positions": positions}
