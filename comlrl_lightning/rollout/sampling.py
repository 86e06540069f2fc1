"""Batched sampling and token scoring (docs/algorithms.md#policy-loss-and-token-scoring).

Layout shared by both: a row is ``[left-padded prompt | completion right-padded after EOS]``, exactly what
``generate`` returns. The completion mask covers the generated tokens up to and including the first EOS and
never padding (our fix of CoMLRL's last-token / pad-target bug, docs/differences.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class SamplingConfig:
    """Sampling settings; CoMLRL defaults. Sampling is always on (``do_sample=True``)."""

    max_new_tokens: int = 256
    temperature: float = 0.6
    top_p: float = 0.6
    top_k: int | None = 50

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens}).")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature}).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}).")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null (got {self.top_k}).")


def validate_generation_kwargs(generation_kwargs: dict | None) -> None:
    """Extra ``generate`` arguments may not override what has its own field (sampling is always on)."""
    reserved = {"do_sample", "temperature", "top_p", "top_k", "max_new_tokens", "num_return_sequences",
                "num_beams"} & set(generation_kwargs or {})
    if reserved:
        raise ValueError(f"generation_kwargs must not set {sorted(reserved)}: sampling is always on and these have "
                         "their own fields (temperature, top_p, top_k, max_new_tokens, num_generations).")


@dataclass
class Completions:
    """K samples for each of M prompts of one agent; row r belongs to prompt r // K."""

    prompt_ids: list[Tensor]  # M unpadded prompt token ids (CPU)
    completion_ids: Tensor  # [M*K, T] long, padded with pad_token_id after EOS
    completion_mask: Tensor  # [M*K, T] bool, generated tokens up to and including EOS
    texts: list[str]  # M*K decoded completions (special tokens skipped)
    num_samples: int

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)


def eos_token_ids(model, tokenizer) -> list[int]:
    """All ids that end generation (generation_config may list several)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("The tokenizer has no eos_token_id; generation could never stop.")
    return ids


def completion_mask_from_ids(completion_ids: Tensor, eos_ids: Sequence[int]) -> Tensor:
    """True for generated tokens up to and including the first EOS of each row (vectorised)."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(list(eos_ids), device=completion_ids.device))
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()  # EOS strictly before position t
    return eos_before == 0


@torch.no_grad()
def sample_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    num_samples: int,
    sampling: SamplingConfig,
    batch_size: int | None = None,
    generation_kwargs: dict | None = None,
) -> Completions:
    """``num_samples`` completions per prompt with one ``generate`` per chunk of ``batch_size`` prompts.

    Runs in eval mode under ``no_grad`` (not inference mode: the ids are reused in training) with the KV cache.
    """
    device = next(model.parameters()).device
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id
    was_training = model.training
    model.eval()
    prompt_ids: list[Tensor] = []
    chunks: list[Tensor] = []
    try:
        step = batch_size or len(prompts)
        for start in range(0, len(prompts), step):
            enc = tokenizer(list(prompts[start : start + step]), return_tensors="pt", padding=True,
                            padding_side="left", add_special_tokens=False)
            enc = {k: v.to(device) for k, v in enc.items()}
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k is not None else 0,
                max_new_tokens=sampling.max_new_tokens,
                num_return_sequences=num_samples,
                num_beams=1,
                use_cache=True,
                eos_token_id=eos_ids,
                pad_token_id=pad_id,
                # Sharded agents are gathered whole before sampling (agents/sharding.py), so the ranks need not
                # decode in lockstep (transformers turns that on for FSDP modules): each stops at its own EOS.
                synced_gpus=False,
                **(generation_kwargs or {}),
            )
            width = enc["input_ids"].shape[1]
            chunks.append(out[:, width:])
            mask = enc["attention_mask"].bool()
            prompt_ids.extend(row[m].cpu() for row, m in zip(enc["input_ids"], mask))
    finally:
        model.train(was_training)
    completion_ids = _pad_right(chunks, pad_id)
    completion_mask = completion_mask_from_ids(completion_ids, eos_ids)
    # Zero out anything after EOS (generate pads with pad_id already; this guards custom stopping).
    completion_ids = completion_ids.masked_fill(~completion_mask, pad_id)
    texts = tokenizer.batch_decode(completion_ids.masked_fill(~completion_mask, pad_id), skip_special_tokens=True)
    return Completions(prompt_ids, completion_ids.cpu(), completion_mask.cpu(), texts, num_samples)


def _pad_right(chunks: list[Tensor], pad_id: int) -> Tensor:
    width = max(c.shape[1] for c in chunks)
    return torch.cat([F.pad(c, (0, width - c.shape[1]), value=pad_id) for c in chunks])


@dataclass
class ScoringInputs:
    """Rows ready for one forward: left-padded prompts followed by right-padded completions."""

    input_ids: Tensor  # [B, P+T]
    attention_mask: Tensor  # [B, P+T]
    position_ids: Tensor  # [B, P+T]
    completion_ids: Tensor  # [B, T]
    completion_mask: Tensor  # [B, T] bool


def build_scoring_inputs(prompt_ids: Sequence[Tensor], completion_ids: Tensor, completion_mask: Tensor,
                         pad_id: int) -> ScoringInputs:
    """Left-pad the B prompts (one per row) and append the completions; positions match generation."""
    width = max(len(p) for p in prompt_ids)
    prompts = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):  # one slice copy per row; no per-token work
        prompts[row, width - len(ids):] = ids
        prompt_mask[row, width - len(ids):] = 1
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    return ScoringInputs(
        input_ids=torch.cat([prompts, completion_ids], dim=1),
        attention_mask=attention_mask,
        position_ids=position_ids,
        completion_ids=completion_ids,
        completion_mask=completion_mask.bool(),
    )


def token_logprobs(model, inputs: ScoringInputs) -> Tensor:
    """log π(y_t | x, y_<t) for every completion position, [B, T] float32 (0 where masked).

    One forward; logits are kept only for the completion positions (``logits_to_keep``), and the log-prob is
    ``gather - logsumexp`` in float32, so no [B, T, V] log-softmax copy is materialised.
    """
    device = next(model.parameters()).device
    T = inputs.completion_ids.shape[1]
    out = model(
        input_ids=inputs.input_ids.to(device),
        attention_mask=inputs.attention_mask.to(device),
        position_ids=inputs.position_ids.to(device),
        use_cache=False,
        logits_to_keep=T + 1,
    )
    logits = out.logits[:, -T - 1 : -1, :]  # position t predicts completion token t
    targets = inputs.completion_ids.to(device)
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1).float()
    logp = picked - torch.logsumexp(logits.float(), dim=-1)
    return logp * inputs.completion_mask.to(device)


def collate_rows(prompt_ids: Sequence[Tensor], completions: Sequence[Tensor], masks: Sequence[Tensor],
                 pad_id: int) -> ScoringInputs:
    """Scoring inputs for groups of samples: group g contributes its ``completions[g]`` rows ([K_g, T_g]),
    each paired with ``prompt_ids[g]``; completions are right-padded to the longest group."""
    width = max(c.shape[1] for c in completions)
    ids = torch.cat([F.pad(c, (0, width - c.shape[1]), value=pad_id) for c in completions])
    mask = torch.cat([F.pad(m, (0, width - m.shape[1]), value=False) for m in masks])
    rows = [p for p, c in zip(prompt_ids, completions) for _ in range(c.shape[0])]
    return build_scoring_inputs(rows, ids, mask, pad_id)


def select_rows(inputs: ScoringInputs, rows: slice) -> ScoringInputs:
    return ScoringInputs(*(getattr(inputs, f)[rows] for f in
                           ("input_ids", "attention_mask", "position_ids", "completion_ids", "completion_mask")))


def trim_prompt_padding(inputs: ScoringInputs) -> ScoringInputs:
    """Drop the left-padding columns no row needs (rows of a micro-batch may all have shorter prompts than the
    longest prompt of their mini-batch); positions are kept, so log-probs are unchanged."""
    first = int(inputs.attention_mask.any(0).long().argmax())
    if first == 0:
        return inputs
    return ScoringInputs(inputs.input_ids[:, first:], inputs.attention_mask[:, first:], inputs.position_ids[:, first:],
                         inputs.completion_ids, inputs.completion_mask)


def micro_batches(inputs: ScoringInputs, max_rows: int | None = None, max_tokens: int | None = None) -> list[slice]:
    """Consecutive row ranges for the forwards of one update: each holds at most ``max_rows`` rows and at most
    ``max_tokens`` tokens as the forward sees them (rows × its longest prompt + the completion width); a row longer
    than ``max_tokens`` is a micro-batch of its own. Neither limit: one range with every row."""
    rows = inputs.input_ids.shape[0]
    if max_tokens is None:
        step = max_rows or rows
        return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]
    width = inputs.completion_ids.shape[1]
    prompt_lengths = (inputs.attention_mask[:, : inputs.input_ids.shape[1] - width].sum(-1) + width).tolist()
    ranges, start, longest = [], 0, 0
    for row, length in enumerate(prompt_lengths):  # planning over rows (scalars), not a per-token loop
        longest_with = max(longest, length)
        full = row > start and ((row - start + 1) * longest_with > max_tokens or
                                (max_rows is not None and row - start >= max_rows))
        if full:
            ranges.append(slice(start, row))
            start, longest_with = row, length
        longest = longest_with
    ranges.append(slice(start, rows))
    return ranges
