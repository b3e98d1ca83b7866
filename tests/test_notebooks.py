"""Every chapter is a jupytext MyST notebook with a parameters cell sized by ``book.size``.

The chapters are executed (quick mode) by the book build in ``test_book.py``.
"""

from pathlib import Path

import jupytext
import pytest
import yaml

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.md"))


def test_there_are_chapters():
    assert NOTEBOOKS, "no chapters found in notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_has_a_parameters_cell_and_is_in_the_toc(path):
    nb = jupytext.read(path)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{path.name}: expected one cell tagged 'parameters'"
    assert "size(" in params[0].source, f"{path.name}: size its run with book.size(full, quick)"
    toc = (ROOT / "_toc.yml").read_text()
    assert f"notebooks/{path.stem}" in yaml.safe_dump(yaml.safe_load(toc)), (
        f"{path.name} not in _toc.yml"
    )
