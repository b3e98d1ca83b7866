"""The engine profile's grouping and the speedup bound drawn from it (chapter 70)."""

import pandas as pd
import pytest

from dejavu_lab.report import profile as profile_report


def _table():
    parts = {f"{p} (us)": 0.0 for p in profile_report.PARTS}
    rows = [
        {"model": "m", "method": "dense", "step (us)": 1000.0, "floor (us)": 700.0,
         **parts, "attention (us)": 100.0, "norms (us)": 50.0, "idle (us)": 50.0},
        {"model": "m", "method": "teal", "step (us)": 800.0, "floor (us)": 350.0,
         **parts, "attention (us)": 100.0, "small ops (us)": 30.0, "idle (us)": 20.0},
    ]  # fmt: skip
    return pd.DataFrame(rows).set_index(["model", "method"])


def test_bound_table_adds_the_fixed_work_to_the_floor():
    b = profile_report.bound_table(_table())
    assert b.loc[("m", "teal"), "fixed (us)"] == pytest.approx(150.0)
    assert b.loc[("m", "teal"), "ceiling step (us)"] == pytest.approx(500.0)
    assert b.loc[("m", "teal"), "speedup now"] == pytest.approx(1000 / 800)
    assert b.loc[("m", "teal"), "speedup bound"] == pytest.approx(1000 / 500)
    assert b.loc[("m", "dense"), "speedup bound"] == pytest.approx(1000 / 900)


def test_recorded_profile_bounds():
    b = profile_report.bound_table(profile_report.profile_table(profile_report.load_profile()[0]))
    methods = b.index.get_level_values("method")
    assert set(methods) >= {"dense", "teal"}
    # the dense step already streams its weights near the ceiling: its bound is about 1 (the
    # cache's bytes, counted twice, can put it a little under)
    assert b.loc[methods == "dense", "speedup bound"].between(0.9, 1.2).all()
    sparse = b.loc[methods != "dense"]
    assert (sparse["speedup bound"] > sparse["speedup now"]).all()
