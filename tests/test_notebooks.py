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


# The chapter template, in the order a reader meets it.
TEMPLATE = (
    "**Objectives.**",
    "**The paper's claim",
    "## What we found, beside the paper",
    "## On a GPU box",
    "**See also.**",
)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_follows_the_template(path):
    text = path.read_text()
    where = [text.find(part) for part in TEMPLATE]
    missing = [part for part, at in zip(TEMPLATE, where, strict=True) if at < 0]
    assert not missing, f"{path.name}: the chapter template needs {missing}"
    assert where == sorted(where), f"{path.name}: put {TEMPLATE} in this order"
    nb = jupytext.read(path)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    claim = next(i for i, c in enumerate(nb.cells) if "**The paper's claim" in c.source)
    assert claim < params, f"{path.name}: objectives and claim come before the parameters cell"


def test_chapters_link_to_their_neighbours():
    """'See also' names the previous and the next chapter in the order of the toc."""
    toc = yaml.safe_dump(yaml.safe_load((ROOT / "_toc.yml").read_text()))
    order = sorted(NOTEBOOKS, key=lambda p: toc.index(f"notebooks/{p.stem}"))
    for before, path, after in zip([None, *order[:-1]], order, [*order[1:], None], strict=True):
        see_also = path.read_text().split("**See also.**", 1)[1]
        for neighbour in (before, after):
            if neighbour is not None:
                assert f"{{doc}}`{neighbour.stem}`" in see_also, (
                    f"{path.name}: 'See also' should link to {neighbour.stem}"
                )
