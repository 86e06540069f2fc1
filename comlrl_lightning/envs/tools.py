"""Cooperative native parallel function calling on BFCL v4 (docs/environments.md; after
``OpenMLRL/LLM_Collab_BFCL-v4``).

N decentralized agents each read the same user request and the JSON function schemas and answer, without
communicating, with Python-style calls (one per line, keyword arguments) or exactly ``[]``; an aggregator
parses, dedupes and merges the calls of all agents into the team's answer.

Data: :func:`bfcl_tasks` reads the installed ``bfcl-eval`` package's data files (``BFCL_v4_<category>.json``,
JSON lines) joined with ``possible_answer/BFCL_v4_<category>.json``. Ground truth is a list of calls
``{function_name: {arg: [acceptable values, ...]}}``; ``""`` among the acceptable values means "may be omitted",
and dict-valued arguments hold the same structure per key.

Team reward (:func:`bfcl_reward`, breakdown :func:`bfcl_reward_breakdown`), per joint action, clamped to
[−0.4, 1.2]::

    0.05 · parse     mean over agents of parse_ok (the answer is exactly ``[]``, or ≥ 1 call and no malformed
                     call-like line)
  + 0.25 · name_f1   multiset F1 between the merged calls' names and the ground-truth names (1 when both empty)
  + 0.35 · args      Σ over greedily matched (merged call, ground-truth call) pairs of the pair's argument
                     score, / #ground-truth calls. Pairs need equal names; the pair with the highest score is
                     matched first (ties: earlier calls). Argument score = #ground-truth args satisfied /
                     (#ground-truth args + 0.5 · #extra args); a ground-truth arg is satisfied when its value is
                     acceptable, or when it is omitted and ``""`` is acceptable; 1.0 when both have no args
  + 0.10 · count     max(0, 1 − |#merged − #ground truth| / #ground truth)
  + 0.15 · balance   evenness of the per-agent unique-call counts c_i (T = Σ c_i): 1 − (D − D_min)/(D_max − D_min)
                     with D = Σ|c_i − T/N|, D_min that of the most even integer split, D_max = 2T(N−1)/N
                     (all calls from one agent); 1 when D_max = D_min (T ≤ 1), 0 when T = 0. N = 2: 1 − (|c0 − c1|
                     − T mod 2)/(T − T mod 2)
  + 0.20 · exact     1 when #merged = #ground truth and every ground-truth call is matched with score 1
  − 0.20 · overlap   cross-agent overlap rate: (Σ c_i − #merged) / Σ c_i (calls proposed by several agents)
  − 0.15 · lazy      max(0, #agents with no call − max(0, N − #ground truth)) / N (agents that could have
                     contributed but did not)
  − 0.05 · extra     #merged calls matched to no ground-truth call / #merged
  − 0.05 · dup       within-agent duplicates / #parsed calls over all agents

(rates are 0 when their denominator is 0). The maximum reachable is 1.10 (every positive term 1, no penalty).

Value comparison: strings are compared case-insensitively with spaces and ``,./-_*^'"`` removed (as BFCL's
checker standardises them), numbers numerically (``20 == 20.0``; bools are not numbers), lists/tuples element
by element, dicts per key against the nested ground truth.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from comlrl_lightning.envs.loading import read_records
from comlrl_lightning.envs.untrusted import UNPARSABLE

REWARD_MIN, REWARD_MAX = -0.4, 1.2
CATEGORIES = ("parallel", "parallel_multiple", "live_parallel", "live_parallel_multiple")
ROLE_MODES = ("self_select", "same_prompt", "odd_even", "split_by_order")
WEIGHTS = {
    "parse": 0.05,
    "name_f1": 0.25,
    "arg_match": 0.35,
    "count_match": 0.10,
    "balance": 0.15,
    "exact": 0.20,
    "overlap_rate": -0.20,
    "lazy_rate": -0.15,
    "extra_rate": -0.05,
    "duplicate_rate": -0.05,
}

# --------------------------------------------------------------------------------------------- loading


def _data_dir(path: str | Path | None) -> Path:
    if path is not None:
        return Path(path).expanduser()
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "bfcl_tasks() needs the BFCL data of the 'bfcl-eval' package: "
            "pip install --no-deps bfcl-eval (or pass path= a folder with BFCL_v4_<category>.json "
            "and possible_answer/)."
        )
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _user_text(question: Any) -> str:
    turns = question if isinstance(question, list) else [[question]]
    first = turns[0] if turns and isinstance(turns[0], list) else turns
    parts = [m.get("content", "") for m in first if isinstance(m, Mapping) and m.get("role", "user") == "user"]
    return "\n".join(p for p in parts if p)


def bfcl_tasks(
    categories: Sequence[str] | str = CATEGORIES, limit: int | None = None, path: str | Path | None = None
) -> list[dict[str, Any]]:
    """BFCL v4 items ``{"id", "prompt", "function", "ground_truth", "official_category", "question"}``.

    ``prompt`` is the user request (the user messages of the first turn), ``function`` the JSON schemas,
    ``ground_truth`` the possible answers. ``limit`` keeps the first items of each category in turn order of
    ``categories`` (applied to the concatenation). ``path``: a folder with the files instead of the package's."""
    root = _data_dir(path)
    if isinstance(categories, str):
        categories = [categories]
    items = []
    for cat in categories:
        qfile, afile = root / f"BFCL_v4_{cat}.json", root / "possible_answer" / f"BFCL_v4_{cat}.json"
        if not qfile.exists() or not afile.exists():
            raise FileNotFoundError(f"BFCL category {cat!r}: {qfile} or {afile} not found.")
        answers = {r["id"]: r["ground_truth"] for r in read_records(afile)}
        for row in read_records(qfile):
            if row["id"] not in answers:
                continue
            items.append(
                {
                    "id": row["id"],
                    "prompt": _user_text(row.get("question")),
                    "function": row["function"],
                    "ground_truth": answers[row["id"]],
                    "official_category": cat,
                    "question": row.get("question"),
                }
            )
    return items[:limit] if limit is not None else items


def bfcl_parallel_tasks() -> list[dict[str, Any]]:
    """All four native-parallel categories (440 items)."""
    return bfcl_tasks()


def bfcl_train_tasks() -> list[dict[str, Any]]:
    """The native-parallel items except every 10th (held out by :func:`bfcl_eval_tasks`)."""
    return [it for k, it in enumerate(bfcl_tasks()) if k % 10 != 0]


def bfcl_eval_tasks() -> list[dict[str, Any]]:
    """Every 10th native-parallel item (44 items), disjoint from :func:`bfcl_train_tasks`."""
    return [it for k, it in enumerate(bfcl_tasks()) if k % 10 == 0]


# ------------------------------------------------------------------------------------------- formatter

_ROLE_TEXT = {
    "self_select": "Contribute a useful, non-empty subset of the requested calls that you are confident about; "
    "your teammates do the same, so the team covers the request together.",
    "same_prompt": "Answer the request with the function calls it needs.",
}


def _role_text(mode: str, i: int, n: int) -> str:
    if mode in _ROLE_TEXT:
        return _ROLE_TEXT[mode]
    if mode == "odd_even":
        pos = ", ".join(f"{k}" for k in range(i + 1, i + 1 + 3 * n, n))
        return (
            f"Handle only the intents at positions {pos}, ... of the request (every {n}-th intent starting with "
            f"intent {i + 1}, in the order they are mentioned); your teammates handle the others."
        )
    if mode == "split_by_order":
        return (
            f"Split the request's intents, in the order they are mentioned, into {n} consecutive parts of "
            f"(nearly) equal size and handle only part {i + 1} of {n}; your teammates handle the other parts."
        )
    raise ValueError(f"role_mode must be one of {ROLE_MODES}, got {mode!r}.")


class BFCLFormatter:
    """Prompt of agent ``agent_index`` (0-based) of ``num_agents`` for a BFCL item, ``role_mode`` one of
    :data:`ROLE_MODES` (``self_select``: contribute a confident non-empty subset; ``same_prompt``: no role;
    ``odd_even``: every N-th intent; ``split_by_order``: the i-th consecutive part)."""

    def __init__(self, agent_index: int = 0, num_agents: int = 2, role_mode: str = "self_select"):
        if role_mode not in ROLE_MODES:
            raise ValueError(f"role_mode must be one of {ROLE_MODES}, got {role_mode!r}.")
        if not 0 <= agent_index < num_agents:
            raise ValueError(f"agent_index {agent_index} out of range for num_agents={num_agents}.")
        self.agent_index, self.num_agents, self.role_mode = agent_index, num_agents, role_mode

    def __call__(self, item: Mapping[str, Any]) -> str:
        i, n = self.agent_index, self.num_agents
        schemas = json.dumps(item.get("function", []), ensure_ascii=False)
        return (
            f"You are agent {i + 1} of {n} decentralized function-calling agents. The agents answer independently "
            "without communication, and a downstream aggregator merges all agents' calls.\n"
            f"Role: {_role_text(self.role_mode, i, n)}\n"
            f"Category: {item.get('official_category', 'unknown')}\n"
            f"Functions (JSON schemas): {schemas}\n"
            f"User request: {item.get('prompt', '')}\n"
            "Answer with Python-style function calls, one per line, keyword arguments only, e.g. "
            "func_name(arg1=value1, arg2=value2). If you contribute nothing, answer exactly []. No other text."
        )


def bfcl_formatters(num_agents: int = 2, role_mode: str = "self_select") -> list[BFCLFormatter]:
    return [BFCLFormatter(i, num_agents, role_mode) for i in range(num_agents)]


def bfcl_agent_0_prompt(item: Mapping[str, Any]) -> str:
    """Agent 1 of 2, ``self_select`` (an import path for configs)."""
    return BFCLFormatter(0, 2)(item)


def bfcl_agent_1_prompt(item: Mapping[str, Any]) -> str:
    """Agent 2 of 2, ``self_select`` (an import path for configs)."""
    return BFCLFormatter(1, 2)(item)


# --------------------------------------------------------------------------------------------- parsing

_CALL_START = re.compile(r"^\s*\[?\s*[A-Za-z_][\w.]*\s*\(")
# Past these a completion is malformed (bfcl_magrpo's 128 tokens are ~500 characters and a few calls): the parse
# and the scoring are linear, and these bound them (~64k tokens of text; 1024 calls, where BFCL asks for a few).
MAX_COMPLETION_CHARS = 1 << 18
MAX_CALLS = 1 << 10


@dataclass
class ParsedCalls:
    """Calls of one completion: ``calls`` [(name, args)], ``malformed`` (call-like lines that did not parse),
    ``empty`` (the answer is exactly ``[]``)."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    malformed: int = 0
    empty: bool = False

    @property
    def ok(self) -> bool:
        return self.empty or (bool(self.calls) and self.malformed == 0)


# What hostile text does to the comparisons too (values whose types do not order, nesting, huge literals).
HOSTILE = (*UNPARSABLE, TypeError)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _value(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        if isinstance(node, ast.Name):  # unit=celsius → "celsius"
            return node.id
        raise ValueError("not a literal") from None


def _param_names(functions: Sequence[Mapping[str, Any]] | None, name: str) -> list[str]:
    for f in functions or []:
        if f.get("name") == name:
            return list((f.get("parameters") or {}).get("properties") or {})
    return []


def _call(node: ast.AST, functions: Sequence[Mapping[str, Any]] | None) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(node, ast.Call):
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    args: dict[str, Any] = {}
    params = _param_names(functions, name)
    try:
        for k, a in enumerate(node.args):  # positional: mapped onto the schema's parameter order
            if isinstance(a, ast.Starred):
                return None
            args[params[k] if k < len(params) else f"_arg{k}"] = _value(a)
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            args[kw.arg] = _value(kw.value)
    except ValueError:
        return None
    return name, args


def _calls_of(expr: ast.AST, functions) -> list[tuple[str, dict[str, Any]]] | None:
    nodes = expr.elts if isinstance(expr, (ast.List, ast.Tuple)) else [expr]
    out = []
    for n in nodes:
        c = _call(n, functions)
        if c is None:
            return None
        out.append(c)
    return out


def _fenced_blocks(text: str) -> list[str]:
    """The bodies of the markdown fences of ``text`` (from the line after an opening fence to the next fence or
    the end), found in one pass: a regex that backtracks over a long line of backticks is quadratic."""
    blocks, pos = [], 0
    while (start := text.find("```", pos)) >= 0:
        newline = text.find("\n", start + 3)
        if newline < 0:  # no line follows this fence (nor any fence after it)
            break
        end = text.find("```", newline + 1)
        if end < 0:
            blocks.append(text[newline + 1 :])
            break
        blocks.append(text[newline + 1 : end])
        pos = end + 3
    return blocks


def parse_calls(text: str, functions: Sequence[Mapping[str, Any]] | None = None) -> ParsedCalls:
    """Parse one completion: markdown fences stripped; the whole answer as a ``[call, ...]`` list (or ``[]``),
    else one call per line (multi-line calls joined while brackets are open, up to the next unindented call
    line; a line's trailing comma and
    enclosing ``[`` / ``]`` ignored). Lines that start like a call but do not parse (or use non-literal
    arguments, ``*args``/``**kwargs``) are skipped and counted as malformed; other prose lines are ignored.
    Positional arguments are named after the schema's parameters (``functions``) in order, else ``_arg<k>``.
    A completion over :data:`MAX_COMPLETION_CHARS` characters or with over :data:`MAX_CALLS` calls is one
    malformed answer (``ParsedCalls(malformed=1)``, as :func:`score_joint` scores what it cannot parse)."""
    text = text or ""
    if len(text) > MAX_COMPLETION_CHARS:
        return ParsedCalls(malformed=1)
    blocks = _fenced_blocks(text)
    body = "\n".join(blocks) if blocks else text
    body = body.strip()
    result = ParsedCalls()
    if not body:
        return result
    try:
        whole = ast.parse(body, mode="eval").body
    except UNPARSABLE:
        whole = None
    if isinstance(whole, ast.List) and not whole.elts:
        result.empty = True
        return result
    if whole is not None:
        if isinstance(whole, (ast.List, ast.Tuple)) and len(whole.elts) > MAX_CALLS:
            return ParsedCalls(malformed=1)
        calls = _calls_of(whole, functions)
        if calls is not None:
            result.calls = calls
            return result
    parts: list[str] = []  # the lines of the call being read, and its bracket depth (kept as lines come)
    depth = 0
    for raw in body.splitlines() + [""]:
        line = raw.strip()
        if parts and raw[:1].strip() and _CALL_START.match(line):  # an unclosed call, then a new unindented call
            result.malformed += 1
            parts, depth = [], 0
        if not parts:
            if not _CALL_START.match(line):
                continue
        if line:
            parts.append(line)
            depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        if depth > 0 and raw != "":
            continue
        chunk = " ".join(parts).rstrip(",").strip()
        parts, depth = [], 0
        if chunk.startswith("[") and not chunk.endswith("]"):
            chunk = chunk[1:]
        if chunk.endswith("]") and not chunk.startswith("["):
            chunk = chunk[:-1].rstrip().rstrip(",")
        try:
            calls = _calls_of(ast.parse(chunk, mode="eval").body, functions)
        except UNPARSABLE:
            calls = None
        if calls is None:
            result.malformed += 1
        else:
            result.calls.extend(calls)
            if len(result.calls) > MAX_CALLS:
                return ParsedCalls(malformed=1)
    return result


def call_key(call: tuple[str, Mapping[str, Any]]) -> str:
    """A call's identity: its name and arguments in a canonical form (dict keys of any types, sets, tuples)."""
    name, args = call
    return name + json.dumps(_canonical(args))


def _canonical(value: Any) -> Any:
    """JSON-ready, order-independent form of a literal (keys sorted by their repr: they may be of mixed types)."""
    if isinstance(value, dict):
        return ["dict", sorted(([repr(k), _canonical(v)] for k, v in value.items()), key=lambda kv: kv[0])]
    if isinstance(value, (set, frozenset)):
        return ["set", sorted(repr(v) for v in value)]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_canonical(v) for v in value]]
    return repr(value)


def dedupe_calls(calls: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """Unique calls (first occurrence kept, order preserved) and the number of duplicates removed."""
    seen, out = set(), []
    for c in calls:
        k = call_key(c)
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out, len(calls) - len(out)


@dataclass
class MergedCalls:
    """Union of the agents' deduped calls (agent order, then call order). ``overlap``: calls dropped because an
    earlier agent already made them; ``conflicts`` (informational): function names that several agents call
    with different arguments — a disagreement or legitimately different parallel calls; all variants are kept."""

    calls: list[tuple[str, dict[str, Any]]]
    per_agent: list[list[tuple[str, dict[str, Any]]]]
    overlap: int
    conflicts: list[str]


def merge_calls(per_agent_calls: Sequence[Sequence[tuple[str, dict[str, Any]]]]) -> MergedCalls:
    per_agent = [dedupe_calls(c)[0] for c in per_agent_calls]
    merged, seen, overlap = [], set(), 0
    for calls in per_agent:
        for c in calls:
            k = call_key(c)
            if k in seen:
                overlap += 1
            else:
                seen.add(k)
                merged.append(c)
    variants: dict[str, dict[str, set[int]]] = {}
    for a, calls in enumerate(per_agent):
        for c in calls:
            variants.setdefault(c[0], {}).setdefault(call_key(c), set()).add(a)
    conflicts = [name for name, keys in variants.items() if len(keys) > 1 and len(set().union(*keys.values())) > 1]
    return MergedCalls(merged, per_agent, overlap, conflicts)


# ---------------------------------------------------------------------------------------------- scoring

_STRIP = re.compile(r"[ ,./\-_*^'\"]")


def _norm_str(s: str) -> str:
    return _STRIP.sub("", s).lower()


def value_matches(value: Any, expected: Any) -> bool:
    """One predicted value against one acceptable ground-truth value (see the module docstring)."""
    if isinstance(expected, Mapping):
        return isinstance(value, Mapping) and args_score(dict(value), expected) == 1.0
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(expected, bool) and isinstance(value, bool) and value == expected
    if isinstance(expected, (int, float)):
        return isinstance(value, (int, float)) and value == expected  # exact, any size (no float overflow)
    if isinstance(expected, str):
        return isinstance(value, str) and _norm_str(value) == _norm_str(expected)
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(value, (list, tuple))
            and len(value) == len(expected)
            and all(value_matches(v, e) for v, e in zip(value, expected))
        )
    return value == expected


def args_score(pred: Mapping[str, Any], truth: Mapping[str, Sequence[Any]]) -> float:
    """#ground-truth args satisfied / (#ground-truth args + 0.5 · #extra args); 1.0 when both are empty."""
    satisfied = 0
    for arg, acceptable in truth.items():
        acceptable = acceptable if isinstance(acceptable, list) else [acceptable]
        if arg in pred:
            satisfied += any(value_matches(pred[arg], e) for e in acceptable if e != "" or pred[arg] == "")
        else:
            satisfied += "" in acceptable
    extra = sum(1 for a in pred if a not in truth)
    denom = len(truth) + 0.5 * extra
    return 1.0 if denom == 0 else satisfied / denom


def _gt_calls(ground_truth: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, dict(args)) for entry in ground_truth for name, args in entry.items()]


def match_calls(
    pred: Sequence[tuple[str, dict[str, Any]]], truth: Sequence[tuple[str, dict[str, Any]]]
) -> list[tuple[int, int, float]]:
    """Greedy matching (pred index, truth index, score): same-name pairs, highest score first."""
    pairs = [(args_score(p[1], t[1]), i, j) for i, p in enumerate(pred) for j, t in enumerate(truth) if p[0] == t[0]]
    pairs.sort(key=lambda x: (-x[0], x[1], x[2]))
    used_p, used_t, out = set(), set(), []
    for s, i, j in pairs:
        if i not in used_p and j not in used_t:
            used_p.add(i)
            used_t.add(j)
            out.append((i, j, s))
    return out


def _balance(counts: Sequence[int]) -> float:
    n, total = len(counts), sum(counts)
    if total == 0:
        return 0.0
    q, r = divmod(total, n)
    d = sum(abs(c - total / n) for c in counts)
    d_min = 2 * r * (n - r) / n
    d_max = 2 * total * (n - 1) / n
    if d_max - d_min <= 1e-12:
        return 1.0
    return max(0.0, min(1.0, 1.0 - (d - d_min) / (d_max - d_min)))


def score_joint(completions: Sequence[str], item: Mapping[str, Any]) -> dict[str, Any]:
    """Breakdown of one joint action (one completion per agent) on a BFCL item; ``total`` is the reward. A
    completion nothing can be made of (nested past the parser's depth, values too large to compare) is scored as
    malformed: the reward never raises on what a model writes."""
    functions = item.get("function")
    parsed = []
    for c in completions:
        try:
            parsed.append(parse_calls(c, functions))
        except HOSTILE:
            parsed.append(ParsedCalls(malformed=1))
    try:
        return _score_parsed(parsed, item)
    except HOSTILE:  # parsed, but its values defeat the comparison: the completions count as malformed
        return _score_parsed([ParsedCalls(malformed=1) if p.calls else p for p in parsed], item)


def _score_parsed(parsed: Sequence[ParsedCalls], item: Mapping[str, Any]) -> dict[str, Any]:
    n = len(parsed)
    raw_total = sum(len(p.calls) for p in parsed)
    dups = sum(dedupe_calls(p.calls)[1] for p in parsed)
    merged = merge_calls([p.calls for p in parsed])
    truth = _gt_calls(item.get("ground_truth") or [])
    pred = merged.calls
    counts = [len(c) for c in merged.per_agent]
    t, m = len(truth), len(pred)

    pn, tn = Counter(c[0] for c in pred), Counter(c[0] for c in truth)
    common = sum((pn & tn).values())
    if t == 0 and m == 0:
        f1 = 1.0
    elif common == 0:
        f1 = 0.0
    else:
        prec, rec = common / m, common / t
        f1 = 2 * prec * rec / (prec + rec)
    matches = match_calls(pred, truth)
    arg = (sum(s for _, _, s in matches) / t) if t else float(m == 0)
    count = max(0.0, 1.0 - abs(m - t) / t) if t else float(m == 0)
    exact = float(m == t and len(matches) == t and all(s == 1.0 for _, _, s in matches))
    lazy_agents = sum(1 for c in counts if c == 0)
    b = {
        "parse": sum(p.ok for p in parsed) / n if n else 0.0,
        "name_f1": f1,
        "arg_match": arg,
        "count_match": count,
        "balance": _balance(counts) if n else 0.0,
        "exact": exact,
        "overlap_rate": merged.overlap / sum(counts) if sum(counts) else 0.0,
        "lazy_rate": max(0, lazy_agents - max(0, n - t)) / n if n else 0.0,
        "extra_rate": (m - len(matches)) / m if m else 0.0,
        "duplicate_rate": dups / raw_total if raw_total else 0.0,
    }
    raw = sum(WEIGHTS[k] * b[k] for k in WEIGHTS)
    b.update(
        num_calls=m,
        num_ground_truth=t,
        per_agent_calls=counts,
        malformed=sum(p.malformed for p in parsed),
        duplicates=dups,
        overlap=merged.overlap,
        conflicts=merged.conflicts,
        raw_total=round(raw, 10),
        total=round(max(REWARD_MIN, min(REWARD_MAX, raw)), 10),
    )
    return b


def _items_for(k: int, batch_items: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    if not batch_items:
        raise ValueError("bfcl_reward needs batch_items (the BFCL items with their ground_truth).")
    if len(batch_items) == 1:
        return list(batch_items) * k
    if len(batch_items) != k:
        raise ValueError(f"batch_items has {len(batch_items)} items for {k} joint actions.")
    return list(batch_items)


def bfcl_reward_breakdown(
    *agent_completions: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Per joint action, the dict of :func:`score_joint`."""
    if not agent_completions:
        return []
    k = len(agent_completions[0])
    if any(len(c) != k for c in agent_completions):
        raise ValueError("agent completion lists differ in length.")
    items = _items_for(k, batch_items)
    return [score_joint([c[j] for c in agent_completions], items[j]) for j in range(k)]


def bfcl_reward(
    *agent_completions: Sequence[str], batch_items: Sequence[Mapping[str, Any]] | None = None
) -> list[float]:
    """Team reward in [−0.4, 1.2] per joint action (see the module docstring)."""
    return [b["total"] for b in bfcl_reward_breakdown(*agent_completions, batch_items=batch_items)]


bfcl_reward.reward_range = (REWARD_MIN, REWARD_MAX)

# ----------------------------------------------------------------------------------------------- eval

EVAL_METRICS = ("total", *WEIGHTS, "num_calls", "malformed")


def bfcl_eval_logger(
    agent_completions_turns: Sequence[Sequence[Sequence[str]]],
    batch_items: Sequence[Mapping[str, Any]] | None = None,
    **_: Any,
) -> list[dict[str, float]]:
    """Per eval sample ``{"turn_k/<name>": value}`` for the names in :data:`EVAL_METRICS` (plus
    ``turn_k/parse_ok`` is ``parse``); ``agent_completions_turns[i][s]`` is agent i's completions over turns."""
    num_samples = len(agent_completions_turns[0]) if agent_completions_turns else 0
    items = _items_for(num_samples, batch_items) if num_samples else []
    out = []
    for s in range(num_samples):
        row: dict[str, float] = {}
        turns = min(len(agent[s]) for agent in agent_completions_turns)
        for t in range(turns):
            b = score_joint([agent[s][t] for agent in agent_completions_turns], items[s])
            for name in EVAL_METRICS:
                row[f"turn_{t + 1}/{name}"] = float(b[name])
        out.append(row)
    return out


def bfcl_eval_aggregator(metrics: Sequence[Mapping[str, float]], num_turns: int | None = None) -> dict[str, float]:
    """Means over samples: ``turn_k/avg_<name>`` for every ``turn_k/<name>`` key (e.g.
    ``turn_1/avg_total``, ``turn_1/avg_exact``, ``turn_1/avg_overlap_rate``)."""
    sums: dict[str, list[float]] = {}
    for m in metrics:
        for key, v in m.items():
            turn, _, name = key.partition("/")
            if num_turns is not None and int(turn.split("_")[1]) > num_turns:
                continue
            sums.setdefault(f"{turn}/avg_{name}", []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sums.items()}
