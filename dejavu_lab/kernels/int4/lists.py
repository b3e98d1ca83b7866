"""The kept rows of a thresholded token, listed once per block of rows for the int4 GEMV.

The threshold GEMV of :mod:`.half2` (``compact=1``) lists the kept rows of its block of 64
input rows before it walks them: it loads x, compares with the threshold, finds the block's
largest magnitude and the prefix sum of the kept flags, writes the list and waits at a barrier.
Every column tile of the matrix does that again for the same rows (28 times for Llama-3-8B's
up projection at 512 outputs a tile), and its first code load waits on all of it. Here the
token's lists are made once, by whoever produces x — the residual add and the next norm of the
decode step (:func:`~dejavu_lab.kernels.residual_norm` with ``lists``), or :func:`kept_lists`
alone — and the GEMV (``int4_threshold_gemv(..., lists=)``) reads its block's count and entries
and goes straight to the codes.

For each block ``b`` of ``rows`` input rows, :class:`KeptLists` holds

- ``entries[b * rows + k]`` for ``k < count``: the k-th kept row of the block, its offset in
  the block in the low 16 bits and its activation divided by the block's largest magnitude as
  fp16 bits in the high 16 (the entries the GEMV walks; the rest of the block's slots are
  stale);
- ``meta[b] = (count, scale, sum)``: the kept rows, the largest magnitude (1 where none is
  kept), and the sum of the kept activations in fp32 (scale and sum as the int32 bits of their
  fp32 values).

The numbers are the ones the GEMV computes for itself, so a listed product equals the unlisted
one to the order of the fp32 sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._common import check_device, check_float, check_thr, use_triton
from .half2_decode import _bits

__all__ = ["LIST_ROWS", "KeptLists", "check_lists", "kept_lists", "kept_lists_ref", "write_lists"]

#: Rows per list block: the half2 GEMV's block of rows (its ``ROWS``).
LIST_ROWS = 64


class KeptLists(NamedTuple):
    """A token's kept rows, one list per block of ``rows`` input rows (module docstring):
    ``entries`` int32 [K], ``meta`` int32 [K // rows, 4] (count, scale bits, sum bits, 0).

    >>> lists = kept_lists_ref(torch.tensor([0.0, 2.0, -4.0, 0.5] * 16), 1.0)
    >>> lists.counts().tolist(), lists.scales().tolist(), lists.sums().tolist()
    ([32], [4.0], [-32.0])
    """

    entries: torch.Tensor
    meta: torch.Tensor
    rows: int = LIST_ROWS

    @classmethod
    def empty(cls, d_in: int, device, rows: int = LIST_ROWS) -> KeptLists:
        """Buffers for a token of ``d_in`` inputs (a multiple of ``rows``), to be filled by
        :func:`kept_lists` or a producer's epilogue.

        >>> KeptLists.empty(128, "cpu").meta.shape
        torch.Size([2, 4])
        """
        if d_in % rows:
            raise ValueError(f"d_in={d_in} is not a multiple of the list block of {rows} rows.")
        entries = torch.zeros(d_in, dtype=torch.int32, device=device)
        return cls(entries, torch.zeros(d_in // rows, 4, dtype=torch.int32, device=device), rows)

    def counts(self) -> torch.Tensor:
        """Kept rows per block, int64."""
        return self.meta[:, 0].long()

    def scales(self) -> torch.Tensor:
        """Each block's largest kept magnitude (1 where none is kept), fp32."""
        return self.meta[:, 1].view(torch.float32)

    def sums(self) -> torch.Tensor:
        """Each block's sum of kept activations, fp32."""
        return self.meta[:, 2].view(torch.float32)

    def kept(self) -> torch.Tensor:
        """The kept input rows, ascending, int64 (reads the counts back to the host)."""
        out = []
        for b, n in enumerate(self.counts().tolist()):
            e = self.entries[b * self.rows : b * self.rows + n].long()
            out.append(b * self.rows + (e & 0xFFFF))
        return torch.cat(out) if out else self.entries.new_zeros(0).long()


@triton.jit
def write_lists(xs, b0, entries_ptr, meta_ptr, n_blocks, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Write the lists of ``BLOCK // ROWS`` blocks from ``xs`` [BLOCK] (fp32, thresholded: a
    dropped row is 0; rows of block ``b0`` first); blocks from ``n_blocks`` on are not written.
    For a producer's epilogue (:func:`~dejavu_lab.kernels.residual_norm`) and
    :func:`kept_lists_kernel`."""
    NB: tl.constexpr = BLOCK // ROWS
    x2 = tl.reshape(xs, (NB, ROWS))
    keep = x2 != 0
    flags = keep.to(tl.int32)
    pos = tl.cumsum(flags, axis=1) - 1
    count = tl.sum(flags, axis=1)
    amax = tl.max(tl.abs(x2), axis=1)
    scale = tl.where(amax > 0, amax, 1.0)
    inv = 1.0 / scale
    j = tl.arange(0, ROWS)
    blk = b0 + tl.arange(0, NB)
    live = blk < n_blocks
    entry = (_bits((x2 * inv[:, None]).to(tl.float16)) << 16) | j[None, :]
    tl.store(entries_ptr + blk[:, None] * ROWS + pos, entry, mask=keep & live[:, None])
    tl.store(meta_ptr + blk * 4, count, mask=live)
    tl.store(meta_ptr + blk * 4 + 1, scale.to(tl.int32, bitcast=True), mask=live)
    tl.store(meta_ptr + blk * 4 + 2, tl.sum(x2, axis=1).to(tl.int32, bitcast=True), mask=live)


@triton.jit
def kept_lists_kernel(x_ptr, thr_ptr, thr_value, entries_ptr, meta_ptr, K,
                      THR_SCALAR: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One program lists ``BLOCK // ROWS`` blocks of x [K] thresholded at ``thr_value``
    (``THR_SCALAR``) or ``thr_ptr`` [K]."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    xs = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if THR_SCALAR:
        xs = tl.where(tl.abs(xs) > thr_value, xs, 0.0)
    else:
        xs = tl.where(tl.abs(xs) > tl.load(thr_ptr + offs, mask=mask, other=0.0), xs, 0.0)
    write_lists(xs, pid * (BLOCK // ROWS), entries_ptr, meta_ptr, K // ROWS, ROWS, BLOCK)


def check_lists(lists, xb: torch.Tensor, d_in: int) -> None:
    """``lists`` must be :class:`KeptLists` of one token of ``d_in`` rows on xb's device.

    >>> check_lists(KeptLists.empty(64, "cpu"), torch.zeros(1, 128), 128)
    Traceback (most recent call last):
    ...
    ValueError: the kept lists hold 64 rows; x has 128: make them from this x (kept_lists(x, thr)).
    """
    if not isinstance(lists, KeptLists):
        raise TypeError(f"lists is a {type(lists).__name__}; pass kept_lists(x, thr).")
    if xb.shape[0] != 1:
        raise ValueError(f"kept lists are one token's; x holds {xb.shape[0]}.")
    if lists.entries.numel() != d_in or lists.meta.shape != (d_in // lists.rows, 4):
        raise ValueError(f"the kept lists hold {lists.entries.numel()} rows; x has {d_in}: "
                         "make them from this x (kept_lists(x, thr)).")  # fmt: skip
    check_device(xb.device, lists=lists.entries)


def kept_lists_ref(x: torch.Tensor, thr, rows: int = LIST_ROWS) -> KeptLists:
    """Plain-PyTorch reference of :func:`kept_lists` (one token ``x`` [K] or [1, K]).

    >>> x = torch.tensor([0.5, -2.0, 1.5, 3.0] * 16).half()
    >>> lists = kept_lists_ref(x, 1.0)
    >>> int(lists.counts()[0]), float(lists.scales()[0]), float(lists.sums()[0])
    (48, 3.0, 40.0)
    >>> lists.kept()[:3].tolist()
    [1, 2, 3]
    """
    xf = x.reshape(-1).float()
    t = torch.as_tensor(thr, dtype=torch.float32, device=x.device)
    xs = torch.where(xf.abs() > t, xf, 0.0).view(-1, rows)
    out = KeptLists.empty(xf.numel(), x.device, rows)
    amax = xs.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax, 1.0)
    half = (xs / scale[:, None]).half().view(torch.int16).int() & 0xFFFF
    for b in range(xs.shape[0]):
        k = torch.nonzero(xs[b] != 0).flatten()
        out.entries[b * rows : b * rows + k.numel()] = ((half[b, k] << 16) | k).int()
    out.meta[:, 0] = (xs != 0).sum(dim=1).int()
    out.meta[:, 1] = scale.view(torch.int32)
    out.meta[:, 2] = xs.sum(dim=1).view(torch.int32)
    return out


def kept_lists(x: torch.Tensor, thr: torch.Tensor | float, *, out: KeptLists | None = None,
               rows: int = LIST_ROWS) -> KeptLists:  # fmt: skip
    """List the rows of one token ``x`` ([K] or [1, K], fp16/bf16, K a multiple of ``rows``)
    that pass ``|x| > thr`` (a float, or fp32 [K]), one list per block of ``rows`` (module
    docstring), for ``int4_threshold_gemv(x, w, thr, lists=...)``. One launch, no host sync;
    ``out``: buffers to fill (:meth:`KeptLists.empty`).

    >>> x = torch.tensor([0.5, -2.0, 1.5, 3.0] * 16).half()
    >>> lists = kept_lists(x, 1.0)  # CPU: under TRITON_INTERPRET=1
    >>> int(lists.counts()[0]), lists.kept()[:3].tolist()
    (48, [1, 2, 3])
    """
    check_float("x", x)
    if x.dim() == 2 and x.shape[0] != 1 or x.dim() not in (1, 2):
        raise ValueError(f"x has shape {tuple(x.shape)}; kept lists are made for one token.")
    k = x.shape[-1]
    if k % rows:
        raise ValueError(f"x has {k} entries, not a multiple of the list block of {rows} rows.")
    scalar = not isinstance(thr, torch.Tensor)
    if not scalar:
        check_thr(thr, k)
        check_device(x.device, thr=thr)
    elif thr != thr:
        raise ValueError("thr is NaN; pass a number (inf drops every entry, -1 keeps all).")
    if out is None:
        out = KeptLists.empty(k, x.device, rows)
    elif out.entries.numel() != k or out.rows != rows or out.entries.device != x.device:
        raise ValueError(f"out holds lists of {out.entries.numel()} rows in blocks of "
                         f"{out.rows} on {out.entries.device}; x has {k} on {x.device} and "
                         f"asks for blocks of {rows}.")  # fmt: skip
    if not use_triton(x.device):
        ref = kept_lists_ref(x, thr, rows)
        out.entries.copy_(ref.entries)
        out.meta.copy_(ref.meta)
        return out
    block = max(rows, min(1024, triton.next_power_of_2(k)))
    kept_lists_kernel[(triton.cdiv(k, block),)](
        x.reshape(-1), thr if not scalar else out.meta, float(thr) if scalar else 0.0,
        out.entries, out.meta, k, THR_SCALAR=scalar, ROWS=rows, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
