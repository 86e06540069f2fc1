"""Temperature / top-k / top-p sampling (core/sampling.py): hand-derived distributions, agreement with
transformers' warpers, and the inverse-CDF draw."""

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from comlrl_lightning.core import sampling
from comlrl_lightning.core.sampling import draw, sample_tokens, truncated_distribution

P = [0.5, 0.3, 0.15, 0.05]  # a 4-token vocabulary, already in descending order
LOGITS = torch.tensor([P]).log()


def _full(probs, ids, vocab):
    return torch.zeros(probs.shape[0], vocab).scatter(-1, ids, probs) if ids is not None else probs


def test_top_p_keeps_the_tokens_whose_mass_before_is_below_top_p():
    # mass before each token: 0, .5, .8, .95 -> with top_p = .6 the first two stay: .5/.8, .3/.8
    probs, ids = truncated_distribution(LOGITS, temperature=1.0, top_p=0.6)
    assert ids.tolist() == [[0, 1, 2, 3]]
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p = .4: only the most likely token (mass before it is 0)
    probs, _ = truncated_distribution(LOGITS, temperature=1.0, top_p=0.4)
    assert torch.allclose(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_k_and_temperature_by_hand():
    # top_k = 3: (.5, .3, .15) / .95
    probs, ids = truncated_distribution(LOGITS, temperature=1.0, top_k=3)
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.15]]) / 0.95)
    # temperature .5 squares the probabilities: (.25, .09, .0225, .0025) / .365, nothing truncated
    probs, ids = truncated_distribution(LOGITS, temperature=0.5)
    assert ids is None
    assert torch.allclose(probs, torch.tensor([[0.25, 0.09, 0.0225, 0.0025]]) / 0.365)
    # temperature before top-p: squared, the mass before token 2 is .34/.365 = .93 < .95, before token 3 .99
    probs, _ = truncated_distribution(LOGITS, temperature=0.5, top_p=0.95)
    assert torch.allclose(probs, torch.tensor([[0.25, 0.09, 0.0225, 0.0]]) / 0.3625)


def test_order_of_the_vocabulary_does_not_matter():
    perm = torch.tensor([2, 0, 3, 1])  # token v sits at column perm^-1(v)
    shuffled = LOGITS[:, perm]
    probs, ids = truncated_distribution(shuffled, temperature=1.0, top_k=3, top_p=0.6)
    assert perm[ids[0]].tolist() == [0, 1, 2]  # the original tokens, largest first
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0]]))


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.7, 50, 0.9), (1.0, 20, 1.0), (0.6, None, 0.6), (1.3, 5, 0.3), (0.9, None, 1.0)]
)
def test_same_distribution_as_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g) * 3
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    theirs = warped.softmax(-1)
    probs, ids = truncated_distribution(logits, temperature, top_k, top_p)
    ours = _full(probs, ids, 1000)
    assert torch.equal(ours > 0, theirs > 0), "a different set of tokens can be drawn"
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_draw_follows_the_distribution_and_never_a_dropped_token():
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0]]).expand(40000, 4)
    index = draw(probs, torch.Generator().manual_seed(1))
    counts = torch.bincount(index, minlength=4).double() / 40000
    assert counts[3] == 0
    sigma = (probs[0] * (1 - probs[0]) / 40000).sqrt().double()
    assert torch.all((counts - probs[0].double()).abs() <= 4 * sigma + 1e-12), counts


def test_draw_at_the_top_of_the_cdf_stays_on_a_kept_token(monkeypatch):
    # u·total rounding up to the total would land past the last kept candidate without the clamp
    monkeypatch.setattr(sampling.torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw.get("dtype")))
    probs = torch.tensor([[0.7, 0.3, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert draw(probs).tolist() == [1, 1]


def test_sample_tokens_returns_vocabulary_ids_and_follows_the_seed():
    logits = torch.full((3000, 6), -10.0)
    logits[:, 4], logits[:, 1] = math.log(0.7), math.log(0.3)
    tokens = sample_tokens(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1, 4}
    assert abs((tokens == 4).double().mean().item() - 0.7) < 0.04
    again = sample_tokens(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": 0}, "top_k must be >= 1"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    args = {"temperature": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        truncated_distribution(LOGITS, **args)
