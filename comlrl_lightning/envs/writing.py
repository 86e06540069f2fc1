"""Cooperative writing tasks: TL;DR summaries and arXiv introductions written by two agents.

Two single-turn tasks (as in OpenMLRL's LLM_Collab_Writing; ``num_turns`` must be 1):

``tldr``
    Reddit posts (``trl-lib/tldr``). Agent 1 writes a *concise* summary of the post, agent 2 a *detailed* one
    that uses more distinct words and transition words.
``arxiv``
    Paper abstracts (``LovelyBuggies/arXiv_abstract``, field ``abstract_text``). Agent 1 expands the abstract
    into the background/motivation part of an introduction, agent 2 into the methodology/implications part;
    each is told the other agent covers the rest.

Team reward (0 to 3): four *gated* levels evaluated in order; a level whose gate fails adds nothing and stops
the accumulation (later levels add nothing either). With ``c1``/``c2`` the completions of agent 1/agent 2::

    L1 structure  (+0.5)  both c1 and c2 have a whitespace-token count within [lo, hi]           else stop
    L2 length     (+0..1) r = len(c2) / len(c1) in characters, scored by a trapezoid window    else stop
    L3 vocabulary (+0..0.5) u = |words(c2)| / |words(c1)|, distinct case-folded ``\\b\\w+\\b`` words,
                          scored by a trapezoid window × 0.5                                    else stop
    L4 style      (+0..1) 0.4 · transition score of c2 + 0.6 · min(J, 0.03) / 0.03
                          (J = Jaccard similarity of the content-word sets of c1 and c2, stopwords removed)

Trapezoid window ``(a, b, c, d)`` (the "linear ramps"): the score is 1 on ``[b, c]``; it rises linearly from 0
at ``a`` to 1 at ``b`` (``(r - a) / (b - a)`` on ``[a, b)``) and falls linearly from 1 at ``c`` to 0 at ``d``
(``(d - r) / (d - c)`` on ``(c, d]``). The gate passes when ``a <= r <= d`` — also at the outer edges, where
the level adds 0 but the next level is still evaluated; outside ``[a, d]`` the gate fails. ``d = inf`` means no
upper ramp. A ratio whose denominator is 0 (no characters / no words in c1) fails the gate.

================  ===================  ===================================  ===================================
task              L1 tokens (both)     L2 char-length ratio window          L3 unique-word ratio window
================  ===================  ===================================  ===================================
tldr              8 – 256              (1.1, 1.6, 3.2, 5.0)                 (1.3, 2.0, inf, inf)
arxiv             128 – 256            (0.8, 1.0, 1.3, 1.5)                 (0.5, 0.7, 1.3, 1.7)
================  ===================  ===================================  ===================================

Transition score (L4): 12 categories of transition words/phrases (:data:`TRANSITION_CATEGORIES`), matched in
``c2`` case-insensitively on word boundaries; with ``k`` categories found the score is 0 for ``k = 0`` and
``min(1, 0.4 + 0.05 · (k - 1))`` otherwise (so at most 0.95 with all 12). Jaccard of two empty content-word sets
is taken as 0.

Per-level breakdowns (:func:`tldr_reward_breakdown`, :func:`arxiv_reward_breakdown`) also report every level
*ungated* (each level scored as if the earlier gates had passed), which the evaluation logger uses.

Reward components (``reward_aggregation``, README): :func:`tldr_reward_components` / :func:`arxiv_reward_components` return the four gated
levels of each pair as named components (``level_1`` … ``level_4``, :func:`reward_components`); their sum is the
float :func:`tldr_reward` / :func:`arxiv_reward` return, for ``reward_aggregation: normalize_components``.

Data: :func:`tldr_tasks` / :func:`arxiv_tasks` read a local ``.jsonl``/``.jsonl.gz`` file or a Hugging Face
dataset id. The ``*_train_tasks`` / ``*_eval_tasks`` functions (the configs' defaults) use the repository's
shared offline copies under ``../shared/data`` when they exist (or ``$COMLRL_WRITING_DATA``), else the hub.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from comlrl_lightning.envs.loading import load_rows

# ------------------------------------------------------------------------------------------------ data
TLDR_HUB_ID = "trl-lib/tldr"
ARXIV_HUB_ID = "LovelyBuggies/arXiv_abstract"
EVAL_HEAD = 64  # local copies are one file: its first EVAL_HEAD rows are the eval set, the rest the train set


def shared_data_dir() -> Path:
    """``$COMLRL_WRITING_DATA`` if set, else ``<repo>/../shared/data``."""
    env = os.environ.get("COMLRL_WRITING_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


def local_tldr_file() -> Path:
    return shared_data_dir() / "tldr" / "tldr_sample.jsonl.gz"


def local_arxiv_file() -> Path:
    return shared_data_dir() / "arxiv_abstract" / "scitldr_abstracts.jsonl.gz"


def tldr_tasks(path_or_id: str = TLDR_HUB_ID, split: str = "train", limit: int | None = None) -> list[dict]:
    """TL;DR items: the original fields plus ``prompt`` (the post text, ``SUBREDDIT/TITLE/POST ... TL;DR:``).

    ``path_or_id``: a local ``.jsonl``/``.jsonl.gz`` file (``split`` is then ignored) or a hub dataset id.
    ``limit``: keep only the first ``limit`` items.
    """
    items = []
    for row in load_rows(path_or_id, split, limit=limit):
        post = row.get("prompt") or row.get("post") or row.get("content")
        if post is None:
            raise KeyError(f"TL;DR item without a 'prompt'/'post' field (fields: {sorted(row)}).")
        items.append({**row, "prompt": str(post)})
    return items


def arxiv_tasks(path_or_id: str = ARXIV_HUB_ID, split: str = "train", limit: int | None = None) -> list[dict]:
    """arXiv items: the original fields plus ``prompt`` (= ``abstract_text``, the abstract).

    ``path_or_id``: a local ``.jsonl``/``.jsonl.gz`` file (``split`` is then ignored) or a hub dataset id.
    """
    items = []
    for row in load_rows(path_or_id, split, limit=limit):
        abstract = row.get("abstract_text") or row.get("abstract") or row.get("prompt")
        if abstract is None:
            raise KeyError(f"arXiv item without an 'abstract_text' field (fields: {sorted(row)}).")
        items.append({**row, "prompt": str(abstract)})
    return items


def tldr_train_tasks() -> list[dict]:
    """Default training set: the shared local sample minus its first EVAL_HEAD rows, else hub ``train[:1000]``."""
    local = local_tldr_file()
    return tldr_tasks(str(local))[EVAL_HEAD:] if local.exists() else tldr_tasks(TLDR_HUB_ID, "train", 1000)


def tldr_eval_tasks() -> list[dict]:
    """Default eval set: the first EVAL_HEAD rows of the shared local sample, else hub ``test[:1000]``."""
    local = local_tldr_file()
    return tldr_tasks(str(local), limit=EVAL_HEAD) if local.exists() else tldr_tasks(TLDR_HUB_ID, "test", 1000)


def arxiv_train_tasks() -> list[dict]:
    """Default training set: the shared local abstracts minus the first EVAL_HEAD, else hub ``train[:1000]``."""
    local = local_arxiv_file()
    return arxiv_tasks(str(local))[EVAL_HEAD:] if local.exists() else arxiv_tasks(ARXIV_HUB_ID, "train", 1000)


def arxiv_eval_tasks() -> list[dict]:
    """Default eval set: the first EVAL_HEAD shared local abstracts, else hub ``val[:1000]``."""
    local = local_arxiv_file()
    return arxiv_tasks(str(local), limit=EVAL_HEAD) if local.exists() else arxiv_tasks(ARXIV_HUB_ID, "val", 1000)


# ------------------------------------------------------------------------------------------------ formatters
def _post(item: Mapping[str, Any]) -> str:
    text = str(item.get("prompt") or item.get("post") or "").strip()
    return text[: -len("TL;DR:")].rstrip() if text.endswith("TL;DR:") else text


def tldr_concise_prompt(item: Mapping[str, Any]) -> str:
    """Agent 1 (TL;DR): a short, factual summary of the post."""
    return (
        "Write a concise summary of the Reddit post below: one or a few factual sentences that give its "
        "main point. Another writer will produce a longer, detailed summary.\n\n"
        f"{_post(item)}\n\nConcise summary:"
    )


def tldr_detailed_prompt(item: Mapping[str, Any]) -> str:
    """Agent 2 (TL;DR): a longer summary with a richer vocabulary and transition words."""
    return (
        "Write a detailed summary of the Reddit post below. Cover the situation, the reasons and the "
        "question in full; use a varied vocabulary and link your sentences with transition words "
        "(for example, however, therefore, moreover). Another writer gives a one-line summary.\n\n"
        f"{_post(item)}\n\nDetailed summary:"
    )


def _abstract(item: Mapping[str, Any]) -> str:
    # raw rows (a hub id or a file given straight to TaskDataModule) have ``abstract_text`` but no ``prompt``
    return str(item.get("abstract_text") or item.get("prompt") or "").strip()


def arxiv_background_prompt(item: Mapping[str, Any]) -> str:
    """Agent 1 (arXiv): background and motivation of an introduction built from the abstract."""
    return (
        "Using the paper abstract below, write the first part of the paper's introduction: the background "
        "of the problem and the motivation for the work. A second writer covers the methodology and its "
        "implications, so do not describe those.\n\n"
        f"Abstract: {_abstract(item)}\n\nBackground and motivation:"
    )


def arxiv_method_prompt(item: Mapping[str, Any]) -> str:
    """Agent 2 (arXiv): methodology and implications of an introduction built from the abstract."""
    return (
        "Using the paper abstract below, write the second part of the paper's introduction: the proposed "
        "methodology and the implications of the results. A second writer covers the background and "
        "motivation, so do not repeat those.\n\n"
        f"Abstract: {_abstract(item)}\n\nMethodology and implications:"
    )


# ------------------------------------------------------------------------------------------------ reward pieces
TRANSITION_CATEGORIES: dict[str, tuple[str, ...]] = {
    "addition": ("furthermore", "moreover", "additionally", "in addition", "besides", "also"),
    "contrast": (
        "however",
        "nevertheless",
        "nonetheless",
        "on the other hand",
        "in contrast",
        "whereas",
        "although",
        "yet",
    ),
    "cause": ("because", "since", "due to", "owing to", "given that"),
    "effect": ("therefore", "thus", "consequently", "as a result", "hence", "accordingly"),
    "example": ("for example", "for instance", "such as", "namely", "to illustrate", "specifically"),
    "emphasis": ("indeed", "in fact", "notably", "certainly", "above all", "importantly"),
    "sequence": ("first", "second", "next", "then", "finally", "subsequently", "afterwards"),
    "time": ("meanwhile", "previously", "eventually", "currently", "recently", "later", "before", "after", "during"),
    "comparison": ("similarly", "likewise", "in the same way", "compared to", "by comparison", "equally"),
    "conclusion": ("in conclusion", "overall", "in summary", "to sum up", "ultimately", "in short"),
    "clarification": ("in other words", "that is", "to clarify", "put simply", "to put it differently"),
    "condition": ("if", "unless", "provided that", "as long as", "in case", "otherwise"),
}
_TRANSITION_PATTERNS = {
    name: re.compile(
        r"\b(?:" + "|".join(r"\s+".join(map(re.escape, p.split())) for p in phrases) + r")\b", re.IGNORECASE
    )
    for name, phrases in TRANSITION_CATEGORIES.items()
}

STOPWORDS = frozenset(
    """
a about above after again against all also am an and any are as at be been before being below between both but
by can could did do does doing down during each few for from further had has have having he her here hers him
his how i if in into is it its itself just me more most my no nor not now of off on once only or other our ours
out over own same she should so some such than that the their theirs them then there these they this those
through to too under until up very was we were what when where which while who whom why will with would you
your yours
""".split()
)

_WORD = re.compile(r"\b\w+\b")


def count_tokens(text: str) -> int:
    """Whitespace tokens (``len(text.split())``)."""
    return len(text.split())


def words(text: str) -> list[str]:
    """Case-folded ``\\b\\w+\\b`` words."""
    return _WORD.findall(text.casefold())


def unique_word_ratio(c1: str, c2: str) -> float | None:
    """Distinct words of ``c2`` / distinct words of ``c1`` (None when ``c1`` has no words)."""
    n1 = len(set(words(c1)))
    return len(set(words(c2))) / n1 if n1 else None


def length_ratio(c1: str, c2: str) -> float | None:
    """Character length of ``c2`` / character length of ``c1`` (None when ``c1`` is empty)."""
    return len(c2) / len(c1) if c1 else None


def transition_categories(text: str) -> list[str]:
    """The transition categories with at least one word/phrase in ``text`` (word-boundary, case-insensitive)."""
    return [name for name, pattern in _TRANSITION_PATTERNS.items() if pattern.search(text)]


def transition_score(text: str) -> float:
    """0 with no category; else ``min(1, 0.4 + 0.05 · (k - 1))`` for ``k`` categories found."""
    k = len(transition_categories(text))
    return 0.0 if k == 0 else min(1.0, 0.4 + 0.05 * (k - 1))


def content_jaccard(c1: str, c2: str) -> float:
    """Jaccard similarity of the stopword-free word sets (0 when both are empty)."""
    a = {w for w in words(c1) if w not in STOPWORDS}
    b = {w for w in words(c2) if w not in STOPWORDS}
    union = a | b
    return len(a & b) / len(union) if union else 0.0


def style_score(c1: str, c2: str, jaccard_cap: float = 0.03) -> float:
    """L4: ``0.4 · transition_score(c2) + 0.6 · min(J, cap) / cap`` (in [0, 1])."""
    return 0.4 * transition_score(c2) + 0.6 * min(content_jaccard(c1, c2), jaccard_cap) / jaccard_cap


def trapezoid(r: float | None, window: tuple[float, float, float, float]) -> float | None:
    """Window ``(a, b, c, d)``: 1 on [b, c], linear 0→1 on [a, b), 1→0 on (c, d]; None (gate fails) outside."""
    a, b, c, d = window
    if r is None or not (a <= r <= d):
        return None
    if r < b:
        return (r - a) / (b - a)
    if r > c:
        return 1.0 if math.isinf(d) else (d - r) / (d - c)
    return 1.0


@dataclass(frozen=True)
class WritingSpec:
    """Thresholds of one task's leveled reward (see the module docstring)."""

    min_tokens: int
    max_tokens: int
    length_window: tuple[float, float, float, float]
    unique_window: tuple[float, float, float, float]
    jaccard_cap: float = 0.03


TLDR_SPEC = WritingSpec(8, 256, (1.1, 1.6, 3.2, 5.0), (1.3, 2.0, math.inf, math.inf))
ARXIV_SPEC = WritingSpec(128, 256, (0.8, 1.0, 1.3, 1.5), (0.5, 0.7, 1.3, 1.7))

LEVEL_WEIGHTS = (0.5, 1.0, 0.5, 1.0)


def reward_breakdown(c1: str, c2: str, spec: WritingSpec) -> dict[str, Any]:
    """Every quantity of the leveled reward for one pair.

    Keys: ``tokens_1``, ``tokens_2``, ``token_ratio`` (tokens_2/tokens_1, 0 when tokens_1 is 0),
    ``length_ratio``, ``unique_word_ratio`` (None when undefined), ``transition_categories`` (list),
    ``transition_coverage`` (categories found / 12), ``transition_score``, ``jaccard``;
    ``level_k`` (k = 1..4, gated contribution), ``passed_level_k`` (gate of level k passed, bool),
    ``levels_passed`` (count of consecutive passed gates), ``total`` (gated reward, = the task reward);
    ``ungated_level_k`` (level k scored as if the earlier gates had passed, 0 where its own gate fails) and
    ``ungated_total``.
    """
    t1, t2 = count_tokens(c1), count_tokens(c2)
    lr, ur = length_ratio(c1, c2), unique_word_ratio(c1, c2)
    found = transition_categories(c2)
    l1_ok = spec.min_tokens <= t1 <= spec.max_tokens and spec.min_tokens <= t2 <= spec.max_tokens
    l2 = trapezoid(lr, spec.length_window)
    l3 = trapezoid(ur, spec.unique_window)
    ungated = [
        LEVEL_WEIGHTS[0] if l1_ok else 0.0,
        LEVEL_WEIGHTS[1] * (l2 or 0.0),
        LEVEL_WEIGHTS[2] * (l3 or 0.0),
        LEVEL_WEIGHTS[3] * style_score(c1, c2, spec.jaccard_cap),
    ]
    passed = [l1_ok, l2 is not None, l3 is not None, True]
    gated, open_ = [], True
    for value, ok in zip(ungated, passed):
        open_ = open_ and ok
        gated.append(value if open_ else 0.0)
    levels_passed = 0
    for ok in passed:
        if not ok:
            break
        levels_passed += 1
    out: dict[str, Any] = {
        "tokens_1": t1,
        "tokens_2": t2,
        "token_ratio": t2 / t1 if t1 else 0.0,
        "length_ratio": lr,
        "unique_word_ratio": ur,
        "transition_categories": found,
        "transition_coverage": len(found) / len(TRANSITION_CATEGORIES),
        "transition_score": transition_score(c2),
        "jaccard": content_jaccard(c1, c2),
    }
    for k in range(4):
        out[f"level_{k + 1}"] = gated[k]
        out[f"passed_level_{k + 1}"] = passed[k]
        out[f"ungated_level_{k + 1}"] = ungated[k]
    out["levels_passed"] = levels_passed
    out["total"] = sum(gated)
    out["ungated_total"] = sum(ungated)
    return out


def tldr_reward_breakdown(summary: str, detail: str) -> dict[str, Any]:
    """:func:`reward_breakdown` with the TL;DR thresholds."""
    return reward_breakdown(summary, detail, TLDR_SPEC)


def arxiv_reward_breakdown(background: str, method: str) -> dict[str, Any]:
    """:func:`reward_breakdown` with the arXiv thresholds."""
    return reward_breakdown(background, method, ARXIV_SPEC)


def tldr_reward(
    summaries: Sequence[str], details: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[float]:
    """Team reward in [0, 3] per (concise summary, detailed summary) pair; see the module docstring."""
    return [float(tldr_reward_breakdown(a, b)["total"]) for a, b in zip(summaries, details)]


def arxiv_reward(
    backgrounds: Sequence[str], methods: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[float]:
    """Team reward in [0, 3] per (background, methodology) pair; see the module docstring."""
    return [float(arxiv_reward_breakdown(a, b)["total"]) for a, b in zip(backgrounds, methods)]


def reward_components(breakdown: Mapping[str, Any]) -> dict[str, float]:
    """The gated levels of one :func:`reward_breakdown` as named components, ``level_1`` … ``level_4``; added in this
    order they give ``breakdown["total"]`` exactly (it is their sum)."""
    return {f"level_{k}": float(breakdown[f"level_{k}"]) for k in range(1, 5)}


def tldr_reward_components(
    summaries: Sequence[str], details: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """:func:`tldr_reward` with each pair's levels as named components (their sum is its reward)."""
    return [reward_components(tldr_reward_breakdown(a, b)) for a, b in zip(summaries, details)]


def arxiv_reward_components(
    backgrounds: Sequence[str], methods: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """:func:`arxiv_reward` with each pair's levels as named components (their sum is its reward)."""
    return [reward_components(arxiv_reward_breakdown(a, b)) for a, b in zip(backgrounds, methods)]


tldr_reward.reward_range = (0.0, 3.0)
arxiv_reward.reward_range = (0.0, 3.0)
tldr_reward_components.reward_range = (0.0, 3.0)
arxiv_reward_components.reward_range = (0.0, 3.0)


# ------------------------------------------------------------------------------------------------ evaluation
EVAL_METRICS = (
    "total_reward",
    "ungated_total_reward",
    "level_1_reward",
    "level_2_reward",
    "level_3_reward",
    "level_4_reward",
    "ungated_level_1_reward",
    "ungated_level_2_reward",
    "ungated_level_3_reward",
    "ungated_level_4_reward",
    "levels_passed",
    "token_ratio",
    "length_ratio",
    "unique_word_ratio",
    "transition_coverage",
    "jaccard",
)


def _infer_task(batch_items: Sequence[Mapping[str, Any]] | None) -> str:
    if batch_items and "abstract_text" in batch_items[0]:
        return "arxiv"
    return "tldr"


def writing_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[str]]],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    task: str | None = None,
) -> list[dict[str, float]]:
    """Per-sample metric dicts for the evaluation callback.

    ``agent_completions_turns[i][s]`` is agent i's list of completions over turns for sample s (agent 0 is
    ``c1``, agent 1 is ``c2``). ``task``: ``"tldr"`` or ``"arxiv"``; inferred from the items when None (items
    with ``abstract_text`` are arXiv). Each dict has, for every turn k, the keys ``turn_k/<name>`` for the names
    in :data:`EVAL_METRICS`: gated ``total_reward`` and ``level_j_reward``, their ungated counterparts,
    ``levels_passed``, ``token_ratio`` (whitespace tokens c2/c1), ``length_ratio`` (characters c2/c1),
    ``unique_word_ratio``, ``transition_coverage`` (share of the 12 categories present in c2) and ``jaccard``.
    Undefined ratios (empty c1) are reported as 0.
    """
    task = task or _infer_task(batch_items)
    if task not in ("tldr", "arxiv"):
        raise ValueError(f"task must be 'tldr' or 'arxiv' (got {task!r}).")
    if len(agent_completions_turns) < 2:
        raise ValueError("the writing tasks need the completions of two agents.")
    spec = TLDR_SPEC if task == "tldr" else ARXIV_SPEC
    per_sample = []
    for first, second in zip(agent_completions_turns[0], agent_completions_turns[1]):
        metrics: dict[str, float] = {}
        for t, (c1, c2) in enumerate(zip(first, second)):
            b = reward_breakdown(c1, c2, spec)
            values = {
                "total_reward": b["total"],
                "ungated_total_reward": b["ungated_total"],
                **{f"level_{k}_reward": b[f"level_{k}"] for k in range(1, 5)},
                **{f"ungated_level_{k}_reward": b[f"ungated_level_{k}"] for k in range(1, 5)},
                "levels_passed": b["levels_passed"],
                "token_ratio": b["token_ratio"],
                "length_ratio": b["length_ratio"] or 0.0,
                "unique_word_ratio": b["unique_word_ratio"] or 0.0,
                "transition_coverage": b["transition_coverage"],
                "jaccard": b["jaccard"],
            }
            metrics.update({f"turn_{t + 1}/{name}": float(v) for name, v in values.items()})
        per_sample.append(metrics)
    return per_sample


def tldr_eval_logger(agent_completions_turns, batch_items=None) -> list[dict[str, float]]:
    """:func:`writing_eval_logger` for the TL;DR task."""
    return writing_eval_logger(agent_completions_turns, batch_items, task="tldr")


def arxiv_eval_logger(agent_completions_turns, batch_items=None) -> list[dict[str, float]]:
    """:func:`writing_eval_logger` for the arXiv task."""
    return writing_eval_logger(agent_completions_turns, batch_items, task="arxiv")


def writing_eval_aggregator(metrics: Sequence[Mapping[str, float]], num_turns: int = 1) -> dict[str, float]:
    """Means over samples: ``turn_k/avg_<name>`` for every ``turn_k/<name>`` of :func:`writing_eval_logger`
    (k = 1..num_turns; e.g. ``turn_1/avg_total_reward``, ``turn_1/avg_length_ratio``,
    ``turn_1/avg_transition_coverage``), plus ``turn_k/level_j_pass_rate`` (share of samples whose
    ``levels_passed >= j``, j = 1..4). Samples lacking a turn are left out of that turn's means."""
    out: dict[str, float] = {}
    for t in range(1, num_turns + 1):
        rows = [m for m in metrics if f"turn_{t}/total_reward" in m]
        if not rows:
            continue
        for name in EVAL_METRICS:
            key = f"turn_{t}/{name}"
            out[f"turn_{t}/avg_{name}"] = sum(float(m[key]) for m in rows) / len(rows)
        for j in range(1, 5):
            out[f"turn_{t}/level_{j}_pass_rate"] = sum(m[f"turn_{t}/levels_passed"] >= j for m in rows) / len(rows)
    return out
