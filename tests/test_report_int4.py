"""The 4-bit chapter's tables, on the real recordings: bytes from step_bytes, perplexities and
rises that match results/quant_quality_*.json, a budget box that picks from them, and the speed
side both ways — no H200 recording (the chapter says so) and a real recording written by the
benchmarks' own CPU runs (``--smoke`` / the tiny engine) into a temporary results folder."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from dejavu_lab import results
from dejavu_lab.arch import get_arch
from dejavu_lab.bench.engine_int4 import bench_int4
from dejavu_lab.models import PRESETS
from dejavu_lab.report import int4, int4_budget
from dejavu_lab.report import int4_speed as speed
from dejavu_lab.step_bytes import step_bytes

ROOT = Path(__file__).resolve().parents[1]
DEMO = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)"
QWEN = "Qwen2.5 Coder 0.5B Instruct AWQ (qwen2.5-coder-0.5b-instruct-q4_k_m.gguf)"


@pytest.fixture(scope="module")
def quality():
    frame, provs = int4.load_quality()
    return frame, provs, int4.quality_table(frame)


def test_bytes_table_is_step_bytes():
    t = int4.bytes_table(kept=(1.0, 0.5, 0.25))
    assert len(t) == 2 * 2 * 3  # models x formats x kept
    arch = get_arch(PRESETS["llama-3-8b"].config())
    sites = dict.fromkeys(int4.TEAL_SITES, 0.5)
    want = step_bytes(arch, vocab=128256, context=512, site_kept=sites, int4_group=128)
    row = t[(t.model == "llama-3-8b") & (t.format == "int4 (group 128)") & (t.kept == 0.5)]
    assert row["total MB"].item() == pytest.approx(want["total"] / 1e6)
    # dense int4 reads half a byte per weight plus a 2-byte scale and min per 128: 0.2656 of fp16
    layers = t[(t.model == "llama-3-8b") & (t.kept == 1.0)].set_index("format")["layers MB"]
    assert layers["int4 (group 128)"] / layers["fp16"] == pytest.approx((0.5 + 4 / 128) / 2)
    assert set(t.loc[t.model == "smollm2-135m", "group"]) == {0, 64}  # 576 is not 128's
    for _, g in t.groupby(["model", "format"]):
        assert g.sort_values("kept")["total MB"].is_monotonic_increasing
    assert "3.1×" in int4.bytes_sentence(t) and "8×" in int4.bytes_sentence(t)


def test_quality_table_matches_the_recordings(quality):
    frame, provs, t = quality
    assert set(provs) == set(int4.QUALITY_FILES)
    assert len(t) == len(frame) == 23 + 31 + 30
    for name, prov in provs.items():
        rec, _ = results.load(name)
        mine = t.loc[prov["model"]]
        for r in rec.itertuples():
            got = mine.loc[(r.format, r.variant, r.sparsity)]
            assert got["perplexity"] == r.perplexity
            assert got["layer bytes vs fp16"] == r.bytes_vs_fp16
            # the recording's vs_fp_pct is ppl(format, s) / ppl(fp, s): ours, re-derived
            vs_fp = (1 + got["rise over fp dense %"] / 100) / (1 + got["same on fp %"] / 100)
            assert 100 * (vs_fp - 1) == pytest.approx(r.vs_fp_pct, nan_ok=True, abs=1e-9)
    # the interaction, by hand from the demo recording: TEAL 50% on int4 g128 vs on fp
    rec = results.load("quant_quality_demo")[0].set_index(["format", "variant", "sparsity"])
    ppl = rec["perplexity"]
    by_hand = (ppl["rtn-g128", "teal (uniform)", 0.5] * ppl["fp", "dense", 0.0]) / (
        ppl["rtn-g128", "dense", 0.0] * ppl["fp", "teal (uniform)", 0.5]
    )
    got = t.loc[(DEMO, "rtn-g128", "teal (uniform)", 0.5), "interaction %"]
    assert got == pytest.approx(100 * (by_hand - 1))
    assert t.loc[(QWEN, "rtn-g128", "dense", 0.0), "same on fp %"] == 0  # dense on fp: no rise
    assert math.isnan(t.loc[(QWEN, "rtn-g32", "teal (uniform)", 0.4), "interaction %"]) is False


def test_compound_sentences_follow_the_numbers(quality):
    _, _, t = quality
    demo = int4.compound_sentence(t, DEMO, "rtn-g128")
    assert "compounds" in demo  # +14% at 50% on the recording
    assert "multiply, no more" in int4.compound_sentence(t, QWEN, "rtn-g32")
    assert "+42.2%" in demo  # the format's dense cost, from the recording's vs_fp_pct


def test_budget_box_picks_the_fewest_bytes_within_each_budget(quality):
    _, _, t = quality
    box = int4_budget.budget_table(t, (2, 10, 50, 100))
    flat = t.reset_index()
    for (model, budget), pick in box.iterrows():
        ok = flat[(flat.model == model) & (flat["rise over fp dense %"] <= budget)]
        assert pick["rise over fp dense %"] <= budget
        assert pick["layer bytes vs fp16"] == ok["layer bytes vs fp16"].min()
    # on the demo, group 32 IS the file's format: free at any budget; Qwen's fp fits 2% only
    assert box.loc[(DEMO, 2), "format"] == "rtn-g32"
    assert tuple(box.loc[(QWEN, 2), ["format", "variant"]]) == ("fp", "dense")
    for model in (DEMO, QWEN):
        assert box.loc[model, "layer bytes vs fp16"].is_monotonic_decreasing
    md = int4_budget.budget_markdown(box)
    assert md.count("- **≤ ") == len(box) and "**SmolLM2-135M-Instruct**" in md


def test_speed_without_recordings_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV_DIR, str(tmp_path))  # an empty results folder
    for kind in ("kernels", "engine"):
        frame, provs, live, missing = speed.load_speed(kind, live=False)
        assert len(frame) == 0 and provs == {} and not live
        assert missing == list(speed.FILES[kind])
        sentence = speed.missing_sentence(kind, missing)
        assert sentence.startswith("There is no H200 recording") and "results/" in sentence
        assert all(m in speed.COMMANDS for m in missing)
    assert speed.kernel_table(frame).empty and speed.engine_table(frame).empty
    assert "untested" in speed.speed_sentence(speed.kernel_table(frame), frame)
    assert speed.missing_sentence("kernels", []) == ""


def _bench_int4_script():
    spec = importlib.util.spec_from_file_location("bench_int4", ROOT / "kernels" / "bench_int4.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_int4"] = module
    spec.loader.exec_module(module)
    return module


def test_speed_tables_read_a_real_recording(quality, tmp_path, monkeypatch):
    """The benchmarks' CPU runs write files of the H200 runs' format: the tables read them."""
    monkeypatch.setenv(results.ENV_DIR, str(tmp_path))
    _bench_int4_script().main(["--smoke", "--name", "int4_gemv_g128"])
    rows = []
    bench_int4("tiny-llama", prompt=4, new_tokens=3, group=64, sparsities=[0.5],
               methods=["teal"], device="cpu", ceiling=4.2, rows=rows, check_tokens=(4, 2),
               quiet=True, plain=True)  # fmt: skip
    results.save("engine_int4_8b", rows, command="test: bench_int4 tiny-llama")

    kframe, kprov, live, kmissing = speed.load_speed("kernels", live=False)
    assert kmissing == ["int4_gemv_g32_64"] and set(kprov) == {"int4_gemv_g128"}
    ktable = speed.kernel_table(kframe)
    rec = results.load("int4_gemv_g128")[0].query("kind == 'time'")
    cublas = rec.query("provider == 'cublas'")["us"].item()
    assert ktable["cublas (µs)"].item() == cublas
    assert ktable["int4 vs cuBLAS"].item() == pytest.approx(
        cublas / rec.query("provider == 'int4'")["us"].item()
    )
    assert {"int4_thr 50% of ideal", "int4_thr 20% vs int4 dense"} <= set(ktable.columns)
    assert "results/int4_gemv_g128.json: recorded on" in speed.speed_caption(kprov, False, kframe)

    eframe, eprov, _, emissing = speed.load_speed("engine", live=False)
    assert emissing == ["engine_int4_13b", "engine_int4_70b"]
    etable = speed.engine_table(eframe)
    e2e = [r for r in rows if r["kind"] == "e2e"]
    assert len(etable) == len(e2e) == 4
    dense = next(r for r in e2e if r["weights"] == "int4" and r["engine"] == "dense")
    assert etable.loc[("tiny-llama", "int4", "dense", 0.0), "ms/token"] == dense["ms_per_token"]
    assert speed.speed_figure(etable, "engine") is not None
    assert speed.speed_figure(ktable, "kernels") is not None
    assert "at tiny-llama int4 dense takes" in speed.speed_sentence(ktable, etable).lower()
    # the plain step's rows stay out of the table and give the fused step's ratio
    plain = [r for r in rows if r["kind"] == "plain"]
    assert [(r["weights"], r["engine"]) for r in plain] == [("int4", "dense"), ("int4", "teal")]
    for r in plain:
        fused = next(e for e in e2e if (e["weights"], e["engine"]) == (r["weights"], r["engine"]))
        assert r["fused_over_plain"] == pytest.approx(r["ms_per_token"] / fused["ms_per_token"])
    ratios = sorted(r["fused_over_plain"] for r in plain)
    sentence = speed.fused_step_sentence()
    assert "results/engine_int4_8b.json" in sentence
    assert f"{ratios[0]:.2f}" in sentence and f"{ratios[-1]:.2f}" in sentence

    # the budget box takes the measured time of a combination the engine timed at that shape
    box = int4_budget.budget_table(quality[2], (2,), engine=etable, shape="tiny-llama")
    fp16 = next(r for r in e2e if r["weights"] == "fp16" and r["engine"] == "dense")
    assert box.loc[(QWEN, 2), "tiny-llama measured ms/token"] == fp16["ms_per_token"]
