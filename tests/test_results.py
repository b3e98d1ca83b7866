"""dejavu_lab.results: atomic save with provenance, strict load."""

import json

import numpy as np
import pytest

from dejavu_lab import results
from dejavu_lab.results import ResultsError


@pytest.fixture
def rdir(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path / "res"))
    return tmp_path / "res"


def test_results_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("DEJAVU_LAB_RESULTS", raising=False)
    assert results.results_dir().name == "results"
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path))
    assert results.results_dir() == tmp_path


def test_save_load_roundtrip(rdir):
    rows = [
        {"d": 4096, "kept": 0.1, "ms": np.float32(0.25), "n": np.int64(3)},
        {"d": 8192, "kept": 0.5, "ms": float("nan"), "n": 4},
    ]
    path = results.save("demo", rows, command="pytest", extra={"ceiling_tbps": 4.2})
    assert path == rdir / "demo.json"
    assert [p.name for p in rdir.iterdir()] == ["demo.json"]  # no temp file left behind
    frame, prov = results.load("demo")
    assert list(frame["d"]) == [4096, 8192]
    assert frame["ms"][0] == pytest.approx(0.25)
    assert frame["ms"].isna()[1]  # NaN is stored as null
    for key in results.REQUIRED_PROVENANCE:
        assert key in prov
    assert prov["command"] == "pytest" and prov["ceiling_tbps"] == 4.2
    assert results.load(path)[1] == prov  # by path too
    assert results.list_results() == ["demo"]
    assert "unknown GPU" not in results.describe(prov)


def test_save_refuses_bad_input(rdir):
    with pytest.raises(ValueError, match="bare name"):
        results.save("a/b", [], command="x")
    with pytest.raises(TypeError, match="list of dicts"):
        results.save("a", [1, 2], command="x")
    with pytest.raises(ValueError, match="overwrite"):
        results.save("a", [], command="x", extra={"gpu": "fake"})


def test_load_errors_do_not_modify(rdir):
    rdir.mkdir(parents=True)
    with pytest.raises(ResultsError, match="no results file"):
        results.load("missing")
    bad = rdir / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ResultsError, match="not valid JSON"):
        results.load("bad")
    assert bad.read_text() == "{not json"
    noprov = rdir / "noprov.json"
    noprov.write_text(json.dumps({"rows": []}))
    with pytest.raises(ResultsError, match="no 'provenance'"):
        results.load("noprov")
    partial = rdir / "partial.json"
    text = json.dumps({"provenance": {"gpu": "x"}, "rows": []})
    partial.write_text(text)
    with pytest.raises(ResultsError, match="provenance lacks"):
        results.load(partial)
    assert partial.read_text() == text


def test_provenance_records_the_switches_that_change_a_run(monkeypatch):
    monkeypatch.setenv("DEJAVU_PDL_EARLY", "0")
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", "/somewhere")  # names where, not what: left out
    info = results.provenance("python kernels/bench_engine_int4.py")
    assert info["env"]["DEJAVU_PDL_EARLY"] == "0"
    assert "DEJAVU_LAB_RESULTS" not in info["env"]
    monkeypatch.delenv("DEJAVU_PDL_EARLY")
    assert "DEJAVU_PDL_EARLY" not in results.provenance("x").get("env", {})
