"""The recorded frontiers side by side: loader, crossings, the decision sentence, the figure."""

import json
import math

import pandas as pd
import pytest

from dejavu_lab import results
from dejavu_lab.errors import ResultsError
from dejavu_lab.report import frontier_sentences, frontiers


def test_loader_reads_every_recording_with_provenance_and_dense():
    frame, provs = frontiers.load_frontiers()
    files = sorted(results.results_dir().glob(f"{frontiers.PREFIX}*.json"))
    assert files and len(provs) == len(files)
    assert "demo" in provs
    for model, prov in provs.items():
        assert all(k in prov for k in frontiers.NEEDED), model
        g = frame[frame.model == model]
        dense = g[g.variant == "dense"]
        assert len(dense) == 1 and dense.ratio.iloc[0] == 1.0 and dense.bytes_fraction.iloc[0] == 1
        assert (g.variant != "dense").any()
        # the ratio is to this model's dense perplexity
        assert (g.ratio * dense.perplexity.iloc[0] - g.perplexity).abs().max() < 1e-9
        assert frontiers.describe(model, prov).startswith(frontiers.title(model))
    assert frame.bytes_fraction.between(0, 1).all()
    assert set(frontiers.missing_models(provs)).isdisjoint(provs)


def _write(folder, name, prov, rows):
    (folder / f"{frontiers.PREFIX}{name}.json").write_text(
        json.dumps({"provenance": prov, "rows": rows})
    )


def test_loader_refuses_a_recording_without_dense(tmp_path):
    frame, provs = frontiers.load_frontiers()
    prov = {k: v for k, v in provs["demo"].items() if k != "file"}
    rows = [{"variant": "cats", "method": "cats", "sparsity": 0.5, "perplexity": 9.0,
             "bytes_per_token_fraction": 0.7}]  # fmt: skip
    _write(tmp_path, "x", prov, rows)
    with pytest.raises(ResultsError, match="no dense row"):
        frontiers.load_frontiers(tmp_path)
    assert frontiers.load_frontiers(tmp_path / "empty")[1] == {}


def _synthetic() -> pd.DataFrame:
    # two models; on m1 variant a is better everywhere, on m2 b is better at 0.5
    rows = []
    for model, curves in {
        "m1": {"a": [(0.8, 1.005), (0.6, 1.04), (0.4, 1.3)], "b": [(0.8, 1.02), (0.4, 1.5)]},
        "m2": {"a": [(0.8, 1.02), (0.5, 1.3)], "b": [(0.8, 1.08), (0.5, 1.1)]},
    }.items():
        rows.append({"model": model, "variant": "dense", "method": "dense", "sparsity": 0.0,
                     "bytes_fraction": 1.0, "perplexity": 10.0, "ratio": 1.0})  # fmt: skip
        for v, pts in curves.items():
            for i, (b, r) in enumerate(pts):
                rows.append({"model": model, "variant": v, "method": "teal", "sparsity": i / 10,
                             "bytes_fraction": b, "perplexity": 10 * r, "ratio": r})  # fmt: skip
    return pd.DataFrame(rows)


def test_crossings_on_a_known_frame():
    cross = frontiers.crossing_table(_synthetic()).set_index(["model", "variant", "fraction"])
    # m1/a at 0.6 is a measured point; at 0.5 halfway (in log) between 1.04 and 1.3
    assert cross.loc[("m1", "a", 0.6), "ratio"] == pytest.approx(1.04)
    assert cross.loc[("m1", "a", 0.5), "ratio"] == pytest.approx(math.sqrt(1.04 * 1.3))
    # 0.75 lies between 0.8 and 0.6 (a quarter of the way)
    assert cross.loc[("m1", "a", 0.75), "ratio"] == pytest.approx(1.005**0.75 * 1.04**0.25)
    assert cross.loc[("m2", "b", 0.5), "ratio"] == pytest.approx(1.1)
    assert len(cross) == 2 * 2 * 3


def test_decision_when_models_agree_and_disagree():
    frame = _synthetic()
    best = frontiers.best_at(frontiers.crossing_table(frame), frame).set_index(
        ["fraction", "model"]
    )
    assert best.loc[(0.6, "m1"), "variant"] == "a" and best.loc[(0.5, "m2"), "variant"] == "b"
    assert bool(best.loc[(0.5, "m2"), "meets"])  # 1.1 <= 1.15
    said = dict(zip((0.75, 0.6, 0.5), frontier_sentences.decision(best.reset_index(), names=str),
                    strict=True))  # fmt: skip
    assert said[0.75].startswith("At 75% of the weight bytes a is best on all 2 models")
    assert "met on none of the 2 models" in said[0.75]
    assert said[0.5].startswith("At 50% of the weight bytes the models disagree: a is best on m1")
    assert "b on m2 (+10.0%, a +30.0%)" in said[0.5]
    assert said[0.5].endswith("The target (at most +15%) is met on m2 only.")


def test_oracle_is_never_the_pick():
    cross = pd.DataFrame({"model": "m", "variant": ["oracle", "teal (greedy)"], "fraction": 0.5,
                          "ratio": [1.01, 1.2]})  # fmt: skip
    assert frontiers.best_at(cross).variant.tolist() == ["teal (greedy)"]


def test_oracle_sentence_sets_the_oracle_beside_the_best_pick():
    cross = pd.DataFrame({"model": ["m"] * 4 + ["n"] * 2,
                          "variant": ["oracle", "teal (greedy)"] * 3,
                          "fraction": [0.6, 0.6, 0.5, 0.5, 0.5, 0.5],
                          "ratio": [1.3, 1.08, 1.6, 1.2, math.nan, 1.1]})  # fmt: skip
    said = frontier_sentences.oracle_sentence(cross, frontiers.best_at(cross), names=str)
    assert "on m +30.0% against +8.0% at 60% of the bytes, +60.0% against +20.0% at 50%" in said
    assert "on n" not in said  # no oracle crossing there
    assert (
        frontier_sentences.oracle_sentence(
            cross[cross.variant != "oracle"], frontiers.best_at(cross)
        )
        == ""
    )


def test_figure_has_one_trace_per_model_and_variant():
    frame, provs = frontiers.load_frontiers()
    fig = frontiers.frontiers_figure(frame, "caption")
    curves = [(t.meta["model"], t.meta["variant"]) for t in fig.data if t.meta]
    expected = set(map(tuple, frame[frame.variant != "dense"][["model", "variant"]].values))
    assert sorted(curves) == sorted(expected)
    colors = {}
    for t in fig.data:
        if t.meta:  # one colour per variant in every panel
            assert colors.setdefault(t.meta["variant"], t.line.color) == t.line.color
    assert len(fig.layout.annotations) >= len(provs)  # a title per panel, and the caption


def test_decision_counts_the_majority_of_three():
    best = pd.DataFrame({"fraction": 0.5, "model": ["a", "b", "c"], "variant": ["x", "y", "x"],
                         "ratio": [1.1, 1.3, 1.2], "runner_up": None,
                         "runner_up_ratio": float("nan"), "target": 1.15,
                         "meets": [True, False, False]})  # fmt: skip
    (said,) = frontier_sentences.decision(best, names=str)
    assert said.startswith("At 50% of the weight bytes the models disagree: x is best on 2 of the "
                           "3 models, a (+10.0%) and c (+20.0%); y on b (+30.0%).")  # fmt: skip
    assert frontiers.consensus(best, 0.5) == (["x"], 2, 3)


def test_refit_sentence_pairs_each_refit_with_its_base_variant():
    cross = pd.DataFrame({"model": ["a", "a", "a", "b"],
                          "variant": ["w (layers)", "w (layers, refit)", "t (refit)", "w (layers)"],
                          "fraction": 0.6, "ratio": [1.09, 1.05, 1.2, 1.1]})  # fmt: skip
    said = frontier_sentences.refit_sentence(cross, names=str)
    assert "on a, w (layers) from +9.0% to +5.0% at 60% of the bytes" in said
    assert "t (refit)" not in said and "on b" not in said  # no base variant / no refit: left out
    assert frontier_sentences.refit_sentence(cross[~cross.variant.str.contains("refit")]) == ""


def test_tilt_sentence_pairs_each_tilted_refit_with_its_untilted_one():
    cross = pd.DataFrame({"model": ["a", "a", "a", "b"],
                          "variant": ["w (layers, refit)", "w (layers, refit, tilted)",
                                      "w (layers)", "w (layers, refit, tilted)"],
                          "fraction": 0.5, "ratio": [1.18, 1.14, 1.25, 1.2]})  # fmt: skip
    said = frontier_sentences.tilt_sentence(cross, names=str)
    assert "on a, w (layers, refit) from +18.0% to +14.0% at 50% of the bytes" in said
    assert "on b" not in said and "w (layers) from" not in said  # no untilted refit on b
    assert frontier_sentences.tilt_sentence(cross[~cross.variant.str.contains("tilted")]) == ""


def test_reruns_load_apart_from_the_frontiers_and_the_sentence_reads_each_point():
    frame, provs = frontiers.load_frontiers()
    again, aprovs = frontiers.load_frontiers(prefix=frontiers.RERUN)
    files = sorted(results.results_dir().glob(f"{frontiers.RERUN}*.json"))
    assert len(aprovs) == len(files)
    text = frontier_sentences.rerun_sentence(frame, provs, again, aprovs)
    assert bool(text) == bool(files)
    for key, prov in aprovs.items():
        base = prov["model"]
        assert base in provs, f"{key}: a rerun of a model with no frontier recording"
        mine = frame[(frame.model == base) & (frame.variant != "dense")]
        both = mine.merge(again[again.model == key], on=["variant", "sparsity"])
        assert len(both), f"{key} shares no point with the frontier of {base}"
        for r in both.itertuples():  # each point's two rises, as the sentence prints them
            assert (
                f"{r.variant} at {r.sparsity:.0%} {r.ratio_x - 1:+.1%} → {r.ratio_y - 1:+.1%}"
                in text
            )
        moved = (100 * (both.ratio_y - both.ratio_x)).abs().max()
        assert f"moved by {moved:.1f} points" in text


def test_rerun_sentence_names_what_changed():
    frame = pd.DataFrame({"model": "m", "variant": ["dense", "a", "a"], "sparsity": [0, 0.4, 0.5],
                          "ratio": [1.0, 1.05, 1.2]})  # fmt: skip
    again = frame.assign(model="m (x)", ratio=[1.0, 1.06, 1.17])
    text = frontier_sentences.rerun_sentence(
        frame, {"m": {"dtype": "bfloat16", "threads": 2}}, again,
        {"m (x)": {"model": "m", "dtype": "float32", "threads": 2}}, names=str,
    )  # fmt: skip
    assert "float32 instead of bfloat16" in text and "thread" not in text
    assert "moved by 3.0 points" in text and "median 2.0" in text
    assert frontier_sentences.rerun_sentence(frame, {}, again, {"m (x)": {"model": "m"}}) == ""
