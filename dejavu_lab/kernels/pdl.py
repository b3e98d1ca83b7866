"""Programmatic dependent launch (Hopper and newer): the next kernel of a decode step is
launched while the one before it is still finishing, and waits at its first instruction.

On a chain of small launches the GPU otherwise spends a gap between each kernel's end and the
next one's start. Launched with ``launch_pdl=True``, a kernel's blocks are scheduled before its
predecessor has exited and block in ``griddepcontrol.wait`` until that grid is complete and its
writes are visible, so only the launch processing overlaps, never the data: each kernel that is
launched this way calls :func:`await_inputs` before it touches global memory. Measured on an
H200 (CUDA-graph replay, 64 links; ``kernels/bench_engine.py`` times the whole step): a chain of
threshold tile GEMVs at 4096 x 4096 went from 6.77 to 6.46 µs per link, and a tile GEMV followed
by a one-program row kernel from 8.76 to 7.61 µs per pair.

Each kernel also signals, once its blocks have passed the wait, that the next one may be
launched (``griddepcontrol.launch_dependents``): the next kernel's blocks are then scheduled
while this one still runs, where it has room, and wait there. The int4 GEMV
(:mod:`.int4.half2`) reads its scales and mins, which no kernel writes, before its wait. On an
H100 at Llama-3-8B shape (``results/engine_int4_8b_pdl_early.json`` beside ``_wait``, the same
run at 1f5321a, CUDA-graph decode after a 512-token prompt), the early signal took the fp16
dense step from 5.475 to 5.362 ms, fp16 TEAL at 50% from 3.309 to 3.198 and int4 TEAL at 50%
from 2.526 to 2.421.

``PDL = False`` (or ``DEJAVU_PDL=0`` in the environment) turns it off, for timing the difference;
``EARLY = False`` (``DEJAVU_PDL_EARLY=0``) keeps the wait but leaves out the early signal (the
next kernel is then launched as this one's blocks exit).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["EARLY", "PDL", "await_inputs", "pdl_args"]

#: Kernels of the decode step launched with programmatic dependent launch (``DEJAVU_PDL=0``: not).
PDL = os.environ.get("DEJAVU_PDL", "1") != "0"
#: Each kernel lets the next one launch once its blocks are past the wait
#: (``DEJAVU_PDL_EARLY=0``: only as they exit).
EARLY = os.environ.get("DEJAVU_PDL_EARLY", "1") != "0"


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """The kernel's first step: under programmatic dependent launch, wait for the grid before
    (``PDL`` 2: then let the next grid launch). Kernels call it under ``if PDL:``: the
    interpreter pays for every nested jit call (about 0.2 ms a program), even one that does
    nothing."""
    if PDL:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """Launch arguments of a kernel that calls :func:`await_inputs`: ``PDL`` (2 while
    :data:`EARLY` is on, else 1) and ``launch_pdl`` on a CUDA GPU of compute capability 9.0 or
    newer while :data:`PDL` is on, else none (the kernel's ``PDL`` stays False and it launches
    as usual).

    >>> pdl_args(torch.device("cpu"))
    {}
    """
    if not (PDL and device.type == "cuda"):
        return {}
    if not _hopper(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"PDL": 2 if EARLY else 1, "launch_pdl": True}
