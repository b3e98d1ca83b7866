"""kernels/bench_engine.py's plumbing on CPU (``--quick``): every variant runs, checks and is
recorded, so the one GPU call that times them all does not fail on a typo."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "kernels" / "bench_engine.py"


def test_quick_run_records_every_variant(tmp_path, monkeypatch, capsys):
    # import the kernels first: triton.jit picks interpreter or compiler when a kernel is
    # defined, so a kernel module first imported below would stay compiled for later tests
    importlib.import_module("dejavu_lab.engine")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' references: plumbing only
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path))
    spec = importlib.util.spec_from_file_location("bench_engine", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_engine", bench)  # its dataclass looks itself up
    spec.loader.exec_module(bench)
    methods = "dense,dense_columns,dense_auto,dejavu,teal,wina,cats,larosa,rsparse"
    bench.main(["--quick", "--no-check", "--methods", methods, "--sparsity", "0.5", "--prompts", "8",
                "--baselines", "hf,hf_compiled", "--name", "quick"])  # fmt: skip
    rows = json.loads((tmp_path / "quick.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r]
    e2e = [r for r in rows if r["kind"] == "e2e"]
    for model in ("tiny-opt", "tiny-llama"):
        got = {r["engine"] for r in e2e if r["model"] == model}
        assert got >= {
            "hf",
            "hf_compiled",
            "dense",
            "dense_columns",
            "dense_auto",
            "sparse",
            "teal",
            "wina",
            "cats",
            "larosa",
            "rsparse",
        }, got
        cols = next(r for r in e2e if r["model"] == model and r["engine"] == "dense_columns")
        assert cols["keep_all_vs_dense"] < 3e-2  # every column read: the dense model's logits
        by = {r["engine"]: r for r in e2e if r["model"] == model and r.get("sparsity") == 0.5}
        teal = by["teal"]["bytes_total"]  # LaRoSA and R-Sparse (factors included) at its bytes
        assert by["larosa"]["bytes_total"] == teal
        assert by["rsparse"]["lowrank_bytes"] > 0
        assert abs(by["rsparse"]["bytes_total"] - teal) < 0.02 * teal
    assert all(r["check_ok"] for r in e2e if "check_ok" in r)
    assert {r["op"] for r in rows if r["kind"] == "op"} == {"qkv", "attn", "o", "mlp"}
    out = capsys.readouterr().out
    assert "vs hfc" in out and "vs best" in out  # the table was printed


def test_cats_gate_bench_quick_checks_every_variant(capsys):
    """kernels/bench_cats_gate.py --quick (CPU, the interpreter): every gate variant and both
    CATS paths are checked against fp32 math (a wrong one exits) and printed."""
    path = SCRIPT.parent / "bench_cats_gate.py"
    spec = importlib.util.spec_from_file_location("bench_cats_gate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick"])
    out = capsys.readouterr().out
    for variant in ("cublas_fp32", "cublas_fp16", "rows_sums", "hidden_cublas", "mlp_rows_sums"):
        assert variant in out, variant


def test_int4_bench_times_dejavu_at_the_window_asked():
    """``--kv-window``: the DejaVu rows carry the window the decoder ran (0: every head's K/V
    each step; default: SparseConfig's), and a window of 0 decodes."""
    import torch

    from dejavu_lab.bench.engine_int4 import bench_int4
    from dejavu_lab.engine import SparseConfig

    for window, want in ((0, 0), (None, SparseConfig().kv_window)):
        rows = []
        bench_int4("tiny-llama", prompt=4, new_tokens=3, group=64, sparsities=[0.5],
                   methods=["dejavu"], device="cpu", ceiling=float("nan"), rows=rows,
                   check_tokens=(4, 2), quiet=True, kv_window=window, int4_only=True)  # fmt: skip
        dv = [r for r in rows if r["kind"] == "e2e" and r["engine"] == "dejavu"]
        assert len(dv) == 1 and "error" not in dv[0], dv
        assert dv[0]["kv_window"] == want and torch.isfinite(torch.tensor(dv[0]["ms_per_token"]))


def test_topk_bench_quick_checks_both_selections(capsys):
    """kernels/bench_topk.py --quick: at every width and budget the engine runs (neurons and
    heads, one row and a batch's), our select keeps the values torch.topk keeps (a mismatch
    exits), and the table has a row per case."""
    path = SCRIPT.parent / "bench_topk.py"
    spec = importlib.util.spec_from_file_location("bench_topk", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table = bench.main(["--quick"])
    assert [(r["shape"], r["n"], r["rows"]) for r in table] == [c[0:2] + c[3:] for c in bench.CASES]
    assert {r["k"] for r in table if r["shape"] == "opt-13b"} == {3072, 20}
    assert "torch/ours" in capsys.readouterr().out
