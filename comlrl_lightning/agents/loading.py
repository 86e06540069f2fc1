"""Loading the agent team: models, tokenizers, special tokens, export.

``agents`` (the config field) names the team, as in CoMLRL (docs/algorithms.md#agents-and-devices):

- a **string** — a factory name from :data:`~comlrl_lightning.agents.factories.MODEL_FACTORIES`
  (``"tiny"``, ``"tiny-5m"``, ``"smollm2-135m-instruct"``), a local directory written by
  ``save_pretrained``, a local ``.gguf`` file, or a Hugging Face hub id — gives a *homogeneous* team of
  ``num_agents`` (default 2) **independent** agents: the model is loaded once and the other agents are
  ``copy.deepcopy`` of it, so they start from the same weights but own separate parameters (CoMLRL loads
  each copy with ``from_pretrained``; the result is the same, the deep copy is faster);
- a **list** of strings and/or model objects — a *heterogeneous* team, one entry per agent
  (``num_agents`` defaults to the list length). A string repeated in the list still yields independent
  copies; the **same model object** repeated in the list is kept as that object, so those agents
  **share weights** (parameter sharing, docs/algorithms.md#agents-and-devices).

Every configuration error is raised by :func:`validate_agent_sources` (which the LightningModule calls
in ``__init__``) *before* any model is loaded.

Differences from CoMLRL, on purpose: ``special_tokens`` that grow a tokenizer also resize the agents'
token embeddings (CoMLRL left them too small, an index error on first use; docs/differences.md); tokenizers get
``padding_side="left"`` (batched generation); a hub id that cannot be fetched offline fails at once with
a message naming it instead of a bare hub error.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import torch

from .factories import FACTORY_MAX_POSITIONS, MODEL_FACTORIES, TOKENIZER_FACTORIES
from .lora import adapter_base, is_adapter_dir

__all__ = [
    "AgentSource",
    "validate_agent_sources",
    "check_model_sources",
    "load_agents",
    "load_tokenizer",
    "ensure_pad_token",
    "apply_tokenizer_specials",
    "add_special_tokens",
    "infer_model_name",
    "save_agents",
    "is_model_object",
    "is_tokenizer_object",
]

AgentSource = Union[str, os.PathLike, torch.nn.Module]

DEFAULT_NUM_AGENTS = 2

_SPECIAL_TOKEN_KEYS = frozenset(
    {
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "extra_special_tokens",
    }
)


# ----------------------------------------------------------------------------------------------------
# Type tests
# ----------------------------------------------------------------------------------------------------


def is_model_object(obj: Any) -> bool:
    """A loaded model usable as an agent: a ``PreTrainedModel`` or any ``nn.Module`` with ``generate``
    (e.g. a value-head wrapper around a causal LM)."""
    from transformers import PreTrainedModel

    return isinstance(obj, PreTrainedModel) or (
        isinstance(obj, torch.nn.Module) and callable(getattr(obj, "generate", None))
    )


def is_tokenizer_object(obj: Any) -> bool:
    from transformers import PreTrainedTokenizerBase

    return isinstance(obj, PreTrainedTokenizerBase) or (
        not isinstance(obj, (str, bytes, os.PathLike, Sequence))
        and callable(getattr(obj, "decode", None))
        and callable(obj)
    )


def _factory_names() -> str:
    return ", ".join(repr(name) for name in MODEL_FACTORIES)


def _looks_like_path(text: str) -> bool:
    """Strings that can only mean a filesystem path (a hub id is ``name`` or ``org/name``)."""
    return (
        text.startswith(("/", "./", "../", "~", ".\\"))
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
        or text.endswith(".gguf")
    )


def _normalize_source(entry: Any, index: int | None, field: str = "agents") -> Any:
    where = field if index is None else f"{field}[{index}]"
    if entry is None:
        raise ValueError(f"{field} entries must be non-null ({where} is None).")
    if isinstance(entry, os.PathLike):
        entry = os.fspath(entry)
    if isinstance(entry, str):
        text = entry.strip()
        if not text:
            raise ValueError(f"{field} entries must be non-empty strings ({where} is {entry!r}).")
        if text in MODEL_FACTORIES:
            return text
        if _looks_like_path(text) and not os.path.exists(os.path.expanduser(text)):
            raise FileNotFoundError(
                f"{where} = {entry!r} looks like a local path but does not exist. Pass an existing "
                f"directory (written by save_pretrained), a hub id, or a factory name ({_factory_names()})."
            )
        _refuse_team_folder(text, where, field)
        _refuse_folder_without_model(text, where)
        return text
    if is_model_object(entry):
        return entry
    raise TypeError(
        f"{where} must be a model name/path string or a loaded model object (PreTrainedModel); "
        f"got {type(entry).__name__}."
    )


def _refuse_team_folder(text: str, where: str, field: str) -> None:
    """A folder ``MultiAgentModule.save_pretrained`` wrote for the whole team (``agent_0/``, ``agent_1/``, ...) given
    where one agent's folder belongs: say which folders to give instead (from_pretrained would fail on it)."""
    folder = os.path.expanduser(text)
    if not os.path.isdir(folder) or any(
        os.path.isfile(os.path.join(folder, f)) for f in ("config.json", "adapter_config.json")
    ):
        return
    members = sorted(
        (
            d
            for d in os.listdir(folder)
            if d.startswith("agent_") and d[6:].isdigit() and os.path.isdir(os.path.join(folder, d))
        ),
        key=lambda d: int(d[6:]),
    )
    if members:
        folders = ", ".join(os.path.join(text, d) for d in members)
        raise ValueError(
            f"{where} = {text!r} is a team folder written by save_pretrained (it holds "
            f"{', '.join(d + '/' for d in members)}): give one folder per agent, {field}: [{folders}]."
        )


def _refuse_folder_without_model(text: str, where: str) -> None:
    """A folder given as a model that holds none (no ``config.json``, no LoRA ``adapter_config.json``): an empty
    folder, a run folder, a typo'd parent. ``from_pretrained`` would fail on it after the other models loaded."""
    folder = os.path.expanduser(text)
    if not os.path.isdir(folder) or any(
        os.path.isfile(os.path.join(folder, f)) for f in ("config.json", "adapter_config.json")
    ):
        return
    what = "an empty folder" if not os.listdir(folder) else "a folder without a model (no config.json in it)"
    raise ValueError(
        f"{where} = {text!r} is {what}: give a folder written by save_pretrained, a hub id, or a factory name "
        f"({_factory_names()})."
    )


# ----------------------------------------------------------------------------------------------------
# Validation (no loading)
# ----------------------------------------------------------------------------------------------------


def check_model_sources(sources: Any, field: str) -> None:
    """Check the model sources of a config field other than ``agents`` (``critics``, ``critic_model``,
    ``reward_model_name``, ``comparator_agents`` ...) without loading anything; errors name ``field``."""
    if isinstance(sources, (list, tuple)):
        for i, entry in enumerate(sources):
            _normalize_source(entry, i, field)
    elif sources is not None:
        _normalize_source(sources, None, field)


def _normalize_tokenizer_specs(
    tokenizers: Any, sources: list[Any], field: str = "agents", tokenizer_field: str = "tokenizers"
) -> list[Any]:
    """One tokenizer spec per agent: a tokenizer object, a string (id/path/factory name) or None."""
    n = len(sources)
    if tokenizers is None:
        specs: list[Any] = [None] * n
    elif isinstance(tokenizers, (str, os.PathLike)):
        text = os.fspath(tokenizers).strip()
        if not text:
            raise ValueError(f"{tokenizer_field} must be a tokenizer, a name/path string, or a list of them; got ''.")
        specs = [text] * n
    elif is_tokenizer_object(tokenizers):
        specs = [tokenizers] * n
    elif isinstance(tokenizers, Sequence) and not isinstance(tokenizers, (bytes, bytearray)):
        if len(tokenizers) != n:
            raise ValueError(
                f"{tokenizer_field} length must match {field}. Got {len(tokenizers)} tokenizers for {n} models."
            )
        specs = []
        for i, tok in enumerate(tokenizers):
            if isinstance(tok, os.PathLike):
                tok = os.fspath(tok)
            if tok is None or isinstance(tok, str) or is_tokenizer_object(tok):
                specs.append(tok)
            else:
                raise TypeError(
                    f"{tokenizer_field}[{i}] must be a tokenizer, a name/path string or None; got {type(tok).__name__}."
                )
    else:
        raise TypeError(
            f"{tokenizer_field} must be a tokenizer, a name/path string, or a list of them (one per model); "
            f"got {type(tokenizers).__name__}."
        )
    missing = [i for i, (src, tok) in enumerate(zip(sources, specs)) if tok is None and not isinstance(src, str)]
    if missing:
        raise ValueError(
            f"Tokenizer(s) must be provided when {field} are model objects. No tokenizer for {field} {missing}: "
            f"pass `{tokenizer_field}` (one shared or one per model)."
        )
    return specs


def validate_agent_sources(
    agents: Any,
    num_agents: int | None = None,
    tokenizers: Any = None,
    *,
    dtype: Any = None,
    model_kwargs: Mapping[str, Any] | None = None,
    special_tokens: Any = None,
    field: str = "agents",
    tokenizer_field: str = "tokenizers",
) -> list[Any]:
    """Check the ``agents`` / ``num_agents`` / ``tokenizers`` fields without loading anything.

    Returns the normalized per-agent sources (length = team size): factory names, paths and hub ids as
    stripped strings, model objects as given (identity kept, so a repeated object means shared weights).
    Raises ``ValueError``/``TypeError``/``FileNotFoundError`` with a message naming the field (``field`` and
    ``tokenizer_field``: the config fields being checked, e.g. ``critics`` and ``tokenizers``).
    The optional keywords check ``dtype``, ``model_kwargs`` (against a factory's signature) and
    ``special_tokens`` the same way :func:`load_agents` will use them.
    """
    if num_agents is not None and (isinstance(num_agents, bool) or not isinstance(num_agents, int) or num_agents < 1):
        raise ValueError(f"num_agents must be >= 1 (an integer); got {num_agents!r}.")
    if agents is None or (isinstance(agents, (str, Sequence)) and len(agents) == 0):
        raise ValueError(
            f"{field} must be provided: set `{field}` to a model name "
            f"(a factory: {_factory_names()}; a hub id; a local path) or to a list of names / model objects."
        )
    if isinstance(agents, (str, os.PathLike)):
        source = _normalize_source(agents, None, field)
        sources = [source] * (DEFAULT_NUM_AGENTS if num_agents is None else num_agents)
    elif is_model_object(agents):
        n = 1 if num_agents is None else num_agents
        if n != 1:
            raise ValueError(
                f"{field} is a single model object but num_agents = {n}: pass a list of models "
                "(repeat the same object to share weights) or a model name string to get independent copies."
            )
        sources = [agents]
    elif isinstance(agents, Sequence) and not isinstance(agents, (bytes, bytearray)):
        entries = list(agents)
        if num_agents is not None and len(entries) != num_agents:
            raise ValueError(f"{field} length ({len(entries)}) must match num_agents ({num_agents}).")
        sources = [_normalize_source(entry, i, field) for i, entry in enumerate(entries)]
    else:
        raise TypeError(
            f"{field} must be a model name/path string, a loaded model, or a list of them; got {type(agents).__name__}."
        )
    _normalize_tokenizer_specs(tokenizers, sources, field, tokenizer_field)
    kwargs = _merge_model_kwargs(dtype, None, model_kwargs)
    for src in {s for s in sources if isinstance(s, str) and s in MODEL_FACTORIES}:
        _check_factory_kwargs(src, kwargs)
    _normalize_special_tokens(special_tokens)
    return sources


# Config attributes holding a model's context length, by architecture (GPT-2: n_positions, ...).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def config_without_weights(source: Any) -> Any:
    """The (text) config of the model ``source`` loads as, without its weights: a loaded model's own, a folder's or a
    cached hub id's ``config.json`` (``AutoConfig``), a LoRA folder's base's; None when it cannot be told here (a
    factory name, a hub id this machine cannot reach, a ``.gguf`` file)."""
    config: Any = None
    if is_model_object(source):
        config = getattr(_unwrap(source), "config", None)
    elif isinstance(source, (str, os.PathLike)) and str(source) not in MODEL_FACTORIES:
        source = str(source)
        if source.endswith(".gguf"):
            return None
        if is_adapter_dir(source):  # a LoRA agent's folder: its base's config
            return config_without_weights(adapter_base(source))
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(os.path.expanduser(source))
        except (OSError, ValueError, KeyError):  # not here, or not a config transformers reads: loading reports it
            return None
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def max_positions(source: Any, model_kwargs: Mapping[str, Any] | None = None) -> tuple[str, int] | None:
    """``(config key, positions)``: how many positions (prompt and completion together) the model ``source`` attends
    over, read from its config without loading weights (``AutoConfig``; a factory's known size; a loaded model's
    config); None when it cannot be told (a hub id this machine cannot reach, a ``.gguf`` file)."""
    if isinstance(source, str) and source in MODEL_FACTORIES:
        size = (model_kwargs or {}).get("max_position_embeddings", FACTORY_MAX_POSITIONS.get(source))
        return ("max_position_embeddings", int(size)) if isinstance(size, int) else None
    config = config_without_weights(source)
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def context_problem(
    sources: Sequence[Any], max_new_tokens: Any, model_kwargs: Mapping[str, Any] | None = None
) -> str | None:
    """``max_new_tokens`` that no agent's context can hold (it must leave a position for the prompt), in one line
    naming the field, the value and the model's limit; None when it fits or the limit is unknown."""
    if not isinstance(max_new_tokens, int):
        return None
    checked: set[Any] = set()
    for i, source in enumerate(sources):
        key = id(source) if not isinstance(source, str) else source
        if key in checked:
            continue
        checked.add(key)
        limit = max_positions(source, model_kwargs)
        if limit is not None and max_new_tokens >= limit[1]:
            name = repr(source) if isinstance(source, str) else f"agents[{i}]"
            return (
                f"max_new_tokens = {max_new_tokens} does not fit the context of the model {name} ({limit[0]} = "
                f"{limit[1]}, prompt and completion together): give max_new_tokens below {limit[1]}."
            )
    return None


def _normalize_dtype(dtype: Any) -> Any:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower()
        if name == "auto":
            return "auto"
        name = name.removeprefix("torch.")
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    raise ValueError(f"dtype must be a torch.dtype or one of 'float32', 'bfloat16', 'float16', 'auto'; got {dtype!r}.")


def _normalize_special_tokens(special_tokens: Any) -> dict[str, Any] | None:
    if special_tokens is None:
        return None
    if isinstance(special_tokens, str):
        special_tokens = [special_tokens]
    if isinstance(special_tokens, Mapping):
        out = dict(special_tokens)
        bad = sorted(set(out) - _SPECIAL_TOKEN_KEYS)
        if bad:
            raise ValueError(f"special_tokens has unknown keys {bad}; allowed: {sorted(_SPECIAL_TOKEN_KEYS)}.")
        for key, value in out.items():
            if key in ("additional_special_tokens", "extra_special_tokens"):
                if isinstance(value, str):
                    out[key] = [value]
                elif not (isinstance(value, Sequence) and all(isinstance(v, str) for v in value)):
                    raise ValueError(f"special_tokens[{key!r}] must be a list of strings; got {value!r}.")
                else:
                    out[key] = list(value)
            elif not isinstance(value, str):
                raise ValueError(f"special_tokens[{key!r}] must be a string; got {value!r}.")
        return out or None
    if isinstance(special_tokens, Sequence) and all(isinstance(v, str) for v in special_tokens):
        return {"additional_special_tokens": list(special_tokens)} if special_tokens else None
    raise ValueError(
        "special_tokens must be a dict like {'pad_token': '<pad>', 'additional_special_tokens': [...]} "
        f"or a list of token strings; got {type(special_tokens).__name__}."
    )


def _merge_model_kwargs(dtype: Any, attn_implementation: str | None, model_kwargs: Mapping | None) -> dict:
    kwargs = dict(model_kwargs or {})
    if "torch_dtype" in kwargs:  # transformers v5 spelling is `dtype`
        legacy = kwargs.pop("torch_dtype")
        if "dtype" in kwargs and _normalize_dtype(kwargs["dtype"]) != _normalize_dtype(legacy):
            raise ValueError("model_kwargs sets both torch_dtype and dtype to different values.")
        kwargs.setdefault("dtype", legacy)
    if "dtype" in kwargs:
        inner = _normalize_dtype(kwargs["dtype"])
        if dtype is not None and _normalize_dtype(dtype) != inner:
            raise ValueError(f"dtype ({dtype!r}) and model_kwargs['dtype'] ({kwargs['dtype']!r}) disagree.")
        kwargs["dtype"] = inner
    elif dtype is not None:
        kwargs["dtype"] = _normalize_dtype(dtype)
    # attn_implementation inside model_kwargs wins over the top-level default (docs/algorithms.md#agents-and-devices).
    if attn_implementation is not None:
        kwargs.setdefault("attn_implementation", attn_implementation)
    return kwargs


def _check_factory_kwargs(name: str, kwargs: dict) -> None:
    factory = MODEL_FACTORIES[name]
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as err:
        params = [p for p in inspect.signature(factory).parameters if p != "kwargs"]
        raise TypeError(
            f"model_kwargs not accepted by the {name!r} factory ({err}); it accepts: {', '.join(params)}."
        ) from None


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------


def _is_offline() -> bool:
    truthy = {"1", "on", "yes", "true"}
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in truthy:
        return True
    if os.environ.get("TRANSFORMERS_OFFLINE", "").strip().lower() in truthy:
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - hub missing or changed
        return False


class ModelLoadError(OSError):
    """A model source named by a field cannot be loaded (raised when the models load, in ``configure_model``)."""


def _hub_error(source: str, what: str, err: BaseException) -> OSError:
    names = _factory_names()
    if _is_offline():
        message = (
            f"Could not load the {what} {source!r}: it is neither a factory name ({names}) nor an existing "
            "local path, and this machine is offline (HF_HUB_OFFLINE=1), so it cannot be fetched from the "
            "Hugging Face hub (it is not in the local hub cache either). Pass a local path (a directory "
            f"written by save_pretrained) or one of the factory names: {names}."
        )
    else:
        message = (
            f"Could not load the {what} {source!r} from the Hugging Face hub or a local path: {err} "
            f"Check the id, or pass a local path or one of the factory names: {names}."
        )
    role = "critic" if what.startswith("critic") else "actor" if what.startswith("agents") else None
    if role is not None:  # CoMLRL's sentence first (a user migrating from it searches for it)
        message = f"Failed to load {role} model from identifier {source!r}. {message}"
    return ModelLoadError(message)


def _is_hub_failure(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return True
    try:
        from huggingface_hub.errors import HFValidationError

        return isinstance(err, HFValidationError)
    except Exception:  # pragma: no cover
        return False


def _from_pretrained(loader: Any, source: str, what: str, **kwargs: Any) -> Any:
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return loader.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    if path.exists():
        return loader.from_pretrained(str(path), **kwargs)
    try:
        return loader.from_pretrained(source, **kwargs)
    except Exception as err:
        if _is_hub_failure(err):
            raise _hub_error(source, what, err) from err
        raise


def load_tokenizer(source: str, **factory_kwargs: Any):
    """A tokenizer by factory name (``TOKENIZER_FACTORIES``), local path (dir or ``.gguf``) or hub id."""
    if source in TOKENIZER_FACTORIES:
        return TOKENIZER_FACTORIES[source](**factory_kwargs)
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, source, "tokenizer")


def _load_model(source: str, kwargs: dict, field: str = "agents") -> tuple[Any, Any]:
    """(model, tokenizer-or-None) for one string source. A LoRA adapter folder (one agent of a saved LoRA team) loads
    as its base with the adapter merged in: a plain model (a comparator's or a reward model's copy of that agent)."""
    if source in MODEL_FACTORIES:
        return MODEL_FACTORIES[source](**kwargs)
    if is_adapter_dir(source):
        from peft import PeftModel

        base, tokenizer = _load_model(adapter_base(source), kwargs, field)
        return PeftModel.from_pretrained(base, os.path.expanduser(source)).merge_and_unload(), tokenizer
    from transformers import AutoModelForCausalLM

    return _from_pretrained(AutoModelForCausalLM, source, f"{field} model", **kwargs), None


def ensure_pad_token(tokenizer):
    """Give ``tokenizer`` a pad token (its eos token when missing); raise if it still has no pad id."""
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise ValueError(
            "Tokenizer must expose pad_token_id. It has neither a pad token nor an eos token; set one "
            "(e.g. special_tokens={'pad_token': '<pad>'})."
        )
    return tokenizer


def _replace_flag_name(tokenizer) -> str | None:
    params = inspect.signature(tokenizer.add_special_tokens).parameters
    for name in ("replace_extra_special_tokens", "replace_additional_special_tokens"):
        if name in params:
            return name
    return None


def add_special_tokens(tokenizer, special_tokens: Any) -> int:
    """Add ``special_tokens`` (dict or list of strings) to ``tokenizer`` keeping its existing extra
    special tokens; returns how many tokens were new to the vocabulary."""
    spec = _normalize_special_tokens(special_tokens)
    if not spec:
        return 0
    flag = _replace_flag_name(tokenizer)
    kwargs = {flag: False} if flag else {}
    return int(tokenizer.add_special_tokens(spec, **kwargs))


def _unwrap(model: Any) -> Any:
    """The causal LM inside a wrapper (value-head models keep it as ``.model`` or ``.pretrained_model``)."""
    if hasattr(model, "get_input_embeddings") and hasattr(model, "config"):
        return model
    for attr in ("pretrained_model", "model", "base_model"):
        inner = getattr(model, attr, None)
        if inner is not None and hasattr(inner, "config"):
            return inner
    return model


def _resize_embeddings(model: Any, vocab_len: int) -> bool:
    lm = _unwrap(model)
    get_emb = getattr(lm, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    if emb is None or emb.num_embeddings >= vocab_len:
        return False
    lm.resize_token_embeddings(vocab_len)
    return True


def apply_tokenizer_specials(tokenizer, model) -> None:
    """Write the tokenizer's ``pad_token_id`` and ``eos_token_id`` (eos falls back to pad) into the
    config and generation config of ``model`` (or each model of a sequence; wrappers: the inner LM).

    A generation config whose ``eos_token_id`` is a list of stop ids (instruct models) keeps the list,
    with the tokenizer's eos added if absent.
    """
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad_id
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    for m in models:
        lm = _unwrap(m)
        config = getattr(lm, "config", None)
        if config is not None:
            config.pad_token_id = pad_id
            config.eos_token_id = eos_id
        gen = getattr(lm, "generation_config", None)
        if gen is not None:
            gen.pad_token_id = pad_id
            if isinstance(gen.eos_token_id, (list, tuple)):
                stops = list(gen.eos_token_id)
                gen.eos_token_id = stops if eos_id in stops else [eos_id, *stops]
            else:
                gen.eos_token_id = eos_id


def load_agents(
    agents: Any,
    num_agents: int | None = None,
    tokenizers: Any = None,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = "sdpa",
    model_kwargs: Mapping[str, Any] | None = None,
    special_tokens: Mapping[str, Any] | Sequence[str] | None = None,
    field: str = "agents",
    tokenizer_field: str = "tokenizers",
) -> tuple[list[Any], list[Any]]:
    """Load the team: ``(models, tokenizers)``, one entry per agent (see the module docstring).

    Args:
        agents: factory name / local path / hub id string (homogeneous team of independent copies), or a
            list of such strings and model objects (heterogeneous; a repeated object shares weights).
        num_agents: team size; default 2 for a string, ``len(agents)`` for a list (must then match).
        tokenizers: one tokenizer (shared by all agents), a list with one per agent (entries may be
            None: load from that agent's source), a name/path string, or None (each agent's own).
            Required for model objects.
        dtype: ``torch.dtype`` or name (``"bfloat16"``, ``"auto"``) for models loaded from names.
        attn_implementation: passed to ``from_pretrained`` / the factories (``model_kwargs`` wins).
        model_kwargs: extra keyword arguments for ``from_pretrained`` or the factory (e.g. for ``"tiny"``:
            ``hidden_size``, ``num_layers``, ``seed``); ``torch_dtype`` is read as ``dtype``.
        special_tokens: dict for ``tokenizer.add_special_tokens`` or a list of extra special tokens;
            embeddings of agents whose tokenizer outgrows them are resized.
        field / tokenizer_field: the config fields named in error messages (``critics``, ``reward_model_name``,
            ``comparator_agents``, ...).

    Model objects are used as given (no dtype cast, no device move). Tokenizers get a pad token
    (eos when missing) and ``padding_side="left"``; every model's config and generation config get the
    tokenizer's pad/eos ids.
    """
    sources = validate_agent_sources(
        agents,
        num_agents,
        tokenizers,
        dtype=dtype,
        model_kwargs=model_kwargs,
        special_tokens=special_tokens,
        field=field,
        tokenizer_field=tokenizer_field,
    )
    tok_specs = _normalize_tokenizer_specs(tokenizers, sources, field, tokenizer_field)
    kwargs = _merge_model_kwargs(dtype, attn_implementation, model_kwargs)
    specials = _normalize_special_tokens(special_tokens)

    # Explicit tokenizers by name: loaded once per distinct string.
    named_tokenizers: dict[str, Any] = {}
    for spec in tok_specs:
        if isinstance(spec, str) and spec not in named_tokenizers:
            named_tokenizers[spec] = load_tokenizer(spec)

    # Models: each distinct string once; later occurrences are deep copies (independent parameters).
    loaded: dict[str, tuple[Any, Any]] = {}
    models: list[Any] = []
    own_tokenizers: list[Any] = []
    for src in sources:
        if not isinstance(src, str):
            models.append(src)
            own_tokenizers.append(None)
        elif src in loaded:
            models.append(copy.deepcopy(loaded[src][0]))
            own_tokenizers.append(loaded[src][1])
        else:
            model, tok = _load_model(src, kwargs, field)
            loaded[src] = (model, tok)
            models.append(model)
            own_tokenizers.append(tok)

    toks: list[Any] = []
    source_tokenizers: dict[str, Any] = {}
    for src, spec, own in zip(sources, tok_specs, own_tokenizers):
        if spec is None:
            if own is None:  # hub id / path: the tokenizer saved with the model
                if src not in source_tokenizers:
                    source_tokenizers[src] = load_tokenizer(src)
                own = source_tokenizers[src]
            toks.append(own)
        elif isinstance(spec, str):
            toks.append(named_tokenizers[spec])
        else:
            toks.append(spec)

    seen: set[int] = set()
    for tok in toks:
        if id(tok) in seen:
            continue
        seen.add(id(tok))
        if specials:
            add_special_tokens(tok, specials)
        ensure_pad_token(tok)
        tok.padding_side = "left"

    # Resize (only when the vocabulary outgrew the embeddings) and write pad/eos ids, once per model.
    done: set[int] = set()
    for model, tok in zip(models, toks):
        if id(model) in done:
            continue
        done.add(id(model))
        vocab_len = max(len(t) for m, t in zip(models, toks) if m is model)
        _resize_embeddings(model, vocab_len)
        apply_tokenizer_specials(tok, model)
    return models, toks


# ----------------------------------------------------------------------------------------------------
# Names and export
# ----------------------------------------------------------------------------------------------------


def infer_model_name(obj: Any) -> str:
    """A readable name: strings as-is; models: ``config._name_or_path`` or ``config.model_type``
    (wrappers: the inner LM's config); otherwise the class name."""
    if isinstance(obj, (str, os.PathLike)):
        return os.fspath(obj)
    for target in (obj, _unwrap(obj)):
        config = getattr(target, "config", None)
        if config is None:
            continue
        name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
        if name:
            return str(name)
        model_type = getattr(config, "model_type", None)
        if model_type:
            return str(model_type)
    return type(obj).__name__


def save_agents(
    models: Sequence[Any], tokenizers: Any, output_dir: str | os.PathLike, state_dicts: Sequence[Any] | None = None
) -> list[Path]:
    """Write each agent to ``output_dir/agent_{i}/`` (``save_pretrained`` of model and tokenizer); ``state_dicts``
    (one per agent, None: the model's own) gives the weights to write — a sharded agent's gathered whole.

    ``tokenizers`` is one tokenizer (shared) or one per agent. Agents that share weights are still
    written once per agent directory, so every directory loads on its own with ``from_pretrained``.
    Returns the directories.
    """
    models = list(models)
    if not models:
        raise ValueError("save_agents needs at least one model.")
    if is_tokenizer_object(tokenizers):
        toks = [tokenizers] * len(models)
    else:
        toks = list(tokenizers)
        if len(toks) != len(models):
            raise ValueError(
                f"tokenizers length must match agents. Got {len(toks)} tokenizers for {len(models)} agents."
            )
    root = Path(output_dir)
    paths = []
    for i, (model, tok) in enumerate(zip(models, toks)):
        target = root / f"agent_{i}"
        target.mkdir(parents=True, exist_ok=True)
        saver = getattr(model, "save_pretrained", None) or getattr(_unwrap(model), "save_pretrained", None)
        if not callable(saver):
            raise TypeError(f"agent {i} ({type(model).__name__}) has no save_pretrained method.")
        state = state_dicts[i] if state_dicts is not None else None
        saver(str(target)) if state is None else saver(str(target), state_dict=state)
        if tok is not None:
            tok.save_pretrained(str(target))
        paths.append(target)
    return paths
