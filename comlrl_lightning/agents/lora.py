"""A LoRA team: ONE frozen base model in memory with one ``peft`` LoRA adapter per agent.

A team of N full copies holds N sets of weights, N gradients and N AdamW states. A LoRA team holds the base once;
each agent is an adapter (``agent_0``, ``agent_1``, ...) of a few million parameters at most, and only adapters
are trained. Agent i is an :class:`AdapterView`: a module whose ``forward`` and ``generate`` switch the shared
model to adapter ``agent_i`` first, so sampling, scoring and training treat it as any other agent model. The
reference policy of the KL penalty is the base itself with the adapters switched off (:meth:`LoRATeam.reference`),
not another copy.

``save_pretrained(dir)`` writes ``dir/agent_i/`` per agent (``adapter_config.json``, ``adapter_model.safetensors``);
given back as ``agents``, such folders load as a LoRA team on a freshly loaded base (``algorithms/team.py:
lora_plan``; docs/scaling.md#lora-teams).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

ADAPTER_CONFIG = "adapter_config.json"


def adapter_name(i: int) -> str:
    return f"agent_{i}"


def is_adapter_dir(source: Any) -> bool:
    """A folder written by ``LoRATeam.save_pretrained`` for one agent (a peft adapter)."""
    return isinstance(source, (str, os.PathLike)) and (Path(source).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_base(source: str | os.PathLike) -> str:
    """The base model an adapter folder was trained on (its ``base_model_name_or_path``)."""
    return json.loads((Path(source).expanduser() / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]


class LoRATeam(nn.Module):
    """One base model, ``num_agents`` LoRA adapters; the base is frozen, every adapter trainable.

    Args:
        base: the loaded base model (a causal LM).
        num_agents: adapters to create (ignored when ``adapters`` are given).
        rank / alpha / dropout / target_modules: the LoRA settings (``peft.LoraConfig``: ``r``, ``lora_alpha``,
            ``lora_dropout``, ``target_modules``; ``all-linear``: every linear layer but the output head).
        adapters: folders of saved adapters, one per agent, to load instead of creating fresh ones.
        base_name: the base's source (a factory name, path or hub id), recorded in the adapter files as the base
            to load them onto.
    """

    def __init__(
        self,
        base: nn.Module,
        num_agents: int,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        target_modules: str | Sequence[str] = "all-linear",
        adapters: Sequence[str | os.PathLike] = (),
        base_name: str | None = None,
    ):
        super().__init__()
        from peft import LoraConfig, PeftModel, get_peft_model

        base.requires_grad_(False)
        if adapters:
            self.peft = PeftModel.from_pretrained(
                base, str(adapters[0]), adapter_name=adapter_name(0), is_trainable=True
            )
            for i, folder in enumerate(adapters[1:], start=1):
                self.peft.load_adapter(str(folder), adapter_name=adapter_name(i), is_trainable=True)
            num_agents = len(adapters)
        else:
            targets = target_modules if isinstance(target_modules, str) else list(target_modules)
            config = LoraConfig(
                r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM"
            )
            try:
                self.peft = get_peft_model(base, config, adapter_name=adapter_name(0))
            except ValueError as err:  # peft: "Target modules {...} not found in the base model"
                from comlrl_lightning.config_errors import ConfigurationError

                linear = sorted(
                    {name.rsplit(".", 1)[-1] for name, module in base.named_modules() if isinstance(module, nn.Linear)}
                )
                raise ConfigurationError(
                    f"lora_target_modules {targets!r} does not fit this model ({str(err).splitlines()[0]}); its linear "
                    f"layers are named {', '.join(linear)} (or use all-linear)."
                ) from err
            for i in range(1, num_agents):
                self.peft.add_adapter(adapter_name(i), config)
        if base_name is not None:
            for config in self.peft.peft_config.values():
                config.base_model_name_or_path = base_name
        self.num_agents = num_agents
        self.adapter_parameters = {adapter_name(i): self._parameters_of(adapter_name(i)) for i in range(num_agents)}
        self.active: str | None = None
        self.frozen: set[str] = set()  # adapters that never learn (trained_agents)
        self.activate(adapter_name(0))
        self.views = [AdapterView(self, adapter_name(i)) for i in range(num_agents)]

    def _parameters_of(self, name: str) -> list[nn.Parameter]:
        return [p for n, p in self.peft.named_parameters() if f".{name}." in n]

    def add_view(self, name: str) -> "AdapterView":
        """A further adapter ``name`` on the same base (an actor-critic's critic: this adapter plus a value head),
        with agent 0's LoRA settings; trainable like the agents'."""
        import copy

        self.peft.add_adapter(name, copy.deepcopy(self.peft.peft_config[adapter_name(0)]))
        self.adapter_parameters[name] = self._parameters_of(name)
        self.active = None
        self.activate(adapter_name(0))
        return AdapterView(self, name)

    @property
    def base(self) -> nn.Module:
        return self.peft.get_base_model()

    def activate(self, name: str) -> None:
        """Route forwards through adapter ``name``. peft's switch also freezes the other adapters; every adapter but
        the frozen ones stays trainable here (each agent's update trains its own adapter only, through its own
        forwards)."""
        if self.active != name:
            self.peft.base_model.set_adapter(name)
            self.train_every_adapter()
            self.active = name

    def train_every_adapter(self) -> None:
        for name, params in self.adapter_parameters.items():
            for p in params:
                p.requires_grad_(name not in self.frozen)

    def freeze(self, name: str) -> None:
        """Adapter ``name`` never learns: no gradients (whichever adapter is active), no optimizer state."""
        self.frozen.add(name)
        self.train_every_adapter()

    def reference(self) -> "ReferenceView":
        """The base with every adapter off: the reference policy of the KL penalty, without a second copy."""
        return ReferenceView(self)

    def save_pretrained(self, output_dir: str | os.PathLike, **kwargs: Any) -> None:
        """``output_dir/agent_i/`` per agent: the adapter's config and weights."""
        self.peft.save_pretrained(str(output_dir), **kwargs)


class AdapterView(nn.Module):
    """Agent ``name`` of a :class:`LoRATeam`: the shared model with that adapter switched on."""

    def __init__(self, team: LoRATeam, name: str):
        super().__init__()
        self.team, self.name = team, name

    @property
    def config(self):
        return self.team.base.config

    @property
    def generation_config(self):
        return self.team.base.generation_config

    @property
    def device(self) -> torch.device:
        return next(self.team.base.parameters()).device

    def trainable_parameters(self) -> list[nn.Parameter]:
        """This agent's adapter weights: what its optimizer group trains and its gradient norm measures."""
        return self.team.adapter_parameters[self.name]

    def freeze(self) -> None:
        """This agent never learns (its adapter only: the base and the other agents are untouched)."""
        self.team.freeze(self.name)

    def forward(self, *args: Any, **kwargs: Any):
        self.team.activate(self.name)
        return self.team.peft(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Tensor:
        self.team.activate(self.name)
        return self.team.peft.generate(*args, **kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return self.team.base.get_input_embeddings()

    def shared_generator(self) -> tuple[nn.Module, str]:
        """The team's one peft model and this agent's adapter: the agents of a team sample in one ``generate``
        call, each row through its own adapter (peft's ``adapter_names``)."""
        return self.team.peft, self.name

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """This agent's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)."""
        target = Path(save_directory)
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # peft writes <dir>/<adapter name>/
            self.team.peft.save_pretrained(tmp, selected_adapters=[self.name], **kwargs)
            for path in (Path(tmp) / self.name).iterdir():
                path.replace(target / path.name)


class ReferenceView(nn.Module):
    """The team's base with every adapter off (peft's ``disable_adapter``); nothing trainable of its own."""

    def __init__(self, team: LoRATeam):
        super().__init__()
        self.team = team

    @property
    def config(self):
        return self.team.base.config

    def forward(self, *args: Any, **kwargs: Any):
        try:
            with self.team.peft.disable_adapter():
                return self.team.peft(*args, **kwargs)
        finally:  # peft's switch back re-freezes every adapter but the active one
            self.team.train_every_adapter()

    def to(self, *args: Any, **kwargs: Any) -> "ReferenceView":
        return self  # lives where the team lives
