"""``dejavu-lab frontier`` on the demo model with tiny windows: the same numbers as the frontier
study, a recording with its provenance, resuming after ``kill -9`` without measuring a finished
point again, only the new points when methods or sparsities are added, a damaged state as one
sentence, and calibration on another text that leaves out what it shares with the evaluated one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dejavu_lab.cli.main import main

pytestmark = pytest.mark.slow  # loads the demo model

ROOT = Path(__file__).resolve().parents[1]
# 32-token windows, 2 evaluated after 64 training tokens: a point takes a fraction of a second
TINY = ["--window", "32", "--eval-tokens", "64", "--train-tokens", "64",
        "--calibration-tokens", "64", "--no-progress"]  # fmt: skip


def _run(capsys, *argv):
    rc = main(["frontier", *argv])
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def _state(folder: Path) -> dict:
    (path,) = folder.glob("*/state.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def demo():
    from dejavu_lab.models import load_model

    return load_model("demo")


@pytest.fixture(autouse=True)
def loaded_once(monkeypatch, demo):
    """Every in-process run reads the module's demo model (the same weights) instead of
    loading it again: seconds per run on a shared CPU."""
    import dejavu_lab.cli.frontier as cli_frontier

    monkeypatch.setattr(cli_frontier, "load", lambda args: demo)


def test_frontier_measures_the_studys_points_and_records_provenance(
    capsys, tmp_path, monkeypatch, demo
):
    from dejavu_lab import results
    from dejavu_lab.collect import fingerprint
    from dejavu_lab.sparsify.calibration import text_hash
    from dejavu_lab.sparsify.frontier import frontier, study_windows

    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path / "results"))
    argv = ["--methods", "oracle", "teal:uniform", "--sparsity", "0.3,0.6", *TINY,
            "--state-dir", str(tmp_path / "state"), "--record", "tiny_frontier", "--json"]  # fmt: skip
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    got = json.loads(out)
    rows = got["rows"]
    assert [(r["variant"], r["sparsity"]) for r in rows] == [
        ("dense", 0.0), ("oracle", 0.3), ("oracle", 0.6),
        ("teal (uniform)", 0.3), ("teal (uniform)", 0.6)]  # fmt: skip
    assert got["computed"] == 5 and got["reused"] == 0 and got["tokens"] == 64
    assert rows[0]["ppl_ratio"] == 1.0 and rows[0]["bytes_per_token_fraction"] == 1.0
    # the command is the study, point for point: the same perplexities and bytes
    model, tok, arch = demo
    kw = dict(window=32, eval_windows=2, train_tokens=64, calibration_tokens=64)
    ref = frontier(model, tok, ["oracle", "teal:uniform"], [0.3, 0.6], **kw)
    for r, (_, e) in zip(rows, ref.iterrows(), strict=True):
        assert (r["variant"], r["sparsity"]) == (e["variant"], e["sparsity"])
        assert r["perplexity"] == pytest.approx(e["perplexity"], rel=1e-6)
        assert r["bytes_per_token_fraction"] == pytest.approx(e["bytes_per_token_fraction"])
    assert all(r["perplexity"] > rows[0]["perplexity"] for r in rows[1:])
    frac = [r["bytes_per_token_fraction"] for r in rows if r["variant"] == "teal (uniform)"]
    assert 0.3 < frac[1] < frac[0] < 1
    # the recording: table, machine, versions, command and text hashes
    frame, prov = results.load(got["record"])
    assert Path(got["record"]).name == "tiny_frontier.json" and len(frame) == 5
    assert frame["perplexity"].tolist() == [r["perplexity"] for r in rows]
    assert prov["command"] == "dejavu-lab frontier " + " ".join(argv)
    assert prov["cpu"] and prov["cpu_count"] >= 1 and prov["torch"] and prov["git_sha"]
    assert prov["dtype"] == "float32" and prov["threads"] >= 1 and prov["model"] == "demo"
    calib, held_out = study_windows(tok, "demo", 32, 2, 64, 64)
    assert prov["text_sha"] == {"evaluated": text_hash(held_out), "calibration": text_hash(calib)}
    assert prov["model_fingerprint"] == fingerprint(model, arch)
    assert prov["variants"]["teal (uniform)"] == {"method": "teal", "allocation": "uniform"}
    assert set(frame["git_sha"]) == set(prov["points_git_sha"])


def test_a_new_machine_extends_a_recording_without_measuring_its_points_again(
    capsys, tmp_path, monkeypatch
):
    """The state folder lives in a cache a fresh machine lacks; the recording in ``results/``
    holds the same points, so a rerun adding a method takes them and measures only the new
    one. A recording of other settings gives nothing; a damaged one is one line and rewritten."""
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path / "results"))
    rec = ["--record", "tiny", "--json"]
    rc, out, err = _run(capsys, "--methods", "oracle", "--sparsity", "0.5", *TINY,
                        "--state-dir", str(tmp_path / "a"), *rec)  # fmt: skip
    assert rc == 0, err
    first = {r["variant"]: r for r in json.loads(out)["rows"]}
    rc, out, err = _run(capsys, "--methods", "oracle", "cats", "--sparsity", "0.5", *TINY,
                        "--state-dir", str(tmp_path / "b"), *rec)  # fmt: skip
    assert rc == 0 and "took 2 points from results/tiny.json" in err, err
    got = json.loads(out)
    assert (got["computed"], got["reused"]) == (1, 2)
    rows = {r["variant"]: r for r in got["rows"]}
    for name in ("dense", "oracle"):  # taken as measured, with their own sha and time
        assert rows[name]["perplexity"] == first[name]["perplexity"]
        assert rows[name]["computed_at"] == first[name]["computed_at"]
    # another window is another run: nothing taken
    other = [a if a != "32" else "16" for a in TINY]
    rc, out, err = _run(capsys, "--methods", "oracle", "--sparsity", "0.5", *other,
                        "--state-dir", str(tmp_path / "c"), *rec)  # fmt: skip
    assert rc == 0 and "took" not in err and json.loads(out)["computed"] == 2
    (tmp_path / "results" / "tiny.json").write_text("{not json")
    rc, out, err = _run(capsys, "--methods", "oracle", "--sparsity", "0.5", *TINY,
                        "--state-dir", str(tmp_path / "d"), *rec)  # fmt: skip
    assert rc == 0 and "could not be read" in err and json.loads(out)["computed"] == 2
    assert json.loads((tmp_path / "results" / "tiny.json").read_text())["rows"]


def test_adding_methods_and_sparsities_measures_only_the_new_points(capsys, tmp_path):
    state = ["--state-dir", str(tmp_path)]
    rc, out, err = _run(capsys, "--methods", "oracle", "--sparsity", "0.5", *TINY, *state, "--json")
    assert rc == 0, err
    first = {(p["spec"]["method"], p["sparsity"]): p["row"] for p in _state(tmp_path)["points"]}
    rc, out, err = _run(capsys, "--methods", "oracle", "cats", "--sparsity", "0.5", "0.7", *TINY,
                        *state, "--json")  # fmt: skip
    assert rc == 0 and "resuming" in err and "2 of 5 points done" in err
    got = json.loads(out)
    assert (got["computed"], got["reused"]) == (3, 2)
    again = {(p["spec"]["method"], p["sparsity"]): p["row"] for p in _state(tmp_path)["points"]}
    assert set(again) == {("dense", 0.0), ("oracle", 0.5), ("oracle", 0.7), ("cats", 0.5),
                          ("cats", 0.7)}  # fmt: skip
    for k, row in first.items():  # finished points are read back, never measured again
        assert again[k] == row
    # the table holds the requested points only, in the requested order
    rc, out, _ = _run(capsys, "--methods", "cats", "--sparsity", "0.7", *TINY, *state, "--json")
    got = json.loads(out)
    assert [r["variant"] for r in got["rows"]] == ["dense", "cats"] and got["computed"] == 0


def test_a_damaged_state_is_one_sentence_and_stays_as_it_was(capsys, tmp_path):
    state = ["--state-dir", str(tmp_path)]
    assert _run(capsys, "--methods", "oracle", "--sparsity", "0.5", *TINY, *state)[0] == 0
    (path,) = tmp_path.glob("*/state.json")
    for damage in (path.read_text()[:100], '{"format": "dejavu-lab-frontier-state/1"}', "\x00"):
        path.write_text(damage)
        rc, out, err = _run(capsys, "--methods", "oracle", "--sparsity", "0.5", *TINY, *state)
        assert rc == 2 and out == ""
        assert err.startswith("dejavu-lab: error: the frontier state") and "damaged" in err
        assert "delete it" in err and len(err.splitlines()) == 1
        assert path.read_text() == damage  # nothing written over it
    path.unlink()  # deleting it, as the sentence says, starts over
    assert _run(capsys, "--methods", "oracle", "--sparsity", "0.5", *TINY, *state)[0] == 0


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--methods", "relu"], "unknown method 'relu'"),
        (["--methods", "cats:greedy"], "cats has no greedy allocation"),
        (["--sparsity", "1.5"], "sparsity must be in [0, 1)"),
        (["--record", "results/x.json"], "--record takes a bare name"),
        (["--eval-tokens", "16"], "less than one window of 32 tokens"),
        (["--calibration-tokens", "128"], "must not exceed train_tokens"),
    ],
)
def test_bad_arguments_are_one_sentence(capsys, tmp_path, argv, says):
    rc, out, err = _run(capsys, *TINY, "--state-dir", str(tmp_path), *argv)
    assert rc == 2 and out == "" and says in err and len(err.splitlines()) == 1


def test_calibration_on_another_text_leaves_out_what_it_shares_with_the_evaluated_text(
    tmp_path, demo
):
    from dejavu_lab.corpus import load_text
    from dejavu_lab.sparsify.frontier import overlapping, study_windows

    _, tok, _ = demo
    _, held_out = study_windows(tok, "demo", 32, 4, 64, 64)
    copy = tmp_path / "copy.txt"  # the corpus itself as a file: it holds the evaluated text
    copy.write_text(load_text("demo")[:6000], encoding="utf-8")
    calib, held = study_windows(tok, "demo", 32, 4, 64, 640, calibration=str(copy))
    assert held.equal(held_out) and calib.shape == (20, 32)
    assert not overlapping(calib, held_out).any()
    from dejavu_lab.corpus import token_windows

    every = token_windows(tok, copy.read_text(), 32)
    assert overlapping(every, held_out).sum() >= 3  # what was left out: the evaluated windows
    assert not calib.equal(every[:20])


def test_a_run_killed_after_its_first_point_resumes_where_it_stopped(capsys, tmp_path):
    """SIGKILL once the state holds a point; the rerun measures only the others and ends with
    the table an uninterrupted run gives."""
    argv = ["frontier", "--methods", "oracle", "cats", "--sparsity", "0.3", "0.6", *TINY,
            "--json"]  # fmt: skip
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dejavu_lab.cli", *argv, "--state-dir", str(killed)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    t0, points = time.time(), []
    while time.time() - t0 < 180 and proc.poll() is None:
        states = list(killed.glob("*/state.json"))
        if states:
            points = json.loads(states[0].read_text())["points"]  # whole: replaced atomically
            if points:
                break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    at_kill = _state(killed)["points"]
    assert 1 <= len(at_kill) < 5
    rc = main([*argv, "--state-dir", str(killed)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"{len(at_kill)} of 5 points done" in err
    resumed = json.loads(out)
    assert (resumed["computed"], resumed["reused"]) == (5 - len(at_kill), len(at_kill))
    after = {json.dumps([p["spec"], p["sparsity"]]): p["row"] for p in _state(killed)["points"]}
    for p in at_kill:  # same timestamps: read back, not measured again
        assert after[json.dumps([p["spec"], p["sparsity"]])] == p["row"]
    assert main([*argv, "--state-dir", str(tmp_path / "whole")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["computed"] == 5
    keys = ("variant", "sparsity", "bytes_per_token_fraction", "kept")
    assert [{k: r[k] for k in keys} for r in resumed["rows"]] == [
        {k: r[k] for k in keys} for r in whole["rows"]
    ]
    # the killed process ran on one thread, this one maybe on more: rounding may differ
    ppl = [r["perplexity"] for r in whole["rows"]]
    assert [r["perplexity"] for r in resumed["rows"]] == pytest.approx(ppl, rel=1e-4)


def test_the_demo_recording_holds_every_training_free_variant_with_its_provenance():
    """results/frontier_demo.json (chapter 42 reads it): every point its command asked for,
    where and how it ran; the variants it holds are the method table's training-free ones and
    those the command names besides (a method added after the recording joins it when the
    command is run again: the finished points are kept)."""
    import shlex

    from dejavu_lab import results
    from dejavu_lab.cli.frontier import _variants

    frame, prov = results.load("frontier_demo")
    argv = shlex.split(prov["command"])
    named = argv[argv.index("--methods") + 1 :]
    named = named[: next((i for i, a in enumerate(named) if a.startswith("--")), len(named))]
    assert "training-free" in named
    variants = {k: v for text in named for k, v in _variants(text)}
    assert set(frame["variant"]) == {"dense", *prov["variants"]} == {"dense", *variants}
    assert {v: variants[v] for v in prov["variants"]} == prov["variants"]
    assert (frame[frame.variant != "dense"].groupby("variant").size() == 5).all()
    assert prov["command"].startswith("dejavu-lab frontier --model demo")
    assert prov["tokens"] >= 4096 and prov["window"] == 512 and prov["calibration_tokens"] == 8192
    for key in ("cpu", "torch", "dtype", "threads", "git_sha", "text_sha", "model_fingerprint"):
        assert prov[key], key
    assert (frame["ppl_ratio"].iloc[1:] > 1).all() and frame["perplexity"].iloc[0] > 1
