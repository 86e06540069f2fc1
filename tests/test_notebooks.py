"""The notebooks in notebooks/ run top to bottom with the tiny models (their default parameters), in a temporary
working directory, offline; each shows its figures and stays stored without outputs."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_quickstart",
        "02_your_own_environment",
        "03_preference_learning",
        "04_analysing_a_run",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean_with_a_model_parameter_cell(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), "store notebooks without outputs"
    first = code[0]
    assert "parameters" in first.metadata.get("tags", [])
    assert 'MODEL = "tiny"  # or "smollm2-135m-instruct"' in first.source
    # Plots go through comlrl_lightning.analysis, not ad-hoc matplotlib code.
    assert not any("matplotlib" in c.source or "plt." in c.source for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    # The kernel inherits this process's environment (conftest.py: offline, one intra-op thread).
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError naming the cell on any error
    images = [
        base64.b64decode(out["data"]["image/png"])
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if "image/png" in out.get("data", {})
    ]
    assert images and all(image.startswith(b"\x89PNG") for image in images), "figures should display"
    errors = [out for cell in notebook.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors
    assert any((tmp_path / "runs").rglob("metrics.csv")), os.listdir(tmp_path)
