"""Every chapter executes, in quick mode (DEJAVU_QUICK=1), so a broken chapter fails `make test`.

``make book`` runs the same notebooks at full size; here each one shrinks itself through the
``size(full, quick)`` calls in its parameters cell.
"""

from pathlib import Path

import jupytext
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.md"))


def test_there_are_chapters():
    assert NOTEBOOKS, "no chapters found in notebooks/"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_executes_in_quick_mode(path, monkeypatch):
    monkeypatch.setenv("DEJAVU_QUICK", "1")
    nb = jupytext.read(path)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert params, f"{path.name} has no cell tagged 'parameters'"
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
