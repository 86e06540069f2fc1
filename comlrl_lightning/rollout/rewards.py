"""Calling user code: formatters, the joint reward, reward processors and external transitions.

One documented reward signature (docs/differences.md)::

    reward_func(*agent_completions, prompts=None, batch_items=None, response_history_per_agent=None) -> list[float]

``agent_completions[i]`` is agent i's list of completion strings; every list has one entry per joint action
and the function returns one team reward per joint action. ``prompts``/``batch_items`` are passed only when
the function names them (or takes ``**kwargs``). Unlike CoMLRL we never guess by retrying after a TypeError.
``response_history_per_agent`` (only when a parameter has that name; ``**kwargs`` does not ask for it) gives an environment with state its trajectory: one entry per
joint action, ``[N]`` lists of each agent's responses in the earlier turns (empty lists at turn 1), so the reward can
replay them from the task item (BridgeBuild, ResourceGathering) instead of keeping state between calls.

Reward components (``reward_aggregation``, README): instead of a float, the reward may return a mapping ``{name: float}`` per joint action
(its levels: ``{"syntax": 0.5, "tests": 0.8}``), the same names for every joint action of a call. The team reward is
then the components' sum, weighted by ``component_weights`` (``reward_component_weights``; a name it does not give
weighs 1.0), and ``reward_processor`` applies to that sum exactly as to a float; the components themselves are kept
(:class:`RawRewards`, ``Node.reward_components``) so that ``reward_aggregation: normalize_components`` can normalise
each one within its group.
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from comlrl_lightning.runs import stop

Formatter = Callable[..., str]


def _accepts(func: Callable, name: str) -> bool:
    """True when ``func`` can be called with keyword ``name``."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _names(func: Callable, name: str) -> bool:
    """True when ``func`` has a parameter called ``name`` (not merely ``**kwargs``)."""
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def call_filtered(func: Callable, **kwargs: Any) -> Any:
    """Call with the keyword arguments ``func`` names (all of them if it takes ``**kwargs``)."""
    return func(**{k: v for k, v in kwargs.items() if _accepts(func, k)})


def default_formatter(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
    """The prompt is the external prompt when given, else ``item["prompt"]``."""
    return external_prompts if external_prompts is not None else str(item.get("prompt", ""))


def build_formatters(formatters: Formatter | Sequence[Formatter] | None, num_agents: int) -> list[Formatter]:
    """One ``(item, external_prompts=None) -> str`` callable per agent; one callable (or a one-element list) serves
    every agent (docs/algorithms.md#formatters-rewards-and-transitions)."""
    if formatters is None:
        return [default_formatter] * num_agents
    if callable(formatters):
        formatters = [formatters]
    if isinstance(formatters, Sequence) and not isinstance(formatters, str) and len(formatters) == 1:
        formatters = list(formatters) * num_agents  # one formatter for every agent
    if not isinstance(formatters, Sequence) or isinstance(formatters, str):
        raise ValueError(
            f"formatters must be a callable or a list of {num_agents} callables, got {type(formatters).__name__}."
        )
    if len(formatters) != num_agents:
        raise ValueError(f"formatters: number of formatters ({len(formatters)}) must match num_agents ({num_agents}).")
    for i, f in enumerate(formatters):
        if not callable(f):
            raise ValueError(f"formatters[{i}] must be callable, got {type(f).__name__}.")
    return [_wrap_formatter(f) for f in formatters]


def callable_name(func: Callable) -> str:
    return f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', type(func).__name__)}".lstrip(".")


def _item_summary(item: Any) -> str:
    if isinstance(item, Mapping):
        return "{" + ", ".join(f"{k!r}: {str(v)[:40]!r}" for k, v in list(item.items())[:8]) + "}"
    return repr(item)[:200]


def _wrap_formatter(func: Formatter) -> Formatter:
    takes_external = _accepts(func, "external_prompts")

    def formatter(item: Mapping[str, Any], external_prompts: str | None = None) -> str:
        try:
            if takes_external and external_prompts is not None:
                prompt = func(item, external_prompts=external_prompts)
            else:
                prompt = func(item)
        except KeyError as err:  # a dataset without the column the formatter reads
            keys = sorted(item) if isinstance(item, Mapping) else type(item).__name__
            raise KeyError(
                f"formatter {callable_name(func)} needs the key {err.args[0]!r}, which the dataset item "
                f"{_item_summary(item)} does not have (its keys: {keys})."
            ) from None
        if not isinstance(prompt, str):
            raise TypeError(
                f"Formatter must return a string prompt. formatter {callable_name(func)} returned "
                f"{type(prompt).__name__} for item {_item_summary(item)}."
            )
        return prompt

    formatter.__wrapped__ = func
    return formatter


def format_prompt(formatter: Formatter, item: Mapping[str, Any], external_prompt: str | None, passthrough: bool) -> str:
    """The model input for one agent at one node (docs/algorithms.md#formatters-rewards-and-transitions).

    Turn 1 formats the item. Later turns either use the external prompt verbatim (passthrough) or format a
    shallow copy of the item whose ``prompt`` is the external prompt (original kept in ``_original_prompt``).
    """
    if external_prompt is None:
        return formatter(item)
    if not isinstance(external_prompt, str):
        raise TypeError(f"External prompt must be a string, got {type(external_prompt).__name__}.")
    if passthrough:
        return external_prompt
    shifted = dict(item)
    shifted.setdefault("_original_prompt", item.get("prompt", ""))
    shifted["prompt"] = external_prompt
    return formatter(shifted, external_prompts=external_prompt)


REWARD_SIGNATURE = (
    "reward_func(*agent_completions, prompts=None, batch_items=None, response_history_per_agent=None) -> list[float]"
)


def check_reward_signature(reward_func: Callable[..., Any], num_agents: int) -> None:
    """The reward can be called with one completion list per agent (and the keywords it names); a clear error
    showing the expected signature otherwise. Runs before any model loads."""
    try:
        signature = inspect.signature(reward_func)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    passed = ("prompts", "batch_items", "response_history_per_agent")
    named = {name: [] for name in passed if name in signature.parameters}  # what we pass
    try:
        signature.bind(*([[]] * num_agents), **named)
    except TypeError as err:
        raise TypeError(
            f"reward_func {callable_name(reward_func)}{signature} cannot take the completions of "
            f"{num_agents} agents ({err}); the expected signature is {REWARD_SIGNATURE}, one positional "
            "list per agent."
        ) from None


@dataclass(frozen=True)
class RawRewards:
    """One reward call's output before ``reward_processor``.

    ``values[j]``: the team reward of joint action j (the weighted sum of its components when the reward returns
    them); ``names``: the component names in first-seen order, ``components[j][c]`` the raw value of component c
    (both None for a reward that returns floats)."""

    values: list[float]
    names: list[str] | None = None
    components: list[list[float]] | None = None


class RewardTimeoutError(TimeoutError):
    """``reward_func`` did not return within ``reward_timeout`` seconds."""


class RewardCaller:
    """Calls the team reward on a batch of joint actions and applies ``reward_processor``.

    ``timeout`` (the ``reward_timeout`` field) bounds one call: a reward that hangs ends the run with
    :class:`RewardTimeoutError` naming the field and ``where()`` (the module's step) instead of hanging it.
    ``component_weights`` (the ``reward_component_weights`` field) weighs the named components of a reward that
    returns them (module docstring) in the team reward; a name it does not give weighs 1.0, a name the reward does
    not return is an error.
    """

    def __init__(
        self,
        reward_func: Callable[..., Any],
        reward_processor: Callable[[float], float] | None = None,
        timeout: float | None = None,
        where: Callable[[], str] | None = None,
        component_weights: Mapping[str, float] | None = None,
    ):
        if not callable(reward_func):
            raise ValueError(f"reward_func must be a callable, got {type(reward_func).__name__}.")
        if reward_processor is not None and not callable(reward_processor):
            raise ValueError(f"reward_processor must be a callable, got {type(reward_processor).__name__}.")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"reward_timeout must be > 0 seconds or null (got {timeout!r}).")
        self.reward_func = reward_func
        self.reward_processor = reward_processor
        self.timeout = timeout
        self.where = where
        self.component_weights = check_component_weights(component_weights)
        self._pass_prompts = _accepts(reward_func, "prompts")
        self._pass_items = _accepts(reward_func, "batch_items")
        self._pass_history = _names(reward_func, "response_history_per_agent")

    def _call(self, args: list, kwargs: dict) -> Any:
        stop.check()  # a safe point per reward call (runs/stop.py)
        if self.timeout is None:
            return self.reward_func(*args, **kwargs)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = self.reward_func(*args, **kwargs)
            except BaseException as err:  # re-raised in the caller's thread
                outcome["error"] = err

        worker = threading.Thread(target=run, name="reward_func", daemon=True)  # a hung call cannot keep us alive
        worker.start()
        deadline = time.monotonic() + self.timeout
        while worker.is_alive() and (left := deadline - time.monotonic()) > 0:
            worker.join(min(left, 0.2))
            stop.check()  # a stop leaves the call behind, as a timeout does (the thread is a daemon)
        if worker.is_alive():
            where = f" at {self.where()}" if self.where is not None else ""
            raise RewardTimeoutError(
                f"reward_func {callable_name(self.reward_func)} did not return within reward_timeout = "
                f"{self.timeout:g} s{where} ({len(args[0]) if args else 0} joint actions); raise reward_timeout if "
                "the reward is slow by design, or look for a hang in it."
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def raw(
        self,
        agent_completions: Sequence[Sequence[str]],
        prompts: Sequence[str] | None = None,
        batch_items: Sequence[Mapping[str, Any]] | None = None,
        check_count: bool = True,
        histories: Sequence[Sequence[Sequence[str]]] | None = None,
    ) -> list[float]:
        """Team rewards before ``reward_processor``; one per joint action (``check_count=False`` leaves the count
        to the caller: the actor-critic family also accepts one value, or one per agent). A reward's components are
        summed (weighted); :meth:`raw_rewards` keeps them."""
        return self.raw_rewards(agent_completions, prompts, batch_items, check_count, histories).values

    def raw_rewards(
        self,
        agent_completions: Sequence[Sequence[str]],
        prompts: Sequence[str] | None = None,
        batch_items: Sequence[Mapping[str, Any]] | None = None,
        check_count: bool = True,
        histories: Sequence[Sequence[Sequence[str]]] | None = None,
    ) -> RawRewards:
        """:meth:`raw` with the reward's components, when it returns them (:class:`RawRewards`). ``histories``: per
        joint action, each agent's earlier responses (none given: a first turn)."""
        expected = len(agent_completions[0])
        kwargs: dict[str, Any] = {}
        if self._pass_prompts and prompts is not None:
            kwargs["prompts"] = list(prompts)
        if self._pass_items and batch_items is not None:
            kwargs["batch_items"] = list(batch_items)
        if self._pass_history:
            first = [[] for _ in agent_completions]
            kwargs["response_history_per_agent"] = (
                [[list(h) for h in row] for row in histories] if histories is not None else [first] * expected
            )
        output = self._call([list(c) for c in agent_completions], kwargs)
        names, rows = _component_rows(output, callable_name(self.reward_func))
        if names is None:
            if self.component_weights:
                raise ValueError(
                    f"reward_component_weights is set ({sorted(self.component_weights)}) but reward_func "
                    f"{callable_name(self.reward_func)} returned plain numbers, not named components."
                )
            values = _as_float_list(output)
        else:
            values = self._weighted_sums(names, rows)
        if check_count and len(values) != expected:
            raise ValueError(
                f"reward_func returned {len(values)} values for {expected} joint actions; it must return one team "
                "reward per joint action (per-agent lists of completions are aligned by index)."
            )
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"reward_func returned a non-finite value {values[bad[0]]!r} at joint action {bad[0]}.")
        return RawRewards(values, names, rows)

    def _weighted_sums(self, names: list[str], rows: list[list[float]]) -> list[float]:
        """Each joint action's team reward: sum_c w_c * component_c, added left to right from 0.0 in the names'
        order, so that with unit weights it is exactly ``sum(mapping.values())``."""
        weights = self.component_weights or {}
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ValueError(
                f"reward_component_weights names {unknown}, which reward_func {callable_name(self.reward_func)} "
                f"does not return (its components: {names})."
            )
        w = [weights.get(name, 1.0) for name in names]
        sums = []
        for row in rows:
            total = 0.0
            for weight, value in zip(w, row):
                total += weight * value
            sums.append(total)
        return sums

    def process(self, raw: Sequence[float]) -> list[float]:
        if self.reward_processor is None:
            return list(raw)
        processed = [float(self.reward_processor(v)) for v in raw]
        bad = [i for i, v in enumerate(processed) if not math.isfinite(v)]
        if bad:
            raise ValueError(
                f"reward_processor returned a non-finite value {processed[bad[0]]!r} (raw {raw[bad[0]]!r})."
            )
        return processed

    def __call__(
        self, agent_completions, prompts=None, batch_items=None, check_count: bool = True, histories=None
    ) -> list[float]:
        return self.process(self.raw(agent_completions, prompts, batch_items, check_count, histories))


def check_component_weights(weights: Mapping[str, float] | None) -> dict[str, float] | None:
    """``reward_component_weights`` as ``{name: float}`` (None stays None); a clear error for anything else."""
    if weights is None:
        return None
    if not isinstance(weights, Mapping):
        raise ValueError(
            f"reward_component_weights must be a mapping {{component name: weight}}, got {type(weights).__name__}."
        )
    out = {}
    for name, weight in weights.items():
        if not isinstance(name, str):
            raise ValueError(f"reward_component_weights: component names must be strings (got {name!r}).")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"reward_component_weights[{name!r}] must be a finite number (got {weight!r}).")
        out[name] = float(weight)
    return out


def _component_rows(values: Any, reward: str) -> tuple[list[str] | None, list[list[float]] | None]:
    """A reward's named components: the names (first-seen order) and one row of values per joint action; (None,
    None) when it returned numbers. Every joint action must give the same names (in any order)."""
    if isinstance(values, Mapping):
        values = [values]  # one joint action
    if not isinstance(values, (list, tuple)) or not any(isinstance(v, Mapping) for v in values):
        return None, None
    kinds = [i for i, v in enumerate(values) if not isinstance(v, Mapping)]
    if kinds:
        raise TypeError(
            f"reward_func {reward} returned named components for some joint actions and "
            f"{type(values[kinds[0]]).__name__} {values[kinds[0]]!r} for joint action {kinds[0]}; return one form for "
            "every joint action."
        )
    names = list(values[0])
    if not names:
        raise ValueError(f"reward_func {reward} returned an empty mapping of components at joint action 0.")
    rows = []
    for j, mapping in enumerate(values):
        if set(mapping) != set(names):
            raise ValueError(
                f"reward_func {reward} returned components {list(mapping)} at joint action {j} but {names} at joint "
                "action 0; every joint action of a call must return the same component names."
            )
        row = []
        for name in names:
            v = mapping[name]
            v = v.item() if hasattr(v, "item") and not isinstance(v, (str, bytes)) else v
            if not isinstance(name, str):
                raise TypeError(f"reward_func {reward}: component names must be strings (got {name!r}).")
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(
                    f"reward_func {reward}: component {name!r} of joint action {j} must be a number, got "
                    f"{type(v).__name__} {v!r}."
                )
            if not math.isfinite(v):
                raise ValueError(
                    f"reward_func {reward} returned a non-finite value {v!r} for component {name!r} at joint action "
                    f"{j}."
                )
            row.append(float(v))
        rows.append(row)
    return names, rows


def _as_float_list(values: Any) -> list[float]:
    """A reward's output as floats; strings and booleans are rejected rather than guessed (``"1"``, ``True``)."""
    if hasattr(values, "tolist"):  # torch / numpy
        values = values.tolist()
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"reward_func must return a list of floats (or of {{name: float}} component mappings), got "
            f"{type(values).__name__}."
        )
    values = [v.item() if hasattr(v, "item") and not isinstance(v, (str, bytes)) else v for v in values]
    for i, v in enumerate(values):  # numpy / torch scalars were unwrapped above
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(
                f"reward_func must return a list of numbers; joint action {i} got {type(v).__name__} {v!r}."
            )
    return [float(v) for v in values]


def call_external_transition(
    transition: Callable[..., Any],
    *,
    prompt: str,
    agent_completions: Sequence[str],
    num_agents: int,
    prompt_history_per_agent: Sequence[Sequence[str]],
    response_history_per_agent: Sequence[Sequence[str]],
) -> list[str]:
    """Next-turn prompts for one branch (docs/algorithms.md#formatters-rewards-and-transitions), validated."""
    prompts = transition(
        prompt=prompt,
        agent_completions=list(agent_completions),
        num_agents=num_agents,
        prompt_history_per_agent=[list(h) for h in prompt_history_per_agent],
        response_history_per_agent=[list(h) for h in response_history_per_agent],
    )
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"External transition must return per-agent prompts (a list of {num_agents} strings), "
            f"got {type(prompts).__name__}."
        )
    if len(prompts) != num_agents:
        raise ValueError(f"External transition returned {len(prompts)} values but expected {num_agents}.")
    return list(prompts)


class RewardProcessors:
    """Factories for common ``reward_processor`` callables (CoMLRL names); usable from YAML by import path."""

    @staticmethod
    def identity() -> Callable[[float], float]:
        return lambda x: x

    @staticmethod
    def clamp(min_val: float = -10.0, max_val: float = 10.0) -> Callable[[float], float]:
        return lambda x: min(max(x, min_val), max_val)

    @staticmethod
    def scale(factor: float = 1.0) -> Callable[[float], float]:
        return lambda x: x * factor

    @staticmethod
    def shift(value: float = 0.0) -> Callable[[float], float]:
        return lambda x: x + value

    @staticmethod
    def sigmoid_scale() -> Callable[[float], float]:
        return lambda x: 1.0 / (1.0 + math.exp(-x))

    @staticmethod
    def normalize_by_length(max_len: int = 1000) -> Callable[..., float]:
        """``reward * min(1, text_length / max_len)``; without ``text_length`` (how the trainers call a processor)
        the reward is returned unchanged."""
        if max_len <= 0:
            raise ValueError(f"normalize_by_length: max_len must be > 0 (got {max_len}).")
        return lambda x, text_length=None: x if text_length is None else x * min(1.0, text_length / max_len)

    @staticmethod
    def exponential_scale(factor: float = 1.0) -> Callable[[float], float]:
        # sign-symmetric: exp(f*|x|) - 1 with the sign of x
        return lambda x: math.copysign(math.expm1(factor * abs(x)), x)


class ScaleShift:
    """``reward_processor`` computing ``x * scale + shift`` — a picklable, YAML-friendly class."""

    def __init__(self, scale: float = 1.0, shift: float = 0.0):
        self.scale, self.shift = scale, shift

    def __call__(self, x: float) -> float:
        return x * self.scale + self.shift
