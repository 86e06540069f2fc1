"""Every field a user can set has a description where the CLI shows fields: ``--model.help`` and ``--print_config``.

The fields are taken from the ``__init__`` signatures along each class's MRO (an algorithm's is generated from its
field groups; a data module's is its own), never from the help text, so a field that lost its ``Args:`` line fails here. Nothing is fitted and no
model is loaded (every model factory and the loader are booby-trapped): building the parser and printing a config
only read signatures and docstrings.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

import comlrl_lightning
from comlrl_lightning import MAGRPO
from comlrl_lightning.agents.factories import MODEL_FACTORIES
from comlrl_lightning.algorithms.fields import FieldGroup

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = [
    "MAGRPO",
    "MAREINFORCE",
    "MARLOO",
    "MAReMax",
    "CentralizedMAGRPO",
    "IAC",
    "MAAC",
    "MADPO",
    "MADPOIter",
    "MARLHF",
    "MARLHFIter",
]
# One shipped config per family.
CONFIGS = ["magrpo", "iac", "madpo", "marlhf", "madpo_iter"]


@dataclasses.dataclass
class MysteryFields(FieldGroup):
    """A group whose field has no ``Args:`` line."""

    mystery_knob: int = 3


class Undocumented(MAGRPO):
    """A MAGRPO whose extra field has no ``Args:`` line: the checker below must report it (and only it)."""

    field_groups = (*MAGRPO.field_groups, MysteryFields)


def init_fields(cls: type) -> list[str]:
    """Every keyword the class accepts through its ``__init__`` chain (in MRO order, each name once)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        for param in inspect.signature(vars(klass)["__init__"]).parameters.values():
            if (
                param.name != "self"
                and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
                and param.name not in names
            ):
                names.append(param.name)
    return names


def strip_type(text: str) -> str:
    """A help or comment text without jsonargparse's ``(type: ..., default: ...)`` suffix."""
    return re.sub(r"\s*\((type|default):.*$", "", " ".join(text.split()), flags=re.S).strip()


def help_descriptions(text: str, prefix: str = "--model.") -> dict[str, str]:
    """``{field: description}`` of every ``--model.<field>`` option in an argparse help text. An option line is
    ``  --model.x METAVAR[, --model.x+ METAVAR]`` followed by the help on the same line (after 2+ spaces) or on
    the indented lines below it."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        option = re.match(r"^  (--\S+?),?(\s.*)?$", line)
        if option:
            current = None
            name = option.group(1)
            if name.startswith(prefix):
                rest = (option.group(2) or "").strip()
                parts = re.split(r"\s{2,}", rest, maxsplit=1)
                current = name[len(prefix) :]
                found[current] = [parts[1] if len(parts) > 1 else ""]
        elif current is not None and line.startswith("   "):
            found[current].append(line.strip())
        else:
            current = None
    return {name: strip_type(" ".join(lines)) for name, lines in found.items()}


def comment_descriptions(text: str) -> dict[str, str]:
    """``{field: comment}`` of the keys of ``model.init_args`` in ``--print_config=comments`` output (the comment
    lines right above each key)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line == "model:")
    found, comment, inside = {}, [], False
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break  # the next top-level section
        if line == "  init_args:":
            inside, comment = True, []
            continue
        if not inside:
            continue
        if not line.strip():
            continue
        if not line.startswith("    "):
            break  # back at the level of init_args
        if line.startswith("    #"):
            comment.append(line.strip()[1:])
        elif re.match(r"^    [A-Za-z_]\w*:", line):
            found[line.split(":", 1)[0].strip()] = strip_type(" ".join(comment))
            comment = []
    return found


@pytest.fixture
def no_models(monkeypatch):
    """Fail the test if anything tries to load a model."""
    import comlrl_lightning.algorithms.team as team

    def trap(*_, **__):
        raise AssertionError("a model was loaded while building the parser or printing a config")

    for name in list(MODEL_FACTORIES):
        monkeypatch.setitem(MODEL_FACTORIES, name, trap)
    monkeypatch.setattr(team, "load_agents", trap)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from comlrl_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info, mock.patch.object(sys, "argv", ["comlrl_lightning"]):
        main(args)  # (sys.argv: pytest's own arguments would make LightningCLI warn)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def model_help(class_path: str, capsys) -> str:
    code, out, err = run_cli(["fit", "--model.help", class_path], capsys)
    assert code == 0, err
    return out


def missing_in(descriptions: dict[str, str], fields: list[str]) -> list[str]:
    return [f for f in fields if not descriptions.get(f)]


# ----------------------------------------------------------------------------------------------- --model.help
def test_every_algorithm_is_exported():
    for name in ALGORITHMS:
        assert name in comlrl_lightning.__all__ and issubclass(
            getattr(comlrl_lightning, name), comlrl_lightning.MultiAgentModule
        )


@pytest.mark.parametrize("name", ALGORITHMS)
def test_model_help_describes_every_field(name, capsys, no_models):
    cls = getattr(comlrl_lightning, name)
    fields = init_fields(cls)
    assert len(fields) > 30  # the whole chain was followed (a family alone declares a handful)
    text = model_help(f"comlrl_lightning.{name}", capsys)
    descriptions = help_descriptions(text)
    assert [f for f in fields if f not in descriptions] == [], f"{name}: fields missing from --model.help"
    assert sorted(descriptions) == sorted(fields), f"{name}: help lists fields the signatures do not"
    assert missing_in(descriptions, fields) == [], f"{name}: fields without a description in --model.help"


@pytest.mark.parametrize("name", ["TaskDataModule", "PreferenceDataModule"])
def test_data_help_describes_every_field(name, capsys):
    fields = init_fields(getattr(comlrl_lightning, name))
    code, out, err = run_cli(["fit", "--data.help", f"comlrl_lightning.{name}"], capsys)
    assert code == 0, err
    descriptions = help_descriptions(out, prefix="--data.")
    assert sorted(descriptions) == sorted(fields)
    assert missing_in(descriptions, fields) == [], f"{name}: fields without a description in --data.help"


def test_the_checker_reports_a_field_without_a_description(capsys, no_models):
    """The checker itself: a subclass field with no ``Args:`` line is reported, the documented ones are not."""
    fields = init_fields(Undocumented)
    assert fields[-1] == "mystery_knob"
    descriptions = help_descriptions(model_help(f"{__name__}.Undocumented", capsys))
    assert "mystery_knob" in descriptions
    assert missing_in(descriptions, fields) == ["mystery_knob"]


def test_help_parser_reads_inline_and_wrapped_descriptions():
    text = (
        "Section:\n"
        "  --model.top_k TOP_K   sample among the k most likely\n"
        "                        tokens. (type: int | null, default: 50)\n"
        "  --model.agents AGENTS, --model.agents+ AGENTS\n"
        "                        the team. (type: str, default: tiny)\n"
        "  --model.bare BARE     (type: int, default: 3)\n"
        "  --model.wrapped WRAPPED\n"
        "                        (type: Literal['a', 'b'],\n"
        "                        default: a)\n"
        "  --data.dataset DATASET  not a model field.\n"
    )
    assert help_descriptions(text) == {
        "top_k": "sample among the k most likely tokens.",
        "agents": "the team.",
        "bare": "",
        "wrapped": "",
    }


def test_comment_parser_reads_each_keys_comment():
    text = (
        "trainer:\n  max_steps: 2\n"
        "model:\n  class_path: comlrl_lightning.MAGRPO\n\n  # the class docstring\n  init_args:\n\n"
        "    # the group baseline. (type: str | null, default: null)\n    advantage_mode:\n\n"
        "    # one formatter per agent,\n    # or one for all. (type: list | null, default: null)\n"
        "    formatters:\n    - a.b\n    - a.c\n\n"
        "    # (type: int, default: 3)\n    bare: 3\n"
        "    model_config:\n      dtype: float32\n"
        "data:\n  class_path: comlrl_lightning.TaskDataModule\n  init_args:\n    # not a model field.\n"
        "    dataset: x\n"
    )
    assert comment_descriptions(text) == {
        "advantage_mode": "the group baseline.",
        "formatters": "one formatter per agent, or one for all.",
        "bare": "",
        "model_config": "",
    }


# ----------------------------------------------------------------------------------------------- --print_config
def class_of(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("config", CONFIGS)
def test_print_config_is_yaml_with_every_field(config, capsys, no_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["fit", "--config", str(REPO / "configs" / f"{config}.yaml"), "--print_config"], capsys)
    assert code == 0, err
    printed = yaml.safe_load(out)
    shipped = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())
    assert printed["model"]["class_path"] == shipped["model"]["class_path"]
    fields = init_fields(class_of(printed["model"]["class_path"]))
    init_args = printed["model"]["init_args"]
    assert [f for f in fields if f not in init_args] == []
    for key, value in shipped["model"]["init_args"].items():  # the config's own values, not the defaults
        if not isinstance(value, (list, dict)) and key != "reward_func":
            assert init_args[key] == value, key
    assert not any(tmp_path.iterdir()), "--print_config wrote files"


def comments_supported() -> bool:
    from jsonargparse import _optionals

    return bool(getattr(_optionals, "ruamel_support", False))


@pytest.mark.parametrize("config", CONFIGS)
def test_print_config_comments_describe_every_field(config, capsys, no_models, tmp_path, monkeypatch):
    """``--print_config=comments`` (jsonargparse offers it when ruamel.yaml is installed): a comment per field."""
    if not comments_supported():
        pytest.skip("jsonargparse offers --print_config=comments only with ruamel.yaml installed")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        ["fit", "--config", str(REPO / "configs" / f"{config}.yaml"), "--print_config=comments"], capsys
    )
    assert code == 0, err
    printed = yaml.safe_load(out)
    fields = init_fields(class_of(printed["model"]["class_path"]))
    comments = comment_descriptions(out)
    assert [f for f in fields if f not in comments] == [], "fields missing from the printed config"
    assert missing_in(comments, fields) == [], f"{config}: fields without a comment in --print_config=comments"


# ----------------------------------------------------------------------------------------------- Literal typos
@pytest.mark.parametrize(
    "field,typo,allowed",
    [
        ("loss_aggregation", "mean_of_means", "seq_sum, token_mean, seq_mean_token_mean, dr_grpo"),
        ("lr_decay", "exponential", "constant, linear, cosine"),
    ],
)
def test_a_literal_typo_names_the_allowed_values(field, typo, allowed, capsys, no_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "magrpo.yaml"),
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            f"--model.init_args.{field}",
            typo,
        ],
        capsys,
    )
    assert code == 2, err
    assert f"{field} must be one of: {allowed}" in err, err
    assert repr(typo) in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
