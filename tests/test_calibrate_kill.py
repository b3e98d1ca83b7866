"""``dejavu-lab perplexity --method teal`` killed with SIGKILL while it calibrates, then rerun:
the rerun recomputes (or resumes from the saved histograms) and prints what an uninterrupted run
prints, with the same calibration file; no run ever loads half a file.

As in ``test_collect_kill.py``, one helper process imports everything once and forks each run
from it (``cli.main`` in a child process, as the console script runs it); every run has its own
cache folder, and a resumed run reuses the killed run's. TEAL writes its calibration file twice:
the histograms, then again with the greedy allocation. A run kills itself with SIGKILL at a
chosen write of that file (half of it written; whole and fsync-ed but not yet renamed), or is
killed from outside while a slowed write is half done. A tiny local Llama with its own tokenizer
keeps each run to a fraction of a second once imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _tiny_folder import build

from dejavu_lab.assets import fetch
from dejavu_lab.sparsify import load_calibration

# argv[1]: JSON {"model", "argv", "phases": [[run, ...], ...]}; a run is {"name", "cache"} and may
# say "kill": "<n>:mid" | "<n>:before-rename" (the n-th write of a calibration file), "slow"
# (seconds of sleep halfway through each calibration write) with "kill_when" (SIGKILL from
# outside once a temporary calibration file exists). stdout and stderr of a run go to
# <cache>/<name>.out and .err; between phases the caches are copied to <cache>.after-phase-<n>.
ZYGOTE = textwrap.dedent(
    r"""
    import glob, json, os, shutil, signal, sys, time
    from dejavu_lab import atomic
    import dejavu_lab.cli.main, dejavu_lab.sparsify, transformers  # import before forking

    spec = json.loads(sys.argv[1])

    def patch(run):
        write, count = atomic._write, [0]
        n, _, when = run.get("kill", "").partition(":")
        def _write(f, data):
            name = os.path.basename(f.name)
            if not name.startswith(".llama-"):  # not a calibration file
                return write(f, data)
            count[0] += 1
            hit = n and int(n) == count[0]
            if hit and when == "mid":  # half the bytes reach the disk, then the process dies
                f.write(data[: len(data) // 2]); f.flush(); os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            if run.get("slow"):  # an outside kill lands in the middle of this write
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
        os.environ["DEJAVU_LAB_CACHE"] = run["cache"]
        for fd, ext in ((1, "out"), (2, "err")):
            log = os.open(f"{run['cache']}/{run['name']}.{ext}", os.O_WRONLY | os.O_CREAT)
            os.dup2(log, fd)
        patch(run)
        code = dejavu_lab.cli.main.main(["perplexity", "--model", spec["model"], *spec["argv"]])
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)

    status = {}
    for n, runs in enumerate(spec["phases"]):
        pids = {}
        for run in runs:
            pids[run["name"]] = start(run)
            if run.get("kill_when"):
                t0 = time.time()
                while not glob.glob(run["kill_when"]) and time.time() - t0 < 120:
                    time.sleep(0.005)
                os.kill(pids[run["name"]], signal.SIGKILL)
        for name, pid in pids.items():
            _, st = os.waitpid(pid, 0)
            status[name] = {
                "signal": os.WTERMSIG(st) if os.WIFSIGNALED(st) else None,
                "code": os.WEXITSTATUS(st) if os.WIFEXITED(st) else None,
            }
        for run in runs:
            shutil.copytree(run["cache"], f"{run['cache']}.after-phase-{n}", dirs_exist_ok=True)
    print(json.dumps(status))
    """
)

ARGV = (
    "--method teal --sparsity 0.5 --window 16 --max-tokens 16 --calibration-tokens 64 "
    "--json --no-progress"
).split()
KILLS = {
    "histograms-mid": {"kill": "1:mid"},
    "histograms-before-rename": {"kill": "1:before-rename"},
    "greedy-mid": {"kill": "2:mid"},  # the histograms are on disk: the rerun resumes from them
    "from-outside": {"slow": 0.5},  # SIGKILL from outside, halfway through the first write
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, in one helper process: (status by name, root)."""
    root = tmp_path_factory.mktemp("calibrate-kill")
    model = build(root / "tiny-llama")
    corpus = fetch("lee_background.cor")

    def cache(name: str) -> str:
        folder = root / name
        folder.mkdir(exist_ok=True)
        shutil.copy(corpus, folder)  # the demo corpus, offline
        return str(folder)

    phase1 = [{"name": "reference", "cache": cache("reference")}]
    for name, how in KILLS.items():
        phase1.append({"name": name, "cache": cache(name), **how})
        if "slow" in how:
            phase1[-1]["kill_when"] = f"{root / name}/calibration/.llama-*.partial"
    phase2 = [{"name": f"{n}-resumed", "cache": str(root / n)} for n in KILLS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    spec = {"model": str(model), "argv": ARGV, "phases": [phase1, phase2]}
    out = subprocess.run(
        [sys.executable, "-c", ZYGOTE, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), root


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
    status, root = runs
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
    status, root = runs
    ref_out = json.loads((root / "reference" / "reference.out").read_text())
    ref = calibration_files(root / "reference")
    (name,) = ref
    for kill in KILLS:
        assert status[f"{kill}-resumed"] == {"signal": None, "code": 0}, kill
        out = json.loads((root / kill / f"{kill}-resumed.out").read_text())
        assert out["perplexity"] == ref_out["perplexity"], kill
        assert out["kept"] == ref_out["kept"], kill
        files = calibration_files(root / kill)
        assert list(files) == list(ref), kill  # no temporary left behind
        assert content(files[name]) == content(ref[name]), kill
