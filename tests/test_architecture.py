"""The layout keeps its promises: layers import one way, ``core/`` is pure maths, algorithm functions stay short, and
the package cites what its users have (the paper, ``docs/``), not private notes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "comlrl_lightning"
# Each layer may import the ones after it, never the ones before it (leaves such as cli/callbacks sit on top).
LAYERS = ["algorithms", "callbacks", "data", "comparators", "rollout", "agents", "runs", "core"]


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).glob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_one_way(layer):
    above = LAYERS[: LAYERS.index(layer)]
    for path in modules(layer):
        for name in imports_of(path):
            for other in above + ["cli", "examples"]:
                assert not name.startswith(f"comlrl_lightning.{other}"), f"{path.name} ({layer}) imports {name}"


def test_core_is_pure_tensor_maths():
    impure = {"os", "io", "json", "tempfile", "pathlib", "shutil", "xml", "csv", "pickle", "subprocess"}
    for path in modules("core"):
        roots = {name.split(".")[0] for name in imports_of(path)} | {
            name.split(".")[0] + "." + name.split(".")[1] for name in imports_of(path) if "." in name
        }
        assert not roots & impure, f"core/{path.name} imports {sorted(roots & impure)}"
        tree = ast.parse(path.read_text())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "open" not in calls and "print" not in calls, f"core/{path.name} does I/O"


def test_algorithm_functions_read_in_one_screen():
    for path in modules("algorithms"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"algorithms/{path.name}:{node.lineno} {node.name} is {length} lines"


def test_the_package_cites_what_its_users_have():
    private = ("REFERENCE §", "DESIGN §", "REFERENCE.md", "DESIGN.md")
    files = [
        *PACKAGE.rglob("*.py"),
        *(REPO / "docs").glob("*.md"),
        *(REPO / "configs").rglob("*.yaml"),
        REPO / "README.md",
        *(REPO / "benchmarks").glob("*.py"),
        *(REPO / "benchmarks").glob("*.md"),
    ]
    for path in files:
        text = path.read_text(encoding="utf-8")
        for marker in private:
            assert marker not in text, f"{path.relative_to(REPO)} cites {marker!r}, a file users do not have"


def test_a_choice_is_declared_once():
    """A choice field's allowed spellings are one ``Choice`` declaration: the field's ``Literal`` comes from it, and
    the code normalises with the same object (no second alias table to drift)."""
    from comlrl_lightning.agents.devices import PARALLEL_TRAINING
    from comlrl_lightning.algorithms import fields
    from comlrl_lightning.comparators.api import API_FORMAT
    from comlrl_lightning.comparators.sources import COMPARATOR_GENERATION_MODE, COMPARATOR_POLICY
    from comlrl_lightning.core.replay import REPLAY_MODE
    from comlrl_lightning.rollout.tree import JOINT_MODE

    for choice, annotation in (
        (JOINT_MODE, fields.JointMode),
        (REPLAY_MODE, fields.ReplayMode),
        (COMPARATOR_POLICY, fields.ComparatorPolicy),
        (COMPARATOR_GENERATION_MODE, fields.GenerationMode),
        (API_FORMAT, fields.ApiFormat),
        (PARALLEL_TRAINING, fields.ParallelTraining),
    ):
        assert fields.choices_of(annotation) == tuple(choice.aliases)
        assert all(choice(spelling.upper()) == value for spelling, value in choice.aliases.items())
    for path in PACKAGE.rglob("*.py"):
        assert "_ALIASES = {" not in path.read_text(), f"{path.relative_to(REPO)} writes an alias table by hand"


def test_an_algorithm_is_a_short_chain_of_classes_over_composed_field_groups():
    """Fields come in as composed dataclass groups and an iterative variant's rounds as a composed object, not as
    base classes: an algorithm's own MRO is at most the algorithm, its parent algorithm, its family and the base,
    and no algorithm writes ``__init__``."""
    import dataclasses

    import comlrl_lightning
    from comlrl_lightning.algorithms.fields import FieldGroup

    for name in comlrl_lightning.algorithms.__all__:
        cls = getattr(comlrl_lightning, name, None)
        if not (isinstance(cls, type) and issubclass(cls, comlrl_lightning.MultiAgentModule)):
            continue
        own = [k for k in cls.__mro__ if k.__module__.startswith("comlrl_lightning")]
        assert len(own) <= 4, f"{name}: {[k.__name__ for k in own]}"
        assert not any(issubclass(k, FieldGroup) for k in own), name
        assert all(dataclasses.is_dataclass(g) and issubclass(g, FieldGroup) for g in cls.field_groups), name
    with pytest.raises(ValueError, match="writes __init__: declare its fields in a group"):

        class Handwritten(comlrl_lightning.MAGRPO):
            def __init__(self, knob: int = 1, **kwargs):
                super().__init__(**kwargs)
