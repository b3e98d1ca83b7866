"""One token's int4 product left as fp32 sums for the decode step's epilogues.

The one-token int4 GEMVs (:mod:`.half2`) add their products into an fp32 workspace, and a
finishing launch rounds the sums into the output. In the decode step that output is read
once, by a rotation or by the residual add and the next norm, which can take the sums
themselves (:func:`~dejavu_lab.kernels.rope_sums`, :func:`~dejavu_lab.kernels.residual_norm`
with ``from_sums``): :func:`int4_sums` runs the product without its finishing launch, as
:func:`~dejavu_lab.kernels.threshold_sums` does for the fp16 threshold GEMV.
"""

from __future__ import annotations

import torch

from ...quant import Int4Weight
from .._common import use_triton
from .half2 import launch_half2
from .kernel import default_config

__all__ = ["half2_config", "int4_sums"]


def half2_config(w: Int4Weight, op: str, device) -> dict | None:
    """The config one token of ``op`` (``int4_gemv``, ``int4_threshold_gemv``) over ``w`` runs
    the half2 kernel of :mod:`.half2` with on ``device``, or None where it runs another kernel
    (``d_out`` not a multiple of 8, the CPU without the interpreter, a tuned table's pick).

    >>> from dejavu_lab.quant import quantize
    >>> half2_config(quantize(torch.randn(64, 12), group=32), "int4_gemv", "cpu") is None
    True
    """
    if w.shape[1] % 8 or not use_triton(torch.device(device)):
        return None
    cfg = default_config(1, *w.shape, group=w.group, op=op, device=torch.device(device))
    return cfg if cfg.get("mode") == "half2" else None


def int4_sums(x: torch.Tensor, w: Int4Weight, thr=None, *, kind: str = "sums", x_act: str = "",
              x_gated: bool = False, x_bias=None, lists=None) -> torch.Tensor | None:  # fmt: skip
    """``x @ dequant(w)`` for one token (``thr`` a float or fp32 [d_in]: TEAL / WINA's
    thresholded product, as :func:`~dejavu_lab.kernels.int4.int4_threshold_gemv`; None: dense)
    left as fp32 sums [d_out] in the per-device workspace, with no bias and no finishing
    launch. The caller's next launch must take them and leave zeros, or the next product into
    the workspace is wrong. Returns None where the half2 kernel would not run (a batch, the CPU
    without the interpreter, ``d_out`` not a multiple of 8, a tuned table that picks another
    kernel): call the GEMV instead. No input checks (the engine calls it inside a CUDA graph).
    ``kind`` names the workspace (two sums may be alive at once). With ``x_act`` (an
    activation) x is itself a previous call's sums, finished as the kernel loads them:
    ``x_act(x + x_bias)``, or with ``x_gated`` ``act(gate) * up`` of x's halves, rounded to
    w's dtype before the threshold — the MLP's hidden activations without a launch of their
    own (the caller then zeroes x). ``lists``: x's kept rows at ``thr``, listed by x's producer
    (:class:`~.lists.KeptLists`): the kernel walks them instead of listing them itself.

    >>> from dejavu_lab.kernels.int4 import int4_gemv_ref, int4_threshold_gemv_ref
    >>> from dejavu_lab.quant import quantize
    >>> _ = torch.manual_seed(0)
    >>> w = quantize(torch.randn(64, 64) / 8, group=32, dtype=torch.float16)  # gate | up
    >>> x = torch.randn(1, 64, dtype=torch.float16)
    >>> ws = int4_sums(x, w)  # CPU: under TRITON_INTERPRET=1
    >>> torch.allclose(ws.half(), int4_gemv_ref(x, w)[0], atol=1e-2)
    True
    >>> w2 = quantize(torch.randn(32, 8) / 4, group=32, dtype=torch.float16)  # 32 neurons
    >>> h = (torch.nn.functional.silu(ws[:32]) * ws[32:]).half()[None]
    >>> y = int4_sums(ws, w2, 0.1, x_act="silu", x_gated=True, kind="down")
    >>> torch.allclose(y.half(), int4_threshold_gemv_ref(h, w2, 0.1)[0], atol=1e-2)
    True
    >>> _ = ws.zero_(), y.zero_()  # what the epilogues do
    """
    xb = x.view(1, -1) if x.dim() == 1 else x
    if xb.shape[0] != 1:
        return None
    cfg = half2_config(w, "int4_gemv" if thr is None else "int4_threshold_gemv", x.device)
    if cfg is None:
        return None
    mode = "dense" if thr is None else "threshold"
    return launch_half2(xb, w, None, cfg, mode=mode, thr=thr, kind=kind, x_act=x_act,
                        x_gated=x_gated, x_bias=x_bias, lists=lists)  # fmt: skip
