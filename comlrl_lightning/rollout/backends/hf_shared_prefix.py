"""Decoding K samples per prompt with one copy of each prompt's keys and values (docs/algorithms.md#sampling).

:func:`~comlrl_lightning.rollout.sampling.prefill_once` encodes each prompt once. Repeating its cache K times along
the batch would then make every decoding step copy the K copies (the cache grows by concatenation) and read them
(attention): for a coding prompt of a few hundred tokens at K=8, most of what a step's attention moves. Here the
cache keeps each prompt's entries once (the *prefix*, ``[prompts, kv heads, P, d]``) and each row's generated
entries apart (the *suffix*, ``[rows, kv heads, t, d]``), and attention scores a prompt's K rows against its prefix
in one product:

    softmax([q·Kₚ | q·Kₛ] / √d) · [Vₚ ; Vₛ]

with the scores of both parts in one softmax, so the result is ordinary attention over the whole sequence, summed
in another order (the logits agree to float rounding; tests/test_rollout.py).

The attention runs under its own name (:data:`ATTENTION`, registered with transformers' attention and mask
interfaces) while :func:`shared_prefix_decoding` is active, in place of ``sdpa``; the model's masks are
transformers' own (the ``sdpa`` boolean masks, padding and any sliding window included). It applies to one decoded
token per row (every step after the prefill). Anything else it leaves to ``sdpa`` itself, over the prefix repeated
for the rows: a query of several tokens, a position bias, soft-capping or sink tokens. A model whose attention is not
``sdpa`` (``eager``, whose model-specific function this module cannot call; flash attention) keeps the cache
repeated K times.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

ATTENTION = "comlrl_shared_prefix"
# The attention implementation this one stands in for, and falls back to (the others keep the repeated cache).
REPLACES = "sdpa"
# Keyword arguments of a model's attention that change what it computes (a sliding window does not: the mask holds
# it); with any of them set, the layer falls back to sdpa over the repeated prefix.
_UNSUPPORTED = ("softcap", "s_aux", "position_bias", "sinks")

_ACTIVE: ContextVar["SharedPrefixCache | None"] = ContextVar("comlrl_shared_prefix_cache", default=None)


class SharedPrefixLayer(DynamicLayer):
    """One layer's cache: the prompts' entries once (``prefix_keys``/``prefix_values``, ``[prompts, kv heads, P,
    d]``) and every row's generated entries (``keys``/``values``, ``[prompts·K, kv heads, t, d]``, rows prompt-major).
    ``update`` appends to the suffix and returns it; :func:`shared_prefix_attention` reads the prefix."""

    is_croppable = False

    def __init__(self, prefix_keys: Tensor, prefix_values: Tensor, repeats: int):
        super().__init__()
        self.prefix_keys, self.prefix_values, self.repeats = prefix_keys, prefix_values, repeats
        rows, heads, _, dim = prefix_keys.shape
        self.device = prefix_keys.device
        self.keys = prefix_keys.new_empty(rows * repeats, heads, 0, dim)
        self.values = prefix_values.new_empty(rows * repeats, heads, 0, prefix_values.shape[-1])
        self.is_initialized = True

    @property
    def prefix_length(self) -> int:
        return self.prefix_keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.prefix_length + self.keys.shape[-2]

    def repeated(self) -> tuple[Tensor, Tensor]:
        """The whole sequence's keys and values for every row, as an ordinary cache holds them."""
        return tuple(
            torch.cat([prefix.repeat_interleave(self.repeats, 0), own], dim=-2)
            for prefix, own in ((self.prefix_keys, self.keys), (self.prefix_values, self.values))
        )

    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise RuntimeError("a shared-prefix cache keeps each prompt's rows together; beam search reorders them")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RuntimeError("a shared-prefix cache already holds its rows; repeat the prompts before sharing them")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise RuntimeError("a shared-prefix cache keeps each prompt's K rows; it cannot select single rows")


class SharedPrefixCache(DynamicCache):
    """A :class:`~transformers.DynamicCache` whose layers are :class:`SharedPrefixLayer`: built from the cache of a
    forward over the distinct prompts, for ``repeats`` rows per prompt."""

    def __init__(self, prompts: DynamicCache, repeats: int):
        Cache.__init__(self, layers=[SharedPrefixLayer(layer.keys, layer.values, repeats) for layer in prompts.layers])


def can_share(cache: DynamicCache, model) -> bool:
    """Whether ``cache`` (of a forward over the prompts) can become a :class:`SharedPrefixCache` for ``model``: every
    layer a plain growing one with entries, and the model's attention ``sdpa`` (:data:`REPLACES`)."""
    configs = _attention_configs(model)
    plain = len(cache.layers) > 0 and all(
        type(layer) is DynamicLayer and layer.get_seq_length() > 0 for layer in cache.layers
    )
    return plain and bool(configs) and all(config._attn_implementation == REPLACES for config in configs)


@contextlib.contextmanager
def shared_prefix_decoding(model, cache: SharedPrefixCache) -> Iterator[None]:
    """While the block runs (a ``generate`` continuing from ``cache``), ``model``'s attention reads each prompt's
    entries once for its rows (:func:`shared_prefix_attention`)."""
    configs = _attention_configs(model)
    before = [config._attn_implementation for config in configs]
    token = _ACTIVE.set(cache)
    for config in configs:
        config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        for config, implementation in reversed(list(zip(configs, before))):
            config._attn_implementation = implementation
        _ACTIVE.reset(token)


def shared_prefix_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention of ``query`` (``[rows, heads, 1, d]``) over the prefix of :data:`_ACTIVE`'s layer and the rows' own
    ``key``/``value`` (the suffix ``update`` returned). ``attention_mask``: transformers' boolean mask over the whole
    sequence (``[rows, 1, 1, P + t]``), or None where nothing is masked. Returns ``[rows, 1, heads, d]``."""
    cache, index = _ACTIVE.get(), getattr(module, "layer_idx", None)
    layer = cache.layers[index] if cache is not None and index is not None and index < len(cache.layers) else None
    shared = layer is not None and key is layer.keys  # else not this cache's layer: nothing is shared here
    if shared and (query.shape[2] != 1 or dropout or any(kwargs.get(name) is not None for name in _UNSUPPORTED)):
        key, value = layer.repeated()
        shared = False
    if not shared:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    prompts, kv_heads, P, _ = layer.prefix_keys.shape
    K, G = layer.repeats, heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    # A prompt's K rows × G query heads per kv head, against the prompt's keys: [prompts, kv heads, K·G, P].
    q = query.view(prompts, K, kv_heads, G, dim)
    prefix_scores = q.transpose(1, 2).reshape(prompts, kv_heads, K * G, dim) @ layer.prefix_keys.transpose(-1, -2)
    # Each row against its own keys: [rows, kv heads, G, t].
    own_scores = query.view(rows, kv_heads, G, dim) @ key.transpose(-1, -2)
    prefix_scores = prefix_scores.view(prompts, kv_heads, K, G, P).transpose(1, 2).reshape(rows, kv_heads, G, P)
    scores = torch.cat([prefix_scores, own_scores], dim=-1).mul_(scale)
    if attention_mask is not None:
        scores.masked_fill_(~attention_mask.view(rows, 1, 1, -1), float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    prefix_weights = weights[..., :P].reshape(prompts, K, kv_heads, G, P).transpose(1, 2)
    out = prefix_weights.reshape(prompts, kv_heads, K * G, P) @ layer.prefix_values  # [prompts, kv heads, K·G, d]
    out = out.view(prompts, kv_heads, K, G, -1).transpose(1, 2).reshape(rows, kv_heads, G, -1)
    out = out + weights[..., P:] @ value  # [rows, kv heads, G, d]
    return out.reshape(rows, 1, heads, -1), None


def _attention_configs(model) -> list:
    """The configs whose ``_attn_implementation`` ``model``'s attention layers and masks read: those of every
    transformers model inside it (a peft or value-head wrapper's inner model, a composite model's parts)."""
    from transformers import PreTrainedModel

    return list({id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}.values())


AttentionInterface.register(ATTENTION, shared_prefix_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
