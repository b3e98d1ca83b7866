"""CATS (Lee et al. 2024, ``lee2024cats``): dense gate, threshold fused, up/down of the kept only.

CATS keeps neuron j of token b iff ``|act(gate_j . x_b)| > thr[j]`` (a per-layer threshold
calibrated for a target sparsity) and computes up and down only for the kept neurons. Three
launches, each streaming one contiguous weight block at close to the copy ceiling:

1. the gate of every neuron densely, over the gate rows (``w_gate_up[:n]``) in fp32: for one
   token as split-K tiles whose sums stay in a workspace (:func:`~dejavu_lab.kernels.cats.sums.rows_sums`, at
   about the copy ceiling on an H200 where cuBLAS reaches 0.91-0.95 of it at the Llama-2-13B
   and Llama-3-8B shapes; ``SPLIT_GATE = False`` runs cuBLAS instead), for a union batch by
   cuBLAS with an fp32 output (:func:`dense_gate`);
2. :func:`~dejavu_lab.kernels.cats.up.cats_up`: the threshold (taking and zeroing the gate's sums, plus its
   bias), and the up rows of the kept neurons only (masked row loads: a dropped row costs no
   memory traffic), ``h`` zero where dropped;
3. :func:`~.threshold_gemv` over the nonzero entries of ``h``: the kept down rows. One token
   runs its tile kernel (:mod:`~dejavu_lab.kernels.threshold.tile`: fp32 atomics, so the rounding depends on the
   order the programs add in); a union batch the compacting kernel, reduced in a fixed order.

Launch shapes fixed by the shapes, no host sync (CUDA-graph capturable). With the split-K gate
and the tile kernel's down step, the H200 runs the whole MLP at 50% kept in 73.4 µs at
Llama-2-13B's shape and 62.2 at Llama-3-8B's (cuBLAS's gate: 75.8 / 66.9;
``results/cats_gate.json``). With the down step on the compacting kernel: 84 µs
against the dense MLP's 110 at Llama-2-13B (gate 37 + up 21 + down 24 µs), 71 against 94 at
Llama-3-8B; with one Triton kernel computing the gate and the masked up rows
together (:func:`~dejavu_lab.kernels.mlp.fused.fused_mlp_kernel` with ``CATS=True``, ~2.5
TB/s on the gate rows against cuBLAS's ~3.8), 113 / 95 µs. ``config={"fused_gate":
True}`` runs that path, for comparison. Union batches are not tuned: at 16 tokens (spread
around one input) both paths take about twice the dense MLP (235 and 230 against 120 µs).
"""

from __future__ import annotations

import torch

from .. import _workspace
from .._common import check_device, check_thr, output, use_triton
from ..mlp.fused import check_mlp, check_mode, default_config, hidden_ref, launch
from ..threshold.gemv import threshold_gemv
from .sums import rows_sums
from .up import cats_up
from .up import default_config as up_config
from .up import launch as up_launch

__all__ = ["SPLIT_GATE", "cats_hidden", "cats_mlp", "cats_mlp_ref", "cats_sums", "dense_gate"]

# one token's gate as split-K tiles (rows_sums) rather than cuBLAS; False (or the config
# {"cublas_gate": True}) runs cuBLAS, for timing the two (kernels/bench_engine.py --plain)
SPLIT_GATE = True


def dense_gate(xb, w_gate_up, n, b_in=None):
    """[B, n] fp32: the gate (or fc1) of every neuron, ``xb @ w_gate_up[:n].T + b_in[:n]``.

    On CUDA one cuBLAS call over the contiguous gate rows with an fp32 output; elsewhere in
    fp32 math (the CPU interpreter's tests compare against a reference computed that way).

    >>> dense_gate(torch.ones(1, 2, dtype=torch.float16), torch.ones(4, 2, dtype=torch.float16), 2)
    tensor([[2., 2.]])
    """
    w, b = w_gate_up[:n], None if b_in is None else b_in[:n]
    if xb.device.type == "cuda":
        g = torch.mm(xb, w.T, out_dtype=torch.float32)
    else:
        g = xb.float() @ w.float().T
    return g if b is None else g.add_(b.float())


def cats_hidden(xb: torch.Tensor, w_gate_up: torch.Tensor, thr: torch.Tensor, *,
                activation: str, n: int, b_in=None, config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """CATS's hidden activations [B, n]: ``act(gate) * up`` (or ``act(fc1)``) of the neurons
    with ``|act(gate)| > thr``, zeros elsewhere — the first two of :func:`cats_mlp`'s steps on
    checked inputs (xb [B, d] fp16/bf16 on a GPU or under the interpreter), for a caller that
    runs the down GEMV itself (the engine's fused step:
    :func:`~dejavu_lab.kernels.threshold.fused.threshold_sums` with threshold 0). Elsewhere (the CPU without
    the interpreter) PyTorch computes the same.

    >>> x = torch.tensor([[1.0, 2.0]], dtype=torch.float16)
    >>> w_in = torch.tensor([[1.0, 1.0], [0.5, 0.0], [3.0, 0.0]], dtype=torch.float16)  # fc1
    >>> cats_hidden(x, w_in, torch.ones(3), activation="relu", n=3)  # 0.5 <= 1: dropped
    tensor([[3., 0., 3.]], dtype=torch.float16)
    """
    batch, d = xb.shape
    gated = w_gate_up.shape[0] == 2 * n
    if not use_triton(xb.device):
        a, u = hidden_ref(xb, w_gate_up, n, activation=activation, gated=gated, b_in=b_in)
        return torch.where(a.abs() > thr.float(), a if u is None else a * u, 0.0).to(xb.dtype)
    config = config or {}
    h = torch.empty((batch, n), dtype=xb.dtype, device=xb.device)
    if config.get("fused_gate"):
        cfg = {**default_config("cats", batch, d, n, n, device=xb.device), **config}
        launch(xb, w_gate_up, None, thr, b_in, h, cats=True, gated=gated, activation=activation,
               k=n, n=n, cfg=cfg)  # fmt: skip
        return h
    cfg = {**up_config(batch, d, n, device=xb.device), **config}
    if batch == 1 and SPLIT_GATE and not config.get("cublas_gate"):  # split-K tiles' sums
        g = rows_sums(xb, w_gate_up[:n], kind="cats_gate", config=config.get("gate"))
        up_launch(xb, w_gate_up, g.view(1, n), thr, b_in, h, activation=activation, cfg=cfg,
                  gate_sums=True)  # fmt: skip
    else:
        cats_up(xb, w_gate_up, dense_gate(xb, w_gate_up, n, b_in), thr, activation=activation,
                b_in=b_in, out=h, config=cfg)  # fmt: skip
    return h


def cats_sums(xb: torch.Tensor, w_gate_up: torch.Tensor, thr: torch.Tensor, *, activation: str,
              n: int, b_in=None) -> torch.Tensor | None:  # fmt: skip
    """One token's gate and kept up rows as fp32 sums [gate | up] ([2n]; fc1: [n]) in the
    workspace ``"hidden"``, for a down GEMV that finishes them as it loads them
    (:func:`~dejavu_lab.kernels.threshold.fused.threshold_sums` with ``x_act``, ``x_gated`` and ``keep_gate``;
    its caller then zeroes them). Two split-K launches (:func:`~dejavu_lab.kernels.cats.sums.rows_sums`): the
    gate of every neuron, then the up rows of the neurons with ``|act(gate + b)| > thr`` only.
    None where this path does not run (a union batch, the CPU without the interpreter,
    ``SPLIT_GATE = False``): use :func:`cats_hidden` there.

    >>> x, w = torch.ones(1, 2, dtype=torch.float16), torch.ones(4, 2, dtype=torch.float16)
    >>> gu = cats_sums(x, w, torch.tensor([1.0, 9.0]), activation="relu", n=2)
    >>> gu.tolist()  # gates 2, 2; relu(2) > 1 keeps neuron 0 only: its up row read
    [2.0, 2.0, 2.0, 0.0]
    >>> _ = gu.zero_()
    """
    if xb.shape[0] != 1 or not use_triton(xb.device) or not SPLIT_GATE:
        return None
    gated = w_gate_up.shape[0] == 2 * n
    gu = _workspace.buffer(xb.device, "hidden", 2 * n, torch.float32)[: 2 * n if gated else n]
    rows_sums(xb, w_gate_up[:n], out=gu[:n])
    if gated:
        gb = None if b_in is None else b_in[:n]
        rows_sums(xb, w_gate_up[n:], out=gu[n:], keep=(gu[:n], thr, activation, gb))
    return gu


def cats_mlp_ref(x, w_gate_up, w_down_t, thr, *, activation, b_in=None, b_down=None):
    """Plain-PyTorch CATS reference: keep neuron j of token b iff ``|act(gate_j . x_b)| > thr[j]``.

    ``w_gate_up`` [2n, d] (gate rows then up rows: SwiGLU/GeGLU) or [n, d] (fc1: ReLU/GELU MLP).

    >>> x = torch.ones(1, 2, dtype=torch.float16)
    >>> w_in = torch.tensor([[1.0, 1.0], [0.5, 0.0], [3.0, 0.0]], dtype=torch.float16)  # fc1
    >>> w_down_t = torch.ones(3, 2, dtype=torch.float16)
    >>> cats_mlp_ref(x, w_in, w_down_t, torch.ones(3), activation="relu")  # 0.5 <= 1: dropped
    tensor([[5., 5.]], dtype=torch.float16)
    """
    xb = x if x.dim() == 2 else x[None]
    n = w_down_t.shape[0]
    gated = w_gate_up.shape[0] == 2 * n
    a, u = hidden_ref(xb, w_gate_up, n, activation=activation, gated=gated, b_in=b_in)
    h = torch.where(a.abs() > thr.float(), a if u is None else a * u, 0.0)
    y = h.to(x.dtype).float() @ w_down_t.float()
    if b_down is not None:
        y = y + b_down.float()
    y = y.to(x.dtype)
    return y if x.dim() == 2 else y[0]


def cats_mlp(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down_t: torch.Tensor,
    thr: torch.Tensor,
    *,
    activation: str,
    b_in: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    deterministic: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """CATS: dense gate, threshold fused, up and down rows read only for the kept neurons.

    x: [d] or [B, d] (B <= 32); w_gate_up: [2n, d] (gate rows then up rows; SwiGLU/GeGLU) or
    [n, d] (fc1 of a ReLU/GELU MLP: ``h = act(fc1 . x + b)`` kept where ``|h| > thr``);
    w_down_t: [n, d]; thr: fp32 [n]. Neuron j counts for token b iff
    ``|act(gate_j . x_b)| > thr[j]``; its up and down rows are read iff some token keeps it.
    No host sync, launch shape fixed by the shapes (CUDA-graph capturable). Three steps
    (:func:`dense_gate`, :func:`~dejavu_lab.kernels.cats.up.cats_up`, :func:`~.threshold_gemv`); a union batch
    gets the same bits on every call, one token's down step sums with fp32 atomics
    (``deterministic=True``: the compacting kernel, bitwise repeatable, slower).
    ``config`` overrides the up kernel's tiles (``"down"``: the down GEMV's; ``"fused_gate":
    True``: gate and up in one Triton kernel, the older path).

    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(2, 16, dtype=torch.float16)  # a union batch of 2 tokens
    >>> w = torch.randn(128, 16, dtype=torch.float16) / 4  # gate + up of n = 64 neurons
    >>> w_down_t = torch.randn(64, 16, dtype=torch.float16) / 8
    >>> thr = torch.full((64,), 0.3)  # |silu(gate)| > 0.3 survives
    >>> y = cats_mlp(x, w, w_down_t, thr, activation="silu")
    >>> torch.allclose(y, cats_mlp_ref(x, w, w_down_t, thr, activation="silu"), atol=1e-2)
    True
    """
    xb, squeeze, n, d = check_mlp(x, w_gate_up, w_down_t, activation, b_in, b_down)
    dtype, device = x.dtype, x.device
    if w_gate_up.shape[0] not in (n, 2 * n):
        raise ValueError(f"w_gate_up has {w_gate_up.shape[0]} rows; expected 2n = {2 * n} "
                         f"(gate then up) or n = {n} (fc1) for w_down_t's {n} neurons.")  # fmt: skip
    check_thr(thr, n)
    check_device(device, thr=thr)
    batch = xb.shape[0]
    res, res2 = output(out, batch, d, squeeze, dtype, device)
    if not use_triton(device):
        res2.copy_(cats_mlp_ref(xb, w_gate_up, w_down_t, thr, activation=activation, b_in=b_in,
                                b_down=b_down))  # fmt: skip
        return res
    config = config or {}
    check_mode(config)
    h = cats_hidden(xb, w_gate_up, thr, activation=activation, n=n, b_in=b_in, config=config)
    if batch == 1 and not deterministic:
        # the tile kernel over h's nonzeros (fp32 atomics, one threshold: 0)
        threshold_gemv(h, w_down_t, 0.0, bias=b_down, out=res2, config=config.get("down"))
        return res
    zeros = _workspace.buffer(device, "zero_thresholds", n, torch.float32)[:n]
    threshold_gemv(
        h, w_down_t, zeros, bias=b_down, out=res2, deterministic=True, config=config.get("down")
    )
    return res
