"""Temperature / top-k / top-p sampling over the few tokens that can be drawn (docs/algorithms.md#sampling).

The distribution is the one ``transformers`` samples from with ``temperature``, ``top_k`` and ``top_p`` (in that
order): softmax of ``logits / temperature`` over the ``top_k`` largest logits, then only the smallest prefix of
them, largest first, whose mass reaches ``top_p`` (a token is kept while the mass strictly before it is below
``top_p``, so the most likely token always is), renormalised. It is computed on the ``top_k`` candidates only:
no sort and no multinomial over the whole vocabulary, which cost ~20 ms per decoding step at batch 8 on a 49k
vocabulary on one CPU thread (against ~1 ms here). One difference: a tie with the k-th largest logit keeps
exactly ``top_k`` tokens here, all tied tokens in ``transformers``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_distribution(
    logits: Tensor, temperature: float, top_k: int | None = None, top_p: float = 1.0
) -> tuple[Tensor, Tensor | None]:
    """``(probs, token_ids)``, both ``[rows, k]``: the sampling distribution over each row's candidates, largest
    first (a dropped candidate has probability 0 and sits after every kept one). ``token_ids`` is ``None`` when
    nothing is truncated (``top_k`` null or ≥ the vocabulary and ``top_p`` 1): ``probs`` is then over the whole
    vocabulary in its own order."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}).")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (got {top_p}).")
    scaled = logits.float() / temperature
    vocab = scaled.shape[-1]
    k = vocab if top_k is None else min(int(top_k), vocab)
    if k < 1:
        raise ValueError(f"top_k must be >= 1 or null (got {top_k}).")
    if k == vocab and top_p >= 1:
        return scaled.softmax(-1), None
    # Largest first; a full sort when top-p alone truncates (top-k of the whole vocabulary is slower).
    values, token_ids = scaled.sort(-1, descending=True) if k == vocab else scaled.topk(k, dim=-1)
    probs = values.softmax(-1)
    if top_p < 1:
        mass_before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(mass_before >= top_p, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs, token_ids


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row, ``[rows]``, drawn from ``probs`` (``[rows, k]``, each row summing to 1) by inverting the
    cumulative distribution at one uniform number per row."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[:-1] + (1,), generator=generator, device=probs.device, dtype=cdf.dtype)
    index = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    # A rounding u·total = total must not land past the last candidate with a non-zero probability.
    last = (probs > 0).cumsum(-1).argmax(-1, keepdim=True)
    return torch.minimum(index, last).squeeze(-1)


def sample_tokens(
    logits: Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token id per row of ``logits`` (``[rows, vocab]``), drawn from :func:`truncated_distribution`."""
    probs, token_ids = truncated_distribution(logits, temperature, top_k, top_p)
    index = draw(probs, generator)
    return index if token_ids is None else token_ids.gather(-1, index.unsqueeze(-1)).squeeze(-1)
