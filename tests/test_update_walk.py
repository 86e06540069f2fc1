"""``benchmarks/update_walk.py`` on a synthetic three-file package whose calls are counted by hand below."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FILES = {
    "util.py": """
        def helper(x):
            return leaf(x)


        def leaf(x):
            return len(x)  # a builtin: the walk ends


        def unused():
            return leaf(1)


        def report(owner):
            return owner.describe()  # typed by the caller's argument


        class Store:
            def add(self, x):
                return helper(x)

            def describe(self):
                return 1
        """,
    "base.py": """
        from pkg import util
        from pkg.util import helper


        class Base:
            def __init__(self):
                self.store = util.Store()  # Store defines no __init__: no edge; self.store is exactly a Store

            @property
            def size(self):
                return helper(self)

            def update(self, batch):
                self.prepare(batch)
                n = self.size  # a property read
                self.store.add(batch)
                return self.finish(n)

            def prepare(self, batch):
                return util.leaf(batch)

            def finish(self, n):
                return util.report(self)

            def describe(self):
                return 0
        """,
    "impl.py": """
        from .base import Base


        class Child(Base):
            def prepare(self, batch):
                super().prepare(batch)
                batch.add(1)  # unknown receiver: Store.add and Other.add
                return self.rule.score(batch)


        class Rule:
            def score(self, batch):
                return batch


        class Other:
            def add(self, x):
                return x


        def build(batch):
            team = Child()
            return team.update(batch)
        """,
}

BASE, IMPL, UTIL = "pkg/base.py", "pkg/impl.py", "pkg/util.py"


@pytest.fixture(scope="module")
def update_walk():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import update_walk
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return update_walk


@pytest.fixture
def package(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    for name, text in FILES.items():
        (root / name).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return root


def edges(report):
    return {(a.split(":", 1)[1], b.split(":", 1)[1]) for a, b, _ in report.edges}


def test_the_update_in_a_class_context_with_a_bind(update_walk, package):
    """self is exactly Child, ``.rule`` is a Rule: every edge is typed except ``batch.add`` (two candidates)."""
    report = update_walk.walk(package, "base.py:Base.update", class_context="Child", binds={"rule": "Rule"})
    assert edges(report) == {
        ("Base.update", "Child.prepare"),  # self.prepare: Child's, by Child's MRO
        ("Base.update", "Base.size"),  # property read
        ("Base.update", "Store.add"),  # self.store is exactly a Store (set in __init__)
        ("Base.update", "Base.finish"),
        ("Child.prepare", "Base.prepare"),  # super()
        ("Child.prepare", "Store.add"),  # batch.add: ambiguous
        ("Child.prepare", "Other.add"),  # batch.add: ambiguous
        ("Child.prepare", "Rule.score"),  # the bind
        ("Base.size", "helper"),
        ("Store.add", "helper"),
        ("Base.prepare", "leaf"),  # util.leaf: module attribute
        ("Base.finish", "report"),  # util.report(self): owner is exactly Child
        ("report", "Base.describe"),  # not Store.describe
        ("helper", "leaf"),
    }
    assert len(report.functions) == 12 and len(report.edges) == 14
    assert list(report.files) == [BASE, IMPL, UTIL]
    assert report.ambiguous_sites == 1 and report.upper_bound and report.by_name_edges == 0
    # in one file: update->size, update->finish, Store.add->helper, helper->leaf, ->score, ->Other.add
    assert report.cross_file_edges == 8
    assert f"{UTIL}:unused" not in report.functions


@pytest.mark.parametrize("unknown", ["none", "unique"])
def test_untyped_receivers_can_be_left_out(update_walk, package, unknown):
    """``batch.add`` matches two methods: neither mode follows it; Store.add is still reached through self.store."""
    report = update_walk.walk(
        package, "base.py:Base.update", class_context="Child", binds={"rule": "Rule"}, unknown=unknown
    )
    assert len(report.functions) == 11 and len(report.edges) == 12 and len(report.files) == 3
    assert not report.upper_bound and f"{IMPL}:Other.add" not in report.functions


def test_without_a_context_self_may_be_any_subclass(update_walk, package):
    """self is a Base or a subclass: self.prepare has two candidates (Base's and Child's override); self.rule is
    unknown, so .score matches by name (one candidate)."""
    report = update_walk.walk(package, "base.py:Base.update")
    assert len(report.functions) == 12 and len(report.edges) == 15 and len(report.files) == 3
    assert ("Base.update", "Base.prepare") in edges(report) and ("Base.update", "Child.prepare") in edges(report)
    assert report.ambiguous_sites == 2 and report.by_name_edges == 1


def test_stop_reaches_a_function_but_does_not_walk_it(update_walk, package):
    report = update_walk.walk(
        package, "base.py:Base.update", class_context="Child", binds={"rule": "Rule"}, stop={"prepare"}
    )
    assert report.stopped == [f"{IMPL}:Child.prepare"]
    assert len(report.functions) == 9 and len(report.edges) == 9 and len(report.files) == 3
    assert f"{BASE}:Base.prepare" not in report.functions  # reached only through Child.prepare's super()


def test_a_constructed_object_is_exactly_its_class(update_walk, package):
    """``team = Child()`` is an edge to the inherited ``Base.__init__``, and ``team.update`` dispatches on Child."""
    report = update_walk.walk(package, "impl.py:build")
    assert {("build", "Base.__init__"), ("build", "Base.update"), ("Base.update", "Child.prepare")} <= edges(report)
    assert ("Base.update", "Base.prepare") not in edges(report)
    assert len(report.functions) == 14 and len(report.edges) == 16 and len(report.files) == 3
    assert report.ambiguous_sites == 1 and report.by_name_edges == 1


def test_the_command_line(update_walk, package, tmp_path, capsys):
    out = tmp_path / "walk.json"
    update_walk.main(
        [
            str(package),
            "pkg/base.py:Base.update",
            "--class-context",
            "Child",
            "--bind",
            "rule=Rule",
            "--unknown",
            "none",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert "functions reached: 11\n" in text and "edges (hops): 12\n" in text and "files: 3\n" in text
    import json

    data = json.loads(out.read_text())
    assert len(data["functions"]) == 11 and not data["upper_bound"]


RETURNS = {
    "mod.py": """
        from .make import Maker


        class Step:
            def finish(self):
                return done()


        class Other:
            def finish(self):
                return 0


        def done():
            return 1


        def begin() -> Step:
            return Step()  # Step defines no __init__: no edge


        def untyped():
            return Step()


        def run():
            step = begin()
            step.finish()  # typed by begin's return annotation: Step.finish only
            other = untyped()
            other.finish()  # no annotation: an unknown receiver, Step.finish and Other.finish by name
            return Maker().make().finish()  # a method's string annotation, resolved in its own module
        """,
    "make.py": """
        from .mod import Step


        class Maker:
            def make(self) -> "Step | None":
                return Step()
        """,
}


@pytest.mark.parametrize("unknown", ["none", "all"])
def test_a_return_annotation_types_the_result(update_walk, tmp_path, unknown):
    """run -> begin, untyped, Maker.make, Step.finish (typed twice); Step.finish -> done. ``--unknown all`` adds
    ``other.finish``'s by-name candidates (Step.finish again and Other.finish): one ambiguous site."""
    root = tmp_path / "pkg"
    root.mkdir()
    for name, text in RETURNS.items():
        (root / name).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    report = update_walk.walk(root, "mod.py:run", unknown=unknown)
    typed = {
        ("run", "begin"),
        ("run", "untyped"),
        ("run", "Maker.make"),
        ("run", "Step.finish"),
        ("Step.finish", "done"),
    }
    assert edges(report) == (typed | {("run", "Other.finish")} if unknown == "all" else typed)
    assert len(report.functions) == (7 if unknown == "all" else 6) and len(report.files) == 2
    assert report.cross_file_edges == 1 and report.ambiguous_sites == (1 if unknown == "all" else 0)
