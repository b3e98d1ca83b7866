"""``dejavu-lab collect`` killed with SIGKILL at several points resumes to byte-identical data,
and processes collecting into one folder at once take turns instead of crashing.

The runs are forked from one helper process that imported everything once
(:mod:`_killed_run`), in two phases: first every killed run, the reference and the concurrent
runs at once; then the resumes. A run is killed with SIGKILL either by itself at a chosen
instant (half of the manifest or of a chunk written; a chunk written and fsync-ed but not yet
renamed) or from outside while it writes. A tiny local Llama with its own tokenizer and the
first 20k characters of the demo corpus keep each run to a fraction of a second.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _killed_run import killed_runs
from _tiny_folder import build
from safetensors.torch import load_file

# run in the helper process before it forks: 6 windows of 16 tokens need no 76k-token corpus
# (collect imported load_text by name)
PRELUDE = """
from dejavu_lab import corpus
import dejavu_lab.collect, dejavu_lab.models
text = corpus.load_text("demo")[:20000]
corpus.load_text = dejavu_lab.collect.load_text = lambda name="demo", *a, **k: text
"""

KILLS = {
    "mid-manifest": {"kill": {"file": "manifest.json", "when": "mid"}},
    "mid-chunk": {"kill": {"file": "chunk_00002", "when": "mid"}},
    "before-rename": {"kill": {"file": "chunk_00003", "when": "before-rename"}},
    # SIGKILL from outside, in the middle of chunk 2
    "from-outside": {"slow": {"file": "chunk", "seconds": 0.3}},
}
WAITERS = [f"second-{i}" for i in range(3)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, in one helper process: (status by name, folder, logs)."""
    root = tmp_path_factory.mktemp("collect-kill")
    model = build(root / "tiny-llama")

    def collect(name, out, *extra, **how):
        argv = ["collect", "--model", str(model), "--window", "16", "--max-tokens", "96",
                "--out", str(out), "--no-progress", *extra]  # fmt: skip
        return {"name": name, "argv": argv, "folder": str(out), **how}

    shared = root / "shared"
    first_chunk = str(shared / "chunk_00000.safetensors")
    phase1 = [collect("reference", root / "reference")]
    for name, how in KILLS.items():
        out = root / name
        phase1.append(collect(name, out, **how))
        if name == "from-outside":
            phase1[-1]["kill_when"] = str(out / "chunk_00001.safetensors")
    # one process collects and pauses before chunk 3; three more start into its folder while it
    # writes and must wait; one with another config must be refused at once
    phase1.append(collect("first", shared, hold="chunk_00003"))
    phase1 += [
        collect(n, shared, after=first_chunk, waits="waiting for it to finish") for n in WAITERS
    ]
    phase1.append(collect("other", shared, "--max-tokens", "64", after=first_chunk))
    phase2 = [collect(f"{n}-resumed", root / n) for n in KILLS]
    logs = root / "logs"
    logs.mkdir()
    return killed_runs([phase1, phase2], logs, PRELUDE), root, logs


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_sigkill_leaves_only_whole_files(runs):
    status, root, _ = runs
    assert status["reference"] == {"signal": None, "code": 0}
    ref = files(root / "reference")
    assert set(ref) == {"manifest.json"} | {f"chunk_{c:05d}.safetensors" for c in range(6)}
    for name in KILLS:
        assert status[name]["signal"] == 9, (name, status[name])  # SIGKILL
        left = root / f"{name}.after-phase-0"
        whole = {n: b for n, b in files(left).items() if not n.startswith(".")}
        for n, data in whole.items():  # whatever has its final name is a whole file
            assert data == ref[n], (name, n)
            if n.endswith(".safetensors"):
                load_file(left / n)
        if name == "mid-manifest":
            assert whole == {}  # nothing but the half-written temporary
        else:
            assert "manifest.json" in whole and "chunk_00000.safetensors" in whole
        if name in ("mid-chunk", "before-rename"):
            assert any(n.endswith(".partial") for n in os.listdir(left))  # the killed write


def test_resuming_after_sigkill_is_byte_identical(runs):
    status, root, _ = runs
    ref = files(root / "reference")
    for name in KILLS:
        assert status[f"{name}-resumed"] == {"signal": None, "code": 0}, name
        assert files(root / name) == ref, name  # byte-identical, no temporary left behind


def test_processes_collecting_into_one_folder_take_turns(runs):
    """The waiters said they wait, then found the work done; the other config was refused."""
    status, root, logs = runs
    for name in ["first", *WAITERS]:
        assert status[name] == {"signal": None, "code": 0}, (name, status[name])
    for name in WAITERS:
        err = (logs / f"{name}.err").read_text()
        assert "another process is collecting into this folder" in err, err
        assert "waiting for it to finish (Ctrl-C to stop)" in err, err
    assert files(root / "shared") == files(root / "reference")  # one whole collection
    assert status["other"] == {"signal": None, "code": 2}
    err = (logs / "other.err").read_text().strip().splitlines()
    assert err[-1].startswith("dejavu-lab: error: ") and "another model or config" in err[-1]
    assert "Traceback" not in "".join(err)
