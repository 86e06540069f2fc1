"""Every reward that parses model output scores whatever a policy writes and never raises (docs/sandbox.md): each
is fed thousands of generated hostile completions — any text, nesting past the parser's recursion limit, chains of
unary operators, integers of hundreds of digits, mixed-type and tuple dict keys, null bytes, code that passes the
format gates with junk inside, JSON-like fragments — and a finite number in the reward's range must come back every
time. BFCL's three crashes of the outside review are pinned as plain examples too; a fit of the BFCL setup survives
a batch of hostile completions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the dev extra (make install)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
_JUNK = st.text(alphabet=st.characters(codec="utf-8"), max_size=60)
_REPEAT = st.sampled_from(
    ["(", "[", "{", "-", "+", "~", "not ", "lambda: ", "'", '"', "\\", "\x00", "9", "f(", "a.", "[[", "{1: "]
)
_LITERAL = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.integers(), st.text(max_size=4), st.tuples(st.integers())), inner, max_size=3),
    ),
    max_leaves=12,
)

HOSTILE = st.one_of(
    st.text(max_size=400),
    st.builds(lambda c, n: c * n, _REPEAT, st.integers(1, 6000)),
    st.builds(lambda c, n, tail: c * n + tail, _REPEAT, st.integers(1, 4000), _JUNK),
    st.builds(lambda d: "f(x=" + "9" * d + ")", st.integers(300, 5000)),
    st.builds(lambda name, v: f"{name}(opts={v!r})", _NAMES, _LITERAL),
    st.builds(lambda name, v: f"[{name}(a={v!r}), {name}(b={v!r})]", _NAMES, _LITERAL),
    st.builds(lambda name, body: f"def {name}(x):\n    return {body}\n", _NAMES, _JUNK),
    st.builds(lambda name, body: f"```python\ndef {name}(*a):\n    {body}\n    return a\n```", _NAMES, _JUNK),
    st.builds(lambda v: json.dumps(v, default=str, skipkeys=True), _LITERAL),
    st.builds(lambda body: "{" + body + "}", _JUNK),
    st.builds(lambda n: "Day " + str(n) + ": " + "x" * 3000, st.integers(-(10**30), 10**30)),
)


def check(values, lo, hi):
    for v in values:
        assert isinstance(v, float) and math.isfinite(v) and lo - 1e-9 <= v <= hi + 1e-9, v


# ----------------------------------------------------------------------------------------------- BFCL
@pytest.fixture(scope="module")
def bfcl_item():
    from comlrl_lightning.envs import tools

    try:
        return tools.bfcl_parallel_tasks()[0]
    except (ImportError, FileNotFoundError) as error:
        pytest.skip(f"BFCL data (bfcl-eval, installed by make install) is not available: {error}")


@pytest.mark.parametrize(
    "completion",
    [
        "f(opts={1: 'a', 'b': 2})",  # mixed-type keys: json.dumps(sort_keys=True) raised TypeError
        "f(opts={(1, 2): 'a'})",  # a tuple key
        "spotify.play(artist='x', duration=" + "9" * 310 + ")",  # float(...) of a 310-digit int raised OverflowError
        "f(x=" + "-" * 3000 + "1)",  # ast.parse raised RecursionError
        "f(x=" + "+" * 3000 + "1)",
        "[" * 5000,
        "f(x=" + "[" * 2000 + "]" * 2000 + ")",  # literal_eval / comparisons past the recursion limit
    ],
)
def test_bfcl_scores_the_completions_that_crashed_it(bfcl_item, completion):
    from comlrl_lightning.envs import tools

    check(tools.bfcl_reward([completion], [completion], batch_items=[bfcl_item]), *tools.bfcl_reward.reward_range)


def test_bfcl_mixed_key_calls_still_dedupe_and_match(bfcl_item):
    """The canonical call key handles any literal: two equal calls with mixed-type keys are one call."""
    from comlrl_lightning.envs import tools

    calls = tools.parse_calls("f(opts={1: 'a', 'b': 2})\nf(opts={'b': 2, 1: 'a'})").calls
    assert len(calls) == 2 and tools.dedupe_calls(calls)[1] == 1


@settings(max_examples=2000, **SETTINGS)
@given(a=HOSTILE, b=HOSTILE)
def test_bfcl_reward_never_raises(bfcl_item, a, b):
    from comlrl_lightning.envs import tools

    check(tools.bfcl_reward([a], [b], batch_items=[bfcl_item]), *tools.bfcl_reward.reward_range)


# ----------------------------------------------------------------------------------------------- TravelPlanner
@pytest.fixture(scope="module")
def travel_item():
    path = DATA / "travelplanner" / "train_sole_planning.jsonl.gz"
    if not path.exists():
        pytest.skip(f"shared TravelPlanner data not found under {path}")
    from comlrl_lightning.envs import travel

    return travel.travel_tasks(str(path), limit=1)[0]


@settings(max_examples=2000, **SETTINGS)
@given(a=HOSTILE, b=HOSTILE)
def test_travel_reward_never_raises(travel_item, a, b):
    from comlrl_lightning.envs import travel

    check(travel.travel_reward([a], [b], batch_items=[travel_item]), *travel.travel_reward.reward_range)


# ----------------------------------------------------------------------------------------------- writing
@settings(max_examples=2000, **SETTINGS)
@given(a=HOSTILE, b=HOSTILE)
def test_writing_rewards_never_raise(a, b):
    from comlrl_lightning.envs import writing

    check(writing.tldr_reward([a], [b]), *writing.tldr_reward.reward_range)
    check(writing.arxiv_reward([a], [b]), *writing.arxiv_reward.reward_range)


# ----------------------------------------------------------------------------------------------- coding (static part)
@settings(max_examples=3000, **SETTINGS)
@given(text=HOSTILE)
def test_coding_extraction_and_gates_never_raise(text):
    """What the coding reward does with a completion before any sandbox runs: markdown stripping, function
    extraction, the format gate, the cooperation checks."""
    from comlrl_lightning.envs import coding

    coding.strip_markdown(text)
    coding.extract_function(text)
    coding.extract_function(text, "aux")
    assert isinstance(coding.is_single_function(text), bool)
    coding.aux_defined(text)
    coding.entry_point_defined(text, "f")
    coding.aux_called(text)
    coding.aux_return_ignored(text)
    coding.is_thin_wrapper(text, "f")
    coding.syntax_error(text)


@pytest.fixture(scope="module")
def mbpp_item():
    path = DATA / "mbpp" / "sanitized-mbpp.json"
    if not path.exists():
        pytest.skip(f"shared MBPP data not found under {path}")
    from comlrl_lightning.envs import coding

    return coding.mbpp_tasks(str(path), split="test", limit=1)[0]


@settings(max_examples=150, **SETTINGS)
@given(a=HOSTILE, b=HOSTILE)
def test_coding_reward_never_raises(mbpp_item, a, b):
    """The whole coding reward, sandbox included (fewer examples: a completion that passes the gate runs)."""
    from comlrl_lightning.envs import coding

    check(coding.coding_reward([a], [b], batch_items=[mbpp_item]), coding.REWARD_MIN, coding.REWARD_MAX)


# ----------------------------------------------------------------------------------------------- ClassEval
@pytest.fixture(scope="module")
def classeval_item():
    path = DATA / "classeval" / "ClassEval_data.json.gz"
    if not path.exists():
        pytest.skip(f"shared ClassEval data not found under {path}")
    from comlrl_lightning.envs import classeval

    return classeval.classeval_tasks(str(path), limit=1)[0]


@settings(max_examples=2000, **SETTINGS)
@given(text=HOSTILE)
def test_classeval_merge_never_raises(classeval_item, text):
    """The ClassEval reward's parsing and merging of completions (before its sandbox)."""
    from comlrl_lightning.envs import classeval

    classeval.parse_completion(text)
    classeval.merge_class([text, text[::-1]], {**classeval_item})


@settings(max_examples=100, **SETTINGS)
@given(a=HOSTILE, b=HOSTILE)
def test_classeval_reward_never_raises(classeval_item, a, b):
    from comlrl_lightning.envs import classeval

    check(
        classeval.classeval_reward([a], [b], batch_items=[classeval_item]), classeval.REWARD_MIN, classeval.REWARD_MAX
    )


def test_a_bfcl_fit_survives_a_batch_of_hostile_completions(tmp_path, bfcl_item, monkeypatch):
    """MAGRPO on BFCL items whose sampled completions are replaced by hostile ones (the sampler is patched to
    answer them): the fit runs its updates and logs rewards."""
    from test_magrpo import column, fit, make_module, read_metrics

    from comlrl_lightning.envs import tools
    from comlrl_lightning.rollout.backends import hf

    hostile = ["f(opts={1: 'a', 'b': 2})", "f(x=" + "-" * 3000 + "1)", "f(x=" + "9" * 310 + ")", "[" * 5000]
    real = hf.sample_completions

    def answer_hostile(model, tokenizer, prompts, K, *args, **kwargs):
        out = real(model, tokenizer, prompts, K, *args, **kwargs)
        out.texts = [hostile[i % len(hostile)] for i in range(len(out.texts))]
        return out

    monkeypatch.setattr(hf, "sample_completions", answer_hostile)
    module = make_module(reward_func=tools.bfcl_reward, formatters=tools.bfcl_formatters(2))
    trainer = fit(module, tmp_path, max_steps=2, items=[bfcl_item] * 4)
    rewards = column(read_metrics(trainer), "rollout/turn_1/reward_mean")
    assert trainer.global_step == 2 and rewards and all(math.isfinite(r) for r in rewards)
