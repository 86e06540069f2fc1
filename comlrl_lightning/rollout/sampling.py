"""What sampling returns, and token scoring (docs/algorithms.md#policy-loss-and-token-scoring).

Layout shared by both: a row is ``[left-padded prompt | completion right-padded after EOS]``, exactly what
``generate`` returns. The completion mask covers the generated tokens up to and including the first EOS and
never padding (our fix of CoMLRL's last-token / pad-target bug, docs/differences.md). Every generation backend
(``rollout/generation.py``: Hugging Face ``generate``, vLLM, transformers' continuous batching) returns its samples
as :class:`Completions` through :func:`assemble_completions`, so training sees the same records whichever engine
sampled them; the loss always scores the sampled ids with the training model (:func:`token_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence, get_args

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.generation import utils as _generation

from comlrl_lightning.agents.memory import is_checkpointing
from comlrl_lightning.agents.value_head import cache_of

# What ``generate`` calls a cache handed to it (transformers renamed ``past_key_values`` to ``cache``).
CACHE_KEYWORD = "cache" if "cache" in getattr(_generation, "ALL_CACHE_NAMES", ()) else "past_key_values"


# What the ``hf`` backend samples with (``generation_dtype``): the training weights, or a half-precision copy.
GenerationDtype = Literal["model", "bfloat16", "float16"]
GENERATION_DTYPES: tuple[str, ...] = get_args(GenerationDtype)


@dataclass
class SamplingConfig:
    """Sampling settings; CoMLRL defaults. Sampling is always on (``do_sample=True``). ``keep_logprobs``: also
    return each sampled token's log-probability under the model (what a scoring forward of the sample gives), read
    from the logits ``generate`` computes anyway, when nothing ahead of the sampler changes them. ``dtype``: sample
    with the training weights as they are (``model``) or with a half-precision copy of them (the ``hf`` backend's
    ``SamplingCopies``)."""

    max_new_tokens: int = 256
    temperature: float = 0.6
    top_p: float = 0.6
    top_k: int | None = 50
    keep_logprobs: bool = False
    dtype: GenerationDtype = "model"  # ``model``, or a half-precision copy to sample with

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens}).")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature}).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}).")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null (got {self.top_k}).")
        if self.dtype not in GENERATION_DTYPES:
            raise ValueError(f"generation_dtype must be one of {', '.join(GENERATION_DTYPES)} (got {self.dtype!r}).")


def validate_generation_kwargs(generation_kwargs: dict | None) -> None:
    """Extra ``generate`` arguments may not override what has its own field (sampling is always on)."""
    reserved = {
        "do_sample",
        "temperature",
        "top_p",
        "top_k",
        "max_new_tokens",
        "num_return_sequences",
        "num_beams",
    } & set(generation_kwargs or {})
    if reserved:
        raise ValueError(
            f"generation_kwargs must not set {sorted(reserved)}: sampling is always on and these have "
            "their own fields (temperature, top_p, top_k, max_new_tokens, num_generations)."
        )


@dataclass
class Completions:
    """K samples for each of M prompts of one agent; row r belongs to prompt r // K."""

    prompt_ids: list[Tensor]  # M unpadded prompt token ids (CPU)
    completion_ids: Tensor  # [M*K, T] long, padded with pad_token_id after EOS
    completion_mask: Tensor  # [M*K, T] bool, generated tokens up to and including EOS
    texts: list[str]  # M*K decoded completions (special tokens skipped)
    num_samples: int
    logprobs: Tensor | None = None  # [M*K, T] float32 log π(token) at sampling (``keep_logprobs``), 0 after EOS
    # [M*K, T] float32 the engine's own log-probs of its samples (vLLM): what it sampled from, which may differ a
    # little from the training model's (``rollout/engine_logprob_gap``); 0 after EOS
    engine_logprobs: Tensor | None = None

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)

    def split(self, prompts: Sequence[int]) -> list["Completions"]:
        """One ``Completions`` per consecutive group of ``prompts[g]`` prompts (the answers of a joint call, per
        agent); each keeps the whole width."""
        out, start = [], 0
        for count in prompts:
            rows = slice(start * self.num_samples, (start + count) * self.num_samples)
            width = max(int(self.completion_mask[rows].sum(-1).max()), 1)  # as wide as this group's longest
            cut = [None if t is None else t[rows, :width] for t in (self.logprobs, self.engine_logprobs)]
            out.append(
                Completions(
                    self.prompt_ids[start : start + count],
                    self.completion_ids[rows, :width],
                    self.completion_mask[rows, :width],
                    self.texts[rows],
                    self.num_samples,
                    *cut,
                )
            )
            start += count
        return out


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


def assemble_completions(
    prompt_ids: Sequence[Tensor],
    rows: Sequence[Tensor],
    tokenizer,
    eos_ids: Sequence[int],
    num_samples: int,
    logprobs: Sequence[Tensor] | None = None,
    engine_logprobs: Sequence[Tensor] | None = None,
) -> Completions:
    """The :class:`Completions` of ``rows`` (each a [r, t] block of generated ids, blocks of any width, rows
    prompt-major), their log-probs laid out the same way: right-padded with the pad id, masked up to and including
    the first EOS, anything after it padding (a backend's custom stopping included), decoded without special
    tokens."""
    pad_id = tokenizer.pad_token_id
    completion_ids = _pad_right(rows, pad_id)
    completion_mask = completion_mask_from_ids(completion_ids, eos_ids)
    completion_ids = completion_ids.masked_fill(~completion_mask, pad_id)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    def laid_out(parts: Sequence[Tensor] | None) -> Tensor | None:
        if parts is None:
            return None
        return (_pad_right([p.float() for p in parts], 0.0) * completion_mask).cpu()

    return Completions(
        list(prompt_ids),
        completion_ids.cpu(),
        completion_mask.cpu(),
        texts,
        num_samples,
        laid_out(logprobs),
        laid_out(engine_logprobs),
    )


def _pad_right(chunks: Sequence[Tensor], value: float) -> Tensor:
    width = max(max(c.shape[1] for c in chunks), 1)
    return torch.cat([F.pad(c, (0, width - c.shape[1]), value=value) for c in chunks])


@dataclass
class ScoringInputs:
    """Rows ready for one forward: left-padded prompts followed by right-padded completions."""

    input_ids: Tensor  # [B, P+T]
    attention_mask: Tensor  # [B, P+T]
    position_ids: Tensor  # [B, P+T]
    completion_ids: Tensor  # [B, T]
    completion_mask: Tensor  # [B, T] bool


def build_scoring_inputs(
    prompt_ids: Sequence[Tensor], completion_ids: Tensor, completion_mask: Tensor, pad_id: int
) -> ScoringInputs:
    """Left-pad the B prompts (one per row) and append the completions; positions match generation."""
    width = max(len(p) for p in prompt_ids)
    prompts = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):  # one slice copy per row; no per-token work
        prompts[row, width - len(ids) :] = ids
        prompt_mask[row, width - len(ids) :] = 1
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    return ScoringInputs(
        input_ids=torch.cat([prompts, completion_ids], dim=1),
        attention_mask=attention_mask,
        position_ids=position_ids,
        completion_ids=completion_ids,
        completion_mask=completion_mask.bool(),
    )


def token_logprobs(
    model, inputs: ScoringInputs, share_prompts: bool = True, entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(y_t | x, y_<t) for every completion position, [B, T] float32 (0 where masked); with ``entropy`` also
    the policy's entropy H_t = −Σ_v π(v) log π(v) at each position, [B, T] (0 where masked), from the same logits.

    Logits are kept only for the completion positions (``logits_to_keep``), and the log-prob is ``gather -
    logsumexp`` in float32, so no [B, T, V] log-softmax copy is materialised. Rows that share a prompt (the K samples
    of one prompt) have it encoded once (:func:`shared_prompts`): one forward over the distinct prompts fills a KV
    cache (with grad), each row continues from its prompt's entries. The result and its gradient are the single
    forward's, to float rounding (tests/test_rollout.py). ``share_prompts=False``, or gradient checkpointing (which
    drops a cache), gives the single forward over every row.
    """
    device = next(model.parameters()).device
    T = inputs.completion_ids.shape[1]
    ids, mask, positions = (
        inputs.input_ids.to(device),
        inputs.attention_mask.to(device),
        inputs.position_ids.to(device),
    )
    shared = shared_prompts(inputs) if share_prompts and shares_prompts(model) else None
    if shared is None:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=T + 1)
        logits = out.logits[:, -T - 1 : -1, :]  # position t predicts completion token t
    else:
        first, prompt_of = (x.to(device) for x in shared)
        P = ids.shape[1] - T  # all prompt tokens but the last go through the prompt forward, once per prompt
        prompts = model(
            input_ids=ids[first, : P - 1],
            attention_mask=mask[first, : P - 1],
            position_ids=positions[first, : P - 1],
            use_cache=True,
            logits_to_keep=1,
        )
        cache = cache_of(prompts)
        cache.batch_select_indices(prompt_of)  # an indexing copy: gradients flow back to the shared prompt
        out = model(
            input_ids=ids[:, P - 1 : -1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, P - 1 : -1],
            use_cache=True,
            logits_to_keep=T,
            **{CACHE_KEYWORD: cache},
        )
        logits = out.logits  # the last prompt token and the completion but its last token: T positions
    targets = inputs.completion_ids.to(device)
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1).float()
    normaliser = torch.logsumexp(logits.float(), dim=-1)
    mask = inputs.completion_mask.to(device)
    logp = (picked - normaliser) * mask
    if not entropy:
        return logp
    probs = torch.softmax(logits.float(), dim=-1)  # [B, T, V]: only when an objective asks for it
    return logp, (normaliser - (probs * logits.float()).sum(-1)) * mask


def shared_prompts(inputs: ScoringInputs) -> tuple[Tensor, Tensor] | None:
    """Which rows have the same prompt (ids and padding): ``(first, prompt_of)``, the first row of each distinct
    prompt [U] and each row's index into them [B]; None when no two rows share one or the prompts are one token."""
    P = inputs.input_ids.shape[1] - inputs.completion_ids.shape[1]
    rows = inputs.input_ids.shape[0]
    if P < 2 or rows < 2:
        return None
    prompt_of = _prompt_index(inputs)
    distinct = int(prompt_of.max()) + 1
    if distinct == rows:
        return None
    first = torch.full((distinct,), rows, dtype=torch.long)
    first.scatter_reduce_(0, prompt_of, torch.arange(rows), reduce="amin")
    return first, prompt_of


def _prompt_index(inputs: ScoringInputs) -> Tensor:
    """[B] each row's index among the distinct prompts (ids and padding) of ``inputs``."""
    P = inputs.input_ids.shape[1] - inputs.completion_ids.shape[1]
    prompts = inputs.input_ids[:, :P].masked_fill(inputs.attention_mask[:, :P] == 0, -1)
    return torch.unique(prompts, dim=0, return_inverse=True)[1]


def forward_tokens(model, inputs: ScoringInputs) -> int:
    """Tokens the forwards of :func:`token_logprobs` run for ``inputs`` (what their activations scale with): a shared
    prompt counts once."""
    rows, width = inputs.input_ids.shape
    shared = shared_prompts(inputs) if shares_prompts(model) else None
    return _forward_cost(rows, rows if shared is None else len(shared[0]), width, inputs.completion_ids.shape[1])


def shares_prompts(model) -> bool:
    """Whether :func:`token_logprobs` encodes a shared prompt once for ``model``: not where a forward drops the KV
    cache it is given (gradient checkpointing, when grads are on); the rows are then scored whole."""
    return not (torch.is_grad_enabled() and is_checkpointing(model))


def collate_rows(
    prompt_ids: Sequence[Tensor], completions: Sequence[Tensor], masks: Sequence[Tensor], pad_id: int
) -> ScoringInputs:
    """Scoring inputs for groups of samples: group g contributes its ``completions[g]`` rows ([K_g, T_g]),
    each paired with ``prompt_ids[g]``; completions are right-padded to the longest group."""
    width = max(c.shape[1] for c in completions)
    ids = torch.cat([F.pad(c, (0, width - c.shape[1]), value=pad_id) for c in completions])
    mask = torch.cat([F.pad(m, (0, width - m.shape[1]), value=False) for m in masks])
    rows = [p for p, c in zip(prompt_ids, completions) for _ in range(c.shape[0])]
    return build_scoring_inputs(rows, ids, mask, pad_id)


def select_rows(inputs: ScoringInputs, rows: slice | Tensor) -> ScoringInputs:
    return ScoringInputs(
        *(
            getattr(inputs, f)[rows]
            for f in ("input_ids", "attention_mask", "position_ids", "completion_ids", "completion_mask")
        )
    )


def trim_prompt_padding(inputs: ScoringInputs) -> ScoringInputs:
    """Drop the left-padding columns no row needs (rows of a micro-batch may all have shorter prompts than the
    longest prompt of their mini-batch); positions are kept, so log-probs are unchanged."""
    first = int(inputs.attention_mask.any(0).long().argmax())
    if first == 0:
        return inputs
    return ScoringInputs(
        inputs.input_ids[:, first:],
        inputs.attention_mask[:, first:],
        inputs.position_ids[:, first:],
        inputs.completion_ids,
        inputs.completion_mask,
    )


def micro_batches(
    inputs: ScoringInputs, max_rows: int | None = None, max_tokens: int | None = None, share_prompts: bool = True
) -> list[slice | Tensor]:
    """The rows of each forward of one update. By rows only: consecutive ranges of at most ``max_rows`` rows (neither
    limit: one range with every row). With a token budget: rows bucketed by length — sorted by prompt length, then
    packed so that a micro-batch's forwards run at most ``max_tokens`` tokens (:func:`forward_tokens`: rows × its
    longest row, or, where rows share a prompt and ``share_prompts``, each distinct prompt once plus every row's
    continuation) and hold at most ``max_rows`` rows; a row longer than ``max_tokens`` is a micro-batch of its own.
    Rows of similar length share a forward, so little of it is padding. Returned as index tensors."""
    rows = inputs.input_ids.shape[0]
    if max_tokens is None:
        step = max_rows or rows
        return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]
    width = inputs.completion_ids.shape[1]
    lengths = inputs.attention_mask[:, : inputs.input_ids.shape[1] - width].sum(-1) + width
    shared = share_prompts and inputs.input_ids.shape[1] - width >= 2  # as shared_prompts decides
    prompt_of = _prompt_index(inputs).tolist() if shared else list(range(rows))
    order = torch.argsort(lengths, stable=True)
    parts, current, prompts = [], [], set()
    for row, length in zip(order.tolist(), lengths[order].tolist()):  # planning over rows (scalars), not tokens
        prompt = prompt_of[row]
        cost = _forward_cost(len(current) + 1, len(prompts) + (prompt not in prompts), length, width)
        if current and (cost > max_tokens or (max_rows is not None and len(current) >= max_rows)):
            parts.append(current)
            current, prompts = [], set()
        current.append(row)  # sorted: the newest row is the longest of its micro-batch
        prompts.add(prompt)
    parts.append(current)
    return [torch.tensor(part, dtype=torch.long) for part in parts]


def _forward_cost(rows: int, prompts: int, length: int, width: int) -> int:
    """Tokens the forwards of :func:`token_logprobs` run for ``rows`` rows of ``prompts`` distinct prompts, the
    longest row ``length`` tokens of which ``width`` are completion."""
    if prompts == rows or length - width < 2:  # nothing shared: one forward over the whole rows
        return rows * length
    return prompts * (length - width - 1) + rows * width


def take(items: Sequence, rows: slice | Tensor) -> list:
    """``items[rows]`` for a list and either kind of :func:`micro_batches` rows."""
    return list(items[rows]) if isinstance(rows, slice) else [items[i] for i in rows.tolist()]
