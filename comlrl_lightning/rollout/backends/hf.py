"""The ``hf`` generation backend: Hugging Face ``generate`` in the training process, on the training weights.

One batched ``generate`` per weight set (agents given the same model, and a whole LoRA team, whose rows each go
through their own adapter), agents on distinct devices in parallel threads. Its speed code is its own:

* each prompt is prefilled once and its KV cache shared by its K samples (:func:`prefill_once`,
  ``hf_shared_prefix.py``);
* tokens are drawn within the top-k candidates (:class:`TopKTopPSampler`), the sampled tokens' log-probs read from
  the logits ``generate`` computes anyway (:class:`SampledTokenLogprobs`);
* on a CPU, the decoding products in the form timed faster there (``hf_products.py``), and half-precision sampling
  copies with packed weights (``generation_dtype``, ``hf_copies.py``).

Every one of them gives the samples the plain ``generate`` would, seed for seed or to float rounding
(tests/test_rollout.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList

from comlrl_lightning.agents.value_head import cache_of
from comlrl_lightning.core.sampling import sample_tokens
from comlrl_lightning.rollout.backends.hf_copies import sampling_copies
from comlrl_lightning.rollout.backends.hf_products import fast_decoding_products
from comlrl_lightning.rollout.backends.hf_shared_prefix import SharedPrefixCache, can_share, shared_prefix_decoding
from comlrl_lightning.rollout.sampling import (
    CACHE_KEYWORD,
    Completions,
    SamplingConfig,
    assemble_completions,
    eos_token_ids,
)
from comlrl_lightning.rollout.weights import answer_groups, generator_of, place_answers
from comlrl_lightning.runs import stop


class HFGenerate:
    """Hugging Face ``generate`` (KV cache, inference mode, eval mode), ``batch_size`` prompts per call; with
    ``concurrent`` (agents on distinct devices) the models generate at the same time, one thread each.

    Agents that share weights answer in ONE call: agents given the same model (parameter sharing) and the agents of a
    LoRA team, whose rows each go through their own adapter (peft's mixed-adapter batch: ``adapter_names``)."""

    def __init__(
        self,
        batch_size: int | None = None,
        generation_kwargs: Mapping[str, Any] | None = None,
        concurrent: bool = False,
    ):
        self.batch_size, self.generation_kwargs, self.concurrent = batch_size, dict(generation_kwargs or {}), concurrent

    name = "hf"

    def sample(self, models, tokenizers, inputs, K, sampling) -> list[Completions]:
        groups = answer_groups(models, tokenizers)
        copies: dict[int, Any] = {}
        if sampling.dtype != "model":  # refreshed here, before any thread starts
            held = sampling_copies(sampling.dtype)
            copies = {agents[0]: held(generator_of(models[agents[0]])[0]) for agents in groups}
            sampling = dataclasses.replace(sampling, keep_logprobs=False)  # a copy's log-probs are not the model's

        def one(agents: list[int]) -> list[Completions]:
            first = agents[0]
            if len(agents) == 1 and first not in copies:
                return [
                    sample_completions(
                        models[first],
                        tokenizers[first],
                        inputs[first],
                        K,
                        sampling,
                        self.batch_size,
                        self.generation_kwargs,
                    )
                ]
            generator = copies[first] if first in copies else generator_of(models[first])[0]
            prompts = [prompt for i in agents for prompt in inputs[i]]
            names = [generator_of(models[i])[1] for i in agents for _ in inputs[i]]
            joint = sample_completions(
                generator,
                tokenizers[first],
                prompts,
                K,
                sampling,
                self.batch_size,
                self.generation_kwargs,
                adapters=None if names[0] is None else names,
            )
            return joint.split([len(inputs[i]) for i in agents])

        if self.concurrent and len(groups) > 1:
            with ThreadPoolExecutor(max_workers=len(groups)) as pool:
                answers = list(pool.map(one, groups))
        else:
            answers = [one(agents) for agents in groups]
        return place_answers(groups, answers, len(models))

    def release_memory(self) -> None:
        """It holds no memory between samplings."""


def sample_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    num_samples: int,
    sampling: SamplingConfig,
    batch_size: int | None = None,
    generation_kwargs: dict | None = None,
    adapters: Sequence[str] | None = None,
) -> Completions:
    """``num_samples`` completions per prompt with one ``generate`` per chunk of ``batch_size`` prompts.

    Runs in eval mode under ``inference_mode`` (the ids are cloned out of it, so training can reuse them) with the
    KV cache. Each prompt is prefilled once and its cache shared by its K samples (:func:`prefill_once`). Tokens are
    drawn by :class:`TopKTopPSampler` (``transformers``' temperature / top-k / top-p distribution, computed on the
    top-k candidates only), unless ``generation_kwargs`` or the model's generation config asks for another
    truncation (``min_p``, ``typical_p``, …): then by ``generate``'s own sampler.
    ``adapters``: one peft adapter name per prompt, when ``model`` is a LoRA team answering for several agents in
    one call (mixed-adapter batch).
    """
    device = next(model.parameters()).device
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id
    was_training = model.training
    model.eval()
    prompt_ids: list[Tensor] = []
    chunks: list[Tensor] = []
    scores: list[Tensor] = []
    keep = sampling.keep_logprobs and logits_reach_sampler_unchanged(model, generation_kwargs)
    own = samples_with_own_sampler(model, generation_kwargs)
    try:
        step = batch_size or len(prompts)
        for start in range(0, len(prompts), step):
            enc = tokenizer(
                list(prompts[start : start + step]),
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,
            )
            enc = {k: v.to(device) for k, v in enc.items()}
            names = None if adapters is None else list(adapters[start : start + step])
            recorder = SampledTokenLogprobs() if keep else None
            extra = dict(generation_kwargs or {})
            processors = [StopCheck(), *(extra.pop("logits_processor", None) or []), *([recorder] if recorder else [])]
            if own:  # our sampler is the last processor and generate takes its draw as the argmax
                processors.append(TopKTopPSampler(sampling))
                for name in _OTHER_TRUNCATIONS:  # set to a neutral value (a greedy generate would warn about it)
                    extra.pop(name, None)
                draw = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            else:
                draw = {
                    "do_sample": True,
                    "temperature": sampling.temperature,
                    "top_p": sampling.top_p,
                    "top_k": sampling.top_k if sampling.top_k is not None else 0,
                }
            if processors:
                extra["logits_processor"] = LogitsProcessorList(processors)
            # A cache of generate's own kind (``cache_implementation: static``, compiled decoding on a GPU) is built
            # by generate itself: the prompts are then encoded K times, and the compiled step keeps the plain
            # linear products.
            own_cache = "cache_implementation" in extra
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.inference_mode())
                # The prompts' forward multiplies many rows (and keeps one position's logits per prompt): plain
                # products, so a process does not time the decoding forms for a row count only the prefill uses.
                inputs = prefill_once(model, enc, num_samples, names, share=not own_cache)
                if not own_cache:
                    stack.enter_context(fast_decoding_products(model))
                if isinstance(inputs.get(CACHE_KEYWORD), SharedPrefixCache):
                    stack.enter_context(shared_prefix_decoding(model, inputs[CACHE_KEYWORD]))
                out = model.generate(
                    **inputs,
                    **draw,
                    max_new_tokens=sampling.max_new_tokens,
                    num_return_sequences=1,
                    num_beams=1,
                    use_cache=True,
                    eos_token_id=eos_ids,
                    pad_token_id=pad_id,
                    # Sharded agents are gathered whole before sampling (agents/sharding.py), so the ranks need not
                    # decode in lockstep (transformers turns that on for FSDP modules): each stops at its own EOS.
                    synced_gpus=False,
                    **extra,
                )
                width = enc["input_ids"].shape[1]
                if recorder is not None:
                    scores.append(recorder.finish(out[:, width:]))
            chunks.append(out[:, width:].clone())  # cloned outside inference mode: a normal tensor
            mask = enc["attention_mask"].bool()
            prompt_ids.extend(row[m].cpu() for row, m in zip(enc["input_ids"], mask))
    finally:
        model.train(was_training)
    return assemble_completions(
        prompt_ids, chunks, tokenizer, eos_ids, num_samples, logprobs=[s.clone() for s in scores] if keep else None
    )


class StopCheck(LogitsProcessor):
    """A safe point per generated token (``runs/stop.py``): a Ctrl-C / SIGTERM stops a long ``generate`` at the next
    token. It leaves the logits alone."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        stop.check()
        return scores


class SampledTokenLogprobs(LogitsProcessor):
    """log π(sampled token) for every generated position, from the logits each decoding step already computed (the
    last processor before the sampler's temperature / top-k / top-p): no extra forward."""

    def __init__(self):
        self.steps: list[Tensor] = []
        self.last: Tensor | None = None  # the previous step's log-softmax, [rows, V]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.last is not None:  # the token sampled at the previous step is the newest input id
            self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, completion_ids: Tensor) -> Tensor:
        """[rows, T] for the T generated columns (the last step's token is read from ``completion_ids``)."""
        if self.last is not None and len(self.steps) < completion_ids.shape[1]:
            self.steps.append(
                self.last.gather(-1, completion_ids[:, len(self.steps) : len(self.steps) + 1]).squeeze(-1)
            )
        return (
            torch.stack(self.steps, dim=1)
            if self.steps
            else completion_ids.new_zeros(completion_ids.shape, dtype=torch.float)
        )


# Generation settings that change the logits before a processor of ours sees them (then the recorded log-probs would
# not be the model's), with the values that leave them alone.
_LOGIT_CHANGERS = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "bad_words_ids": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,),
    "logits_processor": (None,),
    "guidance_scale": (None, 1.0),
    "renormalize_logits": (None, False),
}


def logits_reach_sampler_unchanged(model, generation_kwargs: dict | None) -> bool:
    """Whether the logits ``generate`` hands its last processor are the model's own (no penalty, forced or
    suppressed token, minimum length or user processor in ``generation_kwargs`` or the model's generation
    config): then the sampled tokens' log-probs can be read there instead of from a scoring forward."""
    return _all_neutral(model, generation_kwargs, _LOGIT_CHANGERS)


class TopKTopPSampler(LogitsProcessor):
    """The sampler, run as the last logits processor of a greedy ``generate``: it draws each row's token from the
    temperature / top-k / top-p distribution (:func:`comlrl_lightning.core.sampling.sample_tokens`) and leaves that
    token the only finite score, so ``generate``'s argmax takes the draw. ``generate``'s own sampling sorts and
    draws over the whole vocabulary every step (docs/algorithms.md#sampling)."""

    def __init__(self, sampling: SamplingConfig):
        self.temperature, self.top_k, self.top_p = sampling.temperature, sampling.top_k, sampling.top_p

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        tokens = sample_tokens(scores, self.temperature, self.top_k, self.top_p)
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens.unsqueeze(-1), 0.0)


# Sampling truncations of ``generate`` that TopKTopPSampler does not apply, with the values that leave them off.
_OTHER_TRUNCATIONS = {
    "min_p": (None, 0.0),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
}


def _all_neutral(model, generation_kwargs: dict | None, settings: dict[str, tuple]) -> bool:
    config = getattr(model, "generation_config", None)
    return all(
        (generation_kwargs or {}).get(name) in neutral and getattr(config, name, None) in neutral
        for name, neutral in settings.items()
    )


def samples_with_own_sampler(model, generation_kwargs: dict | None) -> bool:
    """Whether :class:`TopKTopPSampler` draws the tokens: no other truncation (``min_p``, ``typical_p``, …) is asked
    for in ``generation_kwargs`` or the model's generation config."""
    return _all_neutral(model, generation_kwargs, _OTHER_TRUNCATIONS)


def prefill_once(
    model, enc: dict[str, Tensor], K: int, adapters: list[str] | None = None, share: bool = True
) -> dict[str, Any]:
    """``generate``'s inputs for K samples per prompt (rows prompt-major, K per prompt), with each prompt's KV cache
    computed once.

    ``num_return_sequences=K`` would copy every prompt K times before the prefill, so a long prompt (a coding or
    ClassEval task) would be encoded K times. Here all but the last prompt token go through one forward per prompt,
    and ``generate`` continues from their cache with the K-fold rows (it encodes only the last prompt token, then
    samples). The cache keeps each prompt's entries once for its K rows (a
    :class:`~comlrl_lightning.rollout.backends.hf_shared_prefix.SharedPrefixCache`, decoded under
    :func:`~comlrl_lightning.rollout.backends.hf_shared_prefix.shared_prefix_decoding`) where the model's attention allows it,
    and is repeated K times along the batch otherwise. The positions and mask are ``generate``'s own, so the samples
    follow the same distribution (tests/test_rollout.py). ``adapters``: a peft adapter name per prompt (mixed-adapter
    batch). ``share=False``: the K-fold rows only (generate prefills them itself).
    """
    ids, mask = enc["input_ids"], enc["attention_mask"]
    inputs: dict[str, Any] = {"input_ids": ids.repeat_interleave(K, 0), "attention_mask": mask.repeat_interleave(K, 0)}
    if adapters is not None:
        inputs["adapter_names"] = [name for name in adapters for _ in range(K)]
    if share and K > 1 and ids.shape[1] > 1:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        out = model(
            input_ids=ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=True,
            logits_to_keep=1,
            **({"adapter_names": list(adapters)} if adapters else {}),
        )
        cache = cache_of(out)
        if can_share(cache, model):
            cache = SharedPrefixCache(cache, K)
        else:
            cache.batch_repeat_interleave(K)
        inputs[CACHE_KEYWORD] = cache
    return inputs
