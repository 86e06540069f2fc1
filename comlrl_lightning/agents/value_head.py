"""Value heads for actor-critic agents (IAC, MAAC; docs/algorithms.md#actor-critic).

``ValueHead`` maps a hidden state to a scalar. ``CausalLMWithValueHead`` puts one on top of any Hugging Face
causal LM and serves both roles:

* actor (IAC with ``use_separate_critic=False``): ``forward`` returns the LM logits (respecting
  ``logits_to_keep``, so ``rollout.sampling.token_logprobs`` scores it unchanged) and one value per position;
* critic (IAC separate critics, MAAC's shared critic): ``values_at`` returns the value at one position per row
  (the last prompt token for V(h), the last response token for Q(h, a)) from the decoder's hidden states only,
  skipping the [B, L, vocab] LM-head projection.

The wrapper quacks like the backbone where callers need it (``generate``, ``config``, ``generation_config``,
``can_generate``, embeddings, gradient checkpointing, ``device``/``dtype``), and saves as a normal HF model
directory plus ``value_head.safetensors`` and ``value_head_config.json``, so ``AutoModelForCausalLM`` still loads
the backbone from it and :meth:`CausalLMWithValueHead.from_pretrained` loads both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ActorCriticOutput",
    "CausalLMWithValueHead",
    "ValueHead",
    "VALUE_HEAD_WEIGHTS_NAME",
    "VALUE_HEAD_PT_NAME",
    "VALUE_HEAD_CONFIG_NAME",
]

VALUE_HEAD_WEIGHTS_NAME = "value_head.safetensors"
VALUE_HEAD_PT_NAME = "value_head.pt"  # CoMLRL's file name; read (never written) for migration
VALUE_HEAD_CONFIG_NAME = "value_head_config.json"


class ValueHead(nn.Sequential):
    """Scalar value of a hidden state.

        hidden_dim > 0:        V = Linear(hidden_dim -> 1)(tanh(Linear(H -> hidden_dim)(h)))
        hidden_dim None / 0:   V = Linear(H -> 1)(h)

    Weights ~ N(0, 0.02), biases 0, so a fresh head predicts ~0. A ``Sequential`` (state-dict keys ``0.weight``,
    ``0.bias``[, ``2.weight``, ``2.bias``]), the layout of CoMLRL's head.
    """

    def __init__(self, hidden_size: int, hidden_dim: int | None = None):
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1 (got {hidden_size}).")
        if hidden_dim is not None and hidden_dim < 0:
            raise ValueError(f"value_head_hidden_dim must be > 0 or null (got {hidden_dim}).")
        if hidden_dim:
            layers = [nn.Linear(hidden_size, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, 1)]
        else:
            layers = [nn.Linear(hidden_size, 1)]
        super().__init__(*layers)
        self.hidden_size = hidden_size
        self.hidden_dim = hidden_dim or None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in self:
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, mean=0.0, std=0.02)
                nn.init.zeros_(layer.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [...]."""
        return super().forward(hidden).squeeze(-1)


@dataclass
class ActorCriticOutput:
    """``logits``: the backbone's (``logits_to_keep`` applied); ``values``: [B, L] float32, one per position (None
    without a head or with ``output_values=False``); ``hidden_states``/``past_key_values``/``loss`` as the
    backbone returned them (hidden states only when the caller asked ``output_hidden_states=True``).

    A plain dataclass, not a transformers ``ModelOutput``: the KV-cache field of those was renamed across
    transformers versions (``past_key_values`` -> ``cache``); this one keeps CoMLRL's name.
    """

    loss: Tensor | None = None
    logits: Tensor | None = None
    values: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    past_key_values: Any = None


def cache_of(output: Any) -> Any:
    """The KV cache of a backbone output under either transformers name (``cache`` in v5, ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _hidden_size(config: Any) -> int:
    configs = [config]
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):  # multimodal configs keep the LM's sizes in a sub-config
        configs.append(get_text_config())
    for cfg in configs:
        for name in ("hidden_size", "n_embd"):
            size = getattr(cfg, name, None)
            if isinstance(size, int) and size > 0:
                return size
    raise ValueError(
        f"Could not infer hidden size from the model config ({type(config).__name__} has neither hidden_size nor "
        "n_embd); cannot attach a value head."
    )


class CausalLMWithValueHead(nn.Module):
    """A Hugging Face causal LM (``self.model``) with an optional scalar value head (``self.value_head``).

    Args:
        model: any causal LM (``PreTrainedModel`` with a ``config`` giving ``hidden_size`` or ``n_embd``).
        attach_value_head: False -> no head (``values`` is None); used for MAAC actors / IAC with separate critics.
        value_head_hidden_dim: hidden width of the head (None / 0: one linear layer).

    The head lives on the backbone's device in the backbone's dtype; values are returned in float32.
    """

    def __init__(self, model: nn.Module, attach_value_head: bool = True, value_head_hidden_dim: int | None = None):
        super().__init__()
        if isinstance(model, CausalLMWithValueHead):
            raise TypeError(
                "model is already a CausalLMWithValueHead; use CausalLMWithValueHead.from_pretrained "
                "to re-wrap it, or pass its .model."
            )
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("Could not infer hidden size: the model has no config.")
        self.model = model
        self.value_head: ValueHead | None = None
        if attach_value_head:
            head = ValueHead(_hidden_size(config), value_head_hidden_dim)
            param = next(model.parameters(), None)
            if param is not None:
                head = head.to(device=param.device, dtype=param.dtype)
            self.value_head = head
        self.train(model.training)  # a wrapper of an eval-mode model (as from_pretrained returns it) stays in eval

    # --- what callers of a plain causal LM expect ---------------------------------------------------------

    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return getattr(self.model, "generation_config", None)

    @property
    def name_or_path(self) -> str:
        return getattr(self.model, "name_or_path", getattr(self.config, "_name_or_path", ""))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def has_value_head(self) -> bool:
        return self.value_head is not None

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What training this model updates: the backbone's trainable parameters (an agent of a LoRA team: its own
        adapter's, not the other agents' on the shared base) and the head's."""
        own = getattr(self.model, "trainable_parameters", None)
        body = list(own()) if callable(own) else [p for p in self.model.parameters() if p.requires_grad]
        head = [] if self.value_head is None else [p for p in self.value_head.parameters() if p.requires_grad]
        return body + head

    def can_generate(self) -> bool:
        can = getattr(self.model, "can_generate", None)
        return bool(can()) if callable(can) else callable(getattr(self.model, "generate", None))

    def generate(self, *args: Any, **kwargs: Any):
        """Delegates to the backbone's ``generate`` (the value head plays no part in sampling)."""
        return self.model.generate(*args, **kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.get_output_embeddings()

    def resize_token_embeddings(self, *args: Any, **kwargs: Any):
        return self.model.resize_token_embeddings(*args, **kwargs)

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        self.model.gradient_checkpointing_enable(*args, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing_disable()

    # --- forward passes -----------------------------------------------------------------------------------

    def _values(self, hidden: Tensor) -> Tensor:
        """Head on [..., H] hidden states -> [...] float32 values."""
        if self.value_head is None:
            raise ValueError("Value head is missing for value computation (attach_value_head=False).")
        weight = self.value_head[0].weight
        return self.value_head(hidden.to(device=weight.device, dtype=weight.dtype)).float()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        output_values: bool = True,
        **kwargs: Any,
    ) -> ActorCriticOutput:
        """One backbone pass -> logits (``logits_to_keep`` respected) and per-position values [B, L] (float32).

        Hidden states are requested from the backbone only when values are wanted; they are returned only if the
        caller passed ``output_hidden_states=True``. Other keywords (``use_cache``, ``past_key_values``, ``labels``,
        ``inputs_embeds``...) go to the backbone.
        """
        want_hidden = bool(kwargs.pop("output_hidden_states", False))
        compute_values = output_values and self.value_head is not None
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            kwargs["logits_to_keep"] = logits_to_keep  # only forwarded when used: older LMs lack the argument
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=want_hidden or compute_values,
            return_dict=True,
            **kwargs,
        )
        values = self._values(out.hidden_states[-1]) if compute_values else None  # [B, L]
        return ActorCriticOutput(
            loss=getattr(out, "loss", None),
            logits=out.logits,
            values=values,
            hidden_states=out.hidden_states if want_hidden else None,
            past_key_values=cache_of(out),
        )

    def _decoder(self) -> nn.Module | None:
        """The backbone's transformer body (hidden states without the LM head), or None if it has none."""
        getter = getattr(self.model, "get_decoder", None)
        decoder = None
        if callable(getter):
            try:
                decoder = getter()
            except (AttributeError, NotImplementedError, ValueError):
                decoder = None
        if decoder is None or decoder is self.model:
            decoder = getattr(self.model, "base_model", None)
        if decoder is None or decoder is self.model:
            return None
        return decoder

    def values_at(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Value at one position per row, [B] float32, without the LM head's vocabulary projection.

        Args:
            input_ids, attention_mask, position_ids: [B, L], as for ``forward``.
            positions: [B] long index into L per row (negative counts from the end); None -> the last position.
                V(h): the last prompt token; Q(h, a): the last response token.
        """
        decoder = self._decoder()
        if decoder is not None:
            out = decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                return_dict=True,
            )
            hidden = out.last_hidden_state  # [B, L, H]
        else:  # no separable body: full pass, projecting only one position to the vocabulary
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                output_hidden_states=True,
                return_dict=True,
                logits_to_keep=1,
            )
            hidden = out.hidden_states[-1]  # [B, L, H]
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        if positions is None:
            positions = torch.full_like(rows, hidden.shape[1] - 1)
        picked = hidden[rows, positions.to(hidden.device).long()]  # [B, H]
        return self._values(picked)  # [B]

    # --- persistence --------------------------------------------------------------------------------------

    def save_pretrained(
        self, save_directory: str | os.PathLike, state_dict: dict[str, Tensor] | None = None, **kwargs: Any
    ) -> None:
        """Backbone via its ``save_pretrained`` (so ``AutoModelForCausalLM`` loads the directory), plus the head as
        ``value_head.safetensors`` and ``value_head_config.json`` (hidden_size, hidden_dim). ``state_dict``: this
        wrapper's weights to write instead of its own (a sharded model's, gathered whole)."""
        from safetensors.torch import save_file

        directory = Path(save_directory)
        parts = {"model.": None, "value_head.": None}
        if state_dict is not None:
            parts = {
                prefix: {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
                for prefix in parts
            }
            kwargs["state_dict"] = parts["model."]
        self.model.save_pretrained(str(directory), **kwargs)
        if self.value_head is None or not kwargs.get("is_main_process", True):
            return
        head = parts["value_head."] if parts["value_head."] is not None else self.value_head.state_dict()
        state = {k: v.detach().to("cpu").contiguous() for k, v in head.items()}
        save_file(state, str(directory / VALUE_HEAD_WEIGHTS_NAME))
        head_config = {"hidden_size": self.value_head.hidden_size, "hidden_dim": self.value_head.hidden_dim}
        (directory / VALUE_HEAD_CONFIG_NAME).write_text(json.dumps(head_config, indent=2) + "\n")

    @classmethod
    def from_pretrained(
        cls,
        pretrained: str | os.PathLike | nn.Module,
        attach_value_head: bool = True,
        value_head_hidden_dim: int | None = None,
        **model_kwargs: Any,
    ) -> "CausalLMWithValueHead":
        """Wrap a directory / hub id (loaded with ``AutoModelForCausalLM.from_pretrained(pretrained,
        **model_kwargs)``) or a model object.

        With ``attach_value_head``: a directory holding a saved head restores it (its saved ``hidden_dim`` wins;
        an explicit, different ``value_head_hidden_dim`` is an error); otherwise a fresh head is initialised.
        A ``CausalLMWithValueHead`` passed in is re-wrapped around the same backbone, keeping its head.
        """
        head_dir: Path | None = None
        if isinstance(pretrained, CausalLMWithValueHead):
            backbone, old_head = pretrained.model, pretrained.value_head
        elif isinstance(pretrained, nn.Module):
            backbone, old_head = pretrained, None
        else:
            from transformers import AutoModelForCausalLM

            backbone, old_head = AutoModelForCausalLM.from_pretrained(pretrained, **model_kwargs), None
            if Path(pretrained).is_dir():
                head_dir = Path(pretrained)

        if not attach_value_head:
            return cls(backbone, attach_value_head=False)
        if old_head is not None:
            wrapper = cls(backbone, attach_value_head=False)
            wrapper.value_head = old_head
            return wrapper
        if head_dir is None:
            return cls(backbone, value_head_hidden_dim=value_head_hidden_dim)

        state, saved_dim = _read_value_head(head_dir)
        if state is None:
            return cls(backbone, value_head_hidden_dim=value_head_hidden_dim)
        if saved_dim is None:  # CoMLRL's value_head.pt carries no config: infer the layout from the weights
            saved_dim = state["0.weight"].shape[0] if "2.weight" in state else None
        if value_head_hidden_dim and value_head_hidden_dim != saved_dim:
            raise ValueError(
                f"value_head_hidden_dim={value_head_hidden_dim} does not match the saved value head in {head_dir} "
                f"(hidden_dim={saved_dim})."
            )
        wrapper = cls(backbone, value_head_hidden_dim=saved_dim)
        wrapper.value_head.load_state_dict(state)
        return wrapper


def _read_value_head(directory: Path) -> tuple[dict[str, Tensor] | None, int | None]:
    """(state dict, hidden_dim) of a saved head, or (None, None). Keys prefixed ``value_head.`` are accepted."""
    config_path = directory / VALUE_HEAD_CONFIG_NAME
    hidden_dim = json.loads(config_path.read_text()).get("hidden_dim") if config_path.is_file() else None
    if (directory / VALUE_HEAD_WEIGHTS_NAME).is_file():
        from safetensors.torch import load_file

        state = load_file(str(directory / VALUE_HEAD_WEIGHTS_NAME))
    elif (directory / VALUE_HEAD_PT_NAME).is_file():
        state = torch.load(directory / VALUE_HEAD_PT_NAME, map_location="cpu", weights_only=True)
    else:
        return None, None
    state = {k.removeprefix("value_head."): v for k, v in state.items()}
    return state, hidden_dim
