"""kernels/gpu_check.py executes notebooks with nbclient and counts their error cells: checked on
two tiny notebooks (the real chapters take minutes; the GPU box runs them)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "kernels" / "gpu_check.py"
HEADER = """---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---
"""


def _cell(code: str) -> str:
    return f"```{{code-cell}} ipython3\n{code}\n```\n\n"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


@pytest.fixture
def notebooks(tmp_path):
    good = tmp_path / "good.md"
    good.write_text(HEADER + "# A chapter that runs\n\n"
                    + _cell("import dejavu_lab\nfrom myst_nb import glue\nx = 6 * 7")
                    + _cell('glue("answer", f"the answer is {x}", display=False)'))  # fmt: skip
    bad = tmp_path / "bad.md"
    bad.write_text(HEADER + _cell("y = 1 / 0") + _cell("z = 2") + _cell("print(y)"))
    return good, bad


def test_counts_cells_errors_and_glued_text(gpu_check, notebooks, tmp_path):
    good, bad = notebooks
    ok = gpu_check.execute(good, timeout=60, save=tmp_path / "out")
    assert (ok.name, ok.cells, ok.errors) == ("good", 2, [])
    assert ok.glued == {"answer": "'the answer is 42'"}  # the package imported from the tree
    assert (tmp_path / "out" / "good.ipynb").is_file()
    failed = gpu_check.execute(bad, timeout=60)
    assert failed.cells == 3 and len(failed.errors) == 2  # every cell ran after the first error
    assert failed.errors[0].startswith("cell 1: ZeroDivisionError: division by zero")
    assert failed.errors[1].startswith("cell 3: NameError")
    assert "\x1b[" not in "".join(failed.errors)  # a plain-text log, not terminal colours


def test_main_prints_a_table_writes_the_log_and_fails(gpu_check, notebooks, tmp_path,
                                                      monkeypatch, capsys):  # fmt: skip
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path / "results"))
    good, bad = notebooks
    assert gpu_check.main(["--no-tests", str(good)]) == 0
    assert gpu_check.main(["--no-tests", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "chapter" in out and "errors" in out and "FAILED" in out
    log = (tmp_path / "results" / "gpu_check.log").read_text()
    rows = [line.split() for line in log.splitlines() if line.startswith(("good", "bad"))]
    assert [r[:3] for r in rows] == [["good", "2", "0"], ["bad", "3", "2"]]
    assert "answer = 'the answer is 42'" in log and "cell 1: ZeroDivisionError" in log
