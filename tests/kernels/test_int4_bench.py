"""kernels/bench_int4.py's and kernels/bench_int4_rows.py's plumbing on the CPU (``--smoke``, kernels under TRITON_INTERPRET=1):
every provider runs, the sweep checks its candidates, and the rows are recorded with
provenance, so the one GPU call that times them does not fail on a typo."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers import DEVICE

from dejavu_lab.report import int4_floor

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
ON_CPU_ONLY = pytest.mark.skipif(
    DEVICE != "cpu", reason="the smoke run is the CPU check; the GPU runs the bench"
)


def _bench(name, tmp_path, monkeypatch):
    """kernels/<name>.py as a module, writing its results under ``tmp_path``."""
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path))
    spec = importlib.util.spec_from_file_location(name, KERNELS / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, bench)
    spec.loader.exec_module(bench)
    return bench


@ON_CPU_ONLY
def test_smoke_run_records_every_provider(tmp_path, monkeypatch):
    _bench("bench_int4", tmp_path, monkeypatch).main(
        ["--smoke", "--batch", "1,3", "--name", "int4_smoke"]
    )
    data = json.loads((tmp_path / "int4_smoke.json").read_text())
    assert data["provenance"]["command"].endswith("--smoke --batch 1,3 --name int4_smoke")
    rows = data["rows"]
    timed = [r for r in rows if r["kind"] == "time"]
    for batch in (1, 3):
        got = {(r["provider"], r["kept"]) for r in timed if r["batch"] == batch}
        alone = {("int4_sums", k) for k in (1.0, 0.5, 0.2)} if batch == 1 else set()  # one token
        for listed in ("read_kept", "int4_listed", "lists"):  # the kept rows: one token
            alone |= {(listed, k) for k in (0.5, 0.2)} if batch == 1 else set()
        assert got == {("cublas", 1.0), ("fp16_ours", 1.0), ("int4", 1.0), ("read", 1.0),
                       ("fp16_thr", 0.5), ("fp16_thr", 0.2), ("int4_thr", 0.5),
                       ("int4_thr", 0.2)} | alone  # fmt: skip
    read = {r["batch"]: r for r in timed if r["provider"] == "read"}
    dense = {r["batch"]: r for r in timed if r["provider"] == "int4"}
    assert all(read[b]["bytes"] == dense[b]["bytes"] and dense[b]["of_read"] > 0 for b in (1, 3))
    assert all(r["us"] > 0 and r["bytes"] > 0 for r in timed)
    kept_read = {r["kept"]: r for r in timed if r["provider"] == "read_kept"}
    sums = {r["kept"]: r for r in timed if r["provider"] == "int4_sums" and r["kept"] < 1}
    assert all(sums[k]["of_read"] > 0 and kept_read[k]["bytes"] == sums[k]["bytes"] for k in sums)
    # the chapter's sentences read the recording: the read floor, and the kept rows' read
    text = int4_floor.kept_floor_sentence(("int4_smoke",))
    assert "50% kept: the read" in text and "20% kept: the read" in text and "tiny" in text
    assert text.count("listed beforehand") == 2 * len({r["shape"] for r in timed})
    listed = [r for r in timed if r["provider"] == "int4_listed"]
    assert listed and all(r["vs_unlisted"] > 0 and r["of_read"] > 0 for r in listed)
    assert "the read" in int4_floor.floor_sentence(("int4_smoke",))
    thr = [r for r in timed if r["provider"] == "int4_thr"]
    assert all(r["frac_ideal"] > 0 and r["config"] for r in thr)
    four = {
        r["kept"]: r["bytes"] for r in timed if r["provider"].startswith("int4") and r["batch"] == 1
    }
    assert four[0.2] < four[0.5] < four[1.0]  # the bytes model skips dropped rows
    swept = [r for r in rows if r["kind"] == "sweep"]
    assert {r["provider"] for r in swept} == {"int4", "int4_thr"}
    # both smoke candidates passed their check: per batch, dense at 1.0 and threshold at 2 kept
    assert len(swept) == 2 * 2 * (1 + 2)
    assert {r["op"] for r in swept} == {"int4_gemv_g32", "int4_threshold_gemv_g32"}


@ON_CPU_ONLY
def test_rows_smoke_run_checks_and_records_every_path(tmp_path, monkeypatch):
    _bench("bench_int4_rows", tmp_path, monkeypatch).main(
        ["--smoke", "--no-sweep", "--kept", "0.5", "--name", "rows_smoke"]
    )
    data = json.loads((tmp_path / "rows_smoke.json").read_text())
    assert data["provenance"]["command"].endswith("--kept 0.5 --name rows_smoke")
    timed = [r for r in data["rows"] if r["kind"] == "time"]
    got = {(r["provider"], r["path"]) for r in timed}
    assert got == {("up_columns", "half2"), ("up_rows", "half2"), ("up_dejavu", "half2"),
                   ("up_dejavu", "tile"), ("up_cats", "half2"), ("up_cats", "tile"),
                   ("down_rows", "scatter"), ("down_rows", "walk"),
                   ("down_threshold", "half2")}  # fmt: skip
    # every path computed its function (the check ran before the clock) and read fewer bytes
    # where it keeps fewer rows
    assert all(r["relerr"] < 1e-2 and r["us"] > 0 for r in timed), timed
    mb = {(r["provider"], r["path"]): r["mb"] for r in timed}
    assert mb[("up_dejavu", "half2")] == pytest.approx(mb[("up_rows", "half2")] / 2)
    assert mb[("up_dejavu", "half2")] < mb[("up_cats", "half2")] < mb[("up_rows", "half2")]
