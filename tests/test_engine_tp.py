"""Tensor-parallel decoding on CPU: ``torchrun --nproc-per-node 2`` (gloo) runs every
case of tests/_tp_worker.py in one launch — tiny OPT and Llama (GQA), TP=2 logits against TP=1,
dense and sparse (every unit kept; a budget with fixed sets; TEAL and CATS thresholds), greedy
tokens for 16 steps, the predictors' per-rank top-k, one-sentence errors, and
kernels/bench_engine_tp.py --quick."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _audit import sentence

from dejavu_lab.engine import EngineError, TPDecoder
from dejavu_lab.models import random_model

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_tp_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "tp.json"
    # TRITON_INTERPRET=0: the kernels' torch references (the interpreter takes minutes for 16
    # tokens; tests/kernels/ checks the kernels against them): this tests the plumbing
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DEJAVU_LAB_RESULTS": str(out.parent),
        "OMP_NUM_THREADS": "1",
        "TRITON_INTERPRET": "0",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(WORKER),
           str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def _case(run, model, case) -> dict:
    return next(r for r in run["cases"] if r["model"] == model and r["case"] == case)


CASES = [
    (m, c)
    for m in ("tiny-opt", "tiny-llama")
    for c in ("dense", "sparse_keep_all", "sparse_fixed_sets")
]
CASES += [("tiny-opt", "cats_calibrated"), ("tiny-llama", "teal_calibrated")]  # cut thresholds
CASES += [("tiny-opt-postln", "dense_odd_vocab"), ("tiny-llama", "dense_replicated_head")]


@pytest.mark.parametrize(("model", "case"), CASES)
def test_tp2_logits_and_tokens_match_tp1(run, model, case):
    r = _case(run, model, case)
    assert run["world_size"] == 2 and run["backend"] == "gloo"
    tol = 1e-5 if case == "dense" else 1e-2  # fp32; fp16 (two partial sums rounded, then added)
    assert r["relerr"] < tol, r
    assert r["tokens_tp"] == r["tokens_ref"] and len(r["tokens_tp"]) == 16, r
    assert r["ranks_agree"]
    if case == "sparse_fixed_sets":
        assert r["window"] == (4 if model == "tiny-opt" else 0)  # deferred KV on MHA only


@pytest.mark.parametrize("model", ["tiny-opt", "tiny-llama"])
def test_predictors_keep_each_ranks_top_share(run, model):
    r = _case(run, model, "predictors")
    assert r["local_topk_ok"] and r["ranks_agree"], r


def test_world_sizes_that_do_not_divide_give_one_sentence(run):
    e = run["errors"]
    assert (
        e["kv_heads"].startswith("tensor parallelism over 2 ranks")
        and "1 KV head;" in e["kv_heads"]
    )
    assert "255 MLP neurons" in e["neurons"] and "one process" in e["neurons"]
    assert "give every rank" in e["unbalanced"]
    for msg in e.values():
        sentence(msg, "EngineError")  # one line that says what to do


def test_quick_bench_records_every_variant(run):
    rows = json.loads(Path(run["bench"]["path"]).read_text())["rows"]
    e2e = {(r["model"], r["engine"]) for r in rows if r["kind"] == "e2e"}
    for model in ("tiny-opt", "tiny-llama"):
        assert {(model, v) for v in ("dense", "sparse", "sparse_fixed_sets")} <= e2e
    assert all(r["check_ok"] for r in rows if r["kind"] == "check")
    assert all(0 < r["comm_share"] for r in rows if r["kind"] == "e2e")
    assert all(r["keep_all_vs_dense"] < 3e-2 for r in rows if r.get("keep_all_vs_dense"))


def test_no_process_group_says_launch_with_torchrun():
    with pytest.raises(EngineError, match="launch this script with `torchrun") as e:
        TPDecoder(random_model("tiny-opt", dtype=torch.float16).model, max_seq_len=16)
    sentence(str(e.value), "EngineError")
