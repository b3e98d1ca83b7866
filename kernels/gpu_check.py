"""Check a GPU box: the compiled kernels against their references, then the live chapters run.

    make gpu-check                                   # the same as: python kernels/gpu_check.py
    python kernels/gpu_check.py --no-tests notebooks/60_sparse_kernels.md --save /tmp/executed

1. The kernel tests on the GPU: ``pytest tests/kernels tests/test_engine_fused.py`` with
   ``DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0`` (``tests/kernels/helpers.py`` puts every test
   tensor on that device, so the Triton kernels compile for it instead of being interpreted).
2. The chapters that measure live when a GPU is present (60, 65, 70, 75), each read with jupytext
   and executed with nbclient in a fresh kernel, from the chapter's folder with the repository
   on ``PYTHONPATH`` (the package from this source tree, as the book build runs it). Every
   cell runs even after an error, so the count of error cells is complete.

It prints a table (chapter, cells, errors, seconds) and writes a log — that table, the tests'
summary, each error's traceback and the short texts each chapter glued into its prose — to
``$DEJAVU_LAB_RESULTS/gpu_check.log`` (default ``results/``). The exit status is 1 when a test or
a cell failed. Needs jupytext, nbclient and ipykernel beside what the chapters import (the
package's dependencies, and myst-nb with docutils for ``myst_nb.glue``): no Sphinx, no
jupyter-book. ``DEJAVU_QUICK=1`` runs the chapters at their quick sizes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dejavu_lab import results

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ("notebooks/60_sparse_kernels.md", "notebooks/65_int4_weights.md",
            "notebooks/70_end_to_end.md", "notebooks/75_batches.md")  # fmt: skip
TESTS = ("tests/kernels", "tests/test_engine_fused.py")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks; the log is plain text


@dataclass
class Chapter:
    """One executed notebook: its code cells, the cells that raised, and what it glued."""

    name: str
    cells: int = 0
    errors: list[str] = field(default_factory=list)  # "cell N: Name: message" + traceback
    seconds: float = 0.0
    glued: dict[str, str] = field(default_factory=dict)  # glue key -> its text/plain


def _glued(outputs) -> dict[str, str]:
    """glue key -> its text/plain (myst_nb.glue tags its outputs with scrapbook metadata)."""
    out = {}
    for o in outputs:
        book = (o.get("metadata") or {}).get("scrapbook") or {}
        text = o.get("data", {}).get(book.get("mime_prefix", "") + "text/plain")
        if book.get("name") and text is not None:
            out[book["name"]] = text
    return out


def execute(path: str | Path, *, timeout: int = 1800, save: Path | None = None) -> Chapter:
    """Run one notebook (jupytext text or .ipynb) in a fresh kernel; count its error cells."""
    import jupytext
    import nbclient
    import nbformat

    path = Path(path).resolve()
    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}  # fmt: skip
    env = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + env if env else "")  # the source tree
    result = Chapter(path.stem)
    t0 = time.perf_counter()
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                         allow_errors=True,
                                         resources={"metadata": {"path": str(path.parent)}})  # fmt: skip
        client.execute()
    except Exception as exc:  # the kernel died or a cell ran past the timeout
        result.errors.append(f"the run stopped: {type(exc).__name__}: {exc}")
    finally:
        os.environ["PYTHONPATH"] = env
        if not env:
            del os.environ["PYTHONPATH"]
    result.seconds = time.perf_counter() - t0
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        result.cells += 1
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                trace = ANSI.sub("", "\n".join(o.get("traceback", [])))
                result.errors.append(f"cell {i + 1}: {o['ename']}: {o['evalue']}\n{trace}")
        result.glued.update(_glued(cell.get("outputs", [])))
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save / f"{path.stem}.ipynb")
    return result


def run_tests(paths=TESTS) -> tuple[int, str, float]:
    """The kernel tests compiled on the GPU: (exit status, pytest's last line, seconds)."""
    env = {**os.environ, "DEJAVU_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    return out.returncode, (lines[-1] if lines else "no output"), time.perf_counter() - t0


def table(chapters: list[Chapter]) -> str:
    """The summary: one line per chapter (cells, error cells, seconds).

    >>> print(table([Chapter("60_sparse_kernels", 24, [], 61.2)]))
    chapter                      cells  errors  seconds
    60_sparse_kernels               24       0     61.2
    """
    lines = [f"{'chapter':<26} {'cells':>7} {'errors':>7} {'seconds':>8}"]
    lines += [f"{c.name:<26} {c.cells:>7} {len(c.errors):>7} {c.seconds:>8.1f}" for c in chapters]
    return "\n".join(lines)


def log_path() -> Path:
    folder = os.environ.get("DEJAVU_LAB_RESULTS")
    return (Path(folder).expanduser() if folder else ROOT / "results") / "gpu_check.log"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("chapters", nargs="*", default=list(CHAPTERS),
                    help="notebooks to execute (default: the live chapters 60, 65, 70, 75)")  # fmt: skip
    ap.add_argument("--no-tests", action="store_true", help="skip the kernel tests")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    ap.add_argument("--save", type=Path, default=None, help="write the executed .ipynb here")
    args = ap.parse_args(argv)
    log = [f"gpu_check {time.strftime('%Y-%m-%dT%H:%M:%S%z')} on {os.uname().nodename}, "
           f"code at {results.git_sha()}"]  # fmt: skip
    failed = False
    if not args.no_tests:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check needs an NVIDIA GPU for the kernel tests; on a CPU run the chapters "
                  "alone with --no-tests.", file=sys.stderr)  # fmt: skip
            return 2
        log.append(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        rc, summary, seconds = run_tests()
        failed |= rc != 0
        log.append(f"kernel tests on the GPU ({' '.join(TESTS)}): {summary} [{seconds:.0f} s]")
        print(log[-1], flush=True)
    done = []
    for chapter in args.chapters:
        print(f"executing {chapter} ...", flush=True)
        done.append(execute(ROOT / chapter, timeout=args.timeout, save=args.save))
        failed |= bool(done[-1].errors)
    summary = table(done)
    print(summary)
    log += ["", summary]
    for c in done:
        log += [f"\n== {c.name}: glued values"]
        log += [f"{k} = {v}" for k, v in c.glued.items()]
        log += [f"\n== {c.name}: error cell\n{e}" for e in c.errors]
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(log) + "\n")
    print(f"log: {path}" + ("" if not failed else " (FAILED: see the errors there)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
