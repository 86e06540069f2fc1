"""The ``transformers_cb`` generation backend: transformers' continuous batching (``generate_batch``) on the
training weights themselves (docs/scaling.md#continuous-batching).

A paged KV cache, requests scheduled as they finish, each prompt prefilled once and forked into its K samples
(``num_return_sequences=K`` with block sharing), and on a GPU the decoding step captured in CUDA graphs. It reads
the training model's weights directly, so there is nothing to sync; a LoRA team is refused (it would answer one
adapter at a time). The sampling settings map onto its ``GenerationConfig``; its seed is drawn from torch's
generator per call (a resumed run samples what an uninterrupted one would), and the process's own random stream is
left as one draw further on (the engine reseeds torch's generator while it runs).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from comlrl_lightning.rollout.sampling import Completions, SamplingConfig, assemble_completions, eos_token_ids
from comlrl_lightning.rollout.weights import answer_groups, generator_of, place_answers

# generation_kwargs that go to the continuous-batching GenerationConfig as they are.
_PASSED_KWARGS = ("min_new_tokens", "repetition_penalty", "min_p")
_PAGE = 256  # tokens per block of its paged cache (its default)


def continuous_batching_problem(generation_kwargs: Mapping[str, Any] | None, lora: bool = False) -> str | None:
    """Why transformers' continuous batching cannot run with these settings, in one line, or None."""
    from transformers import GenerationMixin

    if not hasattr(GenerationMixin, "generate_batch"):
        import transformers

        return (
            f"generation_backend: transformers_cb needs transformers >= 5.8 (continuous batching, "
            f"generate_batch); this environment has {transformers.__version__}: pip install -U transformers."
        )
    if lora:
        return (
            "generation_backend: transformers_cb samples one adapter at a time and a LoRA team samples every "
            "agent in one call: use generation_backend: hf or vllm with lora_rank."
        )
    unknown = sorted(set(generation_kwargs or {}) - set(_PASSED_KWARGS))
    if unknown:
        return (
            f"generation_kwargs {unknown} have no continuous-batching equivalent; with generation_backend: "
            f"transformers_cb these apply: {', '.join(_PASSED_KWARGS)} (or use generation_backend: hf)."
        )
    return None


class ContinuousBatching:
    """``generate_batch`` per weight set (module docstring)."""

    name = "transformers_cb"

    def __init__(self, generation_kwargs: Mapping[str, Any] | None = None):
        problem = continuous_batching_problem(generation_kwargs)
        if problem:
            raise ValueError(problem)
        self.generation_kwargs = dict(generation_kwargs or {})

    def sample(self, models, tokenizers, inputs, K, sampling: SamplingConfig) -> list[Completions]:
        groups = answer_groups(models, tokenizers)
        answers = []
        for agents in groups:
            generator = generator_of(models[agents[0]])[0]
            if generator_of(models[agents[0]])[1] is not None:
                raise ValueError(continuous_batching_problem(None, lora=True))
            answers.append([self.one(generator, tokenizers[i], inputs[i], K, sampling) for i in agents])
        return place_answers(groups, answers, len(models))

    def release_memory(self) -> None:
        """Its cache lives only while ``generate_batch`` runs."""

    @torch.no_grad()
    def one(
        self, model: nn.Module, tokenizer: Any, prompts: Sequence[str], K: int, sampling: SamplingConfig
    ) -> Completions:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        eos_ids = eos_token_ids(model, tokenizer)
        prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        # A prompt is prefilled once and forked K times; it cannot fork a one-token prompt, so such calls send each
        # prompt K times instead (same samples' distribution, the prompt encoded K times).
        forks = K if min(len(ids) for ids in prompt_ids) > 1 else 1
        requests = [ids for ids in prompt_ids for _ in range(K // forks)]
        config = GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,
            num_return_sequences=forks,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=list(eos_ids),
            pad_token_id=tokenizer.pad_token_id,
            **self.generation_kwargs,
        )
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        on_cpu = next(model.parameters()).device.type == "cpu"
        sizes: dict[str, Any] = {}
        if on_cpu:  # it would size its cache from the machine's memory: this one holds the call's rows whole
            longest = max(len(ids) for ids in prompt_ids) + sampling.max_new_tokens
            sizes["num_blocks"] = -(-len(prompt_ids) * K * longest // _PAGE) + 1
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[] if on_cpu else None):
                results = model.generate_batch(
                    requests,
                    generation_config=config,
                    progress_bar=False,
                    warmup=not on_cpu,  # CUDA graphs
                    continuous_batching_config=ContinuousBatchingConfig(
                        allow_block_sharing=True, seed=seed, page_size=_PAGE, **sizes
                    ),
                )
        finally:
            model.train(was_training)
        failed = [r.error for r in results.values() if r.error is not None]
        if failed or len(results) != len(prompt_ids) * K:
            raise RuntimeError(
                f"transformers' continuous batching returned {len(results)} of "
                f"{len(prompt_ids) * K} samples ({failed[:1] or 'none failed'}); use generation_backend: "
                "hf."
            )
        # Results come request by request, a request's forks together: each prompt's K samples in a row.
        rows = [torch.tensor(r.generated_tokens, dtype=torch.long).view(1, -1) for r in results.values()]
        return assemble_completions(
            [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids], rows, tokenizer, eos_ids, K
        )
