"""``dejavu-lab collect`` killed with SIGKILL at several points resumes to byte-identical data,
and processes collecting into one folder at once take turns instead of crashing.

Starting Python and importing torch + transformers costs seconds, so one helper process imports
everything once and forks each ``dejavu-lab collect`` run from it (``cli.main`` in a child
process, as the console script runs it), in two phases: first every killed run, the reference
and the concurrent runs at once; then the resumes. A run is killed with SIGKILL either by itself
at a chosen instant (half of the manifest or of a chunk written; a chunk written and fsync-ed
but not yet renamed) or from outside while it writes. A tiny local Llama with its own tokenizer
and the first 20k characters of the demo corpus keep each run to a fraction of a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _tiny_folder import build
from safetensors.torch import load_file

# The helper process. argv[1]: JSON {"model", "logs", "phases": [[run, ...], ...]}; a run is
# {"name", "out"} and may say "kill" ("<file>:mid" or "<file>:before-rename"), "slow" (seconds of
# sleep in the middle of each chunk write), "kill_when" (SIGKILL from outside once that file
# exists), "after" (start once that file exists), "hold" (before writing chunk 3, wait until every
# run marked "waits" said it waits) and "extra" (more CLI arguments). Between phases the folders
# are copied to <out>.after-phase-<n>. Prints JSON {name: {"signal": n | None, "code": n | None}}.
ZYGOTE = textwrap.dedent(
    r"""
    import json, os, shutil, signal, sys, time
    from dejavu_lab import atomic, corpus
    import dejavu_lab.cli.main, dejavu_lab.collect, dejavu_lab.models  # import before forking

    spec = json.loads(sys.argv[1])
    text = corpus.load_text("demo")[:20000]
    # 6 windows of 16 tokens need no 76k-token corpus (collect imported load_text by name)
    corpus.load_text = dejavu_lab.collect.load_text = lambda name="demo", *a, **k: text

    def patch(run):
        write = atomic._write
        target, _, when = run.get("kill", "").partition(":")
        def _write(f, data):
            name = os.path.basename(f.name)
            hit = bool(target) and name.startswith("." + target)
            if run.get("hold") and name.startswith(".chunk_00003"):
                while not os.path.exists(go):
                    time.sleep(0.01)
            if hit and when == "mid":  # half the bytes reach the disk, then the process dies
                f.write(data[: len(data) // 2]); f.flush(); os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            if run.get("slow") and name.startswith(".chunk"):  # an outside kill lands mid-write
                f.write(data[: len(data) // 2]); f.flush(); time.sleep(run["slow"])
                f.write(data[len(data) // 2 :])
            else:
                write(f, data)
            if hit and when == "before-rename":  # whole and fsync-ed, never renamed
                f.flush(); os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
        atomic._write = _write

    def start(run):
        pid = os.fork()
        if pid:
            return pid
        err = os.open(os.path.join(spec["logs"], run["name"]), os.O_WRONLY | os.O_CREAT)
        os.dup2(err, 2)
        patch(run)
        argv = ["collect", "--model", spec["model"], "--window", "16", "--max-tokens", "96",
                "--out", run["out"], "--no-progress", *run.get("extra", [])]
        code = dejavu_lab.cli.main.main(argv)
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)

    def wait_for(path, seconds=120):
        t0 = time.time()
        while not os.path.exists(path) and time.time() - t0 < seconds:
            time.sleep(0.005)

    def phase(runs, n):
        global go
        go = os.path.join(spec["logs"], f"go-{n}")
        pids = {}
        for run in runs:
            if run.get("after"):
                wait_for(run["after"])
            pids[run["name"]] = start(run)
            if run.get("kill_when"):
                wait_for(run["kill_when"])
                os.kill(pids[run["name"]], signal.SIGKILL)
        waiters = [r["name"] for r in runs if r.get("waits")]
        t0 = time.time()
        while waiters and time.time() - t0 < 120:  # until every waiter said it waits
            said = [open(os.path.join(spec["logs"], n)).read() for n in waiters]
            if all("waiting for it to finish" in s for s in said):
                break
            time.sleep(0.02)
        open(go, "w").close()
        for name, pid in pids.items():
            _, st = os.waitpid(pid, 0)
            status[name] = {
                "signal": os.WTERMSIG(st) if os.WIFSIGNALED(st) else None,
                "code": os.WEXITSTATUS(st) if os.WIFEXITED(st) else None,
            }
        for run in runs:
            if os.path.isdir(run["out"]):
                shutil.copytree(run["out"], f"{run['out']}.after-phase-{n}", dirs_exist_ok=True)

    status = {}
    for n, runs in enumerate(spec["phases"]):
        phase(runs, n)
    print(json.dumps(status))
    """
)


KILLS = {
    "mid-manifest": {"kill": "manifest.json:mid"},
    "mid-chunk": {"kill": "chunk_00002:mid"},
    "before-rename": {"kill": "chunk_00003:before-rename"},
    "from-outside": {"slow": 0.3},  # SIGKILL from outside, in the middle of chunk 2
}
WAITERS = [f"second-{i}" for i in range(3)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, in one helper process: (status by name, folder, logs)."""
    root = tmp_path_factory.mktemp("collect-kill")
    model = build(root / "tiny-llama")
    shared = root / "shared"
    first_chunk = str(shared / "chunk_00000.safetensors")
    phase1 = [{"name": "reference", "out": str(root / "reference")}]
    for name, how in KILLS.items():
        out = root / name
        phase1.append({"name": name, "out": str(out), **how})
        if name == "from-outside":
            phase1[-1]["kill_when"] = str(out / "chunk_00001.safetensors")
    # one process collects and pauses before chunk 3; three more start into its folder while it
    # writes and must wait; one with another config must be refused at once
    phase1.append({"name": "first", "out": str(shared), "hold": True})
    phase1 += [
        {"name": n, "out": str(shared), "after": first_chunk, "waits": True} for n in WAITERS
    ]
    other = {
        "name": "other",
        "out": str(shared),
        "after": first_chunk,
        "extra": ["--max-tokens", "64"],
    }
    phase1.append(other)
    phase2 = [{"name": f"{n}-resumed", "out": str(root / n)} for n in KILLS]
    logs = root / "logs"
    logs.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    spec = {"model": str(model), "logs": str(logs), "phases": [phase1, phase2]}
    out = subprocess.run(
        [sys.executable, "-c", ZYGOTE, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,  # ~15 s on an idle 2-core machine; generous for a loaded one
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), root, logs


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
        err = (logs / name).read_text()
        assert "another process is collecting into this folder" in err, err
        assert "waiting for it to finish (Ctrl-C to stop)" in err, err
    assert files(root / "shared") == files(root / "reference")  # one whole collection
    assert status["other"] == {"signal": None, "code": 2}
    err = (logs / "other").read_text().strip().splitlines()
    assert err[-1].startswith("dejavu-lab: error: ") and "another model or config" in err[-1]
    assert "Traceback" not in "".join(err)
