"""``dejavu-lab perplexity --method teal`` killed with SIGKILL while it calibrates, then rerun:
the rerun recomputes (or resumes from the saved histograms) and prints what an uninterrupted run
prints, with the same calibration file; no run ever loads half a file.

As in ``test_collect_kill.py``, the runs are forked from one helper process that imported
everything once (:mod:`_killed_run`); every run has its own cache folder, and a resumed run
reuses the killed run's. TEAL writes its calibration file twice:
the histograms, then again with the greedy allocation. A run kills itself with SIGKILL at a
chosen write of that file (half of it written; whole and fsync-ed but not yet renamed), or is
killed from outside while a slowed write is half done. A tiny local Llama with its own tokenizer
keeps each run to a fraction of a second once imported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _killed_run import killed_runs
from _tiny_folder import build

from dejavu_lab.assets import fetch
from dejavu_lab.sparsify import load_calibration

PRELUDE = "import dejavu_lab.sparsify, transformers"  # imported once, before the helper forks

ARGV = (
    "--method teal --sparsity 0.5 --window 16 --max-tokens 16 --calibration-tokens 64 "
    "--json --no-progress"
).split()
# a run kills itself at the n-th write of its calibration file (.llama-*.partial)
KILLS = {
    "histograms-mid": {"kill": {"file": "llama-", "nth": 1, "when": "mid"}},
    "histograms-before-rename": {"kill": {"file": "llama-", "nth": 1, "when": "before-rename"}},
    # the histograms are on disk: the rerun resumes from them
    "greedy-mid": {"kill": {"file": "llama-", "nth": 2, "when": "mid"}},
    # SIGKILL from outside, halfway through the first write
    "from-outside": {"slow": {"file": "llama-", "seconds": 0.5}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, in one helper process: (status by name, root, logs)."""
    root = tmp_path_factory.mktemp("calibrate-kill")
    model = build(root / "tiny-llama")
    corpus = fetch("lee_background.cor")

    def cache(name: str) -> Path:
        folder = root / name
        folder.mkdir(exist_ok=True)
        shutil.copy(corpus, folder)  # the demo corpus, offline
        return folder

    def run(name: str, folder: Path, **how) -> dict:
        argv = ["perplexity", "--model", str(model), *ARGV]
        return {"name": name, "argv": argv, "env": {"DEJAVU_LAB_CACHE": str(folder)},
                "folder": str(folder), **how}  # fmt: skip

    phase1 = [run("reference", cache("reference"))]
    for name, how in KILLS.items():
        phase1.append(run(name, cache(name), **how))
        if "slow" in how:
            phase1[-1]["kill_when"] = f"{root / name}/calibration/.llama-*.partial"
    phase2 = [run(f"{n}-resumed", root / n) for n in KILLS]  # the killed run's cache
    logs = root / "logs"
    logs.mkdir()
    return killed_runs([phase1, phase2], logs, PRELUDE), root, logs


def calibration_files(folder: Path) -> dict[str, bytes]:
    """The calibration folder's files by name (lock files aside)."""
    folder = folder / "calibration"
    if not folder.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix != ".lock"}


def content(data: bytes) -> tuple[dict, dict]:
    """A safetensors file's metadata and tensors: what it holds, whatever order safetensors wrote
    its metadata keys in (a Rust HashMap's, which differs between processes)."""
    from safetensors.torch import load

    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return header["__metadata__"], {k: v.tolist() for k, v in load(data).items()}


def test_sigkill_leaves_no_half_file_under_the_final_name(runs):
    status, root, _ = runs
    assert status["reference"] == {"signal": None, "code": 0}, status["reference"]
    ref = calibration_files(root / "reference")
    (name,) = ref  # one calibration file: histograms and TEAL's greedy path
    assert (
        load_calibration(root / "reference" / "calibration" / name).greedy_table("teal") is not None
    )
    for kill in KILLS:
        assert status[kill]["signal"] == 9, (kill, status[kill])
        left = calibration_files(root / f"{kill}.after-phase-0")
        whole = {n: b for n, b in left.items() if not n.startswith(".")}
        assert any(n.endswith(".partial") for n in left), kill  # the killed write's temporary
        if kill == "greedy-mid":  # the histograms were saved whole before the greedy search
            cal = load_calibration(root / f"{kill}.after-phase-0" / "calibration" / name)
            assert cal.greedy_table("teal") is None
            assert list(whole) == [name]
        else:
            assert whole == {}, kill  # nothing under the final name


def test_rerun_after_sigkill_prints_the_same_and_writes_the_same_file(runs):
    status, root, logs = runs
    ref_out = json.loads((logs / "reference.out").read_text())
    ref = calibration_files(root / "reference")
    (name,) = ref
    for kill in KILLS:
        assert status[f"{kill}-resumed"] == {"signal": None, "code": 0}, kill
        out = json.loads((logs / f"{kill}-resumed.out").read_text())
        assert out["perplexity"] == ref_out["perplexity"], kill
        assert out["kept"] == ref_out["kept"], kill
        files = calibration_files(root / kill)
        assert list(files) == list(ref), kill  # no temporary left behind
        assert content(files[name]) == content(ref[name]), kill
