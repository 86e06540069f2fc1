"""Every shipped config runs two updates through the CLI, with tiny models standing in for the embedded SmolLM2.

Each config is taken as it is (its algorithm, reward, formatters, transitions, data and schedule) and changed only
where the size of the run is set: models, completion length, candidate counts, items, evaluation. The memory of the
real configs (SmolLM2) is measured by ``benchmarks/config_memory.py``.
"""

from __future__ import annotations

import csv
import importlib
import inspect
from pathlib import Path

import pytest
import yaml
from test_iterative_api import server  # noqa: F401  (the loopback comparator API, for madpo_iter_api.yaml)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
EMBEDDED = "smollm2-135m-instruct"
# Fields that set the size of a run, and the small values a test uses (only where the algorithm has the field).
SMALL = {
    "max_new_tokens": 4,
    "use_chat_template": False,
    "preference_num_candidates": 2,
    "comparator_num_candidates": 2,
    "eval_interval": 1,
    "eval_num_samples": 1,
    "num_iterations": 2,
    "reward_num_train_epochs": 1,
}


def tiny(value, models=(EMBEDDED,)):
    """Every model source in ``models`` (the embedded SmolLM2, or a recipe's hub ids) becomes the tiny factory model."""
    if isinstance(value, str) and value in models:
        return "tiny"
    if isinstance(value, list):
        return [tiny(v, models) for v in value]
    if isinstance(value, dict):
        return {k: tiny(v, models) for k, v in value.items()}
    return value


def small_config(config: Path, root: Path, api_url: str | None = None, models=(EMBEDDED,), sizes=SMALL) -> Path:
    cfg = yaml.safe_load(config.read_text())
    model = cfg["model"]
    module, _, name = model["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    accepted = {
        p for klass in cls.__mro__ if "__init__" in vars(klass) for p in inspect.signature(klass.__init__).parameters
    }
    args = tiny(model.get("init_args", {}), models)
    rounds = "policy_loss" not in accepted  # the MAGRPO family's num_iterations counts passes, not rounds
    args.update({k: v for k, v in sizes.items() if k in accepted and (k != "num_iterations" or rounds)})
    if "comparator_api_url" in args:  # a loopback stand-in for the remote comparator
        args["comparator_api_url"] = api_url
    model["init_args"] = args
    cfg["data"].setdefault("init_args", {}).update(max_train_items=4, max_eval_items=1, eval_batch_size=1)
    cfg["trainer"].update(max_steps=2, enable_progress_bar=False, enable_model_summary=False)
    out = root / config.name
    out.write_text(yaml.safe_dump(cfg))
    return out


def fit_two_updates(config: Path, root: Path, updates: int = 2) -> list[dict[str, str]]:
    """Fit a small config through the CLI into ``root/run``: two updates (``updates`` where one buffer drains into
    more: one per turn of a 4-turn tree), a loss logged; returns the metric rows."""
    from comlrl_lightning.cli import main

    cli = main(["fit", "--config", str(config), "--trainer.default_root_dir", str(root / "run")])
    assert cli.trainer.global_step == updates
    rows = list(csv.DictReader(next((root / "run").rglob("metrics.csv")).open()))
    assert any(row.get("loss") or row.get("reward_model/loss") for row in rows)
    return rows


def needs_shared_data(config: Path) -> bool:
    data = yaml.safe_load(config.read_text())["data"]
    return "comlrl_lightning.envs." in str(data) and "envs.toy" not in str(data)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_runs_two_updates(config, tmp_path, monkeypatch, request):
    if needs_shared_data(config) and not SHARED.exists():
        pytest.skip(f"{config.name} reads the benchmark data under {SHARED}")
    monkeypatch.chdir(tmp_path)
    api_url = None
    if "comparator_api_url" in config.read_text():
        api_url = request.getfixturevalue("server").url
        monkeypatch.setenv("COMPARATOR_API_KEY", "sk-test")
    fit_two_updates(small_config(config, tmp_path, api_url), tmp_path)


PLAIN = (type(None), str, int, float, bool)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("MAGRPO", {}),
        ("MAREINFORCE", {}),
        ("MAReMax", {}),
        ("MARLOO", {}),
        ("CentralizedMAGRPO", {}),
        ("IAC", {"use_separate_critic": False}),
        ("IAC", {"critic_model": "tiny"}),
        ("MAAC", {"critic_model": "tiny"}),
        ("MADPO", {}),
        ("MADPOIter", {}),
        ("MARLHF", {}),
        ("MARLHFIter", {}),
    ],
)
def test_the_saved_hyper_parameters_are_what_the_run_uses(name, extra):
    """``hparams.yaml`` and a checkpoint's hyper-parameters record the values the run uses: a field a rule derives
    (``num_agents`` from the team, ``train_batch_size`` from ``rollout_buffer_size``, IAC's ``value_clip_range``
    with a separate critic, an algorithm's own ``advantage_mode``) is saved as derived, not as given."""
    import comlrl_lightning as cl
    from comlrl_lightning.envs import toy

    module = getattr(cl, name)(agents="tiny", reward_func=toy.letter_reward, **extra)
    for key, saved in module.hparams.items():
        if key == "num_agents":  # below
            continue
        used = module.__dict__.get(key, saved)
        if isinstance(used, (list, tuple)) and all(isinstance(v, PLAIN) for v in used):
            assert isinstance(saved, (list, tuple)) and list(saved) == list(used), (key, saved, used)
        elif isinstance(used, PLAIN):
            assert saved == used, (key, saved, used)
    roles = module.collaboration.num_roles if module.collaboration is not None else module.num_agents
    assert module.hparams["num_agents"] == roles  # a centralized team: its roles (one actor model), as CoMLRL


def test_a_credential_stays_in_its_group_never_an_attribute_a_hyper_parameter_or_a_repr():
    from comlrl_lightning import MADPOIter
    from comlrl_lightning.envs.toy import story_reward

    secret = "sk-do-not-print-1234"
    module = MADPOIter(
        agents="tiny",
        reward_func=story_reward,
        comparator_policy="api",
        comparator_api_url="http://127.0.0.1:9",
        comparator_api_key=secret,
    )
    assert module.rounds.api_config.key == secret  # what the client uses
    assert not hasattr(module, "comparator_api_key")
    assert "comparator_api_key" not in module.hparams and "comparator_api_key" not in module.field_values
    assert secret not in repr(module.groups)


def test_a_field_group_may_declare_a_required_field_and_a_default_factory():
    """A user's group: a field without a default is a required keyword; a ``default_factory`` gives each module its
    own object (and ``--help`` shows its value)."""
    import dataclasses

    from comlrl_lightning import MAGRPO
    from comlrl_lightning.algorithms.fields import FieldGroup
    from comlrl_lightning.envs.toy import story_reward

    @dataclasses.dataclass
    class Extra(FieldGroup):
        """Args:
        tags: labels.
        level: required."""

        level: int
        tags: list = dataclasses.field(default_factory=list)

    class Tagged(MAGRPO):
        field_groups = (*MAGRPO.field_groups, Extra)

    params = inspect.signature(Tagged).parameters
    assert params["level"].default is inspect.Parameter.empty and params["tags"].default == []
    with pytest.raises(TypeError, match="level"):
        Tagged(agents="tiny", reward_func=story_reward)
    a = Tagged(agents="tiny", reward_func=story_reward, level=1)
    b = Tagged(agents="tiny", reward_func=story_reward, level=2)
    a.tags.append("x")
    assert b.tags == [] and (a.level, b.level) == (1, 2)
