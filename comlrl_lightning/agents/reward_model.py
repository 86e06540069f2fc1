"""MARLHF's joint reward model (docs/algorithms.md#marlhf) and its use as a team reward.

``JointRewardModel`` scores one *joint* multi-agent response: every agent's prompt and response laid out by
:func:`joint_text`, tokenised with the reward model's own tokenizer, read by a causal-LM body, and mapped to one
scalar by a linear head on the hidden state of the **last non-pad token**.

It is a :class:`~comlrl_lightning.agents.value_head.CausalLMWithValueHead` (held as ``self.model``) whose value
head is one ``Linear(hidden, 1)`` read with ``values_at``, so it shares that class's body-only pass (the decoder
without the ``[B, L, vocab]`` LM-head projection), its float32 head output and its head persistence.

Differences from CoMLRL:

* pooling: CoMLRL reads position ``sum(attention_mask) - 1``, right only for right padding (docs/differences.md;
  a left-padding tokenizer pools a pad). Here the index is the position of the last 1 in the mask, and
  position ids follow the mask (``cumsum - 1``), so a row scores the same under left padding, right padding or
  none;
* the head is initialised N(0, 0.02) with zero bias (the ``ValueHead`` init), not ``nn.Linear``'s default.

``RewardModelReward`` wraps a trained model in the documented reward signature
``(*agent_completions, prompts=None, batch_items=None) -> list[float]``: this is how MARLHF replaces the task
reward in its RL stage (raw scores, no ``reward_processor``, ``no_grad``, eval mode).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from .value_head import VALUE_HEAD_CONFIG_NAME, CausalLMWithValueHead, ValueHead, _read_value_head

__all__ = [
    "JOINT_TEXT_HEADER",
    "REWARD_MODEL_CONFIG_NAME",
    "JointRewardModel",
    "RewardModelReward",
    "joint_text",
    "joint_texts",
    "last_token_positions",
]

JOINT_TEXT_HEADER = "Joint multi-agent response"
REWARD_MODEL_CONFIG_NAME = "reward_model_config.json"


def joint_text(prompts: Sequence[str], responses: Sequence[str]) -> str:
    """The text the reward model reads for one joint response (docs/algorithms.md#marlhf)::

        Joint multi-agent response

        Agent 1 prompt:
        <prompt 1>

        Agent 1 response:
        <response 1>

        Agent 2 prompt:
        ...

    Sections are joined by blank lines; agents are numbered from 1. ``prompts[i]``/``responses[i]`` belong to
    agent i.
    """
    if isinstance(prompts, str) or isinstance(responses, str):
        raise TypeError("joint_text takes one prompt and one response per agent (sequences of strings).")
    if len(prompts) != len(responses):
        raise ValueError(
            f"joint_text needs one prompt per response (got {len(prompts)} prompts for {len(responses)} responses)."
        )
    sections = [JOINT_TEXT_HEADER]
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        sections.append(f"Agent {i + 1} prompt:\n{prompt}")
        sections.append(f"Agent {i + 1} response:\n{response}")
    return "\n\n".join(sections)


def _reward_hidden_size(config: Any) -> int:
    configs = [config] if config is not None else []
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):  # multimodal configs keep the LM's sizes in a sub-config
        configs.append(get_text_config())
    for cfg in configs:
        for name in ("hidden_size", "n_embd", "d_model"):
            size = getattr(cfg, name, None)
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                return size
    raise ValueError(
        "Could not infer reward model hidden size. The backbone config "
        f"({type(config).__name__}) has none of hidden_size, n_embd, d_model."
    )


def _check_max_length(max_length: Any) -> int | None:
    if max_length is None:
        return None
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"reward_max_length must be >= 1 or null. Got {max_length!r}.")
    return int(max_length)


def last_token_positions(attention_mask: Tensor) -> Tensor:
    """[B, L] mask -> [B] long: the index of the last 1 in each row (the last non-pad token), whatever the
    padding side. Rows without a 1 raise ValueError."""
    mask = attention_mask.bool()
    if not bool(mask.any(-1).all()):
        raise ValueError("Every reward-model input row needs at least one non-pad token (got an all-pad row).")
    length = mask.shape[-1]
    return (length - 1 - mask.flip(-1).long().argmax(-1)).long()


class JointRewardModel(nn.Module):
    """Causal-LM backbone + scalar head ``Linear(hidden, 1)``: one score per joint response (docs/algorithms.md#marlhf).

    Args:
        backbone: a causal LM (``PreTrainedModel``; hidden size from its config's ``hidden_size``, ``n_embd`` or
            ``d_model``).
        tokenizer: the reward model's own tokenizer (gets pad = eos when it has no pad token); needed by
            ``score_texts``/``score_joint``, not by ``forward``.
        freeze_backbone: train only the head (backbone parameters get ``requires_grad=False``).
        max_length: truncation length of the tokenised joint texts (None: the tokenizer's ``model_max_length``).

    ``self.model`` is the ``CausalLMWithValueHead`` (backbone ``self.model.model``, head
    ``self.model.value_head``); ``backbone`` and ``reward_head`` (the ``nn.Linear``) name them. The head lives
    on the backbone's device in its dtype; scores are float32.
    """

    def __init__(
        self,
        backbone: nn.Module,
        tokenizer: Any = None,
        *,
        freeze_backbone: bool = False,
        max_length: int | None = None,
    ):
        super().__init__()
        if isinstance(backbone, JointRewardModel):
            raise TypeError("backbone is already a JointRewardModel; pass its .backbone.")
        if isinstance(backbone, CausalLMWithValueHead):
            backbone = backbone.model
        hidden_size = _reward_hidden_size(getattr(backbone, "config", None))
        self.max_length = _check_max_length(max_length)
        self.model = CausalLMWithValueHead(backbone, attach_value_head=False)
        head = ValueHead(hidden_size)  # Linear(hidden, 1)
        param = next(backbone.parameters(), None)
        if param is not None:
            head = head.to(device=param.device, dtype=param.dtype)
        self.model.value_head = head
        self.tokenizer = None
        if tokenizer is not None:
            self.set_tokenizer(tokenizer)
        self.freeze_backbone = bool(freeze_backbone)
        if self.freeze_backbone:
            for p in backbone.parameters():
                p.requires_grad_(False)
        self.train(backbone.training)

    # --- parts --------------------------------------------------------------------------------------------

    @property
    def backbone(self) -> nn.Module:
        return self.model.model

    @property
    def reward_head(self) -> nn.Linear:
        return self.model.value_head[0]

    @property
    def hidden_size(self) -> int:
        return self.model.value_head.hidden_size

    @property
    def config(self):
        return self.backbone.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def set_tokenizer(self, tokenizer: Any) -> None:
        from .loading import ensure_pad_token

        self.tokenizer = ensure_pad_token(tokenizer)

    # --- scoring ------------------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """[B, L] ids and mask (either padding side) -> [B] float32 scores, read at each row's last non-pad
        token. Position ids follow the mask, so padding never changes a row's score."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(input_ids.device)
        positions = last_token_positions(attention_mask)  # [B]
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # [B, L]
        return self.model.values_at(input_ids, attention_mask, position_ids, positions=positions)

    def tokenize(self, texts: Sequence[str]) -> dict[str, Tensor]:
        """Texts -> padded, truncated ``input_ids``/``attention_mask`` on the model's device."""
        if self.tokenizer is None:
            raise ValueError("JointRewardModel needs a tokenizer to score texts (pass tokenizer=...).")
        enc = self.tokenizer(
            list(texts), return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
        )
        device = self.device
        return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """The tokens of each text as :meth:`tokenize` gives it to the model (truncated the same way, without the
        padding): what a forward over some of them costs is their number × the longest (MARLHF plans its reward
        model's micro-batches with it)."""
        if self.tokenizer is None:
            raise ValueError("JointRewardModel needs a tokenizer to count tokens (pass tokenizer=...).")
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)
        return [len(ids) for ids in enc["input_ids"]]

    def score_texts(self, texts: Sequence[str], batch_size: int | None = None) -> Tensor:
        """[B] float32 scores of ready-made texts, ``batch_size`` texts per forward (None: all at once).

        Gradients flow (reward-model training); wrap in ``torch.no_grad()`` to only score."""
        if isinstance(texts, str):
            raise TypeError("score_texts takes a list of texts, not one string.")
        texts = list(texts)
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size must be >= 1 or None (got {batch_size!r}).")
        if not texts:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        step = len(texts) if batch_size is None else int(batch_size)
        scores = [self(**self.tokenize(texts[i : i + step])) for i in range(0, len(texts), step)]
        return scores[0] if len(scores) == 1 else torch.cat(scores)

    def score_joint(
        self,
        prompts_per_agent: Sequence[Sequence[str]],
        responses_per_agent: Sequence[Sequence[str]],
        batch_size: int | None = None,
    ) -> Tensor:
        """[J] scores of J joint responses; both arguments are agent-major (``x[i][j]``: agent i, joint
        action j), one list per agent, each of length J."""
        texts = joint_texts(prompts_per_agent, responses_per_agent)
        return self.score_texts(texts, batch_size=batch_size)

    # --- persistence --------------------------------------------------------------------------------------

    def save_pretrained(
        self, save_directory: str | os.PathLike, state_dict: dict[str, Tensor] | None = None, **kwargs: Any
    ) -> None:
        """Backbone (a normal HF model directory), tokenizer, head (``value_head.safetensors`` +
        ``value_head_config.json``) and ``reward_model_config.json`` (hidden_size, max_length,
        freeze_backbone). ``state_dict``: this model's weights to write instead of its own (a sharded model's,
        gathered whole)."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        if state_dict is not None:
            kwargs["state_dict"] = {k.removeprefix("model."): v for k, v in state_dict.items()}
        self.model.save_pretrained(str(directory), **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))
        config = {
            "hidden_size": self.hidden_size,
            "max_length": self.max_length,
            "freeze_backbone": self.freeze_backbone,
        }
        (directory / REWARD_MODEL_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_pretrained(
        cls,
        source: Any,
        tokenizer: Any = None,
        freeze_backbone: bool = False,
        max_length: int | None = None,
        dtype: torch.dtype | str | None = None,
        *,
        attn_implementation: str | None = "sdpa",
        device: str | torch.device | None = None,
        **model_kwargs: Any,
    ) -> "JointRewardModel":
        """Load a reward model.

        Args:
            source: a factory name (``"tiny"``, ``"smollm2-135m-instruct"``), a hub id, a local path (a directory
                written by :meth:`save_pretrained` restores the head and its ``max_length``), or a model object
                (``tokenizer`` then required; a ``CausalLMWithValueHead`` contributes its backbone only). A model
                object is used as is, not copied: ``freeze_backbone`` and training change it (never pass a live
                actor; load the reward model by name instead).
            tokenizer: tokenizer object or name/path; None: the source's own.
            freeze_backbone, max_length: as in the constructor; ``max_length=None`` keeps a saved one.
                ``freeze_backbone`` is not restored from a saved directory (a training choice: pass it again).
            dtype, attn_implementation, model_kwargs: for loading by name (``load_agents``).
            device: where to move the model (None: leave it where it was loaded).
        """
        from .loading import load_agents

        _check_max_length(max_length)
        if isinstance(source, CausalLMWithValueHead):
            source = source.model
        models, toks = load_agents(
            source,
            num_agents=1,
            tokenizers=tokenizer,
            dtype=dtype,
            attn_implementation=attn_implementation,
            model_kwargs=model_kwargs or None,
            field="reward_model_name",
            tokenizer_field="reward_tokenizer",
        )
        head_state = None
        if isinstance(source, (str, os.PathLike)):
            path = Path(os.fspath(source)).expanduser()
            if path.is_dir():
                config_path = path / REWARD_MODEL_CONFIG_NAME
                if max_length is None and config_path.is_file():
                    max_length = json.loads(config_path.read_text()).get("max_length")
                head_state, hidden_dim = _read_value_head(path)
                if head_state is not None and hidden_dim:
                    raise ValueError(
                        f"{path} holds a value head with hidden_dim={hidden_dim} "
                        f"(see {VALUE_HEAD_CONFIG_NAME}); the reward model's head is one Linear(hidden, 1)."
                    )
        model = cls(models[0], toks[0], freeze_backbone=freeze_backbone, max_length=max_length)
        if head_state is not None:
            model.model.value_head.load_state_dict(head_state)
        if device is not None:
            model.to(device)
        return model


def joint_texts(prompts_per_agent: Sequence[Sequence[str]], responses_per_agent: Sequence[Sequence[str]]) -> list[str]:
    """Agent-major prompts and responses (``[N][J]``) -> J joint texts."""
    if isinstance(prompts_per_agent, str) or isinstance(responses_per_agent, str):
        raise TypeError("Pass one list of prompts and one list of responses per agent.")
    prompts = [list(p) for p in prompts_per_agent]
    responses = [list(r) for r in responses_per_agent]
    if len(prompts) != len(responses) or not responses:
        raise ValueError(
            f"MARLHF reward model expected one completion list per agent (got {len(responses)} "
            f"response lists and {len(prompts)} prompt lists)."
        )
    num_joint = len(responses[0])
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) != num_joint or len(r) != num_joint:
            raise ValueError(
                f"Every agent needs one prompt and one response per joint action: agent {i} has "
                f"{len(p)} prompts and {len(r)} responses for {num_joint} joint actions."
            )
    return [joint_text([p[j] for p in prompts], [r[j] for r in responses]) for j in range(num_joint)]


class RewardModelReward:
    """A :class:`JointRewardModel` as a team reward: how MARLHF replaces the task reward in its RL stage.

    ``reward(*agent_completions, prompts=None, batch_items=None, agent_prompts=None) -> list[float]``:
    ``agent_completions[i]`` is agent i's list of J completions (aligned joint actions); returns J **raw** scores
    (no ``reward_processor``, no normalisation), computed under ``torch.no_grad()`` with the model in eval mode
    (its previous mode is restored afterwards).

    Each agent's prompt, first match wins:

    1. ``agent_prompts``: one list of J prompts per agent (what the MARLHF trainer passes);
    2. ``formatters`` (constructor; one callable ``item -> prompt`` per agent, or one for all) applied to
       ``batch_items`` (length J, or 1 for all);
    3. ``prompts`` (length J, or 1): used for **every** agent (the documented signature carries one prompt per
       joint action only).

    ``RewardCaller`` passes only ``prompts``/``batch_items``; call the object directly to give ``agent_prompts``.
    """

    def __init__(
        self,
        model: JointRewardModel,
        batch_size: int | None = None,
        formatters: Callable[..., str] | Sequence[Callable[..., str]] | None = None,
    ):
        if not isinstance(model, JointRewardModel):
            raise TypeError(f"model must be a JointRewardModel, got {type(model).__name__}.")
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size must be >= 1 or None (got {batch_size!r}).")
        if formatters is not None and not callable(formatters):
            formatters = list(formatters)
            if not all(callable(f) for f in formatters):
                raise ValueError("formatters must be a callable or a list of callables.")
        self.model = model
        self.batch_size = batch_size
        self.formatters = formatters

    def _formatter(self, agent: int, num_agents: int) -> Callable[..., str]:
        if callable(self.formatters):
            return self.formatters
        if len(self.formatters) == 1:
            return self.formatters[0]
        if len(self.formatters) != num_agents:
            raise ValueError(f"RewardModelReward has {len(self.formatters)} formatters for {num_agents} agents.")
        return self.formatters[agent]

    def _agent_prompts(
        self,
        num_agents: int,
        num_joint: int,
        prompts: Sequence[str] | None,
        batch_items: Sequence[Mapping[str, Any]] | None,
        agent_prompts: Sequence[Sequence[str]] | None,
    ) -> list[list[str]]:
        def broadcast(values: Sequence[Any], what: str) -> list[Any]:
            values = list(values)
            if len(values) == 1:
                return values * num_joint
            if len(values) != num_joint:
                raise ValueError(
                    f"{what} must have 1 or {num_joint} entries (one per joint action); got {len(values)}."
                )
            return values

        if agent_prompts is not None:
            if isinstance(agent_prompts, str) or len(agent_prompts) != num_agents:
                raise ValueError(
                    f"MARLHF reward model expected one prompt list per agent in agent_prompts ({num_agents} agents)."
                )
            return [broadcast(p, f"agent_prompts[{i}]") for i, p in enumerate(agent_prompts)]
        if self.formatters is not None:
            if batch_items is None:
                raise ValueError("MARLHF reward model scoring requires batch_items (or agent_prompts).")
            items = broadcast(batch_items, "batch_items")
            return [[self._formatter(i, num_agents)(item) for item in items] for i in range(num_agents)]
        if prompts is None:
            raise ValueError(
                "RewardModelReward needs each agent's prompt: pass agent_prompts=, prompts=, or build "
                "it with formatters and pass batch_items=."
            )
        shared = broadcast([prompts] if isinstance(prompts, str) else prompts, "prompts")
        return [list(shared) for _ in range(num_agents)]

    def __call__(
        self,
        *agent_completions: Sequence[str],
        prompts: Sequence[str] | None = None,
        batch_items: Sequence[Mapping[str, Any]] | None = None,
        agent_prompts: Sequence[Sequence[str]] | None = None,
    ) -> list[float]:
        if not agent_completions:
            raise ValueError("MARLHF reward model expected one completion list per agent (got none).")
        completions = [[c] if isinstance(c, str) else list(c) for c in agent_completions]
        num_joint = len(completions[0])
        per_agent_prompts = self._agent_prompts(len(completions), num_joint, prompts, batch_items, agent_prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                scores = self.model.score_joint(per_agent_prompts, completions, batch_size=self.batch_size)
        finally:
            self.model.train(was_training)
        return [float(s) for s in scores.float().cpu().tolist()]
