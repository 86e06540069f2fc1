"""Bugs found by reading the code (issue 43), each pinned by a test that failed before its fix, and the choice
lists and defaults that are now written once: the upper layer's copy is the lower layer's, so they cannot drift."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import get_args
from unittest import mock

import pytest

from comlrl_lightning import MADPO, MARLHF, MADPOIter
from comlrl_lightning.algorithms.base import MultiAgentModule
from comlrl_lightning.algorithms.fields import (
    ComparatorFields,
    PreferenceFields,
    ReferenceKLFields,
    RolloutFields,
    SamplingFields,
    type_hints,
)
from comlrl_lightning.algorithms.iterative import IterativePreferenceFields
from comlrl_lightning.algorithms.marlhf import BACKENDS, MARLHFFields
from comlrl_lightning.algorithms.on_policy import OnPolicyModule
from comlrl_lightning.cli import main
from comlrl_lightning.comparators.api import ApiComparatorConfig
from comlrl_lightning.core.losses import IMPORTANCE_SAMPLING_MODES, KL_ESTIMATORS, LOSS_AGGREGATIONS
from comlrl_lightning.core.pairs import PAIR_SELECTIONS
from comlrl_lightning.core.replay import ITERATIVE_PAIR_SELECTIONS
from comlrl_lightning.envs import toy
from comlrl_lightning.rollout.sampling import GENERATION_DTYPES, SamplingConfig

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
MAGRPO_FAMILY = ("magrpo", "mareinforce", "marloo", "maremax")


def marlhf(**overrides):
    """A MARLHF module, built (its fields checked) without loading a model."""
    kwargs = dict(
        agents="tiny",
        num_agents=2,
        reward_func=toy.letter_reward,
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        reward_model_name="tiny",
        num_generations=2,
        log_completions=False,
    )
    return MARLHF(**{**kwargs, **overrides})


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info, mock.patch.object(sys, "argv", ["comlrl_lightning"]):
        main(args)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


# ------------------------------------------------------------------------- MARLHF: critic fields without a critic
@pytest.mark.parametrize("backend", MAGRPO_FAMILY)
@pytest.mark.parametrize(
    "field,value",
    [
        ("critic_model", "tiny"),
        ("critic_model_name", "tiny"),
        ("use_separate_critic", False),
        ("critic_type", "q"),
        ("value_loss_coef", 1.0),
        ("critic_learning_rate", 1e-4),
        ("value_clip_range", None),
    ],
)
def test_marlhf_refuses_a_critic_field_its_magrpo_family_backend_would_ignore(backend, field, value):
    with pytest.raises(ValueError) as error:
        marlhf(rl_algorithm=backend, **{field: value})
    message = str(error.value)
    assert (
        message.startswith(field) and f"only used by rl_algorithm iac or maac (got rl_algorithm='{backend}')" in message
    )
    assert repr(value) in message


def test_marlhf_names_every_ignored_critic_field_at_once():
    with pytest.raises(ValueError, match=r"^critics, value_loss_coef=2\.0 are only used by rl_algorithm iac or maac"):
        marlhf(critics=["tiny", "tiny"], value_loss_coef=2.0)


@pytest.mark.parametrize("backend", ["iac", "maac"])
def test_marlhf_takes_the_critic_fields_with_an_actor_critic_backend(backend):
    module = marlhf(rl_algorithm=backend, critic_model="tiny", critic_type="q", value_loss_coef=1.0)
    assert (module.critic_model, module.critic_type, module.value_loss_coef) == ("tiny", "q", 1.0)


@pytest.mark.parametrize("backend", MAGRPO_FAMILY)
def test_marlhf_with_the_critic_fields_at_their_defaults_builds(backend):
    assert marlhf(rl_algorithm=backend).rl_algorithm == backend


# ------------------------------------------------------------------------- the bases are not algorithms to run
def test_the_bases_are_not_offered_as_model_class_paths(capsys):
    code, out, _ = run_cli(["fit", "--help"], capsys)
    assert code == 0
    model = out[out.index("--model CONFIG | CLASS_PATH_OR_NAME | .INIT_ARG_NAME VALUE\n") :]
    offered = model.split("known subclasses:", 1)[1].split(")", 1)[0]
    assert "comlrl_lightning.MAGRPO" in offered and "comlrl_lightning.MARLHF" in offered
    assert "MultiAgentModule" not in offered and "OnPolicyModule" not in offered


@pytest.mark.parametrize(
    "given",
    ["comlrl_lightning.algorithms.base.MultiAgentModule", "OnPolicyModule", "comlrl_lightning.MultiAgentModule"],
)
def test_a_base_as_model_class_path_is_one_clear_line(given, capsys):
    code, _, err = run_cli(["fit", "--config", QUICKSTART, "--model", given], capsys)
    assert code == 2
    assert "Traceback" not in err and "AttributeError" not in err and "objective_class'" not in err
    first = err.splitlines()[0]
    assert first.startswith(f"error: model: {given} is a base class, not one to run (it has no objective_class)")
    assert "MAGRPO" in first and "MARLHF" in first and "OnPolicyModule, " not in first


@pytest.mark.parametrize("base", [MultiAgentModule, OnPolicyModule])
def test_a_base_cannot_be_built_from_python_either(base):
    with pytest.raises(TypeError, match="abstract class .*objective_class"):
        base(agents="tiny", reward_func=toy.letter_reward)


# ------------------------------------------------------------------------- pair_selection: the field's own choices
@pytest.mark.parametrize("module", [MADPO, MARLHF])
def test_pair_selection_outside_the_non_iterative_choices_is_refused_by_its_field(module):
    extra = {"reward_model_name": "tiny"} if module is MARLHF else {}
    with pytest.raises(
        ValueError, match=r"^pair_selection must be one of: reward_gap, random, all \(got 'comparator_reward'\)"
    ):
        module(agents="tiny", reward_func=toy.letter_reward, pair_selection="comparator_reward", **extra)


def test_the_iterative_variant_takes_comparator_reward_and_defaults_to_it():
    module = MADPOIter(agents="tiny", reward_func=toy.letter_reward)
    assert module.pair_selection == "comparator_reward"
    assert MADPOIter(agents="tiny", reward_func=toy.letter_reward, pair_selection="RANDOM").pair_selection == "random"


# ------------------------------------------------------------------------- one list, one default
def choices(group, field):
    return get_args(type_hints(group)[field])


def test_each_choice_list_is_the_lower_layers():
    assert choices(RolloutFields, "loss_aggregation") == LOSS_AGGREGATIONS
    assert choices(RolloutFields, "vllm_importance_sampling_mode") == IMPORTANCE_SAMPLING_MODES
    assert choices(ReferenceKLFields, "reference_kl_estimator") == KL_ESTIMATORS
    assert choices(SamplingFields, "generation_dtype") == GENERATION_DTYPES
    assert choices(PreferenceFields, "pair_selection") == PAIR_SELECTIONS
    assert choices(IterativePreferenceFields, "pair_selection") == ITERATIVE_PAIR_SELECTIONS
    assert choices(MARLHFFields, "rl_algorithm") == tuple(BACKENDS)


def defaults(group) -> dict:
    return {f.name: f.default for f in dataclasses.fields(group)}


def test_the_sampling_fields_default_to_the_samplers_settings():
    fields, sampler = defaults(SamplingFields), defaults(SamplingConfig)
    for name in ("max_new_tokens", "temperature", "top_p", "top_k"):
        assert fields[name] == sampler[name]
    assert fields["generation_dtype"] == sampler["dtype"]


def test_the_api_comparator_fields_default_to_the_clients_settings():
    fields, client = defaults(ComparatorFields), defaults(ApiComparatorConfig)
    prefix = "comparator_api_"
    given = {name[len(prefix) :]: value for name, value in fields.items() if name.startswith(prefix)}
    assert given == client  # every client setting is a field, with the client's default


def test_the_core_functions_defaults_are_the_fields():
    import inspect

    from comlrl_lightning.core import losses, pairs, replay

    def default(function, name):
        return inspect.signature(function).parameters[name].default

    assert defaults(RolloutFields)["loss_aggregation"] == default(losses.token_loss_weights, "aggregation")
    assert defaults(RolloutFields)["vllm_importance_sampling_mode"] == default(
        losses.importance_sampling_weights, "mode"
    )
    assert defaults(RolloutFields)["vllm_importance_sampling_cap"] == default(losses.importance_sampling_weights, "cap")
    assert defaults(ReferenceKLFields)["reference_kl_estimator"] == default(losses.kl_estimate, "estimator")
    assert defaults(PreferenceFields)["pair_selection"] == default(pairs.select_pairs, "selection")
    assert defaults(PreferenceFields)["preference_pairs_per_sample"] == default(pairs.select_pairs, "limit")
    iterative = defaults(IterativePreferenceFields)
    assert iterative["pair_selection"] == default(replay.select_comparison_pairs, "selection")
    assert iterative["preference_pairs_per_sample"] == default(replay.select_comparison_pairs, "limit")


def test_the_core_errors_list_the_choices_they_check():
    from comlrl_lightning.core.pairs import select_pairs
    from comlrl_lightning.core.replay import select_comparison_pairs

    with pytest.raises(ValueError, match=rf"^pair_selection must be one of: {', '.join(PAIR_SELECTIONS)}\. "):
        select_pairs([1.0, 0.0], "best")
    with pytest.raises(ValueError, match=rf"^pair_selection must be one of: {', '.join(ITERATIVE_PAIR_SELECTIONS)}\. "):
        select_comparison_pairs([1.0], [0.0], "best")
