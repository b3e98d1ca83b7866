"""Each sequence's kept sets and their union over a batch (Deja Vu Appendix C.1).

The sets of a DejaVu :class:`dejavu_lab.engine.BatchDecoder` (its ``sets``). Every sequence of a batch keeps its own top-k
MLP neurons and heads per layer — given by hand (:meth:`BatchSets.set_indices`, one set for every
sequence or one row per sequence) or chosen inside the step by DejaVu's lookahead predictors
from the sequence's own hidden state. The kernels then read:

- **MLP**: one index list per layer and step, the union over the live sequences of their sets,
  in a buffer of fixed size ``U = min(n, B k, cap)`` so the launch shape never changes (a CUDA
  graph replays it). ``cap`` is the union budget: when the union holds more than ``U`` neurons
  the ``U`` with the most votes (sequences that keep them) are read, ties broken by the
  predictors' mean probability (or a fixed random order for hand-given sets); when it holds
  fewer, the buffer is filled with unvoted neurons, which only cost their bytes.
- **heads**: the union of the sequences' heads (``min(H, B k_h)`` slots, never capped) for the
  ``W_QKV`` / ``W_O`` rows, and a per-sequence mask over those slots for the attention kernel,
  so each sequence attends exactly its own heads (:func:`~dejavu_lab.kernels.sparse_attention_core`).

The realised union sizes (how many distinct neurons / heads the live sequences asked for) are
written per layer and step into a device buffer, with no host synchronisation in the step;
:meth:`BatchSets.union_sizes` reads them back as rows (one dict each).

The batch's blocks read ``mlp_idx``, ``head_idx`` and ``qkv_idx`` as the batch-1 blocks do:
:meth:`BatchSets.start` points them at the union buffers of the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import EngineError, SparseConfig
from .sets import KeptSets, topk_into

__all__ = ["MAX_ROWS", "BatchSets"]

MAX_ROWS = 32  # the gather-GEMVs take 1-32 rows


@dataclass
class _Plan:
    """The union buffers of one batch size (a CUDA graph per batch size reads its own)."""

    mlp_idx: torch.Tensor  # [L, U] neurons read (the union, padded or capped)
    head_idx: torch.Tensor  # [L, Uh] heads whose W_QKV / W_O rows are read
    qkv_idx: torch.Tensor  # [L, Uh + 2 n_kv] W_QKV blocks: the heads, then K and V blocks
    mask: torch.Tensor  # [L, B, Uh] int8: sequence b attends slot j of head_idx
    mlp_val: torch.Tensor  # [L, U] top-k values (scratch)
    head_val: torch.Tensor  # [L, Uh]


class BatchSets(KeptSets):
    """Per-sequence kept sets and the batch's unions: :class:`~dejavu_lab.engine.sets.KeptSets`
    (same ``k_mlp``, ``k_heads``, predictors) for ``max_batch`` sequences.

    >>> import torch
    >>> from dejavu_lab.engine import BatchDecoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt", dtype=torch.float16).model  # 4 heads, 256 neurons
    >>> dec = BatchDecoder(m, max_seq_len=16, max_batch=2,
    ...                    sparse=SparseConfig(mlp_sparsity=0.75, head_sparsity=0.5))
    >>> dec.set_indices(0, mlp=[range(64), range(32, 96)], heads=[[0, 1], [1, 2]])  # per sequence
    >>> out = dec.generate([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], max_new_tokens=2)
    >>> rows = dec.union_sizes()
    >>> [[r["block"], r["union"], r["read"], r["total"]] for r in rows
    ...  if r["layer"] == 0 and r["step"] == 0]
    [['mlp', 96, 128, 256], ['heads', 3, 4, 4]]
    """

    def __init__(self, arch, sp: SparseConfig, device, *, window: int, predictors=None,
                 max_batch: int, max_seq_len: int, union_budget: float | None):  # fmt: skip
        super().__init__(arch, sp, device, window=window, predictors=predictors)
        a, dev, L, bm = arch, device, arch.n_layers, max_batch
        self.max_batch, self._live_f = max_batch, None
        self.B, self.W, self._plan = 0, 0, None
        n, k, kh = a.d_mlp, self.k_mlp, self.k_heads
        if union_budget is None:
            self.union_cap = n
        else:
            if not isinstance(union_budget, (int, float)) or not 0 < union_budget <= 1:
                raise EngineError(
                    f"union_budget={union_budget!r} must be the fraction of MLP neurons a batch's "
                    "union may keep, in (0, 1] (None: no cap)."
                )
            self.union_cap = round(union_budget * n)
            if self.union_cap < k:
                raise EngineError(
                    f"union_budget={union_budget} keeps {self.union_cap} neurons, fewer than each "
                    f"sequence keeps ({k}); raise it to at least {k / n:.3f}."
                )
        self.seq_mlp = torch.arange(k, device=dev).repeat(L, bm, 1)  # [L, B_max, k]
        self.seq_heads = torch.arange(kh, device=dev).repeat(L, bm, 1)  # [L, B_max, k_h]
        self._seq_val = (torch.zeros(L, bm, k, device=dev), torch.zeros(L, bm, kh, device=dev))
        self._votes = torch.zeros(L, n, device=dev)  # live sequences keeping each neuron
        self._member = torch.zeros(L, bm, self.H, device=dev)  # sequence b keeps head h
        g = torch.Generator().manual_seed(0)  # ties among hand-given sets: a fixed order
        self._prio = (torch.randperm(n, generator=g).float() / n).to(dev)[None].repeat(L, 1)
        self._hprio = (torch.randperm(self.H, generator=g).float() / self.H).to(dev)[None]
        self._counts = torch.zeros(L, 2, dtype=torch.int32, device=dev)  # this step's unions
        steps = max_seq_len + 1
        self._union_log = torch.zeros(steps, L, 2, dtype=torch.int32, device=dev)
        self._plans: dict[int, _Plan] = {}

    def window_for(self, B: int) -> int:
        """The deferred-KV window at batch size B: B x W rows fit one gather-GEMV (<= 32)."""
        if min(self.H, B * self.k_heads) == self.H:
            return 0  # the union can hold every head: nothing to defer
        w = min(self.window, MAX_ROWS // B)
        return w if (w == self.window or w >= 4) else 0

    def start(self, B: int, live: torch.Tensor) -> None:
        """Decode a batch of B sequences (``live`` [B_max]: 1.0 while sequence b generates, the
        decoder's buffer): the blocks read its union buffers from now on."""
        self.B, self.W, self._plan = B, self.window_for(B), self.plan_for(B)
        self._live_f = live
        self.mlp_idx, self.head_idx = self._plan.mlp_idx, self._plan.head_idx
        self.qkv_idx, self.mask = self._plan.qkv_idx, self._plan.mask

    def plan_for(self, B: int) -> _Plan:
        """The fixed-size union buffers of batch size B (made once, kept for its graph)."""
        if B in self._plans:
            return self._plans[B]
        a, dev, L = self.arch, self.device, self.arch.n_layers
        n, k, kh, H = a.d_mlp, self.k_mlp, self.k_heads, self.H
        U, Uh = min(n, B * k, self.union_cap), min(H, B * kh)
        if U == n:
            mlp_idx = torch.arange(n, device=dev).repeat(L, 1)
        elif B == 1:  # the sequence's own set, written in place by set_indices / the predictors
            mlp_idx = self.seq_mlp[:, 0]
        else:
            mlp_idx = torch.zeros(L, U, dtype=torch.long, device=dev)
        if Uh == H:
            head_idx = torch.arange(H, device=dev).repeat(L, 1)
        elif B == 1:
            head_idx = self.seq_heads[:, 0]
        else:
            head_idx = torch.zeros(L, Uh, dtype=torch.long, device=dev)
        deferred = self.window_for(B) > 0  # K/V of the union's heads, else of every KV head
        qkv_idx = torch.zeros(
            L, Uh + 2 * (Uh if deferred else self.Hkv), dtype=torch.long, device=dev
        )
        if not deferred:
            qkv_idx[:, Uh:] = torch.cat((self._kv_all + H, self._kv_all + H + self.Hkv))
        plan = _Plan(mlp_idx, head_idx, qkv_idx, torch.ones(L, B, Uh, dtype=torch.int8, device=dev),
                     torch.zeros(L, U, device=dev), torch.zeros(L, Uh, device=dev))  # fmt: skip
        self._plans[B] = plan
        return plan

    def set_indices(self, layer: int, *, mlp=None, heads=None) -> None:
        """Fix the kept neurons / heads of ``layer``: one set ``[k]`` for every sequence, or one
        row per sequence ``[B, k]`` (sequences ``0..B-1``; used when no predictors are given)."""
        if not 0 <= int(layer) < self.arch.n_layers:
            raise EngineError(f"layer {layer} is not in 0..{self.arch.n_layers - 1}.")
        for name, idx, buf, n in (("mlp", mlp, self.seq_mlp, self.arch.d_mlp),
                                  ("heads", heads, self.seq_heads, self.H)):  # fmt: skip
            if idx is None:
                continue
            if not isinstance(idx, torch.Tensor):
                idx = [r if isinstance(r, int) else list(r) for r in idx]  # ranges, lists
                idx = torch.tensor(idx)
            idx = idx.to(buf.device).long()
            rows = idx[None] if idx.dim() == 1 else idx
            k = buf.shape[2]
            if rows.dim() != 2 or rows.shape[1] != k or not 1 <= rows.shape[0] <= self.max_batch:
                raise EngineError(
                    f"{name} needs {k} distinct indices per sequence ([{k}] or [B, {k}]), got "
                    f"shape {tuple(idx.shape)}."
                )
            if any(r.unique().numel() != k for r in rows):
                raise EngineError(f"{name} needs {k} distinct indices per sequence.")
            if int(rows.min()) < 0 or int(rows.max()) >= n:
                raise EngineError(f"{name} indices must lie in [0, {n - 1}].")
            if idx.dim() == 1:
                buf[layer].copy_(rows.expand(self.max_batch, k))
            else:
                buf[layer, : rows.shape[0]].copy_(rows)

    # ----------------------------------------------------------------------------- the unions

    def select(self, i: int | None = None, prio: torch.Tensor | None = None) -> None:
        """The union buffers of layer i (None: every layer at once) from each live sequence's
        sets; ``prio`` [n] in [0, 1) breaks ties among equally voted neurons."""
        B, p, n, H = self.B, self._plan, self.arch.d_mlp, self.H
        at = slice(None) if i is None else slice(i, i + 1)
        live = self._live_f[:B]  # [B] 1.0 while a sequence generates
        k, kh = self.k_mlp, self.k_heads
        votes = self._votes[at]
        votes.zero_()
        sel = self.seq_mlp[at, :B].reshape(votes.shape[0], B * k)
        votes.scatter_add_(1, sel, live.repeat_interleave(k).expand_as(sel))
        self._counts[at, 0] = (votes > 0).sum(-1).to(torch.int32)
        U = p.mlp_idx.shape[1]
        if U < n and B > 1:
            key = votes + (self._prio[at] if prio is None else prio)
            topk_into(key, U, p.mlp_val[at], p.mlp_idx[at], self.topk_kernel)
        member = self._member[at, :B]  # [l, B, H]
        member.zero_()
        member.scatter_(
            2, self.seq_heads[at, :B], live[None, :, None].expand(member.shape[0], B, kh)
        )
        hv = member.sum(1)  # [l, H]
        self._counts[at, 1] = (hv > 0).sum(-1).to(torch.int32)
        Uh = p.head_idx.shape[1]
        if Uh < H and B > 1:
            topk_into(hv + self._hprio, Uh, p.head_val[at], p.head_idx[at], self.topk_kernel)
        heads = p.head_idx[at]
        p.mask[at] = member.gather(2, heads[:, None, :].expand(-1, B, -1)).to(torch.int8)
        q = p.qkv_idx[at]
        q[:, :Uh] = heads
        if self.W:  # deferred KV: the union's K and V blocks too
            q[:, Uh : 2 * Uh] = heads + H
            q[:, 2 * Uh :] = heads + H + self.Hkv

    def predict(self, i: int, x: torch.Tensor) -> None:
        """Each sequence's top-k from its predictor scores at x [B, d] (layer i - 1's input:
        lookahead), then layer i's unions, ties broken by the batch's mean probability."""
        B = self.B
        ms, hs = self.scores(i, x)  # [B, n], [B, H]
        live = self._live_f[:B]
        if self.k_mlp < self.arch.d_mlp:
            topk_into(ms.float(), self.k_mlp, self._seq_val[0][i, :B], self.seq_mlp[i, :B],
                      self.topk_kernel)  # fmt: skip
        if self.k_heads < self.H:
            topk_into(hs.float(), self.k_heads, self._seq_val[1][i, :B], self.seq_heads[i, :B],
                      self.topk_kernel)  # fmt: skip
        prio = (torch.sigmoid(ms.float()) * live[:, None]).sum(0) / (live.sum() + 1.0)  # [0, 1)
        self.select(i, prio[None])

    def log_unions(self, step_t: torch.Tensor) -> None:
        """This step's union sizes into row ``step_t`` of the device log (no host sync)."""
        self._union_log.index_copy_(0, step_t, self._counts[None])

    def union_sizes(self, steps: int, live_log: torch.Tensor) -> list[dict]:
        """The realised union per layer and decode step since the last prefill, one row (dict)
        each: ``step, layer, block ("mlp"/"heads"), union`` (distinct units the live sequences
        kept), ``read`` (the fixed buffer the kernels read), ``total``, ``batch``, ``live``.
        Plain rows, so the engine needs no pandas: :func:`dejavu_lab.report.batch.union_sizes_table`
        makes them a table."""
        log = self._union_log[:steps].cpu()  # [steps, L, 2]
        live = live_log[:steps].cpu()
        p, rows = self._plan, []
        for block, j, read, total in (("mlp", 0, p.mlp_idx.shape[1], self.arch.d_mlp),
                                      ("heads", 1, p.head_idx.shape[1], self.H)):  # fmt: skip
            for s in range(steps):
                rows += [{"step": s, "layer": i, "block": block, "union": int(log[s, i, j]),
                          "read": read, "total": total, "batch": self.B, "live": int(live[s])}
                         for i in range(self.arch.n_layers)]  # fmt: skip
        return rows
