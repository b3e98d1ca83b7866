"""The speed chapters' captions and sentences say what ran: live or recorded, one model or
several, one batch or two. Live runs need a GPU, so a live run is stood in for by a recording cut
to what a live run measures (one model, batch 1 only) with a live provenance."""

import pandas as pd

from dejavu_lab import results
from dejavu_lab.report import batch, engine, kernels, source

LIVE_PROV = {"gpu": "NVIDIA H200", "date": "2026-12-05T01:00:00+00:00", "copy_tbps": 4.2}


def test_caption_says_live_or_recorded_and_why():
    live = source.caption(LIVE_PROV, live=True, files=["results/engine_e2e.json"])
    assert live == "Measured live on NVIDIA H200 (2026-12-05)."
    prov = results.load("engine_e2e")[1]
    cpu = source.caption(prov, live=False, files=["results/engine_e2e.json"], gpu=False)
    gpu = source.caption(prov, live=False, files=["results/engine_e2e.json"], gpu=True)
    assert cpu.startswith("Recorded on NVIDIA H200") and "measured at 360074a" in cpu
    assert cpu.endswith("No GPU here: drawn from results/engine_e2e.json.")
    assert "No GPU here" not in gpu and "LIVE = False" in gpu  # on a GPU box: a choice
    assert source.origin(LIVE_PROV, live=True) == "measured live on NVIDIA H200 (2026-12-05)"


def test_end_to_end_sentences_name_only_the_models_that_ran():
    frame = results.load("engine_e2e")[0]
    live = frame[frame["model"].isin(["opt-6.7b"]) | frame["model"].isna()]  # one live model
    one = engine.gains_sentence(engine.speedup_table(live, 512))
    assert one.startswith("Only the opt-6.7b shape ran: it gains ") and one.count("opt-6.7b") == 1
    several = engine.gains_sentence(engine.speedup_table(frame, 512))
    assert several.startswith("The opt-30b shape gains")
    assert all(m in several for m in ("opt-13b", "opt-6.7b", "llama-2-13b"))
    intro = engine.latency_intro(live, "opt-6.7b", LIVE_PROV, live=True)
    assert "opt-6.7b shape" in intro and "measured live on NVIDIA H200" in intro
    assert "recorded" not in intro.lower() and "OPT-30B" not in intro
    assert "recorded on NVIDIA H200" in engine.latency_intro(frame, "opt-30b",
                                                             results.load("engine_e2e")[1],
                                                             live=False)  # fmt: skip
    assert engine.budgets_phrase(live, ["opt-6.7b"]) == "opt-6.7b at 85% MLP + 50% heads removed"


def test_fused_step_compares_each_recording_with_its_own_dense_step():
    fused, fprov = results.load("engine_e2e_fused")
    unfused, uprov = results.load("engine_e2e")
    text = engine.fused_sentence(fused, fprov, unfused, uprov, "opt-6.7b", 512)

    def ratio(frame):
        e = frame[(frame.kind == "e2e") & (frame.model == "opt-6.7b") & (frame.prompt == 512)]
        ms = e.set_index("engine")["ms_per_token"]
        return ms["dense"] / ms["sparse"]

    assert f"{ratio(fused):.2f}× faster than the dense step of its own run" in text
    assert f"{ratio(unfused):.2f}× faster than its run's dense step" in text
    assert "results/engine_e2e_fused.json, recorded on" in text
    assert "results/engine_e2e.json, recorded on" in text
    assert (
        "the fused step is the " + ("slower" if ratio(fused) < ratio(unfused) else "faster") in text
    )
    missing = engine.fused_sentence(fused, fprov, unfused, uprov, "facebook/opt-6.7b", 512)
    assert missing.startswith("The recordings have no fused and unfused step")


def test_kernel_sentences_leave_out_what_a_live_run_did_not_measure():
    mlp, attn, prov, _ = kernels.load(live=False)
    live_mlp, live_attn = mlp[mlp.batch == 1], attn[attn.batch == 1]  # a quick live grid
    assert kernels.attention_sentence(live_attn).endswith("at batch 1.")
    assert "batch 16" in kernels.attention_sentence(attn)
    assert kernels.union_sentence(live_mlp, 12288) == "This run measured no batch of 16 tokens."
    for text in (kernels.attention_sentence(live_attn), kernels.union_sentence(mlp, 12288),
                 kernels.gather_sentence(live_mlp, 12288),
                 kernels.fit_sentence(kernels.overhead_fit(live_mlp), 12288)):  # fmt: skip
        assert "nan" not in text, text
    assert "attention" in prov and prov["attention"]["git_sha"] != prov["git_sha"]


def test_batch_sentences_follow_the_grid_that_ran():
    frame = batch.load(live=False)[0]
    live = frame[(frame["model"] == "llama-3-8b") & frame["batch"].isin([1, 32])]
    ratios = batch.ratios_sentence(live, "llama-3-8b", 2048)
    assert "B = 1" in ratios and "B = 32" in ratios and "B = 16" not in ratios
    targets = batch.targets_sentence(live)
    assert targets.startswith("llama-3-8b, prompt 2048: ") and "opt-30b" not in targets
    assert "B = 32 (target 1.3×" in targets and "B = 16" not in targets
    full = batch.targets_sentence(frame)
    met = batch.targets(frame)["met"]
    assert full.count("met;") == met.sum() and full.count("missed;") == (~met).sum()
    shares = batch.time_shares(live, "llama-3-8b", 2048)
    assert "from" in batch.attention_sentence(shares) and "B = 32" in batch.attention_sentence(
        shares
    )
    assert batch.uncapped_sentence(live[live.engine != "sparse_uncapped"]) == (
        "This run has no uncapped rows."
    )
    for text in (ratios, targets, batch.uncapped_sentence(live), batch.attention_sentence(shares)):
        assert "nan" not in text, text


def test_batch_sentences_without_the_demo_model_are_one_sentence():
    assert batch.union_sentence(None, None).count(".") == 1
    assert batch.quality_sentence(None, None, 0.5).count(".") == 1
    q = pd.DataFrame({"window": [0, 0, 0, 0, 1, 1, 1, 1], "perplexity": [30.0, 33, 32, 36] * 2,
                      "run": ["dense", "batch 1", "batch 2", "batch 2, union <= 50%"] * 2})  # fmt: skip
    h = pd.DataFrame({"window": [0, 0, 1, 1], "perplexity": [31.0, 31.01] * 2,
                      "run": ["batch 1", "batch 2"] * 2})  # fmt: skip
    text = batch.quality_sentence(q, h, 0.5)
    assert text.startswith("Over 2 held-out windows, the mean perplexity is 33.0 alone and 32.0")
    assert "31.01 against 31.00 alone" in text
