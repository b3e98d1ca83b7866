"""Timed cases of the kept-row int4 kernels: DejaVu's and CATS's MLP on 4-bit weights, one token.

One gated MLP (``d`` inputs, ``n`` neurons, group-wise int4) held three ways, the same codes,
rotated through enough copies that every call reads cold weights
(:func:`~dejavu_lab.bench.timing.rotation_copies`): ``W_in`` as rows
(:class:`~dejavu_lab.quant.Int4Rows`, gate rows then up rows) and as columns (``W_inᵀ``, the
dense engine's layout), and ``W2ᵀ``. :meth:`Int4RowsCase.calls` gives one zero-argument call
per copy for a provider:

- ``up_columns``: the dense int4 up projection as the engine runs it (``int4_gemv``, SiLU and
  the gate product in its finishing launch), every neuron — the reference;
- ``up_rows``: :func:`~dejavu_lab.kernels.int4.int4_kept_up` over every neuron;
- ``up_dejavu``: the same over ``kept n`` listed neurons (sorted, drawn at random);
- ``up_cats``: :func:`~dejavu_lab.kernels.int4.int4_cats_up`, a threshold that keeps about
  ``kept n`` neurons;
- ``down_rows``: :func:`~dejavu_lab.kernels.int4.int4_rows_gemv` over the listed neurons;
- ``down_threshold``: ``int4_threshold_gemv`` at 0 over the same activations scattered into
  zeros (what ``down_rows`` runs after its scatter: its floor).

``config`` overrides the kernel's tiles (``{"mode": "tile"}``: the fp32 tile kernel, the
previous one-token path; ``{"mode": "rows"}`` for ``down_rows``: the index walk).

>>> case = Int4RowsCase(64, 96, group=32, device="cpu", max_copies=2)
>>> case.check("up_dejavu", 0.5) < 1e-2  # the Triton kernels on CPU under TRITON_INTERPRET=1
True
>>> case.int4_bytes("up_dejavu", 0.5)  # 48 neurons x 2 rows x (32 code bytes + 2 scales, 2 mins)
3840
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.int4 import (
    int4_cats_up,
    int4_cats_up_ref,
    int4_gemv,
    int4_kept_up,
    int4_kept_up_ref,
    int4_rows_gemv,
    int4_rows_gemv_ref,
    int4_threshold_gemv,
)
from ..quant import quantize, quantize_rows
from .timing import cuda, relerr, rotation_copies

__all__ = ["PROVIDERS", "Int4RowsCase"]

PROVIDERS = ("up_columns", "up_rows", "up_dejavu", "up_cats", "down_rows", "down_threshold")


class Int4RowsCase:
    """A gated MLP of ``d`` inputs and ``n`` neurons in int4 (module docstring).

    >>> case = Int4RowsCase(64, 32, group=32, device="cpu", max_copies=1)
    >>> idx = case.idx(0.25)  # 8 of the 32 neurons, sorted, the same list every time
    >>> len(case.calls("down_rows", 0.25)), idx.numel(), bool((idx.diff() > 0).all())
    (1, 8, True)
    >>> torch.equal(idx, case.idx(0.25))
    True
    """

    def __init__(self, d: int, n: int, *, group: int = 128, dtype=torch.float16, device=None,
                 max_copies: int = 64, seed: int = 0):  # fmt: skip
        self.device = torch.device(device or ("cuda" if cuda() else "cpu"))
        self.d, self.n, self.group, self.dtype = d, n, group, dtype
        g = torch.Generator(device=self.device).manual_seed(seed)
        n_copies = min(max_copies, rotation_copies(0.2 * 3 * d * n / 2, 3 * d * n / 2))
        self.rows, self.columns, self.down = [], [], []
        for _ in range(n_copies):
            w_in = torch.randn(2 * n, d, generator=g, device=self.device) * d**-0.5
            r = quantize_rows(w_in, group=group, dtype=dtype)
            self.rows.append(r)
            self.columns.append(r.columns())
            w2_t = torch.randn(n, d, generator=g, device=self.device) * n**-0.5
            self.down.append(quantize(w2_t, group=group, dtype=dtype))
        self.x = torch.randn(1, d, generator=g, device=self.device).to(dtype)
        self.h = torch.randn(1, n, generator=g, device=self.device).to(dtype)

    def idx(self, kept: float) -> torch.Tensor:
        """``round(kept n)`` distinct neurons, sorted, int32 (the same list for the same kept)."""
        k = max(1, round(kept * self.n))
        g = torch.Generator(device=self.device).manual_seed(k)
        perm = torch.randperm(self.n, generator=g, device=self.device)[:k]
        return perm.sort().values.to(torch.int32)

    def cats_thr(self, kept: float) -> torch.Tensor:
        """fp32 [n]: one threshold on ``|silu(gate)|`` that keeps about ``kept n`` neurons of x
        on the first copy."""
        gate = (self.x.float() @ self.rows[0].dequantize(torch.float32)[: self.n].T)[0]
        a = torch.nn.functional.silu(gate).abs()
        t = torch.quantile(a, 1.0 - kept) if kept < 1 else torch.tensor(-1.0)
        return torch.full((self.n,), float(t), device=self.device)

    def calls(self, provider: str, kept: float = 1.0,
              config: dict | None = None) -> list[Callable[[], object]]:  # fmt: skip
        """One zero-argument call per weight copy (module docstring)."""
        x, n = self.x, self.n
        kw = {"activation": "silu", "gated": True}
        if provider == "up_columns":
            return [lambda c=c: int4_gemv(x, c, config=config, **kw) for c in self.columns]
        if provider == "up_rows":
            return [lambda r=r: int4_kept_up(x, r, None, config=config, **kw) for r in self.rows]
        idx = self.idx(kept)
        if provider == "up_dejavu":
            return [lambda r=r: int4_kept_up(x, r, idx, validate=False, config=config, **kw)
                    for r in self.rows]  # fmt: skip
        if provider == "up_cats":
            thr = self.cats_thr(kept)
            return [lambda r=r: int4_cats_up(x, r, thr, activation="silu", config=config)
                    for r in self.rows]  # fmt: skip
        hk = self.h[:, : idx.numel()].contiguous()
        if provider == "down_rows":
            return [lambda w=w: int4_rows_gemv(hk, w, idx, validate=False, config=config)
                    for w in self.down]  # fmt: skip
        if provider == "down_threshold":
            full = torch.zeros(1, n, dtype=self.dtype, device=self.device)
            full[:, idx.long()] = hk
            return [lambda w=w: int4_threshold_gemv(full, w, 0.0, config=config) for w in self.down]
        raise ValueError(f"provider {provider!r} is not one of {', '.join(PROVIDERS)}.")

    def int4_bytes(self, provider: str, kept: float = 1.0) -> int:
        """Weight bytes one call reads: code rows and the scales and mins beside them."""
        per_row = self.d // 2 + 2 * 2 * self.d // self.group  # codes + fp16 scale and min
        k = self.n if provider in ("up_columns", "up_rows") else max(1, round(kept * self.n))
        if provider.startswith("up"):
            rows = 2 * k if provider != "up_cats" else self.n + k  # CATS: every gate row
            return rows * per_row
        return k * per_row  # a row of W2^T: d outputs, its group's scales and mins

    def check(self, provider: str, kept: float, config: dict | None = None) -> float:
        """The relative error of ``provider``'s first call against its fp32 reference."""
        r, x = self.rows[0], self.x
        got = self.calls(provider, kept, config)[0]()
        if provider in ("up_columns", "up_rows"):
            ref = int4_kept_up_ref(x, r, None, activation="silu", gated=True)
        elif provider == "up_dejavu":
            ref = int4_kept_up_ref(x, r, self.idx(kept), activation="silu", gated=True)
        elif provider == "up_cats":
            ref = int4_cats_up_ref(x, r, self.cats_thr(kept), activation="silu")
        else:
            idx = self.idx(kept)
            ref = int4_rows_gemv_ref(self.h[:, : idx.numel()], self.down[0], idx)
        return relerr(got, ref)
