"""The W4A16 GEMVs' timed case: one weight shape in fp16 and in int4, rotating cold copies, and
the calls ``kernels/bench_int4.py`` times in CUDA-graph replay.

Providers, all on the same random weight (int4: :func:`~dejavu_lab.quant.quantize` of it):

- ``cublas``: fp16 ``x @ w_t`` (torch.mm); ``fp16_ours``: our fp16 tile GEMV with every
  column kept (:func:`~dejavu_lab.kernels.threshold_gemv` at ``thr=-1``); ``fp16_thr``: the
  fp16 threshold GEMV at the case's kept fraction;
- ``int4``: :func:`~dejavu_lab.kernels.int4.int4_gemv`; ``int4_thr``:
  :func:`~dejavu_lab.kernels.int4.int4_threshold_gemv` at the kept fraction;
- ``int4_sums``: the dense int4 GEMV (below 1 kept: the threshold GEMV) as the decode step
  runs it, leaving fp32 sums for the next launch
  (:func:`~dejavu_lab.kernels.int4.sums.int4_sums`, its tuned config; never finished or
  zeroed here, so only its time means anything): the kernel without the finishing launch;
- ``int4_listed``: the threshold kernel alone as ``int4_sums``, walking the token's kept rows
  listed beforehand (:func:`~dejavu_lab.kernels.int4.lists.kept_lists`, outside the timed
  call, as the norm before it makes them in the decode step); ``lists``: that list maker
  alone;
- ``read``: the read floor, one streaming read of as many bytes as ``int4`` moves
  (:func:`~dejavu_lab.bench.read_floor.stream_read`); ``read_kept``: a read of the code rows
  the threshold GEMV keeps and nothing else, the threshold GEMV's floor
  (:func:`~dejavu_lab.bench.read_floor.kept_rows_read`);
- ``gemlite``: the peer, gemlite's ``GemLiteLinearTriton`` (4-bit, same group, the same codes,
  scales and mins passed in its HQQ form ``(q - z) s`` with ``z = -min / s``), when installed.

Inputs keep exactly ``kept`` of the channels (the same set for every token of a batch, so the
union is the kept fraction; TEAL's threshold 1.0: dropped entries lie in (-0.9, 0.9), kept ones
beyond 1.1). Bytes are each provider's own: fp16 rows, or int4 codes of the rows read plus the
scales and mins of the groups touched.
"""

from __future__ import annotations

import math

import torch

from ..kernels import threshold_gemv
from ..kernels.int4 import (
    int4_gemv,
    int4_gemv_ref,
    int4_threshold_gemv,
    int4_threshold_gemv_ref,
)
from ..kernels.int4.lists import LIST_ROWS, kept_lists
from ..kernels.int4.sums import int4_sums
from ..quant import Int4Weight, quantize
from .read_floor import BLOCK, kept_rows_read, stream_read
from .timing import cuda, relerr, rotation_copies

__all__ = ["Int4Case", "gemlite_layer", "gemlite_version"]

THR = 1.0  # the one TEAL threshold of every case (see the inputs)


def gemlite_version() -> str | None:
    """gemlite's version when it imports here, else None (the bench then skips the peer).

    >>> gemlite_version() is None or gemlite_version() >= "0.6"  # it needs a CUDA GPU to import
    True
    """
    try:
        import gemlite
    except Exception:  # not installed, or built against another torch/triton
        return None
    return getattr(gemlite, "__version__", "unknown")


def gemlite_layer(w: Int4Weight):
    """gemlite's 4-bit layer holding the same weight as ``w``: codes ``[out, in]``, scales and
    HQQ zeros ``[out, in / group]`` (``w_t = q s + m = (q - z) s`` with ``z = -m / s``).

    >>> from dejavu_lab.quant import quantize
    >>> w = quantize(torch.randn(256, 128), group=64, dtype=torch.float16)
    >>> layer = gemlite_layer(w.to("cuda")) if gemlite_version() else None  # a GPU with gemlite
    >>> layer is None or tuple(layer.W_q.shape)[1] == 128
    True
    """
    from gemlite import DType, GemLiteLinearTriton

    d_in, d_out = w.shape
    dtype = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16}[w.dtype]
    scales = w.scales.float()
    safe = torch.where(scales != 0, scales, torch.ones_like(scales))
    zeros = (-w.mins.float() / safe).T.contiguous().to(w.dtype)
    layer = GemLiteLinearTriton(4, group_size=w.group, in_features=d_in, out_features=d_out,
                                input_dtype=dtype, output_dtype=dtype)  # fmt: skip
    layer.pack(w.codes().T.contiguous(), w.scales.T.contiguous(), zeros, bias=None)
    return layer


class Int4Case:
    """One weight shape ``w_t`` [d_in, d_out]: fp16 copies and int4 copies to rotate through.

    >>> case = Int4Case(128, 64, group=32, device="cpu", max_copies=2)
    >>> case.int4_bytes(1.0) - case.q[0].nbytes  # every row and group, plus x in and y out
    384
    >>> case.check(0.5, 2) < 1e-2  # the Triton kernels on CPU under TRITON_INTERPRET=1
    True
    """

    def __init__(self, d_in: int, d_out: int, *, group: int = 128, dtype=torch.float16,
                 min_kept: float = 0.2, device=None, peer: bool = False,
                 max_copies: int = 64):  # fmt: skip
        self.device = torch.device(device or ("cuda" if cuda() else "cpu"))
        self.d_in, self.d_out, self.group, self.dtype = d_in, d_out, group, dtype
        fp16_bytes = d_in * d_out * 2
        n16 = min(max_copies, rotation_copies(min_kept * fp16_bytes, fp16_bytes))
        self.w16 = torch.randn(n16, d_in, d_out, dtype=dtype, device=self.device)
        self.w16.mul_(d_in**-0.5)
        n4 = min(max_copies, rotation_copies(min_kept * fp16_bytes / 4, fp16_bytes / 4))
        # int4 copies quantised from the fp16 ones (cycled), one at a time to bound memory
        self.q = [quantize(self.w16[c % n16], group=group, dtype=dtype) for c in range(n4)]
        self.peer = [gemlite_layer(q) for q in self.q] if peer else None

    @property
    def copies(self) -> tuple[int, int]:
        """(fp16 copies, int4 copies) rotated through."""
        return self.w16.shape[0], len(self.q)

    def inputs(self, kept: float, batch: int, n: int, seed: int = 0) -> list[torch.Tensor]:
        """``n`` token batches [batch, d_in], each keeping exactly ``round(kept d_in)`` channels
        at threshold :data:`THR` (the same channels for every token of a batch)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        k = round(kept * self.d_in)
        xs = []
        for _ in range(n):
            x = torch.rand(batch, self.d_in, device=self.device, generator=g) * 1.8 - 0.9
            keep = torch.randperm(self.d_in, device=self.device, generator=g)[:k]
            big = torch.rand(batch, k, device=self.device, generator=g) + 1.1
            sign = torch.randint(0, 2, (batch, k), device=self.device, generator=g) * 2 - 1
            x[:, keep] = big * sign
            xs.append(x.to(self.dtype))
        return xs

    def calls(self, provider: str, kept: float, batch: int, config: dict | None = None):
        """Zero-argument callables, one per weight copy, for ``provider`` (module docstring)."""
        n16, n4 = self.copies
        n = n16 if provider.startswith(("cublas", "fp16")) else n4
        xs = self.inputs(kept, batch, n)
        out = [torch.empty(batch, self.d_out, dtype=self.dtype, device=self.device) for _ in xs]
        w16, q = self.w16, self.q
        if provider == "cublas":
            return [lambda c=c: torch.mm(xs[c], w16[c], out=out[c]) for c in range(n)]
        if provider == "fp16_ours":
            return [lambda c=c: threshold_gemv(xs[c], w16[c], -1.0, out=out[c]) for c in range(n)]
        if provider == "fp16_thr":
            return [lambda c=c: threshold_gemv(xs[c], w16[c], THR, out=out[c]) for c in range(n)]
        if provider == "int4":
            return [lambda c=c: int4_gemv(xs[c], q[c], out=out[c], config=config)
                    for c in range(n)]  # fmt: skip
        if provider == "int4_thr":
            return [lambda c=c: int4_threshold_gemv(xs[c], q[c], THR, out=out[c], config=config)
                    for c in range(n)]  # fmt: skip
        if provider == "int4_sums":
            if batch != 1:
                raise ValueError("int4_sums runs one token (batch 1).")
            thr = THR if kept < 1 else None  # kept < 1: the threshold GEMV's kernel alone
            # a workspace of its own: the sums pile up there, where no other kernel reads
            return [lambda c=c: int4_sums(xs[c], q[c], thr, kind="bench_sums") for c in range(n)]
        if provider in ("int4_listed", "lists"):
            if batch != 1:
                raise ValueError(f"{provider} runs one token (batch 1).")
            rows = min(LIST_ROWS, self.group)
            made = [kept_lists(x, THR, rows=rows) for x in xs]
            if provider == "lists":
                return [lambda c=c: kept_lists(xs[c], THR, out=made[c], rows=rows)
                        for c in range(n)]  # fmt: skip
            return [lambda c=c: int4_sums(xs[c], q[c], THR, kind="bench_sums", lists=made[c])
                    for c in range(n)]  # fmt: skip
        if provider == "read_kept":  # the threshold GEMV's kept rows of codes, nothing else
            words = self.q[0].packed.view(torch.int32)  # one xor per block of >= 64 words
            sink = torch.empty(words.numel() // 64 + 1, dtype=torch.int32, device=self.device)
            return [lambda c=c: kept_rows_read(q[c].packed.view(torch.int32), xs[c], THR, sink)
                    for c in range(n)]  # fmt: skip
        if provider == "read":
            words = -(-self.int4_bytes(1.0, batch) // 4)
            bufs = [torch.zeros(words, dtype=torch.int32, device=self.device) for _ in range(n)]
            sink = torch.empty(-(-words // BLOCK), dtype=torch.int32, device=self.device)
            return [lambda c=c: stream_read(bufs[c], sink) for c in range(n)]
        if provider == "gemlite":
            if self.peer is None:
                raise ValueError("this case was built without the peer (peer=False).")
            return [lambda c=c: self.peer[c](xs[c]) for c in range(n)]
        raise ValueError(f"provider {provider!r} is not one of cublas, fp16_ours, fp16_thr, "
                         "int4, int4_thr, int4_sums, int4_listed, lists, read, read_kept, "
                         "gemlite.")  # fmt: skip

    def int4_bytes(self, kept: float, batch: int = 1) -> int:
        """Bytes an int4 call must move: codes of the kept rows, the (scale, min) rows of every
        group with a kept row (expected over random kept sets), tokens in and outputs out."""
        q = self.q[0]
        n_groups = self.d_in // self.group
        k = round(kept * self.d_in)
        # P(a group of `group` rows has no kept row), kept rows drawn without replacement
        p_empty = math.comb(self.d_in - self.group, k) / math.comb(self.d_in, k) if k else 1.0
        io = batch * (self.d_in + self.d_out) * q.scales.element_size()
        return int(k * q.row_bytes + n_groups * (1 - p_empty) * q.group_bytes + io)

    def fp16_bytes(self, kept: float, batch: int = 1) -> int:
        """Bytes an fp16 call must move: the kept rows, tokens in and outputs out."""
        return int((round(kept * self.d_in) * self.d_out + batch * (self.d_in + self.d_out)) * 2)

    def check(self, kept: float, batch: int, config: dict | None = None) -> float:
        """Worst relative error of the int4 dense and threshold GEMVs (``config``) against their
        references on fresh inputs (and of the peer against ours, when built)."""
        x = self.inputs(kept, batch, 1, seed=1)[0]
        q = self.q[0]
        errs = [relerr(int4_gemv(x, q, config=config), int4_gemv_ref(x, q)),
                relerr(int4_threshold_gemv(x, q, THR, config=config),
                       int4_threshold_gemv_ref(x, q, THR))]  # fmt: skip
        if self.peer is not None:
            errs.append(relerr(self.peer[0](x).view(batch, -1), int4_gemv_ref(x, q)))
        return max(float("inf") if math.isnan(e) else e for e in errs)
