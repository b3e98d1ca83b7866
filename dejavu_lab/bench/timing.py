"""The one GPU timing harness: clocks, the copy ceiling, relative errors, config sweeps and
fixed-width tables, used by every ``kernels/*.py`` script, :mod:`dejavu_lab.bench.kernels` (the
sparse kernels' timed cases), :mod:`dejavu_lab.bench.engine` and the chapters.

Two clocks: ``triton.testing.do_bench`` (events around one launch after an L2 flush) and CUDA
graph replay, as a decoding engine runs (:func:`time_both`, :func:`graph_us`, :func:`graph_ms`);
:func:`timed` is one call between two CUDA events. Repeated calls over one weight would measure
the L2 cache (60 MB on an H200), so a timed case rotates over enough weight copies
(:func:`rotation_copies`) that every call reads cold weights.

Every bandwidth figure is divided by one ceiling, :func:`copy_ceiling`: the median time of a
2 GiB device-to-device copy by ``triton.testing.do_bench`` (25 warm-up copies, 200 ms of
repeats), bytes read plus bytes written over that time.

On a machine without a GPU everything runs through the CPU path with wall-clock timing, which
is only good for checking the plumbing (tiny shapes).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable

import torch

__all__ = [
    "copy_ceiling",
    "cuda",
    "graph_ms",
    "graph_us",
    "print_rows",
    "relerr",
    "rotation_copies",
    "sweep",
    "sync",
    "time_both",
    "timed",
]

L2_FLUSH_BYTES = 4 * 60e6  # rotate over >= 4x the H200's L2 (60 MB) per case
MAX_COPIES_BYTES = 6e9  # but keep a case's stacked weights under 6 GB


def cuda() -> bool:
    """Whether a CUDA GPU is here (else every clock is the CPU's wall clock).

    >>> cuda() == torch.cuda.is_available()
    True
    """
    return torch.cuda.is_available()


def sync() -> None:
    """Wait for the GPU's queued work (nothing on the CPU).

    >>> sync()
    """
    if cuda():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    """Milliseconds of one call of fn (CUDA events on a GPU, wall clock on the CPU).

    >>> timed(lambda: sum(range(1000))) > 0
    True
    """
    if not cuda():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graph_ms(fn: Callable[[], object]) -> float:
    """Median ms of fn captured in a CUDA graph and replayed 7 times, after two eager calls
    (warm-up); the wall clock of one eager call on the CPU.

    >>> x = torch.randn(16, 16)
    >>> graph_ms(lambda: x @ x) > 0
    True
    """
    with torch.no_grad():
        fn()
        fn()
        if not cuda():
            return timed(fn)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return sorted(timed(g.replay) for _ in range(7))[3]


def time_both(fn: Callable[[], object], *, rep_ms: int = 60) -> tuple[float, float]:
    """(event-timed median ms, graph-replay median ms) of ``fn``; wall clock on CPU.

    >>> x = torch.randn(64, 64)
    >>> event_ms, graph_ms = time_both(lambda: x @ x)  # on CPU both are the wall-clock median
    >>> event_ms > 0 and graph_ms > 0
    True
    """
    if not cuda():
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(times)
        return med, med
    from triton.testing import do_bench, do_bench_cudagraph

    event = do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
    graph = do_bench_cudagraph(fn, rep=max(20, rep_ms // 2), return_mode="median")
    return float(event), float(graph)


def graph_us(calls: list[Callable[[], object]], *, n_calls: int = 120, reps: int = 9) -> float:
    """Median µs per call of ``calls`` (cycled: one weight copy each) replayed in a CUDA graph.

    ``n_calls`` calls are captured in one graph (fewer replays than ``do_bench_cudagraph`` at
    the same noise, so a sweep of many configs fits a short GPU lease); the median over
    ``reps`` replays is divided by ``n_calls``. Wall clock on the CPU.

    >>> x = torch.randn(32, 32)
    >>> graph_us([lambda: x @ x, lambda: x @ x.T], n_calls=4) > 0
    True
    """
    order = [calls[i % len(calls)] for i in range(max(n_calls, len(calls)))]
    if not cuda():
        t0 = time.perf_counter()
        for fn in order:
            fn()
        return (time.perf_counter() - t0) * 1e6 / len(order)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compile, allocate workspaces, warm up, outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in order:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(order))
    del graph
    return statistics.median(times)


def copy_ceiling(nbytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + written), the practical ceiling.

    NaN without a CUDA GPU; an H200 reads about 4.25 (``results/sparse_mlp.json``).

    >>> tbps = copy_ceiling()
    >>> tbps > 1 if torch.cuda.is_available() else math.isnan(tbps)
    True
    """
    if not cuda():
        return float("nan")
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e12


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``|out - ref| / |ref|`` in float64.

    >>> round(relerr(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1])), 3)
    0.043
    """
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def rotation_copies(selected_bytes: float, copy_bytes: float) -> int:
    """Weight copies to rotate through so every timed call reads cold weights: enough that
    the selected bytes of all copies exceed 4x the L2, at most 64 and under 6 GB in all.

    >>> rotation_copies(9e6, 90e6)  # 10% of an 11008x4096 fp16 matrix per call
    27
    """
    want = max(1, math.ceil(L2_FLUSH_BYTES / max(selected_bytes, 1.0)))
    return max(1, min(want, int(MAX_COPIES_BYTES // max(copy_bytes, 1.0)), 64))


def sweep(
    candidates: list[dict],
    check: Callable[[dict], float],
    time_us: Callable[[dict], float],
    *,
    tol: float = 5e-3,
) -> list[tuple[dict, float]]:
    """(config, µs) for each candidate that computes the right function (``check`` returns its
    relative error; a wrong or failing candidate is printed and never recorded).

    >>> sweep([{"a": 1}, {"a": 2}], check=lambda c: 0.0 if c["a"] == 1 else 1.0,
    ...       time_us=lambda c: 5.0)
      {'a': 2}: WRONG, relative error 1.00e+00
    [({'a': 1}, 5.0)]
    """
    timed = []
    for cfg in candidates:
        try:
            err = check(cfg)
            if not err < tol:
                print(f"  {cfg}: WRONG, relative error {err:.2e}")
                continue
            timed.append((cfg, time_us(cfg)))
        except Exception as exc:  # a candidate that fails to compile is skipped
            print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
    return timed


def print_rows(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """A fixed-width table: ``columns`` = (header, row key, format spec); missing keys blank.

    >>> print_rows([{"shape": "a", "us": 1.25}], [("shape", "shape", "6s"), ("us", "us", "6.1f")])
    shape      us
    a         1.2
    """
    widths = [int("".join(itertools.takewhile(str.isdigit, f)) or 0) for _, _, f in columns]
    print(" ".join(f"{h:>{w}s}" if i else f"{h:{w}s}" for i, ((h, _, _), w) in
                   enumerate(zip(columns, widths, strict=True))))  # fmt: skip
    for r in rows:
        cells = [format(r[k], f) if r.get(k) is not None else " " * w
                 for (_, k, f), w in zip(columns, widths, strict=True)]  # fmt: skip
        print(" ".join(cells))
