"""An agent's attention shape read without its weights (a tiny preset's numbers and ``model_kwargs``, else the
config :func:`~comlrl_lightning.agents.loading.config_without_weights` finds): what the checks made before any model
loads need, e.g. the head size a generation engine must support. None where it cannot be known cheaply."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .factories import TINY_PRESETS
from .loading import config_without_weights, max_positions


def architecture(source: Any, model_kwargs: Mapping[str, Any] | None = None) -> dict[str, int | None] | None:
    """``{"head_size", "positions"}`` of the model ``source`` (an ``agents`` entry) loads as, with ``model_kwargs``
    applied to a tiny preset; None when unknown."""
    limit = max_positions(source, model_kwargs)
    positions = limit[1] if limit else None
    if isinstance(source, str) and source in TINY_PRESETS:
        preset = {
            **TINY_PRESETS[source],
            **{k: v for k, v in dict(model_kwargs or {}).items() if k in TINY_PRESETS[source]},
        }
        return {"head_size": preset["hidden_size"] // preset["num_heads"], "positions": positions}
    config = config_without_weights(source)
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    head_size = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
    if head_size is None and positions is None:
        return None
    return {"head_size": head_size, "positions": positions}
