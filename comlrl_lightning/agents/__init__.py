"""Agents: loading the team (models + tokenizers), device specs, offline model factories.

Public API::

    load_agents(agents, num_agents=None, tokenizers=None, dtype=None, attn_implementation="sdpa",
                model_kwargs=None, special_tokens=None) -> (models, tokenizers)
    validate_agent_sources(agents, num_agents=None, tokenizers=None) -> sources   # no loading
    save_agents(models, tokenizers, output_dir) -> [output_dir/agent_i, ...]
    resolve_devices(spec, n, kind="agent_devices"), resolve_single_device(*specs)
    normalize_parallel_training(value), PARALLEL_MODES
    MODEL_FACTORIES: "tiny", "tiny-5m", "smollm2-135m-instruct"
    ValueHead(hidden_size, hidden_dim=None), CausalLMWithValueHead(model, attach_value_head=True,
        value_head_hidden_dim=None)   # actor-critic value heads; .from_pretrained / .save_pretrained
    joint_text(prompts, responses) -> str; JointRewardModel(backbone, tokenizer=None, *, freeze_backbone=False,
        max_length=None)   # MARLHF joint reward model; .from_pretrained / .save_pretrained / .score_joint
    RewardModelReward(model, batch_size=None, formatters=None)   # RM scores as the team reward
"""

from .devices import (
    AUTO,
    PARALLEL_MODES,
    DeviceSpec,
    auto_devices,
    normalize_parallel_training,
    resolve_devices,
    resolve_single_device,
)
from .factories import (
    MODEL_FACTORIES,
    SMOLLM2_NAME,
    TINY_PRESETS,
    TOKENIZER_FACTORIES,
    build_tiny_model,
    build_tiny_tokenizer,
    cache_root,
    smollm2_cache_dir,
)
from .loading import (
    AgentSource,
    add_special_tokens,
    apply_tokenizer_specials,
    check_model_sources,
    ensure_pad_token,
    infer_model_name,
    is_model_object,
    is_tokenizer_object,
    load_agents,
    load_tokenizer,
    save_agents,
    validate_agent_sources,
)
from .reward_model import JointRewardModel, RewardModelReward, joint_text, joint_texts
from .value_head import ActorCriticOutput, CausalLMWithValueHead, ValueHead

__all__ = [
    "AUTO",
    "PARALLEL_MODES",
    "DeviceSpec",
    "auto_devices",
    "normalize_parallel_training",
    "resolve_devices",
    "resolve_single_device",
    "MODEL_FACTORIES",
    "TOKENIZER_FACTORIES",
    "SMOLLM2_NAME",
    "TINY_PRESETS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cache_root",
    "smollm2_cache_dir",
    "AgentSource",
    "add_special_tokens",
    "apply_tokenizer_specials",
    "ensure_pad_token",
    "infer_model_name",
    "is_model_object",
    "is_tokenizer_object",
    "load_agents",
    "load_tokenizer",
    "save_agents",
    "validate_agent_sources",
    "check_model_sources",
    "ActorCriticOutput",
    "CausalLMWithValueHead",
    "ValueHead",
    "JointRewardModel",
    "RewardModelReward",
    "joint_text",
    "joint_texts",
]
