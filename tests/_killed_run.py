"""The kill-and-resume harness of test_collect_kill.py and test_calibrate_kill.py: ``dejavu-lab``
runs killed with SIGKILL at a chosen write, or from outside, then run again.

Starting Python and importing torch + transformers costs seconds, so one helper process (this
file, run by :func:`killed_runs`) imports everything once and forks each run from it
(``cli.main`` in a child process, as the console script runs it), phase after phase: all the
runs of a phase at once, then, once they ended, the next phase (the resumes). It prints
``{name: {"signal": n | None, "code": n | None}}``, how each run ended.

A run is a dict with its ``"name"`` and CLI ``"argv"``; it may say

- ``"env"``: environment variables set in the child;
- ``"kill"``: ``{"file": prefix, "nth": n, "when": "mid" | "before-rename"}``, the process
  kills itself at the ``n``-th (default first) atomic write of a file whose name starts with
  ``prefix``: half its bytes fsync-ed (``"mid"``), or whole and fsync-ed but not yet renamed;
- ``"slow"``: ``{"file": prefix, "seconds": s}``, writes of such files sleep ``s`` halfway (an
  outside kill lands mid-write);
- ``"kill_when"``: a glob, SIGKILL from outside once it matches;
- ``"after"``: a glob, the run starts once it matches;
- ``"hold"``: a prefix, before writing such a file the run waits until every run of its phase
  marked ``"waits"`` printed that text on stderr;
- ``"folder"``: copied to ``<folder>.after-phase-<n>`` after each phase (what the kill left).

A run's stdout and stderr go to ``<logs>/<name>.out`` and ``.err``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

# run this file as a script through -c: the child's sys.path starts, as the test's, with the
# working directory (the checkout whose dejavu_lab the test imports)
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def killed_runs(phases: list[list[dict]], logs, prelude: str = "", timeout: float = 600) -> dict:
    """Run ``phases`` (lists of runs, see the module docstring) in one helper process that ran
    ``prelude`` (Python: imports, patches) before forking; how each run ended, by name."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    spec = {"phases": phases, "logs": str(logs), "prelude": prelude}
    out = subprocess.run(
        [sys.executable, "-c", _BOOT, __file__, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,  # ~15 s on an idle 2-core machine; generous for a loaded one
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _patch(run: dict, go: str) -> None:
    """Make this process's atomic writes kill, slow or hold it as ``run`` says."""
    from dejavu_lab import atomic

    write, count = atomic._write, [0]
    kill, slow, hold = run.get("kill"), run.get("slow"), run.get("hold")

    def _write(f, data):
        name = os.path.basename(f.name)
        if hold and name.startswith("." + hold):
            while not os.path.exists(go):
                time.sleep(0.01)
        hit = False
        if kill and name.startswith("." + kill["file"]):
            count[0] += 1
            hit = count[0] == kill.get("nth", 1)
        if hit and kill["when"] == "mid":  # half the bytes reach the disk, then the process dies
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        if slow and name.startswith("." + slow["file"]):  # an outside kill lands mid-write
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep(slow["seconds"])
            f.write(data[len(data) // 2 :])
        else:
            write(f, data)
        if hit and kill["when"] == "before-rename":  # whole and fsync-ed, never renamed
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

    atomic._write = _write


def _start(run: dict, logs: str, go: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    import dejavu_lab.cli.main

    os.environ.update(run.get("env", {}))
    for fd, ext in ((1, "out"), (2, "err")):
        log = os.open(os.path.join(logs, f"{run['name']}.{ext}"), os.O_WRONLY | os.O_CREAT)
        os.dup2(log, fd)
    _patch(run, go)
    code = dejavu_lab.cli.main.main(run["argv"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for(pattern: str, seconds: float = 120) -> None:
    t0 = time.time()
    while not glob.glob(pattern) and time.time() - t0 < seconds:
        time.sleep(0.005)


def _said(logs: str, run: dict) -> str:
    path = os.path.join(logs, f"{run['name']}.err")
    return open(path).read() if os.path.exists(path) else ""


def _phase(runs: list[dict], n: int, logs: str, status: dict) -> None:
    go = os.path.join(logs, f"go-{n}")
    pids = {}
    for run in runs:
        if run.get("after"):
            _wait_for(run["after"])
        pids[run["name"]] = _start(run, logs, go)
        if run.get("kill_when"):
            _wait_for(run["kill_when"])
            os.kill(pids[run["name"]], signal.SIGKILL)
    waiters = [r for r in runs if r.get("waits")]
    t0 = time.time()
    while waiters and time.time() - t0 < 120:  # until every waiter said it waits
        if all(r["waits"] in _said(logs, r) for r in waiters):
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
        folder = run.get("folder")
        if folder and os.path.isdir(folder):
            shutil.copytree(folder, f"{folder}.after-phase-{n}", dirs_exist_ok=True)


def _main(spec: dict) -> None:
    exec(spec["prelude"], {})
    import dejavu_lab.cli.main  # noqa: F401  (imported once, before forking)

    status = {}
    for n, runs in enumerate(spec["phases"]):
        _phase(runs, n, spec["logs"], status)
    print(json.dumps(status))


if __name__ == "__main__":
    _main(json.loads(sys.argv[-1]))
