"""Every public function and class of the package shows a short example in its docstring.

The examples themselves run as doctests (``--doctest-modules`` in ``pyproject.toml``), so
this test only checks that none is missing; a wrong example fails its own doctest.
"""

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import dejavu_lab


def _public_modules() -> list[str]:
    names = ["dejavu_lab"]
    for info in pkgutil.walk_packages(dejavu_lab.__path__, "dejavu_lab."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def _public_objects(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    return [
        (name, obj)
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module_name
    ]


@pytest.mark.parametrize("module_name", _public_modules())
def test_every_public_object_has_an_example(module_name):
    missing = [
        name for name, obj in _public_objects(module_name) if ">>>" not in (obj.__doc__ or "")
    ]
    assert not missing, f"{module_name}: add a short '>>>' example to the docstring of {missing}"


def test_examples_are_not_skipped():
    """An example marked +SKIP is not checked; only lines that need a GPU may skip, and the
    comment on the line before says so (doctest accepts nothing after its directive)."""
    skipped = []
    for module_name in _public_modules():
        for name, obj in _public_objects(module_name):
            lines = (obj.__doc__ or "").splitlines()
            for before, line in zip([""] + lines, lines, strict=False):
                if "+SKIP" in line and "GPU" not in before + line:
                    skipped.append(f"{module_name}.{name}")
    assert not skipped, f"these examples are skipped without a GPU reason: {sorted(set(skipped))}"


def _api_page() -> dict[str, set[str] | None]:
    """Each automodule on book/api.md: its explicit member list, or None for a bare ':members:'."""
    text = (Path(__file__).parents[1] / "book" / "api.md").read_text()
    pages = {}
    for block in re.split(r"\.\. automodule:: ", text)[1:]:
        name, _, rest = block.partition("\n")
        members = re.match(r"\s*:members:(.*)", rest)
        listed = members.group(1).strip() if members else ""
        pages[name.strip()] = {m.strip() for m in listed.split(",")} if listed else None
    return pages


@pytest.mark.parametrize("module_name", [m for m in _public_modules() if m != "dejavu_lab"])
def test_the_api_page_documents_every_public_object(module_name):
    pages = _api_page()
    assert module_name in pages, f"add '.. automodule:: {module_name}' to book/api.md"
    module = importlib.import_module(module_name)
    listed = pages[module_name]
    if listed is None:  # a bare :members: documents the module's __all__ (or every public name)
        listed = set(getattr(module, "__all__", [n for n, _ in _public_objects(module_name)]))
    missing = sorted({name for name, _ in _public_objects(module_name)} - listed)
    assert not missing, f"book/api.md does not document {module_name}: {missing}"
