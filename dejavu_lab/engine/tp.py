"""Tensor-parallel decoding over ``torch.distributed``: the sparse step across GPUs (Deja Vu §5.1).

A 175B-parameter model is 350 GB in fp16: it does not fit one GPU. The paper runs OPT-175B on
8 A100s with Megatron-style tensor parallelism (apex in its code) and reports DejaVu 1.8-2.0x
faster than FasterTransformer there (§5.1). Here one process per GPU, started by
``torchrun``, holds one shard (:mod:`~dejavu_lab.engine.tp_weights`: heads with their KV cache,
MLP neurons, ``lm_head`` rows) and runs the single-GPU :class:`~dejavu_lab.engine.Decoder`'s
code on it — the same dense GEMVs or sparse kernels, over its own units and its share of the
kept sets. Per layer the ranks exchange two tensors, as Megatron does:

- an all-reduce of the attention block's output ``[1, d]`` and one of the MLP's (row-parallel
  ``W_O`` and ``W2`` give partial sums), in the weights' dtype — gloo sums fp16 and bf16 too
  (checked with torch 2.13), so no fp32 detour; the decoder's one change is the ``_reduce``
  hook its ``_block`` calls on each block output (identity on one GPU);
- per step, an all-gather of the logits (vocab-parallel ``lm_head``: ``[1, V/W]`` per rank).

Kept sets. DejaVu keeps the top-k neurons and heads of its predictors' scores per layer. Each
rank keeps the top ``n_keep(sparsity, n/W)`` of its *own* units: the predictors' ``d -> r``
half runs on every rank (it is small, and its input, the residual stream, is replicated), their
``r -> n`` half only over the rank's units (rows sliced at load) — the scores are computed once
in all, already split, with no collective. A global top-k would need an all-gather of scores per
layer and would give ranks unequal work (the slowest sets the step time). Fixed sets
(:meth:`TPDecoder.set_indices`) take *global* indices that give every rank the same count
(:func:`split_indices`).

CUDA graphs: NCCL collectives can be captured (torch >= 2.1 keeps the watchdog off captured
work), so :meth:`~dejavu_lab.engine.decode_loop.DecodeLoop.capture` records the whole step with its
collectives, as on one GPU; gloo's cannot: on CPU every step runs eagerly.

Keep NVLink multicast off (:data:`NVLS_OFF`, set by :func:`init_tp` before NCCL starts): a
program that uses it can put a host's GPUs out of service on the machines this project uses.

Launch one process per GPU (the script calls the same methods in the same order on every rank):

    torchrun --nproc-per-node 8 my_script.py

    rank, world, device = init_tp()                    # my_script.py
    w = random_shard("opt-175b", rank, world, device=device)
    dec = TPDecoder(w, max_seq_len=640, sparse=SparseConfig(0.85, 0.5))
    tokens = dec.generate(ids, 128)                    # the same tokens on every rank

Without a process group the decoder refuses in one sentence:

>>> from dejavu_lab.models import random_model
>>> TPDecoder(random_model("tiny-opt").model, max_seq_len=16)
Traceback (most recent call last):
...
dejavu_lab.errors.EngineError: torch.distributed is not initialised: launch this script with `torchrun --nproc-per-node N script.py` and run dejavu_lab.engine.init_tp() before building a TPDecoder.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from .config import PLANNED, EngineError, SparseConfig
from .decoder import Decoder
from .sets import KeptSets
from .tp_weights import ShardedWeights, shard_weights
from .weights import DecoderWeights, decoder_weights, layout_for

__all__ = ["NVLS_OFF", "TPDecoder", "init_tp", "split_indices"]

# NVLink SHARP / multicast off for NCCL, torch's symmetric memory and NVSHMEM (see module doc)
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
_NOT_INIT = (
    "torch.distributed is not initialised: launch this script with `torchrun --nproc-per-node N "
    "script.py` and run dejavu_lab.engine.init_tp() before building a TPDecoder."
)
# torch 2.13 (CPU here) deprecates all_gather_into_tensor for all_gather_single; older: the former
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_tp(backend: str | None = None, *, timeout_s: float = 600) -> tuple[int, int, torch.device]:
    """Join the process group ``torchrun`` set up: ``(rank, world_size, device)``.

    Sets :data:`NVLS_OFF`, then NCCL with this process's GPU (``LOCAL_RANK``) when CUDA is
    present, else gloo on the CPU; a group already initialised is used as it is.

    >>> import os
    >>> "RANK" in os.environ or init_tp()
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: this process was not started by torchrun (its environment has no RANK and WORLD_SIZE); launch it with torchrun: run `torchrun --nproc-per-node N script.py`.
    """
    os.environ.update(NVLS_OFF)  # NCCL reads them when its communicator starts
    if not dist.is_initialized():
        if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
            raise EngineError(
                "this process was not started by torchrun (its environment has no RANK and "
                "WORLD_SIZE); launch it with torchrun: run `torchrun --nproc-per-node N script.py`."
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)  # eager init on its own GPU (before any graph capture)
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
        else:
            dist.init_process_group(backend, timeout=timeout)
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def split_indices(idx, n: int, world_size: int) -> list[torch.Tensor]:
    """Global indices of ``n`` units -> each rank's local indices (rank r holds ``[r n/W, (r+1)
    n/W)``), sorted.

    >>> [t.tolist() for t in split_indices([0, 5, 2, 7], n=8, world_size=2)]
    [[0, 2], [1, 3]]
    """
    idx = torch.as_tensor(idx).long().flatten().cpu()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise EngineError(f"indices must lie in [0, {n - 1}]; pass global unit indices.")
    per = n // world_size
    return [torch.sort(idx[(idx >= r * per) & (idx < (r + 1) * per)] - r * per).values
            for r in range(world_size)]  # fmt: skip


def _local_thresholds(sparse: SparseConfig | None, w: ShardedWeights) -> SparseConfig | None:
    """TEAL/WINA/CATS thresholds given at full width, cut to this rank's o_in / down_in / gate."""
    if sparse is None or sparse.thresholds is None:
        return sparse
    a, s = w.full_arch, w.shard
    dh = a.d_head
    cut = {"o_in": (s.heads[0] * dh, s.heads[1] * dh), "down_in": s.neurons, "gate": s.neurons}
    width = {"attn_in": a.d_model, "mlp_in": a.d_model, "o_in": a.n_heads * dh,
             "down_in": a.d_mlp, "gate": a.d_mlp}  # fmt: skip
    thr = {}
    for (layer, site), t in sparse.thresholds.items():
        if not isinstance(t, torch.Tensor):  # one number: the same on every rank
            thr[(layer, site)] = t
            continue
        if t.numel() != width[site]:
            raise EngineError(
                f"thresholds[({layer}, {site!r})] has {t.numel()} entries but site {site} of the "
                f"whole model takes {width[site]}; give every rank the full-width thresholds."
            )
        lo, hi = cut.get(site, (0, t.numel()))
        thr[(layer, site)] = t[lo:hi]
    return dataclasses.replace(sparse, thresholds=thr)


class _ShardSets(KeptSets):
    """DejaVu's kept sets on one rank: the predictors' ``r -> n`` rows cut to the rank's
    ``neurons`` and ``heads`` (``[start, stop)`` of the whole model's)."""

    def __init__(self, *args, neurons: tuple[int, int], heads: tuple[int, int], **kwargs):
        self.neurons, self.heads = neurons, heads
        super().__init__(*args, **kwargs)

    def _fuse_predictors(self) -> None:
        """The stacked predictors with their r -> n rows cut to this rank's neurons / heads."""
        super()._fuse_predictors()
        if self._fused is None:
            return
        (n0, n1), (h0, h1) = self.neurons, self.heads
        self._fused = [(d, r, wm[n0:n1].contiguous(), bm[n0:n1].contiguous(),
                        wh[h0:h1].contiguous(), bh[h0:h1].contiguous())
                       for d, r, wm, bm, wh, bh in self._fused]  # fmt: skip

    def scores(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ms, hs = super().scores(i, x)
        if self._fused is not None:  # already this rank's
            return ms, hs
        (n0, n1), (h0, h1) = self.neurons, self.heads
        return ms[..., n0:n1], hs[..., h0:h1]


class TPDecoder(Decoder):
    """:class:`~dejavu_lab.engine.Decoder` on one tensor-parallel rank (see module doc).

    ``model`` is a HF model or full :class:`~dejavu_lab.engine.DecoderWeights` (every rank
    passes the same; this rank's shard is cut, onto ``device`` if given), or this rank's
    :class:`~dejavu_lab.engine.tp_weights.ShardedWeights` (:func:`random_shard`,
    :func:`shard_weights`). Other arguments as for ``Decoder``; ``group`` is the process group
    (default: the world). Logits are the whole vocabulary's, the same on every rank.

    One process can hold a group of one (a real launch is ``torchrun``, see module doc):

    >>> import torch.distributed as dist
    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> m, ids = random_model("tiny-opt").model, torch.tensor([[5, 6, 7]])
    >>> dec, ref = TPDecoder(m, max_seq_len=16), Decoder(m, max_seq_len=16)
    >>> dec.w.shard.heads, dec.generate(ids, 4).tolist() == ref.generate(ids, 4).tolist()
    ((0, 4), True)
    >>> dist.destroy_process_group()
    """

    fuse_epilogues = False  # each block's output is all-reduced (_reduce) before the residual add

    def __init__(self, model, *, max_seq_len: int, sparse: SparseConfig | None = None,
                 predictors=None, arch=None, dense_ops: str | dict | None = None, group=None,
                 vocab_parallel: bool = True, device: str | torch.device | None = None):  # fmt: skip
        if sparse is not None and sparse.method in PLANNED:
            raise EngineError(
                f"{sparse.method} runs on one GPU (Decoder); its rotations and factors are not "
                "sharded over tensor-parallel ranks yet."
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise EngineError(_NOT_INIT)
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        if isinstance(model, ShardedWeights):
            w = model
            if (w.shard.rank, w.shard.world_size) != (self.rank, self.world_size):
                raise EngineError(
                    f"these weights are the shard of rank {w.shard.rank} of "
                    f"{w.shard.world_size} but this process is rank {self.rank} of "
                    f"{self.world_size}; build each rank's own (random_shard or shard_weights)."
                )
        else:
            method = "dense" if sparse is None else sparse.method
            if isinstance(model, DecoderWeights) and model.prefill_masks:
                raise EngineError("refit weights (fold_refit) run in the batch-1 Decoder only.")
            full = model if isinstance(model, DecoderWeights) else decoder_weights(
                model, arch, layout=layout_for(method))  # fmt: skip
            w = shard_weights(
                full, self.rank, self.world_size, vocab_parallel=vocab_parallel, device=device
            )
        if self.backend == "nccl" and w.device.type != "cuda":
            raise EngineError(
                f"the NCCL backend reduces GPU tensors but the weights are on {w.device}; pass "
                "device=init_tp()[2] (this rank's GPU)."
            )
        super().__init__(w, max_seq_len=max_seq_len, sparse=_local_thresholds(sparse, w),
                         predictors=predictors, dense_ops=dense_ops)  # fmt: skip

    # ----------------------------------------------------------------------------- collectives

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial block outputs [S, d] (row-parallel W_O / W2), in place."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        """[S, V_local] logit shards -> [S, V] on every rank (vocab-parallel lm_head)."""
        if not self.w.vocab_parallel or self.world_size == 1:
            return logits[:, : self.w.vocab]
        S, Vl = logits.shape
        out = torch.empty(self.world_size * S, Vl, dtype=logits.dtype, device=logits.device)
        _all_gather(out, logits.contiguous(), group=self.group)
        return out.view(self.world_size, S, Vl).transpose(0, 1).reshape(S, -1)[:, : self.w.vocab]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self._gather(super()._head(x))  # [S, V]

    # ----------------------------------------------------------------------------- kept sets

    def _new_sets(self, sparse: SparseConfig) -> _ShardSets:
        s = self.w.shard
        return _ShardSets(self.arch, sparse, self.w.device, window=self.window,
                         predictors=self.predictors, neurons=s.neurons, heads=s.heads)  # fmt: skip

    def set_indices(self, layer: int, *, mlp=None, heads=None) -> None:
        """Fix the kept neurons / heads of ``layer`` by *global* indices; each rank keeps those
        in its range, which must be ``k_mlp`` neurons and ``k_heads`` heads on every rank."""
        if self.sets is None:
            return super().set_indices(layer, mlp=mlp, heads=heads)  # its one-sentence error
        fa, s, local = self.w.full_arch, self.w.shard, {}
        for name, idx, n, k, what in (("mlp", mlp, fa.d_mlp, self.k_mlp, "MLP neurons"),
                                      ("heads", heads, fa.n_heads, self.k_heads, "heads")):  # fmt: skip
            if idx is None:
                continue
            mine = split_indices(idx, n, self.world_size)[self.rank]
            if mine.numel() != k:
                lo, hi = s.neurons if name == "mlp" else s.heads
                raise EngineError(
                    f"rank {self.rank} keeps {k} of its {what} {lo}..{hi - 1} but the {name} set "
                    f"gives it {mine.numel()}; give every rank {k} of its own "
                    f"({k * self.world_size} in all)."
                )
            local[name] = mine
        super().set_indices(layer, **local)

    # ----------------------------------------------------------------------------- graphs

    @torch.no_grad()
    def capture(self) -> None:
        """Record the decode step, its collectives included, in a CUDA graph (NCCL only)."""
        if self.w.device.type == "cuda" and self.world_size > 1:
            if self.backend != "nccl":
                raise EngineError(
                    f"the {self.backend} backend's collectives cannot be captured in a CUDA "
                    "graph; use NCCL on GPUs (init_tp does), or call step() without a graph."
                )
            torch.cuda.synchronize()  # no collective still in flight when the capture starts
        super().capture()

    def parts(self) -> dict:
        """As :meth:`Decoder.parts`, plus ``collectives``: the step's all-reduces (two per
        layer, [1, d]) and logits all-gather alone, on zero buffers."""
        out = super().parts()
        d, L = self.arch.d_model, self.arch.n_layers
        buf = torch.zeros(1, d, dtype=self.w.dtype, device=self.w.device)
        shard = torch.zeros(1, self.w.lm_head.shape[0], dtype=self.w.dtype, device=self.w.device)

        def collectives():
            for _ in range(2 * L):
                self._reduce(buf)
            return self._gather(shard)

        out["collectives"] = collectives
        return out
