"""TEAL's own decoder as a peer (dejavu_lab.bench.peer_teal): the glue runs for real on a CPU
at a tiny shape, TEAL's Triton kernels under TRITON_INTERPRET=1, when a TEAL checkout is here
(``DEJAVU_TEAL_DIR``, or one extracted from a local mirror of its repository); without one,
the bad-path error and the threshold rule are still tested."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from dejavu_lab.bench import peer_teal, teal_import
from dejavu_lab.errors import InputError
from dejavu_lab.models import Shape
from dejavu_lab.report import peer as report_peer

MIRROR = Path("/work/.mirror/FasterDecoding+TEAL/repo")  # a bare clone, where one is kept
# every output width a multiple of TEAL's first tile config (BLOCK_N = 128): d 128, 4 heads of
# 32, 2 KV heads (W_QKV 256 wide), 256 neurons
TINY = Shape("llama", 128, 2, 4, 256, n_kv_heads=2, vocab=128)


@pytest.fixture(scope="module")
def teal_dir(tmp_path_factory):
    if os.environ.get("DEJAVU_TEAL_DIR"):
        return teal_import.teal_checkout(os.environ["DEJAVU_TEAL_DIR"]), None
    if not MIRROR.is_dir():
        pytest.skip("no TEAL checkout: set DEJAVU_TEAL_DIR to a clone of FasterDecoding/TEAL")
    out = tmp_path_factory.mktemp("teal")
    tar = subprocess.run(["git", "-C", str(MIRROR), "archive", "HEAD", "gpt-fast", "kernels"],
                         capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    head = subprocess.run(["git", "-C", str(MIRROR), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    return out, head  # an extracted tree has no .git: its commit is found from its files


@pytest.fixture(scope="module")
def teal(teal_dir):
    pytest.importorskip("msgspec", reason="TEAL's kernel wrapper imports msgspec")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TEAL's Triton kernels run on a CPU only under TRITON_INTERPRET=1")
    return teal_import.load_teal(teal_dir[0])


def test_a_folder_that_is_not_a_teal_checkout_is_one_sentence(tmp_path):
    (tmp_path / "gpt-fast").mkdir()
    with pytest.raises(InputError, match=r"is not a TEAL checkout \(it lacks gpt-fast/model.py,"):
        peer_teal.bench_teal(tmp_path, "llama-3-8b", [8], 4, [0.5], "cpu")
    with pytest.raises(InputError, match="runs Llama shapes only; 'opt-30b' is opt"):
        teal_import.teal_args("opt-30b", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_threshold_keeps_the_asked_fraction(dtype):
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    sparsities = [0.0, 0.1, 0.4, 0.5, 0.9]
    kept = [int((x.abs().float() > t).sum()) for t in peer_teal.threshold_for(x, sparsities)]
    ties = 0 if dtype == torch.float32 else 24  # fp16 magnitudes repeat: a few ties
    assert kept == pytest.approx([8000 - round(8000 * s) for s in sparsities], abs=ties)


def test_the_kernels_keep_exactly_the_entries_over_the_threshold(teal):
    """TEAL's op reads column i of W only where |x_i| > t: its product is the reference on
    the kept entries (fp32 comparison, fp32 accumulation), and differs from the dense one."""
    peer_teal._interpreter_configs(teal)
    gemv = teal.gemv.SparseGEMV.initialize("sparse_gemv", "cpu").operator(True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 256, generator=g).half()
    w = (torch.randn(128, 256, generator=g) / 16).half().T.contiguous().T  # column-major
    (t,) = peer_teal.threshold_for(x, [0.5])
    keep = x.abs().float() > t
    ref = (x.float() * keep) @ w.float().T
    out = gemv(x, w, t, 0).float()
    assert keep.float().mean().item() == 0.5
    assert ((out - ref).norm() / ref.norm()).item() < 2e-3
    assert ((out - x.float() @ w.float().T).norm() / ref.norm()).item() > 0.3


def _keep_all():
    return {(i, s): -1.0 for i in range(TINY.n_layers) for *_, s in peer_teal.SITES}


def test_keeping_everything_reproduces_the_dense_step(teal):
    """The glue (column-major weights, kernels, thresholds) with every column kept computes
    what TEAL's dense gpt-fast step computes."""
    ids = torch.randint(0, TINY.vocab, (1, 12), generator=torch.Generator().manual_seed(2))
    out = {}
    for name in ("dense", "keep_all"):
        model = peer_teal._build(teal, TINY, 16, "cpu")
        if name == "keep_all":
            peer_teal._sparsify(teal, model, _keep_all(), "cpu")
        with torch.no_grad():
            model(ids[:, :8], torch.arange(8))
            out[name] = torch.cat([model(ids[:, t : t + 1], torch.tensor([t])).float()
                                   for t in range(8, 12)])  # fmt: skip
    err = (out["keep_all"] - out["dense"]).norm() / out["dense"].norm()
    assert err.item() < 2e-2


def test_teal_decodes_at_the_kept_fraction_asked(teal, teal_dir):
    """bench_teal end to end at a tiny shape (eager on a CPU): rows for dense and 50%, and
    TEAL's kernels keep about half of each site's entries in the decode steps."""
    rows = peer_teal.bench_teal(teal_dir[0], TINY, [32], 9, [0.0, 0.5], "cpu", repeats=1)
    assert [r.get("error") for r in rows] == [None, None]
    dense, sparse = rows
    assert (dense["method"], sparse["method"], sparse["engine"]) == ("dense", "teal", "teal_peer")
    if teal_dir[1] is not None and teal_dir[1] in teal_import.KNOWN.values():
        assert sparse["teal_commit"] == teal_dir[1]
    assert all(r["ms_per_token"] > 0 for r in rows)
    assert sparse["kept_mean"] == pytest.approx(0.5, abs=0.05)
    assert 0.4 < sparse["kept_min"] <= sparse["kept_max"] < 0.6


def _script(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "kernels" / "bench_engine.py"
    spec = importlib.util.spec_from_file_location("bench_engine", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_engine", bench)  # its dataclass looks itself up
    spec.loader.exec_module(bench)
    return bench


def test_the_script_refuses_a_folder_that_is_not_teal_in_one_sentence(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"^--peer-teal: \S+ is not a TEAL checkout .*\.$"):
        _script(monkeypatch).main(["--quick", "--peer-teal", str(tmp_path)])


def test_the_script_records_teal_beside_ours(teal, teal_dir, tmp_path, monkeypatch, capsys):
    """bench_engine.py --quick --peer-teal: TEAL's rows in the same file as ours, its commit in
    the provenance, and the table of ours vs TEAL printed."""
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path))
    _script(monkeypatch).main(["--quick", "--no-check", "--methods", "dense", "--prompts", "8",
                               "--baselines", "", "--peer-teal", str(teal_dir[0]),
                               "--peer-repeats", "1", "--name", "quick"])  # fmt: skip
    saved = json.loads((tmp_path / "quick.json").read_text())
    peer = [r for r in saved["rows"] if r["kind"] == "peer"]
    assert [(r["model"], r["sparsity"], r.get("error")) for r in peer] == [
        ("tiny-llama", 0.0, None), ("tiny-llama", 0.5, None)]  # fmt: skip
    assert saved["provenance"]["teal_commit"] == teal.commit
    assert "ours vs TEAL's own decoder" in capsys.readouterr().out
    # the book's table of the recording (chapter 70): our dense row beside TEAL's, Llama only
    table = report_peer.peer_table(report_peer.load("quick")[0])
    assert set(table["model"]) == {"tiny-llama"}
    dense = table[table["sparsity"] == 0.0].iloc[0]
    assert dense["TEAL / ours"] == dense["TEAL's decoder (ms)"] / dense["ours (ms)"] > 0
    assert dense["our step"] == "dense"  # the only dense step this run timed


def test_the_peer_table_sets_our_default_dense_step_beside_teals():
    """Dense, TEAL's decoder is compared with the engine's default step (every column through
    our kernels) where the recording timed it, not with the cuBLAS step beside it."""
    row = {"kind": "e2e", "model": "m", "prompt": 8, "sparsity": 0.0}
    frame = pd.DataFrame([
        {**row, "engine": "dense", "ms_per_token": 6.0},
        {**row, "engine": "dense_columns", "ms_per_token": 5.0},
        {**row, "engine": "teal", "sparsity": 0.5, "ms_per_token": 3.0},
        {**row, "kind": "peer", "engine": "teal_peer", "ms_per_token": 5.5},
        {**row, "kind": "peer", "engine": "teal_peer", "sparsity": 0.5, "ms_per_token": 4.5},
    ])  # fmt: skip
    table = report_peer.peer_table(frame).set_index("sparsity")
    assert table.loc[0.0, "our step"] == "dense_columns" and table.loc[0.0, "ours (ms)"] == 5.0
    assert table.loc[0.5, "TEAL / ours"] == 1.5 and len(table) == 2
