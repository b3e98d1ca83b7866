"""The observation recorder on the demo model at tiny sizes, and the chapters' side-by-side
tables and sentences on the recordings in results/."""

import json
import os
from unittest import mock

import pytest

from dejavu_lab import results
from dejavu_lab.measure.observations import (
    STAGES,
    Sizes,
    head_levels,
    main,
    measure_stage,
    record,
    sweep_quantities,
)
from dejavu_lab.models import load_model
from dejavu_lab.report import observations as obs

TINY = Sizes(window=40, eval_windows=1, calib_windows=1, embed_windows=1, head_windows=1,
             mlp_levels=(0.5, 0.9), head_fractions=(1 / 3,), union_window=40,
             union_windows=8, union_positions=2, union_min_pos=16, union_draws=4)  # fmt: skip


@pytest.fixture(scope="module")
def demo():
    return load_model("demo")


def test_record_writes_every_stage_with_provenance_and_resumes(demo, tmp_path, capsys):
    model, tok, _ = demo
    with mock.patch.dict(os.environ, {results.ENV_DIR: str(tmp_path)}):
        path = record(model, tok, "obs", sizes=TINY, command="test", extra={"model": "demo"})
        frame, prov = results.load(path)
        assert set(frame["stage"]) == set(STAGES)
        assert prov["sizes"]["window"] == 40 and prov["n_layers"] == 30 and prov["model"] == "demo"
        assert set(prov["stage_seconds"]) == set(STAGES)
        values = dict(zip(frame["name"], frame["value"], strict=False))
        # the observations' real properties on the demo model, even at 40 tokens
        assert 0.5 < values["cos_consecutive"] < 1
        assert values["norm_ratio_mlp"] > 1  # the residual outweighs the update
        assert values["mlp_rise10_oracle"] > values["mlp_rise10_static"]  # contextual wins
        assert values["union_batch"] == 8  # the batch is capped by the sequences drawn
        assert 0 <= values["union_top10_mlp"] < 0.9
        # a rerun with the same sizes measures nothing and leaves the rows as they were
        before = json.loads(path.read_text())["rows"]
        record(model, tok, "obs", sizes=TINY, command="test")
        assert "already recorded" in capsys.readouterr().err
        assert json.loads(path.read_text())["rows"] == before


def test_record_starts_over_when_the_sizes_change(demo, tmp_path):
    model, tok, _ = demo
    with mock.patch.dict(os.environ, {results.ENV_DIR: str(tmp_path)}):
        record(model, tok, "obs", sizes=TINY, stages=("heads",), command="t", progress=False)
        other = Sizes(**{**TINY.__dict__, "head_windows": 2})
        path = record(model, tok, "obs", sizes=other, stages=("embeddings",), command="t",
                      progress=False)  # fmt: skip
        frame, prov = results.load(path)
        assert set(frame["stage"]) == {"embeddings"} and prov["sizes"]["head_windows"] == 2


def test_stage_and_levels_refuse_bad_input(demo):
    model, tok, _ = demo
    with pytest.raises(ValueError, match="stage must be one of"):
        measure_stage(model, tok, "nope", TINY)
    assert head_levels((0.01, 0.99), 12) == (1 / 12, 11 / 12)  # at least one head, one kept


def test_main_prints_the_quantities(capsys):
    assert main(["--stages", "embeddings", "--window", "32", "--embed-windows", "1"]) == 0
    out = capsys.readouterr().out
    assert "cos_consecutive" in out and "norm_ratio_mlp" in out


def test_sweep_quantities_say_at_least_when_the_curve_never_crosses():
    import pandas as pd

    sweep = pd.DataFrame({"target": "heads", "mode": "oracle", "sparsity": [0.25, 0.5],
                          "rise": [0.001, 0.02]})  # fmt: skip
    assert sweep_quantities(sweep)["heads_rise10_oracle"] == (0.5, False)


# --- the report on the recordings -------------------------------------------------------------


@pytest.mark.parametrize("chapter", sorted(set(STAGES.values())))
def test_each_chapter_table_sets_the_recording_beside_live_numbers(chapter):
    demo, prov = obs.load_recording(obs.DEMO_RECORDING)
    qwen, qprov = obs.load_recording()
    assert qprov["n_layers"] == 28 and qprov["model_dtype"] == "bfloat16"
    assert qprov["sizes"] == prov["sizes"], "the two recordings must be like for like"
    same = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in prov["sizes"].items()})
    table = obs.beside(chapter, demo, sizes=same)
    assert len(table.columns) == 2 and len(table) >= 2  # same sizes: no third column
    assert "—" not in table.iloc[:, 0].tolist()
    quick = obs.beside(chapter, demo, sizes=Sizes(window=48, union_windows=8))
    assert quick.columns[-1] == "demo model (recorded, same sizes)"
    assert quick.iloc[:, 0].tolist() == quick.iloc[:, 2].tolist()  # live = the demo recording
    sentence = obs.verdict(chapter, demo)
    assert sentence.endswith(".") and "Qwen2.5-Coder-1.5B" in sentence
    cap = obs.origin(qprov, chapter)
    assert cap.startswith("Qwen2.5-Coder-1.5B-Instruct, bfloat16") and "measured at" in cap


def test_verdict_follows_the_numbers():
    demo, _ = obs.load_recording(obs.DEMO_RECORDING)
    qwen, _ = obs.load_recording()
    flipped = {**demo, "rho_entropy_norm": (-qwen["rho_entropy_norm"][0], True)}
    text = obs.verdict("30_mean_shift_heads", flipped)
    rq = qwen["rho_entropy_norm"][0]
    assert ("on the demo model only" if rq >= 0 else f"on {'Qwen2.5-Coder-1.5B'} only") in text
