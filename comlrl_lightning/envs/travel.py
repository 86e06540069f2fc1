"""Cooperative travel planning (TravelPlanner, Xie et al. 2024): two role-partitioned agents fill one plan.

Task. An item is a TravelPlanner query (``prompt``) for a trip of ``days`` days (3, 5 or 7) with its
``reference_information`` (flights, restaurants, attractions, accommodations, distances) and, on the train
split, the human ``annotated_plan``. A plan has ``days × 7`` *slots* ``(day, field)`` for the fields in
:data:`FIELDS`; a slot is either a value (e.g. ``"Coco Bambu, Rockford"``) or the explicit empty value ``"-"``.

Roles (:func:`slot_owner`). Agent 0 owns ``current_city``, ``transportation`` and ``accommodation`` on every
day plus ``dinner`` on even days; agent 1 owns ``breakfast``, ``attraction`` and ``lunch`` on every day plus
``dinner`` on odd days. Both agents answer at the same time (single turn), each with exactly one JSON object
``{"agent_id": i, "assignments": [{"day": d, "field": f, "value": v}, ...]}`` that writes ``"-"`` for owned
slots that should stay empty.

Parser (:func:`parse_proposal`, never raises). Markdown fences are removed, then the first complete top-level
JSON object is decoded (``json.JSONDecoder.raw_decode`` from each ``{`` in turn; text after it is ignored).
An assignment entry is *well-formed* when it is a dict with an integer ``day`` in ``1..days`` (bools are not
integers), a ``field`` in :data:`FIELDS` and a string ``value``; otherwise it is *invalid* (unknown field,
out-of-range day, missing keys, non-string value ...). Values are stripped; ``""`` counts as ``"-"``. A second
well-formed entry for the same slot from the same agent is a *duplicate*: the first one is kept. The agent is
identified by its position (agent 0 = first completion list); a wrong ``agent_id`` only lowers validity.

Merger (:func:`merge_proposals`, deterministic). Per slot, over the kept entries of both agents: one proposal →
accepted; two identical (normalised) proposals → accepted once, counted as *overlap*, credited to both agents;
two different proposals → the slot stays empty (missing) and counts as a *conflict*; none → missing.

Reference used by the reward. ONLY the item's ``days`` and its ``annotated_plan`` (the gold plan: ``days``
non-empty day dicts; its ``"-"`` slots are the *gold-empty* slots, all others *gold-filled*). The
``reference_information`` is shown to the agents but not used by the reward (no database check). Items without
an annotated plan (validation/test) cannot be scored: the reward raises ``ValueError``.

Value matching (:func:`slot_match`) on normalised strings (lower case, whitespace collapsed, surrounding
spaces/``;``/``.`` removed): 1.0 when equal; for ``attraction`` (``;``-separated lists) otherwise the Jaccard
overlap of the item sets; for other fields 0.5 when one string contains the other; else 0.0.

Dense joint reward v3 (:func:`travel_reward_breakdown`), ``N = days × 7`` slots, ``F`` / ``E`` the numbers of
gold-filled / gold-empty slots, ``O_i`` the number of slots agent i owns::

    R = clamp(0.05·A + G·P + 0.20·exact_bonus
              − 0.15·overlap − 0.30·conflict − 0.25·coverage_deficit − 0.15·invalid_slot − 0.25·over_capacity
              − 0.15·duplicate − 0.25·explicit_empty_mismatch − 0.15·spurious_fill,  −0.5, 1.2)

    A    mean over the agents of strict-parse success (a top-level JSON object was decoded: 1, else 0)
    V_i  decode success × mean of 6 equally weighted components in [0, 1]:
           shape      the object has an "agent_id" (0.5) and an "assignments" list (0.5)
           agent_id   "agent_id" equals the agent's index
           entries    well-formed entries / all entries                      (0 when there are no entries)
           role       well-formed entries on slots the agent owns / well-formed entries      (0 when none)
           unique     1 − duplicate entries / well-formed entries                            (0 when none)
           owned      owned slots addressed by a kept entry (a value or "-") / O_i
    V    harmonic mean of V_0, V_1 (0 when one is 0)
    C    harmonic mean of the contribution ratios c_i = min(1, merged slots accepted from agent i / O_i)
    G    0.20 + 0.80·sqrt(V·C)
    P    0.20·coverage + 0.45·slot_quality + 0.05·gated_empty_recall + 0.15·role_balance
         + 0.10·owned_slot_quality, where
           coverage            gold-filled slots whose merged value is non-empty (not "-", not missing) / F
           slot_quality        mean of slot_match(merged value, gold value) over the F gold-filled slots
                               (missing or "-" scores 0)
           gated_empty_recall  gold-empty slots merged as explicit "-" / E, counted only when coverage ≥ 0.5
                               (else 0; 1 when E = 0 and coverage ≥ 0.5)
           role_balance        1 − |s_0 − e_0| / max(e_0, 1 − e_0), with s_0 = agent 0's share of the
                               accepted slot credits and e_0 = O_0 / N (0 when nothing was accepted)
           owned_slot_quality  min over agents of the mean slot_match(agent's own kept value, gold) over the
                               gold-filled slots that agent owns (before merging; 1 for an agent owning none)
    exact_bonus              1 when every one of the N merged slots equals the gold value (gold-empty slots
                             must be an explicit "-"), else 0
    overlap                  slots with two identical proposals / N
    conflict                 slots with two different proposals / N
    coverage_deficit         slots missing from the merged plan (no value and no "-"; conflicts included) / N
    invalid_slot             invalid entries / all entries of both agents                   (0 when none)
    over_capacity            mean over agents of min(1, max(0, well-formed entries − O_i) / O_i)
    duplicate                duplicate entries / well-formed entries of both agents         (0 when none)
    explicit_empty_mismatch  gold-filled slots merged as "-" / F
    spurious_fill            gold-empty slots merged with a non-empty value / E              (0 when E = 0)

The perfect split of the annotated plan (each agent writes exactly its owned slots with the gold values, "-"
included) scores A = V = C = G = 1, P = 0.95, exact_bonus = 1, no penalties: R = 0.05 + 0.95 + 0.20 = 1.20.

Evaluation: :func:`travel_eval_logger` / :func:`travel_eval_aggregator` (``turn_1/avg_total_reward``,
``turn_1/avg_parse_rate``, ``turn_1/avg_coverage``, ``turn_1/avg_conflict_rate`` ...).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from comlrl_lightning.envs.loading import load_rows

FIELDS = ("current_city", "transportation", "breakfast", "attraction", "lunch", "dinner", "accommodation")
AGENT0_FIELDS = ("current_city", "transportation", "accommodation")
AGENT1_FIELDS = ("breakfast", "attraction", "lunch")
EMPTY = "-"
REWARD_MIN, REWARD_MAX = -0.5, 1.2
TRAVEL_HUB_ID = "osunlp/TravelPlanner"
TRAIN_HEAD = 40  # the shared 45 annotated train rows: first 40 train, last 5 eval (as in LLM_Collab_Travel)
MAX_REFERENCE_CHARS = 4000
PENALTY_COEFFICIENTS = {
    "overlap": 0.15,
    "conflict": 0.30,
    "coverage_deficit": 0.25,
    "invalid_slot": 0.15,
    "over_capacity": 0.25,
    "duplicate": 0.15,
    "explicit_empty_mismatch": 0.25,
    "spurious_fill": 0.15,
}
P_WEIGHTS = {
    "coverage": 0.20,
    "slot_quality": 0.45,
    "gated_empty_recall": 0.05,
    "role_balance": 0.15,
    "owned_slot_quality": 0.10,
}


# ------------------------------------------------------------------------------------------------ data
def shared_data_dir() -> Path:
    """``$COMLRL_TRAVEL_DATA`` if set, else ``<repo>/../shared/data``."""
    env = os.environ.get("COMLRL_TRAVEL_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


def local_travel_file() -> Path:
    return shared_data_dir() / "travelplanner" / "train_sole_planning.jsonl.gz"


def _literal(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        try:
            return json.loads(value)
        except ValueError:
            return None


def _plan_days(plan: Any) -> list[dict[str, Any]]:
    if not isinstance(plan, list):
        return []
    return [d for d in plan if isinstance(d, Mapping) and d]


def travel_tasks(path_or_id: str = TRAVEL_HUB_ID, split: str = "train", limit: int | None = None) -> list[dict]:
    """TravelPlanner items: the original fields plus ``prompt`` (the query), ``days`` (int),
    ``reference_information`` (string, as stored), ``reference_sections`` (parsed list of
    ``{"Description", "Content"}`` dicts, ``[]`` if unparsable) and ``plan`` (the annotated plan as a list of
    non-empty day dicts, ``[]`` when the split has none).

    ``path_or_id``: a local ``.jsonl``/``.jsonl.gz`` (e.g. the shared derived ``train_sole_planning.jsonl.gz``;
    ``split`` is then ignored) or the hub id (config and split ``split``). ``limit`` keeps the first rows.
    """
    rows = load_rows(path_or_id, split, config=split)  # hub configs: train/validation/test
    rows = rows if limit is None else rows[:limit]
    items = []
    for row in rows:
        query = row.get("query") or row.get("prompt")
        if query is None:
            raise KeyError(f"TravelPlanner item without a 'query' field (fields: {sorted(row)}).")
        plan = _plan_days(_literal(row.get("annotated_plan")))
        days = row.get("days")
        days = int(days) if days not in (None, "") else len(plan)
        ref = row.get("reference_information") or ""
        sections = _literal(ref) if isinstance(ref, str) else ref
        sections = [s for s in sections if isinstance(s, Mapping)] if isinstance(sections, list) else []
        items.append(
            {
                **row,
                "prompt": str(query),
                "days": days,
                "reference_information": ref if isinstance(ref, str) else repr(ref),
                "reference_sections": sections,
                "plan": plan,
            }
        )
    return items


def travel_train_tasks() -> list[dict]:
    """Default training set: the first 40 rows of the shared local copy, else hub ``train`` rows [:40]."""
    local = local_travel_file()
    items = travel_tasks(str(local)) if local.exists() else travel_tasks(TRAVEL_HUB_ID, "train")
    return items[:TRAIN_HEAD]


def travel_eval_tasks() -> list[dict]:
    """Default eval set: the last 5 annotated train rows (the shared local copy, else the hub)."""
    local = local_travel_file()
    items = travel_tasks(str(local)) if local.exists() else travel_tasks(TRAVEL_HUB_ID, "train")
    return items[TRAIN_HEAD:]


# ------------------------------------------------------------------------------------------------ roles
def slot_owner(day: int, field: str) -> int:
    """The agent (0 or 1) that owns slot ``(day, field)``."""
    if field == "dinner":
        return 0 if day % 2 == 0 else 1
    if field in AGENT0_FIELDS:
        return 0
    if field in AGENT1_FIELDS:
        return 1
    raise ValueError(f"unknown field {field!r}")


def owned_slots(agent_id: int, days: int) -> list[tuple[int, str]]:
    return [(d, f) for d in range(1, days + 1) for f in FIELDS if slot_owner(d, f) == agent_id]


# ------------------------------------------------------------------------------------------------ formatters
def reference_text(item: Mapping[str, Any], max_chars: int = MAX_REFERENCE_CHARS) -> str:
    """The reference information as text: table columns joined by " | ", each section cut (at a line end) to an
    equal share of ``max_chars`` (at least 80 characters per section)."""
    sections = item.get("reference_sections")
    if sections is None:
        parsed = _literal(item.get("reference_information") or "")
        sections = parsed if isinstance(parsed, list) else []
    if not sections:
        raw = str(item.get("reference_information") or "")
        return raw[:max_chars] + (" ..." if len(raw) > max_chars else "")
    share = max(80, max_chars // len(sections))
    parts = []
    for s in sections:
        content = str(s.get("Content", ""))
        content = "\n".join(re.sub(r"\s{2,}", " | ", line.strip()) for line in content.splitlines() if line.strip())
        if len(content) > share:
            content = content[:share].rsplit("\n", 1)[0] + "\n... (truncated)"
        parts.append(f"## {s.get('Description', '')}\n{content}")
    return "\n".join(parts)


def _role_lines(agent_id: int, days: int) -> str:
    if agent_id == 0:
        own = "current_city, transportation and accommodation on every day, and dinner on even-numbered days"
        other = "breakfast, attraction and lunch on every day, and dinner on odd-numbered days"
    else:
        own = "breakfast, attraction and lunch on every day, and dinner on odd-numbered days"
        other = "current_city, transportation and accommodation on every day, and dinner on even-numbered days"
    slots = ", ".join(f"day {d} {f}" for d, f in owned_slots(agent_id, days))
    return (
        f"You are planner agent {agent_id} of a team of two. You are responsible for {own}. "
        f"Your teammate fills {other}; do not write its slots.\nYour slots: {slots}."
    )


def travel_prompt(item: Mapping[str, Any], agent_id: int, max_reference_chars: int = MAX_REFERENCE_CHARS) -> str:
    days = int(item.get("days") or 0)
    return (
        f"{_role_lines(agent_id, days)}\n\n"
        f"Trip request: {item['prompt']}\n\n"
        f"Reference information (only use names and options listed here):\n"
        f"{reference_text(item, max_reference_chars)}\n\n"
        'Values look like "Restaurant Name, City", "Flight Number: F123, from A to B, Departure Time: 10:00, '
        'Arrival Time: 12:00" or "from A to B" for a travel day\'s current_city; several attractions are '
        'separated by ";". Write "-" for a slot of yours that should stay empty.\n'
        f"Reply with exactly one JSON object and nothing else:\n"
        f'{{"agent_id": {agent_id}, "assignments": [{{"day": 1, "field": "<one of your fields>", '
        f'"value": "<text or ->"}}, ...]}}\n'
        "List every one of your slots exactly once."
    )


def travel_agent0_prompt(item: Mapping[str, Any]) -> str:
    """Formatter of agent 0 (cities, transportation, accommodation, even-day dinners)."""
    return travel_prompt(item, 0)


def travel_agent1_prompt(item: Mapping[str, Any]) -> str:
    """Formatter of agent 1 (breakfast, attractions, lunch, odd-day dinners)."""
    return travel_prompt(item, 1)


# ------------------------------------------------------------------------------------------------ parsing
_FENCE = re.compile(r"```[ \t]*[\w+-]*[^\n]*\n(.*?)(?:```|\Z)", re.S)


def _first_object(text: str) -> Any:
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        return obj
    return None


def normalise(value: str) -> str:
    return re.sub(r"\s+", " ", str(value).lower()).strip(" ;.")


def parse_proposal(text: str, agent_id: int, days: int) -> dict[str, Any]:
    """Parse one agent's completion; never raises. Returns ``decoded`` (bool), ``components`` (the 6 soft
    validity components), ``validity`` (V_i), ``slots`` (``{(day, field): value}`` of the kept entries),
    ``num_entries``, ``num_wellformed``, ``num_invalid``, ``num_duplicates``, ``num_off_role``, ``agent_id_ok``."""
    out = {
        "decoded": False,
        "components": dict.fromkeys(("shape", "agent_id", "entries", "role", "unique", "owned"), 0.0),
        "validity": 0.0,
        "slots": {},
        "num_entries": 0,
        "num_wellformed": 0,
        "num_invalid": 0,
        "num_duplicates": 0,
        "num_off_role": 0,
        "agent_id_ok": False,
    }
    try:
        text = text if isinstance(text, str) else ""
        fenced = _FENCE.findall(text)
        obj = None
        for candidate in fenced + [text]:
            obj = _first_object(candidate)
            if isinstance(obj, dict):
                break
        if not isinstance(obj, dict):
            return out
        out["decoded"] = True
        comp = out["components"]
        entries = obj.get("assignments")
        comp["shape"] = 0.5 * ("agent_id" in obj) + 0.5 * isinstance(entries, list)
        aid = obj.get("agent_id")
        out["agent_id_ok"] = isinstance(aid, int) and not isinstance(aid, bool) and aid == agent_id
        comp["agent_id"] = float(out["agent_id_ok"])
        entries = entries if isinstance(entries, list) else []
        slots: dict[tuple[int, str], str] = {}
        wellformed = duplicates = off_role = 0
        for e in entries:
            if not isinstance(e, dict):
                continue
            day, field, value = e.get("day"), e.get("field"), e.get("value")
            if (
                not isinstance(day, int)
                or isinstance(day, bool)
                or not 1 <= day <= days
                or field not in FIELDS
                or not isinstance(value, str)
            ):
                continue
            wellformed += 1
            off_role += slot_owner(day, field) != agent_id
            if (day, field) in slots:
                duplicates += 1
                continue
            value = value.strip()
            slots[(day, field)] = value if value else EMPTY
        out.update(
            slots=slots,
            num_entries=len(entries),
            num_wellformed=wellformed,
            num_invalid=len(entries) - wellformed,
            num_duplicates=duplicates,
            num_off_role=off_role,
        )
        if entries:
            comp["entries"] = wellformed / len(entries)
        if wellformed:
            comp["role"] = (wellformed - off_role) / wellformed
            comp["unique"] = 1.0 - duplicates / wellformed
        owned = owned_slots(agent_id, days)
        if owned:
            comp["owned"] = sum(s in slots for s in owned) / len(owned)
        out["validity"] = sum(comp.values()) / len(comp)
    except Exception:  # noqa: BLE001 - the parser must never raise
        return out
    return out


def merge_proposals(proposals: Sequence[Mapping[tuple[int, str], str]]) -> dict[str, Any]:
    """Merge per-agent ``{slot: value}`` dicts. Returns ``plan`` (``{slot: value}``, conflicts and missing slots
    absent), ``credit`` (``{slot: [agent ids]}`` credited for each accepted slot), ``overlap`` and ``conflict``
    (sets of slots)."""
    plan: dict[tuple[int, str], str] = {}
    credit: dict[tuple[int, str], list[int]] = {}
    overlap, conflict = set(), set()
    every = sorted({s for p in proposals for s in p})
    for slot in every:
        offers = [(i, p[slot]) for i, p in enumerate(proposals) if slot in p]
        values = {normalise(v) for _, v in offers}
        if len(values) > 1:
            conflict.add(slot)
            continue
        if len(offers) > 1:
            overlap.add(slot)
        plan[slot] = offers[0][1]
        credit[slot] = [i for i, _ in offers]
    return {"plan": plan, "credit": credit, "overlap": overlap, "conflict": conflict}


# ------------------------------------------------------------------------------------------------ reward
def slot_match(value: str | None, gold: str, field: str) -> float:
    """Similarity of a proposed value with the gold value (see the module docstring)."""
    if value is None:
        return 0.0
    v, g = normalise(value), normalise(gold)
    if v == g:
        return 1.0
    if not v or not g or v == EMPTY or g == EMPTY:
        return 0.0
    if field == "attraction":
        a = {normalise(x) for x in v.split(";") if normalise(x)}
        b = {normalise(x) for x in g.split(";") if normalise(x)}
        return len(a & b) / len(a | b) if a | b else 0.0
    return 0.5 if (v in g or g in v) else 0.0


def _harmonic(values: Sequence[float]) -> float:
    if any(v <= 0 for v in values):
        return 0.0
    return len(values) / sum(1.0 / v for v in values)


def _gold_slots(item: Mapping[str, Any]) -> tuple[int, dict[tuple[int, str], str]]:
    plan = item.get("plan")
    if plan is None:
        plan = _plan_days(_literal(item.get("annotated_plan")))
    days = int(item.get("days") or len(plan))
    if not plan:
        raise ValueError(
            "the travel reward needs items with an annotated plan ('plan'/'annotated_plan'; train split only)."
        )
    gold = {}
    for k, day in enumerate(plan[:days]):
        d = int(day.get("days", k + 1)) if str(day.get("days", "")).isdigit() else k + 1
        for f in FIELDS:
            v = day.get(f, EMPTY)
            v = str(v).strip() if v is not None else EMPTY
            gold[(d, f)] = v if v else EMPTY
    for d in range(1, days + 1):
        for f in FIELDS:
            gold.setdefault((d, f), EMPTY)
    return days, gold


def _is_empty(v: str) -> bool:
    return normalise(v) == EMPTY or not normalise(v)


def travel_reward_breakdown(
    agent0_completion: str, agent1_completion: str, item: Mapping[str, Any]
) -> dict[str, float]:
    """Every term of the dense joint reward v3 for one joint action (see the module docstring)."""
    days, gold = _gold_slots(item)
    n = days * len(FIELDS)
    parsed = [parse_proposal(agent0_completion, 0, days), parse_proposal(agent1_completion, 1, days)]
    owned = [owned_slots(i, days) for i in range(2)]
    merged = merge_proposals([p["slots"] for p in parsed])
    plan, credit = merged["plan"], merged["credit"]
    filled = [s for s, g in gold.items() if not _is_empty(g)]
    empty = [s for s, g in gold.items() if _is_empty(g)]

    a = sum(p["decoded"] for p in parsed) / 2
    v_i = [p["validity"] for p in parsed]
    v = _harmonic(v_i)
    c_i = [min(1.0, sum(i in credit[s] for s in credit) / len(owned[i])) if owned[i] else 1.0 for i in range(2)]
    c = _harmonic(c_i)
    g = 0.20 + 0.80 * math.sqrt(v * c)

    coverage = sum(s in plan and not _is_empty(plan[s]) for s in filled) / len(filled) if filled else 1.0
    slot_quality = sum(slot_match(plan.get(s), gold[s], s[1]) for s in filled) / len(filled) if filled else 1.0
    if coverage >= 0.5:
        empty_recall = sum(s in plan and _is_empty(plan[s]) for s in empty) / len(empty) if empty else 1.0
    else:
        empty_recall = 0.0
    credits = [sum(i in credit[s] for s in credit) for i in range(2)]
    if sum(credits):
        e0 = len(owned[0]) / n
        role_balance = max(0.0, 1.0 - abs(credits[0] / sum(credits) - e0) / max(e0, 1 - e0))
    else:
        role_balance = 0.0
    owned_quality = []
    for i in range(2):
        mine = [s for s in filled if slot_owner(*s) == i]
        owned_quality.append(
            sum(slot_match(parsed[i]["slots"].get(s), gold[s], s[1]) for s in mine) / len(mine) if mine else 1.0
        )
    terms_p = {
        "coverage": coverage,
        "slot_quality": slot_quality,
        "gated_empty_recall": empty_recall,
        "role_balance": role_balance,
        "owned_slot_quality": min(owned_quality),
    }
    p = sum(P_WEIGHTS[k] * terms_p[k] for k in P_WEIGHTS)
    exact = float(all(s in plan and normalise(plan[s]) == normalise(gold[s]) for s in gold))

    entries = sum(q["num_entries"] for q in parsed)
    wellformed = sum(q["num_wellformed"] for q in parsed)
    penalties = {
        "overlap": len(merged["overlap"]) / n,
        "conflict": len(merged["conflict"]) / n,
        "coverage_deficit": sum(s not in plan for s in gold) / n,
        "invalid_slot": sum(q["num_invalid"] for q in parsed) / entries if entries else 0.0,
        "over_capacity": sum(
            min(1.0, max(0, parsed[i]["num_wellformed"] - len(owned[i])) / len(owned[i])) if owned[i] else 0.0
            for i in range(2)
        )
        / 2,
        "duplicate": sum(q["num_duplicates"] for q in parsed) / wellformed if wellformed else 0.0,
        "explicit_empty_mismatch": sum(s in plan and _is_empty(plan[s]) for s in filled) / len(filled)
        if filled
        else 0.0,
        "spurious_fill": sum(s in plan and not _is_empty(plan[s]) for s in empty) / len(empty) if empty else 0.0,
    }
    raw = 0.05 * a + g * p + 0.20 * exact - sum(PENALTY_COEFFICIENTS[k] * penalties[k] for k in penalties)
    return {
        "total": min(REWARD_MAX, max(REWARD_MIN, raw)),
        "unclamped_total": raw,
        "A": a,
        "V_0": v_i[0],
        "V_1": v_i[1],
        "V": v,
        "C_0": c_i[0],
        "C_1": c_i[1],
        "C": c,
        "G": g,
        "P": p,
        **terms_p,
        "exact_bonus": exact,
        **penalties,
        "parse_rate": a,
        "num_conflicts": float(len(merged["conflict"])),
        "num_overlaps": float(len(merged["overlap"])),
        "num_slots": float(n),
    }


def travel_reward(
    agent0_completions: Sequence[str],
    agent1_completions: Sequence[str],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
) -> list[float]:
    """Dense joint reward v3 in [−0.5, 1.2] per joint action (``batch_items`` aligned with the completions)."""
    if not batch_items:
        raise ValueError("travel_reward needs batch_items (the items with their annotated plans).")
    if len(batch_items) == 1 and len(agent0_completions) > 1:
        batch_items = list(batch_items) * len(agent0_completions)
    return [
        travel_reward_breakdown(c0, c1, item)["total"]
        for c0, c1, item in zip(agent0_completions, agent1_completions, batch_items)
    ]


travel_reward.reward_range = (REWARD_MIN, REWARD_MAX)


# ------------------------------------------------------------------------------------------------ evaluation
EVAL_METRICS = (
    "total_reward",
    "parse_rate",
    "validity",
    "contribution",
    "coverage",
    "slot_quality",
    "gated_empty_recall",
    "role_balance",
    "owned_slot_quality",
    "exact_match",
    "overlap_rate",
    "conflict_rate",
    "coverage_deficit",
    "invalid_slot_rate",
    "over_capacity",
    "duplicate_rate",
    "explicit_empty_mismatch",
    "spurious_fill",
)
_FROM_BREAKDOWN = {
    "total_reward": "total",
    "parse_rate": "A",
    "validity": "V",
    "contribution": "C",
    "exact_match": "exact_bonus",
    "overlap_rate": "overlap",
    "conflict_rate": "conflict",
    "invalid_slot_rate": "invalid_slot",
    "duplicate_rate": "duplicate",
}


def travel_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[str]]], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, float]]:
    """Per-sample dicts ``turn_k/<name>`` for the names in :data:`EVAL_METRICS` (``agent_completions_turns[i][s]``
    is agent i's list of completions over turns for sample s)."""
    if len(agent_completions_turns) < 2:
        raise ValueError("the travel task needs the completions of two agents.")
    if not batch_items:
        raise ValueError("travel_eval_logger needs batch_items (the items with their annotated plans).")
    per_sample = []
    for s, (first, second) in enumerate(zip(agent_completions_turns[0], agent_completions_turns[1])):
        item = batch_items[s] if s < len(batch_items) else batch_items[-1]
        metrics: dict[str, float] = {}
        for t, (c0, c1) in enumerate(zip(first, second)):
            b = travel_reward_breakdown(c0, c1, item)
            metrics.update({f"turn_{t + 1}/{name}": float(b[_FROM_BREAKDOWN.get(name, name)]) for name in EVAL_METRICS})
        per_sample.append(metrics)
    return per_sample


def travel_eval_aggregator(metrics: Sequence[Mapping[str, float]], num_turns: int = 1) -> dict[str, float]:
    """Means over samples: ``turn_k/avg_<name>`` for every name of :data:`EVAL_METRICS` (e.g.
    ``turn_1/avg_total_reward``, ``turn_1/avg_parse_rate``, ``turn_1/avg_coverage``, ``turn_1/avg_conflict_rate``)."""
    out: dict[str, float] = {}
    for t in range(1, num_turns + 1):
        rows = [m for m in metrics if f"turn_{t}/total_reward" in m]
        for name in EVAL_METRICS if rows else ():
            out[f"turn_{t}/avg_{name}"] = sum(float(m[f"turn_{t}/{name}"]) for m in rows) / len(rows)
    return out
