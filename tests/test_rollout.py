"""Sampling, token scoring and the rollout tree (docs/algorithms.md#rollout-trees-and-joint-actions,
#returns-and-credit, examples 2 and 3).

Model-backed tests use the offline ``tiny`` Qwen2 (pad == eos, left padding). The tree tests replace
``sample_completions`` with a deterministic fake so every reward, return and credit is known in advance.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from comlrl_lightning.rollout import weights
from comlrl_lightning.rollout.backends import hf as hf_backend
from comlrl_lightning.rollout.backends import hf_copies as generation_mod
from comlrl_lightning.rollout.backends.hf import TopKTopPSampler, sample_completions
from comlrl_lightning.rollout.generation import make_backend
from comlrl_lightning.rollout.rewards import RewardCaller, ScaleShift, build_formatters
from comlrl_lightning.rollout.sampling import (
    CACHE_KEYWORD,
    Completions,
    SamplingConfig,
    ScoringInputs,
    build_scoring_inputs,
    collate_rows,
    completion_mask_from_ids,
    eos_token_ids,
    forward_tokens,
    micro_batches,
    select_rows,
    shared_prompts,
    token_logprobs,
    trim_prompt_padding,
)
from comlrl_lightning.rollout.tree import RolloutEngine, normalize_joint_mode

# =========================================================================== completion mask


@pytest.mark.parametrize(
    "ids, eos, expected",
    [
        ([5, 6, 0, 0, 0], [0], [1, 1, 1, 0, 0]),  # EOS included, pads (== EOS) after it excluded
        ([5, 0, 7, 8, 0], [0], [1, 1, 0, 0, 0]),  # real tokens after EOS excluded too
        ([5, 6, 7, 8], [0], [1, 1, 1, 1]),  # no EOS: everything generated counts
        ([0, 5, 6], [0], [1, 0, 0]),  # EOS at position 0: only the EOS
        ([5, 9, 3, 0, 4], [9, 0], [1, 1, 0, 0, 0]),  # several eos ids: the first of any ends the row
        ([5, 3, 9, 0, 4], [9, 0], [1, 1, 1, 0, 0]),
        ([5, 3, 4, 2, 9], [0, 9], [1, 1, 1, 1, 1]),
    ],
)
def test_completion_mask_single_rows(ids, eos, expected):
    mask = completion_mask_from_ids(torch.tensor([ids]), eos)
    assert mask.dtype == torch.bool
    assert mask[0].tolist() == [bool(x) for x in expected]


def test_completion_mask_batch_rows_are_independent():
    ids = torch.tensor([[0, 1, 2], [1, 0, 0], [1, 2, 3], [3, 3, 0]])
    expected = [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert completion_mask_from_ids(ids, [0]).long().tolist() == expected


# =========================================================================== tiny model


@pytest.fixture(scope="module")
def tiny():
    from comlrl_lightning.agents.factories import MODEL_FACTORIES

    model, tok = MODEL_FACTORIES["tiny"]()
    model.eval()
    return model, tok


def _reference_logprobs(model, prompt: torch.Tensor, completion: torch.Tensor, length: int) -> torch.Tensor:
    """Unpadded, one sequence: log p(completion[t] | prompt, completion[:t]) for t < length."""
    seq = torch.cat([prompt, completion[:length]]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()
    P = len(prompt)
    logp = torch.log_softmax(logits[P - 1 : P + length - 1], dim=-1)
    return logp.gather(-1, completion[:length].unsqueeze(-1)).squeeze(-1)


def test_token_logprobs_match_unpadded_reference(tiny):
    model, tok = tiny
    eos = tok.eos_token_id
    pad = tok.pad_token_id
    texts = ["The quick brown fox jumps over the lazy dog and runs away", "Two agents", "Write code"]
    prompt_ids = [torch.tensor(tok(t, add_special_tokens=False).input_ids) for t in texts]
    assert len({len(p) for p in prompt_ids}) == 3  # three different prompt lengths

    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(1, len(tok), (n,), generator=g)

    # Group 0: 2 rows, width 5 -- EOS then pad / no EOS at all.
    c0 = torch.stack([torch.cat([rand(2), torch.tensor([eos, pad, pad])]), rand(5)])
    # Group 1: 1 row, width 3 -- EOS at position 0.
    c1 = torch.tensor([[eos, pad, pad]])
    # Group 2: 2 rows, width 7 -- EOS at the very end / EOS in the middle.
    c2 = torch.stack(
        [torch.cat([rand(6), torch.tensor([eos])]), torch.cat([rand(3), torch.tensor([eos, pad, pad, pad])])]
    )
    comps = [c0, c1, c2]
    eos_ids = eos_token_ids(model, tok)
    masks = [completion_mask_from_ids(c, eos_ids) for c in comps]

    inputs = collate_rows(prompt_ids, comps, masks, pad)
    assert inputs.completion_ids.shape == (5, 7)
    model.eval()
    with torch.no_grad():
        got = token_logprobs(model, inputs)
    assert got.shape == (5, 7) and got.dtype == torch.float32

    rows = [(0, c0[0]), (0, c0[1]), (1, c1[0]), (2, c2[0]), (2, c2[1])]
    lengths = [3, 5, 1, 7, 4]
    for r, ((g_idx, comp), length) in enumerate(zip(rows, lengths)):
        assert int(inputs.completion_mask[r].sum()) == length
        ref = _reference_logprobs(model, prompt_ids[g_idx], comp, length)
        torch.testing.assert_close(got[r, :length], ref, atol=1e-4, rtol=0)
        assert torch.all(got[r, length:] == 0)
        assert torch.all(ref < 0)  # real log-probs (non-trivial comparison)

    # Row subsets score the same (select_rows keeps the layout consistent).
    with torch.no_grad():
        sub = token_logprobs(model, select_rows(inputs, slice(2, 4)))
    torch.testing.assert_close(sub, got[2:4], atol=1e-5, rtol=0)


def _grouped_rows(tok, K: int = 3, width: int = 6) -> ScoringInputs:
    """K random completions (some ending early in EOS) for each of three prompts of different lengths."""
    g = torch.Generator().manual_seed(1)
    texts = ["The quick brown fox jumps over the lazy dog and runs away", "Two agents", "Write code to sort a list"]
    prompt_ids = [torch.tensor(tok(t, add_special_tokens=False).input_ids) for t in texts]
    comps = [torch.randint(1, len(tok), (K, width), generator=g) for _ in texts]
    comps[0][0, 2] = comps[2][1, 0] = tok.eos_token_id
    masks = [completion_mask_from_ids(c, [tok.eos_token_id]) for c in comps]
    return collate_rows(prompt_ids, comps, masks, tok.pad_token_id)


def test_rows_sharing_a_prompt_encode_it_once_with_the_single_forwards_logprobs_and_gradients(tiny):
    """The K samples of a prompt are scored from one encoding of it: one forward over the distinct prompts (all but
    their last token), then one over every row's continuation. Log-probs and every parameter's gradient equal the
    single forward over the whole rows."""
    model, tok = tiny
    inputs = _grouped_rows(tok)
    first, prompt_of = shared_prompts(inputs)
    assert sorted(first.tolist()) == [0, 3, 6] and prompt_of[first].tolist() == [0, 1, 2]
    assert (prompt_of == prompt_of[[0, 0, 0, 3, 3, 3, 6, 6, 6]]).all()
    P, T = inputs.input_ids.shape[1] - 6, 6
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    weights = torch.randn(9, 6, generator=torch.Generator().manual_seed(2))
    grads = {}
    try:
        for share in (True, False):
            seen.clear()
            model.zero_grad()
            logp = token_logprobs(model, inputs, share_prompts=share)
            (logp * weights).sum().backward()
            grads[share] = (logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
            assert seen == ([(3, P - 1), (9, T)] if share else [(9, P + T)]), seen
    finally:
        hook.remove()
        model.zero_grad()
    assert forward_tokens(model, inputs) == 3 * (P - 1) + 9 * T  # what the update's memory check counts
    torch.testing.assert_close(grads[True][0], grads[False][0], atol=2e-5, rtol=0)
    assert (grads[True][0][inputs.completion_mask] < 0).all()
    for name, grad in grads[False][1].items():
        torch.testing.assert_close(grads[True][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # A micro-batch's rows, in any order and mixing prompts, share the same way.
    rows = torch.tensor([7, 1, 4, 0, 8])
    with torch.no_grad():
        part = token_logprobs(model, trim_prompt_padding(select_rows(inputs, rows)))
    torch.testing.assert_close(part, grads[False][0][rows], atol=2e-5, rtol=0)
    # Distinct prompts, or one row, have nothing to share.
    assert shared_prompts(select_rows(inputs, torch.tensor([0, 3, 6]))) is None
    assert shared_prompts(select_rows(inputs, slice(0, 1))) is None


def test_scoring_under_gradient_checkpointing_scores_whole_rows(tiny):
    """Gradient checkpointing drops a KV cache passed to a layer, so a shared prompt cannot be continued from: the
    rows are scored whole (sharing there would score the completions without their prompt)."""
    import copy

    from comlrl_lightning.agents.memory import enable_checkpointing

    model, tok = tiny
    inputs = _grouped_rows(tok)
    with torch.no_grad():
        expected = token_logprobs(model, inputs, share_prompts=False)
    ckpt = copy.deepcopy(model)
    enable_checkpointing(ckpt)
    ckpt.train()
    seen = []
    ckpt.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    logp = token_logprobs(ckpt, inputs)
    assert seen == [tuple(inputs.input_ids.shape)]
    assert forward_tokens(ckpt, inputs) == inputs.input_ids.numel()
    torch.testing.assert_close(logp.detach(), expected, atol=2e-5, rtol=0)


def test_build_scoring_inputs_layout():
    prompts = [torch.tensor([7, 8, 9]), torch.tensor([5])]
    comp = torch.tensor([[1, 0, 0], [2, 3, 4]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    inp = build_scoring_inputs(prompts, comp, mask, pad_id=0)
    assert inp.input_ids.tolist() == [[7, 8, 9, 1, 0, 0], [0, 0, 5, 2, 3, 4]]
    assert inp.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    # Positions count real tokens only: the completion continues right after the prompt.
    assert inp.position_ids[0, :4].tolist() == [0, 1, 2, 3]
    assert inp.position_ids[1, 2:].tolist() == [0, 1, 2, 3]
    assert inp.completion_mask.dtype == torch.bool


def test_micro_batches_by_rows_and_by_token_budget():
    # prompts of 3, 1, 2, 5 tokens; completions 2 wide: the forward of rows a..b is (b-a) × (longest prompt + 2)
    prompts = [torch.arange(1, n + 1) for n in (3, 1, 2, 5)]
    inp = build_scoring_inputs(prompts, torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool), 0)
    assert micro_batches(inp) == [slice(0, 4)]
    assert micro_batches(inp, max_rows=3) == [slice(0, 3), slice(3, 4)]

    # widths 5, 3, 4, 7, bucketed by length: rows 1 (3), 2 (4), 0 (5), 3 (7). [3, 4] costs 2 × 4 = 8 ≤ 10; adding 5
    # → 3 × 5 = 15 > 10; [5]; adding 7 → 14 > 10; [7] alone
    def plan(**limits):
        return [part.tolist() for part in micro_batches(inp, **limits)]

    assert plan(max_tokens=10) == [[1, 2], [0], [3]]
    assert plan(max_tokens=15) == [[1, 2, 0], [3]]
    assert plan(max_rows=2, max_tokens=100) == [[1, 2], [0, 3]]
    assert plan(max_tokens=1) == [[1], [2], [0], [3]]
    parts = [trim_prompt_padding(select_rows(inp, part)) for part in micro_batches(inp, max_tokens=10)]
    assert sum(int((~p.attention_mask[:, :-2].bool()).sum()) for p in parts) == 1  # one pad, in the [1, 2] bucket


def test_a_token_budget_counts_a_shared_prompt_once(tiny):
    """K rows of one prompt cost its prompt once plus their continuations, as ``token_logprobs`` runs them: a budget
    that fits the group whole keeps it in one forward (its prompt encoded once); counted per row, it would split."""
    model, _ = tiny
    prompts = [torch.arange(1, 9), torch.arange(11, 19)]  # two 8-token prompts, 4 rows each, completions 2 wide
    inp = collate_rows(prompts, [torch.ones(4, 2, dtype=torch.long)] * 2, [torch.ones(4, 2, dtype=torch.bool)] * 2, 0)
    # per group: 7 prompt tokens once + 4 rows x (last prompt token + 1 completion token) = 15 (whole rows: 4 x 10)
    assert [p.tolist() for p in micro_batches(inp, max_tokens=15)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(forward_tokens(model, select_rows(inp, p)) == 15 for p in micro_batches(inp, max_tokens=15))
    assert len(micro_batches(inp, max_tokens=15, share_prompts=False)) == 8  # 10 tokens a row: one row each
    assert [p.tolist() for p in micro_batches(inp, max_tokens=30)] == [list(range(8))]  # 2 x 7 + 8 x 2
    # Rows without prompt tokens (an empty prompt, no chat template) have nothing to share: priced whole.
    empty = build_scoring_inputs(
        [torch.tensor([], dtype=torch.long)] * 3,
        torch.ones(3, 2, dtype=torch.long),
        torch.ones(3, 2, dtype=torch.bool),
        0,
    )
    assert [p.tolist() for p in micro_batches(empty, max_tokens=4)] == [[0, 1], [2]]


def test_trimming_prompt_padding_keeps_positions_and_log_probs(tiny):
    model, tok = tiny
    prompts = [torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([11, 12]), torch.tensor([13, 14, 15])]
    comp = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    inputs = build_scoring_inputs(prompts, comp, mask, tok.pad_token_id)
    tail = trim_prompt_padding(select_rows(inputs, slice(1, 3)))
    assert tail.input_ids.shape[1] == 3 + 3  # the longest remaining prompt + the completion width
    assert tail.position_ids[:, -3:].tolist() == inputs.position_ids[1:3, -3:].tolist()
    with torch.no_grad():
        full = token_logprobs(model.eval(), inputs)
        torch.testing.assert_close(token_logprobs(model, tail), full[1:3], atol=1e-5, rtol=0)
    assert trim_prompt_padding(inputs) is inputs  # nothing to drop


class _ForceEos(LogitsProcessor):
    """Row r emits EOS exactly at generation step ``steps[r]`` (never, if absent) and never before."""

    def __init__(self, model, prompt_width, steps, eos):
        self.model, self.width, self.steps, self.eos = model, prompt_width, steps, eos
        self.training_flags = []

    def __call__(self, input_ids, scores):
        self.training_flags.append(self.model.training)
        step = input_ids.shape[1] - self.width
        scores = scores.clone()
        for r in range(scores.shape[0]):
            if self.steps.get(r) == step:
                scores[r] = -float("inf")
                scores[r, self.eos] = 0.0
            else:
                scores[r, self.eos] = -float("inf")
        return scores


PROMPTS = ["The quick brown fox jumps over", "Two"]


def test_sample_completions_layout_and_mask(tiny):
    model, tok = tiny
    eos = tok.eos_token_id
    enc = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    width = max(map(len, enc))
    steps = {0: 0, 1: 1, 2: 3, 3: 2, 4: 4}  # row 5 never ends
    proc = _ForceEos(model, width, steps, eos)
    model.train()
    torch.manual_seed(0)
    out = sample_completions(
        model,
        tok,
        PROMPTS,
        3,
        SamplingConfig(max_new_tokens=6),
        generation_kwargs={"logits_processor": LogitsProcessorList([proc])},
    )
    assert model.training is True  # restored
    assert proc.training_flags and not any(proc.training_flags)  # generated in eval mode
    model.eval()

    assert isinstance(out, Completions) and out.num_samples == 3
    assert [p.tolist() for p in out.prompt_ids] == enc  # unpadded
    assert out.completion_ids.shape == (6, 6) and out.completion_mask.shape == (6, 6)
    expected_len = [1, 2, 4, 3, 5, 6]
    assert out.lengths.tolist() == expected_len
    for r, n in enumerate(expected_len):
        assert out.completion_mask[r].tolist() == [True] * n + [False] * (6 - n)
        if r in steps:
            assert out.completion_ids[r, n - 1] == eos  # EOS included in the mask
        assert torch.all(out.completion_ids[r, n:] == tok.pad_token_id)
        assert torch.all(out.completion_ids[r, : n - (r in steps)] != eos)
        assert out.texts[r] == tok.decode(out.completion_ids[r, :n], skip_special_tokens=True)
    assert out.texts[0] == ""  # only an EOS


def test_sample_completions_free_sampling_invariants_and_seed(tiny):
    model, tok = tiny
    cfg = SamplingConfig(max_new_tokens=5, temperature=1.0, top_p=1.0, top_k=None)
    model.eval()
    torch.manual_seed(123)
    a = sample_completions(model, tok, PROMPTS, 2, cfg)
    torch.manual_seed(123)
    b = sample_completions(model, tok, PROMPTS, 2, cfg)
    assert model.training is False
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert a.completion_ids.shape[0] == 4 and a.completion_ids.shape[1] <= 5
    mask = a.completion_mask
    # Mask is a prefix in every row, ids are pad outside it, texts decode the masked tokens.
    assert torch.equal(mask, completion_mask_from_ids(a.completion_ids, [tok.eos_token_id]) & mask)
    assert torch.all(mask[:, 0])
    assert torch.all(mask[:, :-1] | ~mask[:, 1:])
    assert torch.all(a.completion_ids[~mask] == tok.pad_token_id)
    for r in range(4):
        assert a.texts[r] == tok.decode(a.completion_ids[r][mask[r]], skip_special_tokens=True)


def test_each_prompt_is_prefilled_once_and_samples_the_tokens_generate_alone_would(tiny):
    """Prefix sharing: one forward encodes the M prompts (not M x K rows); the K samples continue from its cache and,
    seed for seed, draw exactly the tokens ``generate`` draws on the K-fold prompts with the same sampler."""
    model, tok = tiny
    prompts = ["Write a short story about a cat who", "Two", "The quick brown fox jumps over the lazy dog and"]
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    widths = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        for seed in range(5):
            widths.clear()
            torch.manual_seed(seed)
            ours = sample_completions(model, tok, prompts, 4, cfg)
            assert widths[0] == (3, enc.input_ids.shape[1] - 1), "the prompts are not encoded once each"
            assert all(rows == 12 and length == 1 for rows, length in widths[1:]), widths  # then one token a step
            torch.manual_seed(seed)
            with torch.no_grad():
                fold = {k: v.repeat_interleave(4, 0) for k, v in enc.items()}  # what num_return_sequences=4 does
                alone = model.generate(
                    **fold,
                    do_sample=False,
                    max_new_tokens=12,
                    logits_processor=LogitsProcessorList([TopKTopPSampler(cfg)]),
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )[:, enc.input_ids.shape[1] :]
            width = ours.completion_ids.shape[1]
            assert torch.equal(ours.completion_ids, alone[:, :width]), f"seed {seed}: different tokens"
    finally:
        hook.remove()


def test_a_shared_prefix_is_kept_once_and_decodes_the_tokens_of_the_repeated_cache(tiny, monkeypatch):
    """The cache holds each prompt's entries once, the K rows' own entries apart, and every decoding step's attention
    goes through the shared-prefix path; seed for seed the tokens are those of the cache repeated K times, the kept
    log-probs agree to float rounding, and the model's attention implementation is back afterwards."""
    from comlrl_lightning.rollout.backends import hf as sampling_mod
    from comlrl_lightning.rollout.backends import hf_shared_prefix as shared_prefix

    model, tok = tiny
    prompts = ["Write a short story about a cat who", "Two", "The quick brown fox jumps over the lazy dog and"]
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, keep_logprobs=True)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.inference_mode():
        cache = sampling_mod.prefill_once(model, dict(enc), 4)[CACHE_KEYWORD]
    assert isinstance(cache, shared_prefix.SharedPrefixCache)
    P = enc.input_ids.shape[1] - 1
    assert all(layer.prefix_keys.shape[0] == 3 and layer.keys.shape[0] == 12 for layer in cache.layers)
    assert cache.get_seq_length() == P

    shared_steps = []
    attention = shared_prefix.shared_prefix_attention

    def counted(module, query, *args, **kwargs):
        shared_steps.append(query.shape)
        return attention(module, query, *args, **kwargs)

    monkeypatch.setitem(shared_prefix.AttentionInterface._global_mapping, shared_prefix.ATTENTION, counted)
    torch.manual_seed(0)
    shared = sample_completions(model, tok, prompts, 4, cfg)
    layers = model.config.num_hidden_layers
    assert len(shared_steps) == layers * shared.completion_ids.shape[1]  # every step, every layer: one query token
    assert all(shape[0] == 12 and shape[2] == 1 for shape in shared_steps)
    assert model.config._attn_implementation == "sdpa"

    class Fails(LogitsProcessor):
        def __call__(self, input_ids, scores):
            raise RuntimeError("a processor failed")

    with pytest.raises(RuntimeError, match="a processor failed"):
        sample_completions(model, tok, prompts, 4, cfg, generation_kwargs={"logits_processor": [Fails()]})
    assert model.config._attn_implementation == "sdpa" and shared_prefix._ACTIVE.get() is None

    monkeypatch.setattr(sampling_mod, "can_share", lambda cache, model: False)
    seen = len(shared_steps)
    torch.manual_seed(0)
    repeated = sample_completions(model, tok, prompts, 4, cfg)
    assert len(shared_steps) == seen  # the repeated cache: ordinary attention
    assert torch.equal(shared.completion_ids, repeated.completion_ids)
    torch.testing.assert_close(shared.logprobs, repeated.logprobs, atol=1e-5, rtol=1e-5)

    # eager attention may be a model's own function (soft-capping, sinks), which the shared path cannot fall back to
    monkeypatch.setattr(sampling_mod, "can_share", shared_prefix.can_share)
    monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    with torch.inference_mode():
        cache = sampling_mod.prefill_once(model, dict(enc), 4)[CACHE_KEYWORD]
    assert not isinstance(cache, shared_prefix.SharedPrefixCache) and cache.layers[0].keys.shape[0] == 12


def test_shared_prefix_attention_is_attention_over_the_repeated_prefix():
    """By hand: queries of 2 prompts x K=3 rows, grouped heads, left padding in the prefix: the shared-prefix
    attention gives sdpa's attention over [prefix repeated K times | the rows' own entries]; so does a query of
    several tokens (sdpa over the repeated prefix) and a sliding window (the mask holds it, as for sdpa)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from comlrl_lightning.rollout.backends import hf_shared_prefix as shared_prefix

    torch.manual_seed(0)
    prompts, K, kv_heads, G, P, t, d = 2, 3, 2, 3, 5, 4, 8
    rows = prompts * K
    prompt_cache = DynamicCache()
    prompt_cache.layers = [DynamicLayer()]
    prompt_cache.layers[0].update(torch.randn(prompts, kv_heads, P, d), torch.randn(prompts, kv_heads, P, d))
    cache = shared_prefix.SharedPrefixCache(prompt_cache, K)
    layer = cache.layers[0]
    own_keys, own_values = layer.update(torch.randn(rows, kv_heads, t, d), torch.randn(rows, kv_heads, t, d))
    assert cache.get_seq_length() == P + t
    query = torch.randn(rows, kv_heads * G, 1, d)
    mask = torch.ones(rows, 1, 1, P + t, dtype=torch.bool)
    mask[:K, ..., :2] = False  # the first prompt is left-padded by 2
    module = type("Attention", (), {"layer_idx": 0, "num_key_value_groups": G, "is_causal": True})()
    full_keys, full_values = layer.repeated()
    assert torch.equal(full_keys[K : 2 * K, :, :P], layer.prefix_keys[1:].expand(K, -1, -1, -1))
    token = shared_prefix._ACTIVE.set(cache)
    try:
        for m in (mask, None):
            expected, _ = sdpa_attention_forward(module, query, full_keys, full_values, m, scaling=0.3)
            got, _ = shared_prefix.shared_prefix_attention(module, query, own_keys, own_values, m, scaling=0.3)
            assert got.shape == expected.shape == (rows, 1, kv_heads * G, d)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        two = torch.randn(rows, kv_heads * G, 2, d)
        two_mask = torch.ones(rows, 1, 2, P + t, dtype=torch.bool)
        expected, _ = sdpa_attention_forward(module, two, full_keys, full_values, two_mask)
        got, _ = shared_prefix.shared_prefix_attention(module, two, own_keys, own_values, two_mask)
        torch.testing.assert_close(got, expected)
        expected, _ = sdpa_attention_forward(module, query, full_keys, full_values, mask, sliding_window=3)
        got, _ = shared_prefix.shared_prefix_attention(module, query, own_keys, own_values, mask, sliding_window=3)
        torch.testing.assert_close(got, expected)
    finally:
        shared_prefix._ACTIVE.reset(token)
    with pytest.raises(RuntimeError, match="K rows"):
        cache.batch_select_indices(torch.tensor([0]))


def test_the_decoding_products_timed_faster_sample_the_same_tokens_and_log_probs(tiny, monkeypatch):
    """While decoding, a model's large CPU linear layers may multiply as W @ xᵀ (rollout/backends/hf_products.py): seed for seed
    the samples are the plain products' tokens, the kept log-probs a scoring forward's, a forward with grad keeps
    the plain product, and the layers' own forwards are back afterwards."""
    from comlrl_lightning.rollout.backends import hf_products as decoding

    model, tok = tiny
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50, keep_logprobs=True)
    monkeypatch.setattr(decoding, "_CHOICES", {})
    torch.manual_seed(0)
    plain = sample_completions(model, tok, PROMPTS, 3, cfg)
    assert not decoding._CHOICES, "a small model was timed"
    monkeypatch.setattr(decoding, "LARGE_WEIGHT_BYTES", 0)
    monkeypatch.setattr(decoding, "CLEARLY_FASTER", float("inf"))  # W @ xᵀ whatever the timing
    used = []
    by_columns = decoding._by_columns
    monkeypatch.setattr(decoding, "_by_columns", lambda layer, x: used.append(layer) or by_columns(layer, x))
    torch.manual_seed(0)
    fast = sample_completions(model, tok, PROMPTS, 3, cfg)
    # timed for the decoding steps' 2 prompts x K=3 rows only, not for the prefill's 2 prompts
    assert {rows for _, rows, _ in decoding._CHOICES} == {6}
    assert {id(layer) for layer in used} == {id(layer) for layer in linears}
    assert not any("forward" in vars(layer) for layer in linears)
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
    used.clear()
    with decoding.fast_decoding_products(model):
        model(input_ids=fast.completion_ids[:2, :1]).logits.sum().backward()  # training: with grad, 2 rows
    assert not used
    model.zero_grad()


def test_the_decoding_products_keep_the_form_that_times_clearly_faster(monkeypatch):
    """The form made slower loses; the choice is timed once per thread count, row count and set of weight shapes;
    W @ xᵀ gives F.linear's result, contiguous."""
    import time

    from comlrl_lightning.rollout.backends import hf_products as decoding

    layers = [torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False)]
    x = torch.randn(3, 1, 16)
    with torch.no_grad():
        out = decoding._by_columns(layers[0], x)
        torch.testing.assert_close(out, layers[0](x), atol=1e-6, rtol=1e-6)
    assert out.is_contiguous()

    def slowed(form):
        def run(layer, x):
            time.sleep(0.002)
            return form(layer, x)

        return run

    for slow, expected in (("_plain", True), ("_by_columns", False)):
        with monkeypatch.context() as patch:
            patch.setattr(decoding, slow, slowed(getattr(decoding, slow)))
            assert decoding.columns_faster(layers, 4) is expected
    timed = []
    monkeypatch.setattr(decoding, "_CHOICES", {})
    monkeypatch.setattr(decoding, "columns_faster", lambda layers, rows: timed.append(rows) or rows == 4)
    first, second = decoding._Products(layers), decoding._Products(layers[::-1])
    assert first.by_columns(4) and second.by_columns(4) and not first.by_columns(2)
    assert timed == [4, 2]
    assert decoding._Products(layers[:1]).by_columns(4) and timed == [4, 2, 4]  # other shapes: timed again


class _Spy(LogitsProcessor):
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def test_tokens_are_drawn_by_our_sampler_unless_another_truncation_is_asked_for(tiny, monkeypatch):
    """TopKTopPSampler draws every token (generate runs greedy on its one-hot scores); ``min_p`` in
    ``generation_kwargs`` or the model's generation config hands sampling back to ``generate``."""
    from comlrl_lightning.rollout.backends import hf as rollout_sampling

    model, tok = tiny
    draws = []
    real = rollout_sampling.sample_tokens
    monkeypatch.setattr(rollout_sampling, "sample_tokens", lambda *a, **k: draws.append(1) or real(*a, **k))
    cfg = SamplingConfig(max_new_tokens=4, temperature=0.8, top_p=0.9, top_k=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # greedy generate with our sampler warns about nothing
        torch.manual_seed(0)
        out = sample_completions(model, tok, PROMPTS, 3, cfg)
    assert len(draws) == out.completion_ids.shape[1] > 0, "one draw per decoding step"
    assert out.completion_ids.unique().numel() > 2, "not sampling"
    assert rollout_sampling.samples_with_own_sampler(model, None)
    draws.clear()
    out = sample_completions(model, tok, PROMPTS, 3, cfg, generation_kwargs={"min_p": 0.05})
    assert not draws and not rollout_sampling.samples_with_own_sampler(model, {"min_p": 0.05})
    model.generation_config.typical_p = 0.9
    try:
        assert not rollout_sampling.samples_with_own_sampler(model, None)
    finally:
        model.generation_config.typical_p = None
    # a user's processor runs before ours
    spy = _Spy()
    sample_completions(model, tok, PROMPTS, 2, cfg, generation_kwargs={"logits_processor": LogitsProcessorList([spy])})
    assert spy.calls > 0 and len(draws) == spy.calls


def test_our_sampler_draws_the_tokens_generates_own_sampler_would_in_distribution(tiny):
    """3000 samples of 2 tokens each way (our sampler; generate's, handed back by a ``min_p`` that truncates nothing
    under top-k 50): a two-sample chi-square per position stays within 4 standard deviations of its degrees of
    freedom (a wrong temperature, a top-p off by one token or a top-k after top-p would exceed it by far)."""
    model, tok = tiny
    cfg = SamplingConfig(max_new_tokens=2, temperature=0.3, top_p=0.9, top_k=50)

    def run(kwargs):
        torch.manual_seed(0)
        return sample_completions(model, tok, ["Two"], 3000, cfg, generation_kwargs=kwargs).completion_ids

    ours, theirs = run(None), run({"min_p": 1e-9})
    for position in range(2):
        a, b = (torch.bincount(ids[:, position], minlength=len(tok)).double() for ids in (ours, theirs))
        seen = (a + b) > 0
        expected = (a + b)[seen] / 2
        chi2 = (((a[seen] - expected) ** 2 + (b[seen] - expected) ** 2) / expected).sum().item()
        dof = int(seen.sum()) - 1
        assert chi2 < dof + 4 * (2 * dof) ** 0.5, (position, chi2, dof)


def test_agents_sharing_one_model_sample_in_one_call(tiny):
    from comlrl_lightning.rollout.backends.hf import HFGenerate

    model, tok = tiny
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    try:
        out = HFGenerate().sample(
            [model, model], [tok, tok], [["Two", "The fox"], ["Write"]], 2, SamplingConfig(max_new_tokens=3)
        )
    finally:
        hook.remove()
    assert shapes[0][0] == 3 and {rows for rows, _ in shapes[1:]} == {6}, shapes  # 3 prompts, 6 rows: one call
    assert [c.completion_ids.shape[0] for c in out] == [4, 2] and [len(c.prompt_ids) for c in out] == [2, 1]
    assert out[1].texts == [
        tok.decode(ids[m], skip_special_tokens=True) for ids, m in zip(out[1].completion_ids, out[1].completion_mask)
    ]


def test_kept_sampling_logprobs_are_what_a_scoring_forward_gives(tiny):
    """``keep_logprobs``: each sampled token's log-probability, read from the logits generation computed anyway,
    equals a scoring forward's (0 after EOS); a setting that changes the logits first (``min_new_tokens``) turns
    it off rather than keeping something else."""
    model, tok = tiny
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=20, keep_logprobs=True)
    torch.manual_seed(3)
    out = sample_completions(model, tok, PROMPTS, 3, cfg, batch_size=1)
    assert out.logprobs is not None and out.logprobs.shape == out.completion_ids.shape
    groups = [slice(0, 3), slice(3, 6)]
    inputs = collate_rows(
        out.prompt_ids,
        [out.completion_ids[s] for s in groups],
        [out.completion_mask[s] for s in groups],
        tok.pad_token_id,
    )
    with torch.no_grad():
        scored = token_logprobs(model, inputs)
    torch.testing.assert_close(out.logprobs, scored, atol=1e-4, rtol=1e-4)
    assert torch.all(out.logprobs[~out.completion_mask] == 0) and torch.all(out.logprobs[out.completion_mask] < 0)
    forced = sample_completions(model, tok, PROMPTS, 2, cfg, generation_kwargs={"min_new_tokens": 2})
    assert forced.logprobs is None


def test_a_bf16_generation_copy_is_made_once_and_refreshed_only_after_the_weights_change(tiny):
    """``generation_dtype: bfloat16``: agents sample through a bf16 copy of their weights (the training weights stay
    float32), made once per weight set, refreshed in place after an update changed the weights and left alone
    otherwise; the log-probs kept while sampling are dropped (they would be the copy's, not the model's)."""
    import copy

    from comlrl_lightning.rollout.backends.hf import HFGenerate

    model, tok = tiny
    other = copy.deepcopy(model)
    backend = HFGenerate()
    seen = []
    cfg = SamplingConfig(max_new_tokens=4, keep_logprobs=True, dtype="bfloat16")

    def sample(models):
        hooks = [m.register_forward_pre_hook(lambda mod, a, k: seen.append(mod), with_kwargs=True) for m in models]
        try:
            return backend.sample(models, [tok] * len(models), [["Two"]] * len(models), 2, cfg)
        finally:
            for h in hooks:
                h.remove()

    out = sample([model, model, other])  # two weight sets: two copies
    held = generation_mod.sampling_copies("bfloat16").held
    copies = {id(m): held[m][0] for m in (model, other)}
    assert len(copies) == 2 and seen and not any(m is model or m is other for m in seen), "a training model generated"
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for c in copies.values() for p in c.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(c.logprobs is None for c in out) and [c.completion_ids.shape[0] for c in out] == [2, 2, 2]
    for source, clone in ((model, copies[id(model)]), (other, copies[id(other)])):
        for p, q in zip(source.parameters(), clone.parameters()):
            assert torch.equal(q, p.to(torch.bfloat16))

    bump = [[q._version for q in c.parameters()] for c in copies.values()]  # in-place writes into each copy
    sample([model, model, other])  # nothing changed: nothing copied
    assert [[q._version for q in c.parameters()] for c in copies.values()] == bump
    with torch.no_grad():
        next(model.parameters()).add_(0.5)  # a write the version counter sees (a checkpoint load)
    sample([model, model, other])
    assert {id(m): held[m][0] for m in (model, other)} == copies, "a copy was rebuilt, not refreshed"
    for p, q in zip(model.parameters(), copies[id(model)].parameters()):
        assert torch.equal(q, p.to(torch.bfloat16))
    assert [q._version for q in copies[id(other)].parameters()] == bump[1]  # the other weight set did not change
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(other.parameters(), lr=0.1, fused=True).step()  # fused AdamW writes in place uncounted ...
    weights.weights_changed()  # ... so every update says so
    sample([other])
    for p, q in zip(other.parameters(), copies[id(other)].parameters()):
        assert torch.equal(q, p.to(torch.bfloat16))
    # On CPU the copy's linear layers multiply by packed weights: re-packed with the refresh, they give what a plain
    # bf16 copy of the updated weights gives (a stale pack would give the old weights' logits).
    clone = copies[id(other)]
    assert any(isinstance(m, generation_mod.PackedLinear) for m in clone.modules()) == generation_mod.packing_works(
        generation_mod.BF16_BLOCKED
    )
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        plain = copy.deepcopy(other).to(torch.bfloat16)(input_ids=ids).logits.float()
        assert torch.allclose(clone(input_ids=ids).logits.float(), plain, atol=1e-2)
    assert all(
        isinstance(m, torch.nn.Embedding) or not isinstance(m, torch.nn.Linear) or not torch.equal(m.weight, m0.weight)
        for m, m0 in zip(other.modules(), model.modules())
    ), "a linear layer did not change"


def test_a_half_precision_copy_on_a_cpu_without_its_matrix_instructions_is_warned_about(tiny, monkeypatch, caplog):
    """Where the CPU has no bf16 / fp16 matrix instructions the copy's matmuls are emulated and sampling is slower
    than in float32: making such a copy warns once, naming the field and its fix; a CPU with them does not warn."""
    import copy

    model, _ = tiny
    assert generation_mod.cpu_multiplies_in(torch.float32)
    for has_units, warned in ((False, 1), (True, 0)):
        monkeypatch.setattr(generation_mod, "cpu_multiplies_in", lambda dtype, has_units=has_units: has_units)
        generation_mod._warn_emulated.cache_clear()
        copies = generation_mod.SamplingCopies("bfloat16")
        with caplog.at_level("WARNING", logger=generation_mod.__name__):
            caplog.clear()
            copies(copy.deepcopy(model))
            copies(copy.deepcopy(model))  # a second weight set: no second warning
        messages = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
        assert len(messages) == warned, messages
        assert all("generation_dtype: bfloat16" in m and "generation_dtype: model" in m for m in messages)
        assert all(
            ("generation_dtype: float16" in m) == generation_mod.packing_works(generation_mod.FP16_WEIGHTS)
            for m in messages
        )
    # A float16 copy that is emulated (here: of a model loaded in bf16, which has no float32 tensors to share) names
    # generation_dtype: model only, not the value already set.
    monkeypatch.setattr(generation_mod, "cpu_multiplies_in", lambda dtype: False)
    generation_mod._warn_emulated.cache_clear()
    with caplog.at_level("WARNING", logger=generation_mod.__name__):
        caplog.clear()
        generation_mod.SamplingCopies("float16")(copy.deepcopy(model).bfloat16())
    messages = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(messages) == 1 and "Set generation_dtype: model on" in messages[0], messages
    generation_mod._warn_emulated.cache_clear()


@pytest.mark.parametrize("packing", [generation_mod.BF16_BLOCKED, generation_mod.FP16_WEIGHTS], ids=lambda p: p.name)
def test_packed_linear_gives_the_plain_product_with_the_packings_weights(packing):
    """PackedLinear (a CPU sampling copy's layers): the plain product with the packing's weights (bf16: the bf16
    layer's; fp16 weights: float32 products over the fp16-rounded weight) for 2-D and 3-D inputs of any row count,
    with and without bias; re-packing after a write follows the new weight; only layers of the dtype the packing
    takes are packed; a weight beyond fp16's range is left to the plain product."""
    if not generation_mod.packing_works(packing):
        pytest.skip(f"this torch build or CPU does not pack linears as {packing.name}")
    rounded = packing.weights
    torch.manual_seed(0)
    tol = {"atol": 1e-2, "rtol": 1e-2} if packing.takes == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}

    def plain(layer, x):
        bias = None if layer.bias is None else layer.bias.detach()
        return torch.nn.functional.linear(x, layer.weight.detach().to(rounded).to(packing.takes), bias)

    for bias in (True, False):
        layer = torch.nn.Linear(64, 96, bias=bias).to(packing.takes)
        xs = [
            torch.randn(4, 64).to(packing.takes),
            torch.randn(3, 7, 64).to(packing.takes),
            torch.randn(33, 64).to(packing.takes),
        ]
        expected = [plain(layer, x) for x in xs]
        holder = torch.nn.Sequential(layer)
        assert generation_mod.pack_linears(holder, packing) == 1
        assert type(layer) is torch.nn.Linear  # replaced in its parent, not turned into another class
        layer = holder[0]
        assert isinstance(layer, generation_mod.PackedLinear) and layer.weight is holder[0].weight
        for x, want in zip(xs, expected):
            got = layer(x)
            assert got.shape == want.shape and torch.allclose(got.float(), want.float(), **tol)
            if packing is generation_mod.FP16_WEIGHTS and bias:  # the rounding is the weight's, not a no-op
                assert not torch.allclose(got, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-7)
        with torch.no_grad():
            layer.weight.mul_(-1)
        generation_mod.pack_linears(holder, packing)
        assert torch.allclose(layer(xs[0]).float(), plain(layer, xs[0]).float(), **tol)
    other = torch.float32 if packing.takes == torch.bfloat16 else torch.bfloat16
    assert generation_mod.pack_linears(torch.nn.Sequential(torch.nn.Linear(4, 4).to(other)), packing) == 0
    assert generation_mod.pack_linears(torch.nn.Sequential(torch.nn.Linear(4, 4).half()), packing) == 0
    if packing is generation_mod.FP16_WEIGHTS:
        huge = torch.nn.Linear(4, 4)
        with torch.no_grad():
            huge.weight[0, 0] = 1e6  # fp16's largest is 65504
        x = torch.randn(2, 4)
        want = huge(x)
        holder = torch.nn.Sequential(huge)
        generation_mod.pack_linears(holder, packing)
        assert holder[0].packed is None and torch.equal(holder[0](x), want)


def test_a_float16_copy_on_a_cpu_without_fp16_units_shares_the_models_tensors_and_packs_fp16_weights(tiny, monkeypatch):
    """``generation_dtype: float16`` on a CPU without fp16 matrix instructions (where an fp16 matmul is emulated):
    the copy is the model's own module tree with every tensor shared (no second float32 model), whose linear layers
    multiply float32 activations by fp16-rounded weights. Its logits are those of the model with its linear weights
    rounded to fp16; the training model is left as it was; after an update the copy re-packs the new weights
    without writing into the model's tensors; a CPU with fp16 units gets a cast copy instead."""
    import copy

    if not generation_mod.packing_works(generation_mod.FP16_WEIGHTS):
        pytest.skip("this torch build or CPU does not pack fp16 weights for fbgemm")
    monkeypatch.setattr(generation_mod, "cpu_multiplies_in", lambda dtype: False)  # such a CPU (an AMD EPYC, AVX2)
    model, tok = tiny
    model = copy.deepcopy(model)
    ids = tok("The quick brown fox", return_tensors="pt").input_ids

    def rounded_logits(source):
        reference = copy.deepcopy(source)
        with torch.no_grad():
            for m in reference.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight = torch.nn.Parameter(m.weight.half().float())
            return reference(input_ids=ids).logits

    with torch.no_grad():
        exact = model(input_ids=ids).logits
    copies = generation_mod.SamplingCopies("float16")
    clone = copies(model)
    assert clone is not model and all(a is b for a, b in zip(clone.parameters(), model.parameters()))
    assert all(a is b for a, b in zip(clone.buffers(), model.buffers()))
    linears = [m for m in clone.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is generation_mod.PackedLinear and m.packed is not None for m in linears)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert not clone.training and all(p.dtype == torch.float32 for p in clone.parameters())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, exact)  # the training model is untouched
        torch.testing.assert_close(clone(input_ids=ids).logits, rounded_logits(model), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(clone(input_ids=ids).logits, exact, atol=1e-7, rtol=0)

    frozen = linears[0].weight  # a frozen layer (a LoRA team's base) is not re-packed after an update
    linears[0].requires_grad_(False)
    packs = {id(m): m.packed for m in linears}
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(trained, lr=0.1, fused=True).step()  # written in place, uncounted
    versions = [p._version for p in model.parameters()]
    weights.weights_changed()
    assert copies(model) is clone  # refreshed, not rebuilt
    assert [p._version for p in model.parameters()] == versions, "the refresh wrote into the model's tensors"
    assert [m.packed is packs[id(m)] for m in linears] == [m.weight is frozen for m in linears]
    with torch.no_grad():
        torch.testing.assert_close(clone(input_ids=ids).logits, rounded_logits(model), atol=1e-5, rtol=1e-5)
        frozen.mul_(0.5)  # a counted write (a checkpoint load) re-packs even a frozen layer
    copies(model)
    assert linears[0].packed is not packs[id(linears[0])]
    with torch.no_grad():
        torch.testing.assert_close(clone(input_ids=ids).logits, rounded_logits(model), atol=1e-5, rtol=1e-5)

    cast = generation_mod.SamplingCopies("float16")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation_mod, "cpu_multiplies_in", lambda dtype: True)
        assert all(p.dtype == torch.float16 for p in cast(copy.deepcopy(model)).parameters())
    # A model whose weights are not float32 (loaded in bf16) has nothing to share: it gets an fp16 copy too.
    assert all(p.dtype == torch.float16 for p in cast(copy.deepcopy(model).bfloat16()).parameters())


def test_generation_dtype_is_a_checked_field_and_the_kl_reward_scores_instead_of_keeping():
    from comlrl_lightning import MAGRPO

    with pytest.raises(ValueError, match="generation_dtype must be one of model, bfloat16, float16"):
        SamplingConfig(dtype="int8")
    module = MAGRPO(
        agents="tiny",
        num_agents=2,
        reward_func=lambda a, b: [1.0] * len(a),
        num_generations=2,
        max_new_tokens=3,
        generation_dtype="bfloat16",
        reference_kl_enabled=True,
        reference_kl_coef=0.1,
    )
    assert module.sampling.dtype == "bfloat16" and module.sampling.keep_logprobs  # kept only when sampling in "model"
    rollout = module.engine.rollout(module.agents, module.tokenizers, [{"prompt": "Two"}])
    assert all(a.sampling_logprobs is None for n in rollout.nodes for a in n.agents)


def test_sample_completions_chunked_prompts(tiny):
    model, tok = tiny
    eos = tok.eos_token_id
    prompts = ["Two", "The quick brown fox", "Write"]
    # batch_size=1: three generate calls of different prompt widths; chunk c ends after c+1 tokens.

    class PerChunk(LogitsProcessor):
        def __init__(self):
            self.last, self.chunk, self.width = None, -1, 0

        def __call__(self, input_ids, scores):
            continuing = (
                self.last is not None
                and input_ids.shape == (self.last.shape[0], self.last.shape[1] + 1)
                and torch.equal(input_ids[:, :-1], self.last)
            )
            if not continuing:  # first step of a new generate call
                self.chunk, self.width = self.chunk + 1, input_ids.shape[1]
            self.last = input_ids.clone()
            scores = scores.clone()
            if input_ids.shape[1] - self.width == self.chunk:
                scores[:] = -float("inf")
                scores[:, eos] = 0.0
            else:
                scores[:, eos] = -float("inf")
            return scores

    proc = PerChunk()
    torch.manual_seed(0)
    out = sample_completions(
        model,
        tok,
        prompts,
        2,
        SamplingConfig(max_new_tokens=8),
        batch_size=1,
        generation_kwargs={"logits_processor": LogitsProcessorList([proc])},
    )
    assert [p.tolist() for p in out.prompt_ids] == [tok(p, add_special_tokens=False).input_ids for p in prompts]
    assert out.completion_ids.shape == (6, 3)  # right-padded to the longest chunk
    assert out.lengths.tolist() == [1, 1, 2, 2, 3, 3]
    assert torch.all(out.completion_ids[~out.completion_mask] == tok.pad_token_id)


def test_sampled_completions_score_like_unpadded_reference(tiny):
    """End to end: what sample_completions returns, collated per prompt, scores like the unpadded reference."""
    model, tok = tiny
    eos = tok.eos_token_id
    enc = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    proc = _ForceEos(model, max(map(len, enc)), {0: 2, 2: 0, 3: 4}, eos)
    torch.manual_seed(1)
    out = sample_completions(
        model,
        tok,
        PROMPTS,
        2,
        SamplingConfig(max_new_tokens=5),
        generation_kwargs={"logits_processor": LogitsProcessorList([proc])},
    )
    groups = [slice(0, 2), slice(2, 4)]
    inputs = collate_rows(
        out.prompt_ids,
        [out.completion_ids[s] for s in groups],
        [out.completion_mask[s] for s in groups],
        tok.pad_token_id,
    )
    with torch.no_grad():
        got = token_logprobs(model, inputs)
    for r in range(4):
        n = int(out.lengths[r])
        ref = _reference_logprobs(model, out.prompt_ids[r // 2], out.completion_ids[r], n)
        torch.testing.assert_close(got[r, :n], ref, atol=1e-4, rtol=0)
        assert torch.all(got[r, n:] == 0)


# =========================================================================== rollout tree (fake sampler)


class Agent:
    """Sentinel 'model': the fake sampler reads its name."""

    def __init__(self, name):
        self.name = name


class ChatTok:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return f"<chat>{messages[0]['content']}</chat>"


class FakeSampler:
    """Agent X's k-th sample for prompt p is the text ``"X:p#k"``; masks have lengths 1 + (k % 3)."""

    T = 4

    def __init__(self):
        self.calls = []

    def __call__(self, model, tokenizer, prompts, num_samples, sampling, batch_size=None, generation_kwargs=None):
        self.calls.append(
            dict(
                agent=model.name,
                tokenizer=tokenizer,
                prompts=list(prompts),
                K=num_samples,
                batch_size=batch_size,
                generation_kwargs=generation_kwargs,
            )
        )
        K, M = num_samples, len(prompts)
        texts = [f"{model.name}:{p}#{k}" for p in prompts for k in range(K)]
        ids = torch.arange(M * K * self.T).view(M * K, self.T) + 1
        lengths = torch.tensor([1 + (k % 3) for _ in prompts for k in range(K)])
        mask = torch.arange(self.T).unsqueeze(0) < lengths.unsqueeze(1)
        prompt_ids = [torch.tensor(list(p.encode())) for p in prompts]
        return Completions(prompt_ids, ids.masked_fill(~mask, 0), mask, texts, K)


def parse(text):
    agent, rest = text.split(":", 1)
    prompt, k = rest.rsplit("#", 1)
    return agent, prompt, int(k)


class TableReward:
    """Team reward looked up by (agent 0's prompt, per-agent sample indices); records every call."""

    def __init__(self, table=None, default=0.0):
        self.table, self.default, self.calls = table or {}, default, []

    def __call__(self, *completions, prompts=None, batch_items=None):
        self.calls.append(dict(completions=[list(c) for c in completions], prompts=prompts, items=batch_items))
        out = []
        for texts in zip(*completions):
            parsed = [parse(t) for t in texts]
            out.append(self.table.get((parsed[0][1], tuple(p[2] for p in parsed)), self.default))
        return out


class Transition:
    """Next prompt of agent i: its last prompt + '>' + the branch's sample indices; records every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        self.calls.append(
            dict(
                prompt=prompt,
                agent_completions=agent_completions,
                num_agents=num_agents,
                prompt_history=prompt_history_per_agent,
                response_history=response_history_per_agent,
            )
        )
        ks = "".join(str(parse(c)[2]) for c in agent_completions)
        return [f"{h[-1]}>{ks}" for h in prompt_history_per_agent]


@pytest.fixture
def fake(monkeypatch):
    sampler = FakeSampler()
    monkeypatch.setattr(hf_backend, "sample_completions", sampler)  # under the HF generation backend
    return sampler


MODELS = [Agent("A"), Agent("B")]
TOKS = ["tokA", "tokB"]

# Example 2 of docs/algorithms.md: root r = [1, 2]; child of action 0 has [0.5, 1.5], child of action 1 [3, 5].
E2_TABLE = {
    ("p", (0, 0)): 1.0,
    ("p", (1, 1)): 2.0,
    ("p>00", (0, 0)): 0.5,
    ("p>00", (1, 1)): 1.5,
    ("p>11", (0, 0)): 3.0,
    ("p>11", (1, 1)): 5.0,
}


def make_engine(
    reward,
    *,
    N=2,
    K=2,
    H=1,
    joint_mode="aligned",
    transition=None,
    passthrough=True,
    formatters=None,
    processor=None,
    **kw,
):
    backend = make_backend(
        "hf",
        batch_size=kw.pop("generation_batch_size", None),
        generation_kwargs=kw.pop("generation_kwargs", None),
        concurrent=kw.pop("parallel_agents", False),
    )
    return RolloutEngine(
        num_agents=N,
        formatters=build_formatters(formatters, N),
        reward=RewardCaller(reward, processor),
        sampling=SamplingConfig(max_new_tokens=4),
        backend=backend,
        use_chat_template=kw.pop("use_chat_template", False),
        num_generations=K,
        num_turns=H,
        joint_mode=joint_mode,
        external_transition=transition,
        external_prompt_passthrough=passthrough,
        **kw,
    )


def _values(t):
    return [round(float(x), 6) for x in t]


def test_aligned_two_turns_e2(fake):
    reward, transition = TableReward(E2_TABLE), Transition()
    engine = make_engine(reward, H=2, transition=transition)
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}], env_step=10, policy_version=3)

    assert [len(level) for level in roll.levels] == [1, 2]
    (root,) = roll.roots
    assert roll.levels[0] == [root] and len(roll.nodes) == 3
    assert root.joint_index.tolist() == [[0, 0], [1, 1]]
    assert root.agents[0].texts == ["A:p#0", "A:p#1"] and root.agents[1].texts == ["B:p#0", "B:p#1"]
    assert root.agents[0].prompt == "p"
    c0, c1 = root.children[0], root.children[1]
    assert roll.levels[1] == [c0, c1]
    assert [a.prompt for a in c0.agents] == ["p>00", "p>00"] and [a.prompt for a in c1.agents] == ["p>11", "p>11"]
    assert (root.turn, c0.turn, c1.turn) == (0, 1, 1)

    assert _values(root.rewards) == [1.0, 2.0]
    assert _values(c0.returns) == [0.5, 1.5] and _values(c1.returns) == [3.0, 5.0]
    assert _values(root.returns) == [1.0 + 1.0, 2.0 + 4.0]  # G_j = r_j + mean(child_j)
    assert root.mean_reward == 1.5 and root.mean_return == 4.0

    assert roll.num_joint_actions == 6
    assert (root.env_step, c0.env_step, c1.env_step) == (12, 14, 16)
    assert all(n.policy_version == 3 for n in roll.nodes)
    for node in roll.nodes:
        assert not node.children or len(node.children) == 2
        for agent in node.agents:
            assert torch.equal(agent.credit, node.returns)
    assert set(roll.timings) >= {"generate", "reward", "transition"}


def test_node_agent_samples_are_sliced_per_prompt(fake):
    engine = make_engine(TableReward(), K=3)
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}, {"prompt": "qq"}])
    for node, prompt in zip(roll.roots, ["p", "qq"]):
        for agent in node.agents:
            assert bytes(agent.prompt_ids.tolist()).decode() == prompt
            assert agent.completion_mask.sum(-1).tolist() == [1, 2, 3]
            assert agent.completion_ids.shape == (3, 3)  # trimmed to the node's longest completion
            assert [parse(t)[1] for t in agent.texts] == [prompt] * 3


def test_reward_processor_feeds_returns_raw_kept(fake):
    engine = make_engine(TableReward(E2_TABLE), H=2, transition=Transition(), processor=ScaleShift(2.0, -1.0))
    (root,) = engine.rollout(MODELS, TOKS, [{"prompt": "p"}]).roots
    assert _values(root.raw_rewards) == [1.0, 2.0]
    assert _values(root.rewards) == [1.0, 3.0]
    # children processed: [0, 2] (mean 1) and [5, 9] (mean 7)
    assert _values(root.returns) == [2.0, 10.0]


def test_discount(fake):
    engine = make_engine(TableReward(E2_TABLE), H=2, transition=Transition(), discount=0.5)
    (root,) = engine.rollout(MODELS, TOKS, [{"prompt": "p"}]).roots
    assert _values(root.returns) == [1.0 + 0.5 * 1.0, 2.0 + 0.5 * 4.0]
    # Compounds over three turns: every reward 1 -> leaf 1, middle 1.5, root 1.75.
    engine = make_engine(TableReward(default=1.0), H=3, transition=Transition(), discount=0.5)
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}])
    assert [len(level) for level in roll.levels] == [1, 2, 4]
    assert _values(roll.levels[2][0].returns) == [1.0, 1.0]
    assert _values(roll.levels[1][0].returns) == [1.5, 1.5]
    assert _values(roll.roots[0].returns) == [1.75, 1.75]


def test_early_termination_strictly_greater(fake):
    # Root mean reward is 1.5.
    transition = Transition()
    engine = make_engine(TableReward(E2_TABLE), H=2, transition=transition, early_termination_threshold=1.49)
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}])
    assert [len(level) for level in roll.levels] == [1]
    assert roll.roots[0].children == {} and transition.calls == []
    assert _values(roll.roots[0].returns) == [1.0, 2.0]
    assert roll.num_joint_actions == 2

    engine = make_engine(TableReward(E2_TABLE), H=2, transition=Transition(), early_termination_threshold=1.5)
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}])
    assert [len(level) for level in roll.levels] == [1, 2]  # equal to the threshold: expanded

    # early_termination=False (evaluation / ablation) ignores the threshold.
    engine = make_engine(TableReward(E2_TABLE), H=2, transition=Transition(), early_termination_threshold=1.49)
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}], early_termination=False)
    assert [len(level) for level in roll.levels] == [1, 2]


def test_early_termination_per_node_three_turns(fake):
    # Threshold 2: root (1.5) and "p>00" (1.0) expand, "p>11" (4.0) is a leaf.
    engine = make_engine(
        TableReward(E2_TABLE, default=0.25), H=3, transition=Transition(), early_termination_threshold=2.0
    )
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}])
    assert [len(level) for level in roll.levels] == [1, 2, 2]
    root = roll.roots[0]
    c0, c1 = root.children[0], root.children[1]
    assert c1.children == {} and sorted(c0.children) == [0, 1]
    assert [n.agents[0].prompt for n in roll.levels[2]] == ["p>00>00", "p>00>11"]
    assert _values(c1.returns) == [3.0, 5.0]
    assert _values(c0.returns) == [0.75, 1.75]
    assert _values(root.returns) == [1.0 + 1.25, 2.0 + 4.0]
    assert roll.num_joint_actions == 2 + 4 + 4


CROSS_TABLE = {("p", (0, 0)): 1.0, ("p", (0, 1)): 2.0, ("p", (1, 0)): 4.0, ("p", (1, 1)): 8.0}


@pytest.mark.parametrize("mode", ["cross", "crossed", "CROSS"])
def test_cross_e3(fake, mode):
    reward = TableReward(CROSS_TABLE)
    engine = make_engine(reward, joint_mode=mode)
    assert engine.joint_mode == "cross"
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}], env_step=5)
    (root,) = roll.roots
    assert root.joint_index.tolist() == [list(c) for c in itertools.product(range(2), repeat=2)]
    assert len(reward.calls) == 1
    call = reward.calls[0]
    assert call["completions"] == [["A:p#0", "A:p#0", "A:p#1", "A:p#1"], ["B:p#0", "B:p#1", "B:p#0", "B:p#1"]]
    assert call["prompts"] == ["p"] * 4 and call["items"] == [{"prompt": "p"}] * 4
    assert _values(root.rewards) == [1.0, 2.0, 4.0, 8.0] and _values(root.returns) == [1.0, 2.0, 4.0, 8.0]
    assert _values(root.agents[0].credit) == [1.0 + 2.0, 4.0 + 8.0]  # g00+g01, g10+g11
    assert _values(root.agents[1].credit) == [1.0 + 4.0, 2.0 + 8.0]  # g00+g10, g01+g11
    assert roll.num_joint_actions == 4 and root.env_step == 9
    # One generate per agent, K samples each (not K^N).
    assert [(c["agent"], c["K"], c["prompts"]) for c in fake.calls] == [("A", 2, ["p"]), ("B", 2, ["p"])]


def test_cross_two_turns_and_three_agents(fake):
    reward = TableReward(CROSS_TABLE, default=1.0)
    transition = Transition()
    engine = make_engine(reward, H=2, joint_mode="cross", transition=transition)
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}])
    assert [len(level) for level in roll.levels] == [1, 4]
    assert [n.agents[0].prompt for n in roll.levels[1]] == ["p>00", "p>01", "p>10", "p>11"]
    assert [len(c["completions"][0]) for c in reward.calls] == [4, 16]
    assert roll.num_joint_actions == 4 + 16
    assert _values(roll.roots[0].returns) == [2.0, 3.0, 5.0, 9.0]  # children all return 1
    assert [c["agent_completions"] for c in transition.calls] == [
        [f"A:p#{i}", f"B:p#{j}"] for i, j in itertools.product(range(2), repeat=2)
    ]

    # N = 3: 8 joint actions, credit of agent i sample k = sum over the 4 actions using it.
    def reward3(a, b, c):
        return [float(parse(x)[2] * 4 + parse(y)[2] * 2 + parse(z)[2] + 1) for x, y, z in zip(a, b, c)]

    engine = make_engine(reward3, N=3, joint_mode="cross")
    (root,) = engine.rollout([Agent("A"), Agent("B"), Agent("C")], ["t"] * 3, [{"prompt": "p"}]).roots
    combos = list(itertools.product(range(2), repeat=3))
    g = [4 * i + 2 * j + k + 1 for i, j, k in combos]
    assert _values(root.rewards) == g
    for agent in range(3):
        expected = [sum(v for v, c in zip(g, combos) if c[agent] == s) for s in range(2)]
        assert _values(root.agents[agent].credit) == expected


def test_cross_and_crossed_identical(fake):
    def run(mode):
        reward = TableReward(CROSS_TABLE, default=0.5)
        roll = make_engine(reward, H=2, joint_mode=mode, transition=Transition()).rollout(
            MODELS, TOKS, [{"prompt": "p"}]
        )
        return (
            [(n.joint_index.tolist(), _values(n.returns), [_values(a.credit) for a in n.agents]) for n in roll.nodes],
            reward.calls,
            roll.num_joint_actions,
        )

    assert run("cross") == run("crossed")


def test_single_agent_cross_is_grpo(fake):
    engine = make_engine(lambda c: [float(parse(x)[2]) for x in c], N=1, K=3, joint_mode="cross")
    (root,) = engine.rollout([Agent("A")], ["t"], [{"prompt": "p"}]).roots
    assert root.joint_index.tolist() == [[0], [1], [2]]
    assert _values(root.agents[0].credit) == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("passthrough", [True, False])
def test_external_transition_contract(fake, passthrough):
    transition = Transition()
    reward = TableReward()
    engine = make_engine(
        reward,
        H=3,
        transition=transition,
        passthrough=passthrough,
        formatters=[lambda it: "A[" + it["prompt"] + "]", lambda it: "B[" + it["prompt"] + "]"],
    )
    item = {"prompt": "p", "id": 7}
    roll = engine.rollout(MODELS, TOKS, [item])
    assert item == {"prompt": "p", "id": 7}
    root = roll.roots[0]
    assert [a.prompt for a in root.agents] == ["A[p]", "B[p]"]

    # Turn-0 -> 1: one call per joint action, in order, with the branch's completions and histories.
    first = transition.calls[:2]
    for j, call in enumerate(first):
        responses = [f"A:A[p]#{j}", f"B:B[p]#{j}"]
        assert call == dict(
            prompt="p",
            agent_completions=responses,
            num_agents=2,
            prompt_history=[["A[p]"], ["B[p]"]],
            response_history=[[r] for r in responses],
        )
    for j in range(2):
        external = [f"A[p]>{j}{j}", f"B[p]>{j}{j}"]
        child = root.children[j]
        expected = external if passthrough else [f"A[{external[0]}]", f"B[{external[1]}]"]
        assert [a.prompt for a in child.agents] == expected
        assert child.item is item  # the dataset item, not the shifted copy
    # The sampler saw exactly those prompts.
    assert fake.calls[2]["prompts"] == [root.children[0].agents[0].prompt, root.children[1].agents[0].prompt]
    # Reward receives agent 0's prompt of each joint action and the dataset item.
    assert reward.calls[1]["prompts"] == [root.children[j].agents[0].prompt for j in (0, 0, 1, 1)]
    assert reward.calls[1]["items"] == [item] * 4

    # Turn-1 -> 2: raw item prompt again, histories of the branch (two turns).
    assert len(transition.calls) == 2 + 4
    call = transition.calls[2 + 1]  # child 0, joint action 1
    child0 = root.children[0]
    assert call["prompt"] == "p"
    assert call["agent_completions"] == [child0.agents[0].texts[1], child0.agents[1].texts[1]]
    assert call["response_history"] == [
        ["A:A[p]#0", child0.agents[0].texts[1]],
        ["B:B[p]#0", child0.agents[1].texts[1]],
    ]
    assert [h[0] for h in call["prompt_history"]] == ["A[p]", "B[p]"]
    if passthrough:
        assert call["prompt_history"] == [["A[p]", "A[p]>00"], ["B[p]", "B[p]>00"]]
    assert [len(level) for level in roll.levels] == [1, 2, 4]


def test_a_reward_that_names_the_history_gets_each_trajectorys_earlier_responses(fake):
    seen = []

    def reward(a, b, response_history_per_agent):
        seen.append(response_history_per_agent)
        return [float(len(h[0])) for h in response_history_per_agent]

    engine = make_engine(reward, H=2, transition=Transition())
    (root,) = engine.rollout(MODELS, TOKS, [{"prompt": "p"}]).roots
    # turn 1: two joint actions, no earlier turn; turn 2: one call for both children, each with its own parent action
    assert seen[0] == [[[], []], [[], []]]
    assert seen[1] == [[["A:p#0"], ["B:p#0"]]] * 2 + [[["A:p#1"], ["B:p#1"]]] * 2
    assert _values(root.rewards) == [0.0, 0.0] and _values(root.children[0].rewards) == [1.0, 1.0]


def test_transition_error_propagates(fake):
    engine = make_engine(TableReward(), H=2, transition=lambda **kw: ["only one"])
    with pytest.raises(ValueError, match="returned 1 values but expected 2"):
        engine.rollout(MODELS, TOKS, [{"prompt": "p"}])


def test_batched_levels_one_call_per_agent_and_reward(fake):
    table = dict(E2_TABLE)
    table.update({("q", (0, 0)): 9.0, ("q", (1, 1)): 9.0})  # "q" terminates early (mean 9 > 5)
    reward = TableReward(table, default=0.1)
    items = [{"prompt": "p"}, {"prompt": "q"}, {"prompt": "r"}]
    engine = make_engine(
        reward,
        H=2,
        transition=Transition(),
        early_termination_threshold=5.0,
        generation_batch_size=2,
        generation_kwargs={"foo": 1},
    )
    roll = engine.rollout(MODELS, TOKS, items)

    assert [(c["agent"], c["tokenizer"], len(c["prompts"])) for c in fake.calls] == [
        ("A", "tokA", 3),
        ("B", "tokB", 3),
        ("A", "tokA", 4),
        ("B", "tokB", 4),
    ]
    assert fake.calls[2]["prompts"] == ["p>00", "p>11", "r>00", "r>11"]
    assert all(c["batch_size"] == 2 and c["generation_kwargs"] == {"foo": 1} and c["K"] == 2 for c in fake.calls)
    assert [len(c["completions"][0]) for c in reward.calls] == [6, 8]
    assert reward.calls[0]["prompts"] == ["p", "p", "q", "q", "r", "r"]
    assert reward.calls[0]["items"] == [items[0]] * 2 + [items[1]] * 2 + [items[2]] * 2
    assert [len(level) for level in roll.levels] == [3, 4]
    assert [n.item["prompt"] for n in roll.roots] == ["p", "q", "r"]
    assert roll.roots[1].children == {}
    assert roll.num_joint_actions == 6 + 8

    # Batching changes nothing: every tree equals the tree of its item rolled out alone.
    for item, batched_root in zip(items, roll.roots):
        alone = (
            make_engine(TableReward(table, default=0.1), H=2, transition=Transition(), early_termination_threshold=5.0)
            .rollout(MODELS, TOKS, [item])
            .roots[0]
        )
        assert torch.equal(alone.returns, batched_root.returns)
        assert sorted(alone.children) == sorted(batched_root.children)
        for j in alone.children:
            assert torch.equal(alone.children[j].returns, batched_root.children[j].returns)
    assert _values(roll.roots[0].returns) == [2.0, 6.0]


def test_parallel_agents_same_result(fake):
    def run(parallel):
        roll = make_engine(TableReward(E2_TABLE), H=2, transition=Transition(), parallel_agents=parallel).rollout(
            MODELS, TOKS, [{"prompt": "p"}, {"prompt": "x"}]
        )
        return [(n.agents[0].texts, n.agents[1].texts, _values(n.returns)) for n in roll.nodes]

    assert run(True) == run(False)


def test_chat_template_only_wraps_model_input(fake):
    transition = Transition()
    engine = make_engine(TableReward(), H=2, transition=transition, use_chat_template=True)
    roll = engine.rollout(MODELS, [ChatTok(), ChatTok()], [{"prompt": "p"}])
    assert fake.calls[0]["prompts"] == ["<chat>p</chat>"]
    assert roll.roots[0].agents[0].prompt == "p"
    assert transition.calls[0]["prompt_history"] == [["p"], ["p"]]


def test_constructor_errors():
    # (a multi-turn run without an external_transition is refused by the module's check_config: test_magrpo.py)
    with pytest.raises(ValueError, match=r"aligned, cross") as err:
        make_engine(TableReward(), joint_mode="bogus")
    assert "bogus" in str(err.value)
    assert [normalize_joint_mode(m) for m in ("align", "Aligned", "cross", "crossed")] == [
        "aligned",
        "aligned",
        "cross",
        "cross",
    ]


def test_evaluation_style_single_chain(fake):
    transition = Transition()
    reward = TableReward(default=1.0)
    engine = make_engine(reward, K=4, H=3, transition=transition, early_termination_threshold=-100.0)
    roll = engine.rollout(MODELS, TOKS, [{"prompt": "p"}], num_generations=1, early_termination=False)
    assert [len(level) for level in roll.levels] == [1, 1, 1]
    assert all(c["K"] == 1 for c in fake.calls)
    root = roll.roots[0]
    chain = [root, root.children[0], root.children[0].children[0]]
    assert roll.nodes == chain
    assert [n.agents[0].prompt for n in chain] == ["p", "p>00", "p>00>00"]
    assert all(n.joint_index.tolist() == [[0, 0]] for n in chain)
    assert _values(root.returns) == [3.0]
    assert roll.num_joint_actions == 3 and len(transition.calls) == 2


def test_an_update_changes_the_weights_it_stepped_and_not_an_agent_it_left_out():
    """``weights_changed`` with the optimizer's parameters: a model whose parameters got no gradient (an agent a
    schedule left out of the update) did not change for its engine or sampling copy; the stepped one did, even
    though the fused AdamW kernel writes without counting; a trained parameter the optimizer does not hold counts
    as changed by every update."""
    first, second, elsewhere = (torch.nn.Linear(3, 3) for _ in range(3))
    optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=0.1, fused=True)

    def update(trained):
        """What the models saw before an update that gives only ``trained`` a gradient."""
        seen = {m: weights.weights_seen(m) for m in (first, second, elsewhere)}
        optimizer.zero_grad()
        for p in trained.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        weights.weights_changed(p for group in optimizer.param_groups for p in group["params"])
        return {m: weights.changed_parameters(m, seen[m]) for m in seen}

    for trained, left_out in ((first, second), (second, first)):
        changed = update(trained)
        assert changed[trained] == [True, True] and changed[left_out] == [False, False]
        assert changed[elsewhere] == [True, True]
