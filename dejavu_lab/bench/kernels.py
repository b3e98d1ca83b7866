"""The sparse kernels' timed cases: one MLP or attention shape with rotating cold weights, and
one result row per (op, kept fraction, batch, provider), for ``kernels/bench_sparse_mlp.py``,
``kernels/bench_sparse_attention.py`` and the chapter ``notebooks/60_sparse_kernels.md``.

Deja Vu Appendix E measures sparse MLP and attention against dense at batch 1; we report, for
each case, the dense cuBLAS layer, a PyTorch ``index_select`` + matmul baseline and our Triton
kernel, timed two ways (:func:`~dejavu_lab.bench.timing.time_both`: events around one launch after an
L2 flush, and CUDA-graph replay), with the bytes that must move, the achieved bandwidth and the
speedup over dense against the ideal 1 / kept fraction.

Repeated calls over one weight would measure the L2 cache (60 MB on an H200) once the selected
rows fit in it, so each case keeps several weight copies stacked in one tensor and every call
rotates to the next copy (and its own random index set): every timed call reads cold weights,
as a real model does when it walks through its layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels import (
    sparse_attention,
    sparse_attention_ref,
    sparse_mlp_down,
    sparse_mlp_down_ref,
    sparse_mlp_up,
    sparse_mlp_up_ref,
)
from .timing import cuda, graph_us, relerr, rotation_copies, time_both

__all__ = ["AttentionCase", "MlpCase", "attention_row", "mlp_row"]


def _rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    state = [0]

    def call():
        i = state[0]
        state[0] = (i + 1) % len(calls)
        return calls[i]()

    return call


class MlpCase:
    """One MLP shape (d, hidden 4d or ``hidden``) with stacked weight copies for cold-cache timing.

    ``w1``/``b1``: fc1 [copies*n, d] / [copies*n]; ``w2t``: fc2 weight transposed [copies*n, d];
    ``b2``: [d]. ``min_kept`` sizes the rotation so the smallest selection still misses L2.

    >>> case = MlpCase(16)  # d = 16, 64 neurons; on the GPU when there is one
    >>> case.n, case.copies, tuple(case.w1.shape)
    (64, 64, (4096, 16))
    >>> case.check("up", 0.25, 1) < 1e-2  # our kernel vs the fp32 reference, 16 of 64 kept
    True
    """

    def __init__(self, d: int, *, hidden: int | None = None, min_kept: float = 0.05,
                 dtype=torch.float16, device=None):  # fmt: skip
        device = device or ("cuda" if cuda() else "cpu")
        self.d, self.n, self.dtype, self.device = d, hidden or 4 * d, dtype, torch.device(device)
        esize = torch.finfo(dtype).bits // 8
        self.copies = rotation_copies(min_kept * self.n * d * esize, self.n * d * esize)
        rows = self.copies * self.n

        def rand(*shape, scale):
            return torch.randn(*shape, dtype=dtype, device=device).mul_(scale)

        self.w1 = rand(rows, d, scale=d**-0.5)
        self.b1 = rand(rows, scale=0.1)
        self.w2t = rand(rows, d, scale=self.n**-0.5)
        self.b2 = rand(d, scale=0.1)

    def _inputs(self, kept: float, batch: int):
        n, k = self.n, round(kept * self.n)
        idx = [
            (torch.randperm(n, device=self.device)[:k] + r * n).to(torch.int32)
            for r in range(self.copies)
        ]
        x = torch.randn(batch, self.d, dtype=self.dtype, device=self.device)
        h = torch.randn(batch, k, dtype=self.dtype, device=self.device).relu_()
        h_full = torch.zeros(batch, n, dtype=self.dtype, device=self.device)
        if k:
            h_full[:, idx[0].long()] = h  # copy 0 sits at offset 0
        return k, idx, x, h, h_full

    def calls(self, op: str, kept: float, batch: int, config: dict | None = None) -> dict:
        """{'dense', 'torch', 'contig', 'triton'} -> rotating zero-argument callables, plus metadata.

        'contig' is cuBLAS on the same number of rows made contiguous (the first k rows of each
        copy): what a gather-free sparse layout would cost, the reference our gather must match.
        """
        n, d = self.n, self.d
        k, idx, x, h, h_full = self._inputs(kept, batch)
        sl = [slice(r * n, (r + 1) * n) for r in range(self.copies)]
        w1, b1, w2t, b2 = self.w1, self.b1, self.w2t, self.b2
        if op == "up":
            dense = [lambda s=s: F.linear(x, w1[s], b1[s]) for s in sl]
            gather = [
                lambda i=i: torch.relu(F.linear(x, w1.index_select(0, i), b1.index_select(0, i)))
                for i in idx
            ]
            ours = [
                lambda i=i: sparse_mlp_up(
                    x, w1, i, bias=b1, activation="relu", validate=False, config=config
                )
                for i in idx
            ]
            contig = [
                lambda s=s: F.linear(x, w1[s.start : s.start + k], b1[s.start : s.start + k])
                for s in sl
            ]
        elif op == "down":
            dense = [lambda s=s: torch.addmm(b2, h_full, w2t[s]) for s in sl]
            gather = [lambda i=i: torch.addmm(b2, h, w2t.index_select(0, i)) for i in idx]
            ours = [
                lambda i=i: sparse_mlp_down(h, w2t, i, bias=b2, validate=False, config=config)
                for i in idx
            ]
            contig = [lambda s=s: torch.addmm(b2, h, w2t[s.start : s.start + k]) for s in sl]
        else:
            raise ValueError(f"op {op!r} is not 'up' or 'down'.")
        esize = torch.finfo(self.dtype).bits // 8
        io = batch * (d + k) * esize  # tokens in, selected activations out (or the reverse)
        sparse_bytes = k * d * esize + k * 4 + io + (k if op == "up" else d) * esize
        dense_bytes = n * d * esize + batch * (d + n) * esize + (n if op == "up" else d) * esize
        return {
            "dense": _rotating(dense),
            "torch": _rotating(gather),
            "triton": _rotating(ours),
            "contig": _rotating(contig),
            "lists": {"dense": dense, "torch": gather, "triton": ours, "contig": contig},
            "k": k,
            "bytes": {
                "dense": dense_bytes,
                "torch": sparse_bytes,
                "triton": sparse_bytes,
                "contig": sparse_bytes,
            },  # fmt: skip
        }

    def check(self, op: str, kept: float, batch: int, config: dict | None = None) -> float:
        """Relative error of the Triton kernel against the fp32 reference on fresh inputs."""
        k, idx, x, h, _ = self._inputs(kept, batch)
        if op == "up":
            got = sparse_mlp_up(x, self.w1, idx[0], bias=self.b1, config=config)
            ref = sparse_mlp_up_ref(x, self.w1, idx[0], bias=self.b1)
        else:
            got = sparse_mlp_down(h, self.w2t, idx[0], bias=self.b2, config=config)
            ref = sparse_mlp_down_ref(h, self.w2t, idx[0], bias=self.b2)
        if got.isnan().any():
            return float("inf")
        return relerr(got, ref) if k else 0.0


class AttentionCase:
    """Decode-step attention at one shape (OPT-175B: 96 heads x 128, d = 12288).

    >>> case = AttentionCase(n_heads=4, d_head=16, context=8)  # a tiny shape for the CPU
    >>> case.d, tuple(case.k_cache.shape)
    (64, (1, 4, 8, 16))
    >>> case.check(0.5) < 1e-2  # our kernel vs the fp32 reference, 2 of 4 heads kept
    True
    """

    def __init__(self, n_heads=96, d_head=128, context=1024, batch=1, dtype=torch.float16,
                 device=None):  # fmt: skip
        device = device or ("cuda" if cuda() else "cpu")
        self.h, self.dh, self.ctx, self.batch = n_heads, d_head, context, batch
        self.d = d = n_heads * d_head
        self.dtype, self.device = dtype, torch.device(device)

        def rand(*shape, scale=1.0):
            return torch.randn(*shape, dtype=dtype, device=device).mul_(scale)

        self.w_qkv = rand(3 * d, d, scale=d**-0.5)
        self.b_qkv = rand(3 * d, scale=0.1)
        self.w_o = rand(d, d, scale=d**-0.5)  # nn.Linear layout, for the dense baseline
        self.w_o_t = self.w_o.T.contiguous()  # what the sparse kernel reads
        self.b_o = rand(d, scale=0.1)
        self.k_cache = rand(batch, n_heads, context, d_head)
        self.v_cache = rand(batch, n_heads, context, d_head)
        self.x = rand(batch, d)
        self.seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)

    def calls(self, kept: float, config: dict | None = None) -> dict:
        h, dh, d, b, ctx = self.h, self.dh, self.d, self.batch, self.ctx
        x, kc, vc, pos = self.x, self.k_cache, self.v_cache, ctx - 1
        heads = torch.randperm(h, device=self.device)[: round(kept * h)].to(torch.int32)
        hl = heads.long()
        ar = torch.arange(dh, device=self.device)
        q_rows = (hl[:, None] * dh + ar).reshape(-1)
        rows = torch.cat([q_rows, q_rows + d, q_rows + 2 * d])

        def dense():
            qkv = F.linear(x, self.w_qkv, self.b_qkv).view(b, 3, h, dh)
            kc[:, :, pos] = qkv[:, 1]
            vc[:, :, pos] = qkv[:, 2]
            o = F.scaled_dot_product_attention(qkv[:, 0, :, None], kc, vc)
            return F.linear(o.reshape(b, d), self.w_o, self.b_o)

        def gather():
            qkv = F.linear(x, self.w_qkv.index_select(0, rows), self.b_qkv.index_select(0, rows))
            qkv = qkv.view(b, 3, heads.numel(), dh)
            kc[:, hl, pos] = qkv[:, 1]
            vc[:, hl, pos] = qkv[:, 2]
            o = F.scaled_dot_product_attention(qkv[:, 0, :, None], kc[:, hl], vc[:, hl])
            return torch.addmm(self.b_o, o.reshape(b, -1), self.w_o_t.index_select(0, q_rows))

        def ours():
            return sparse_attention(
                x, self.w_qkv, self.w_o_t, kc, vc, self.seqlens, heads, n_heads=h,
                b_qkv=self.b_qkv, b_o=self.b_o, validate=False, config=config,
            )  # fmt: skip

        esize = torch.finfo(self.dtype).bits // 8
        kv = b * ctx * dh * 2 * esize  # one head's keys and values, all sequences
        sel = heads.numel()
        return {
            "dense": dense,
            "torch": gather,
            "triton": ours,
            "heads": sel,
            "bytes": {
                "dense": 4 * d * d * esize + h * kv,
                "torch": 4 * sel * dh * d * esize + sel * kv,
                "triton": 4 * sel * dh * d * esize + sel * kv,
            },
        }

    def check(self, kept: float, config: dict | None = None) -> float:
        heads = torch.randperm(self.h, device=self.device)[: round(kept * self.h)]
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        args = (self.x, self.w_qkv, self.w_o_t)
        kw = dict(n_heads=self.h, b_qkv=self.b_qkv, b_o=self.b_o)
        got = sparse_attention(*args, kc, vc, self.seqlens, heads, config=config, **kw)
        ref = sparse_attention_ref(
            *args, self.k_cache.clone(), self.v_cache.clone(), self.seqlens, heads, **kw
        )
        return float("inf") if got.isnan().any() else relerr(got, ref)


def _row(base: dict, calls: dict, provider: str, timed: tuple, dense: tuple, ideal: float):
    event, graph = timed
    nbytes = calls["bytes"][provider]
    row = {**base, "provider": provider, "event_ms": event, "graph_ms": graph, "bytes": nbytes,
           "event_tbps": nbytes / (event * 1e-3) / 1e12,
           "graph_tbps": nbytes / (graph * 1e-3) / 1e12}  # fmt: skip
    if provider != "dense":
        row.update(
            ideal=ideal,
            speedup_event=dense[0] / event,
            speedup_graph=dense[1] / graph,
            frac_ideal_event=dense[0] / event / ideal,
            frac_ideal_graph=dense[1] / graph / ideal,
        )
    return row


def mlp_row(case: MlpCase, op: str, kept: float, batch: int, provider: str, *,
            dense_cache: dict, config: dict | None = None, graph_only: bool = False,
            fast: bool = False) -> dict:  # fmt: skip
    """Time one (op, kept, batch, provider) on fresh inputs; dense times are cached per shape.

    ``fast`` times graph replay only, with :func:`graph_us` (a short GPU lease's sweep).

    >>> row = mlp_row(MlpCase(16), "up", 0.25, 1, "triton", dense_cache={})  # wall clock on CPU
    >>> row["k"], row["ideal"], row["bytes"], "speedup_graph" in row
    (16, 4.0, 672, True)
    """
    calls = case.calls(op, kept, batch, config)
    key = (op, case.d, case.n, batch)

    def timer(p):
        if fast and cuda():
            return float("nan"), graph_us(calls["lists"][p]) * 1e-3
        return time_both(calls[p])

    if key not in dense_cache:
        dense_cache[key] = timer("dense")
    if provider == "dense":
        timed = dense_cache[key]
    elif graph_only and cuda() and not fast:
        from triton.testing import do_bench_cudagraph

        timed = (float("nan"), do_bench_cudagraph(calls[provider], rep=20, return_mode="median"))
    else:
        timed = timer(provider)
    base = {"op": op, "d": case.d, "hidden": case.n, "kept": kept, "k": calls["k"],
            "batch": batch, "copies": case.copies, "config": config}  # fmt: skip
    return _row(base, calls, provider, timed, dense_cache[key], case.n / max(calls["k"], 1))


def attention_row(case: AttentionCase, kept: float, provider: str, *, dense_cache: dict,
                  config: dict | None = None) -> dict:  # fmt: skip
    """Time one (kept heads, provider) decode step of attention at ``case``'s shape.

    >>> case = AttentionCase(n_heads=4, d_head=16, context=8)
    >>> row = attention_row(case, 0.5, "torch", dense_cache={})  # wall clock on CPU
    >>> row["heads"], row["ideal"], row["bytes"]
    (2, 2.0, 17408)
    """
    calls = case.calls(kept, config)
    if case.batch not in dense_cache:
        dense_cache[case.batch] = time_both(calls["dense"])
    timed = dense_cache[case.batch] if provider == "dense" else time_both(calls[provider])
    base = {"op": "attention", "d": case.d, "n_heads": case.h, "d_head": case.dh,
            "context": case.ctx, "kept": kept, "heads": calls["heads"], "batch": case.batch,
            "config": config}  # fmt: skip
    return _row(base, calls, provider, timed, dense_cache[case.batch], case.h / calls["heads"])
