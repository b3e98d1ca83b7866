"""LaRoSA's and R-Sparse's plans as the decode step runs them (LaRoSA §3; R-Sparse §3–4).

Both keep TEAL's rule on a transformed site input when their plan keeps by threshold
(``rule="threshold"``, the designs that measured best: ``sparsify.topk.DEFAULT_DESIGN``), so
the engine runs them through TEAL's threshold kernels:

- **LaRoSA**: attention's output is rotated per key/value group. The rotation folds into W_V's
  rows and W_O's columns (:func:`fold_rotations`: a copy of those two matrices per layer, the
  rest shared), after which the step is TEAL's on the folded weights, with the plan's
  thresholds in the rotated basis (per column ``t / ||(W Q)[:, j]||`` for
  ``score="weighted"``): the same kernels and the same bytes at the same kept fractions. One
  basis for the whole residual stream (``basis="global"``, RMSNorm models) folds too
  (:func:`fold_residual`, SliceGPT's move: the embedding, every writer's rows and every
  reader's columns turned, the norms' gains folded into the readers; a copy of the model).
- **R-Sparse**: per site the thresholded product plus ``U_r (V_r x_R)``, ``x_R`` the entries
  the threshold drops (:mod:`~dejavu_lab.engine.lowrank`); ``U_r = W diag(s) B_r`` and
  ``V_r = B_rᵀ diag(1/s)`` from the plan's SVD, as ``sparsify.rsparse.factors`` writes them.

What the engine does not run, refused in one sentence: a fixed count per token
(``rule="topk"``: it needs a top-k kernel) and a basis per layer or per site (``basis="layer"``
or ``"site"``: the stream's turn between bases is a d × d GEMV the engine does not have).

>>> import torch
>>> from dejavu_lab.engine import decoder_weights
>>> from dejavu_lab.models import random_model
>>> w = decoder_weights(random_model("tiny-llama").model, layout="columns")
>>> rot = random_rotations(w.arch)  # one orthogonal d_head x d_head basis per K/V group
>>> tuple(rot[0].shape), fold_rotations(w, rot).layers[0].w_o_t.shape == w.layers[0].w_o_t.shape
((2, 16, 16), True)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..collect import fingerprint
from .config import EngineError
from .weights import DecoderWeights

__all__ = ["check_factors", "factor_bytes", "fold_residual", "fold_rotations", "plan_parts",
           "random_factors", "random_rotations", "site_shape"]  # fmt: skip

_SHAPE = ("model_type", "n_layers", "d_model", "n_heads", "d_mlp")


def plan_parts(plan, w: DecoderWeights, model=None) -> tuple[dict, dict, dict]:
    """``(thresholds, rotations, factors)`` of a LaRoSA or R-Sparse plan (a
    ``sparsify.topk.TopkPlan``) for the engine over weights ``w``: ``{(layer, site): float or
    fp32 [d_in]}``, ``{layer: fp32 [kv_heads, d_head, d_head]}`` (LaRoSA; with
    ``"residual": fp32 [d, d]`` for a global basis, :func:`fold_residual`) and ``{(layer,
    site): (U [d_out, r], V [r, d_in])}`` fp32 (R-Sparse, sites with a rank). ``model``: the
    Hugging Face model ``w`` was built from, whose fingerprint the plan's must match (without
    it, only the shapes are compared).

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import larosa
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 16)), cache=False,
    ...                        progress=False)
    >>> p = larosa.plan(m.model, mo, 0.5, basis="none", rule="threshold")
    >>> thr, rot, fac = plan_parts(p, decoder_weights(m.model), m.model)
    >>> len(thr), sorted(rot), fac
    (8, [0, 1], {})
    >>> plan_parts(larosa.plan(m.model, mo, 0.5, basis="none"), decoder_weights(m.model))
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: the engine runs plans built with rule='threshold' (TEAL's rule on the transformed inputs); a fixed count per token (rule='topk') needs a top-k kernel it does not have.
    """
    arch = w.arch
    fp = getattr(plan, "fingerprint", None) or {}
    shape = {"model_type": arch.model_type, "n_layers": arch.n_layers, "d_model": arch.d_model,
             "n_heads": arch.n_heads, "d_mlp": arch.d_mlp}  # fmt: skip
    if any(fp.get(k) != shape[k] for k in _SHAPE) or (
        model is not None and fp.get("weights_sha256") != fingerprint(model, arch)["weights_sha256"]
    ):
        raise EngineError(
            "this plan was built for another model (or the same one in another dtype); build it "
            "for the model the engine runs."
        )
    thresholds, rotations, factors = {}, {}, {}
    for (i, site), sp in sorted(plan.sites.items()):
        t = sp.tensors
        if sp.threshold is None:
            raise EngineError(
                "the engine runs plans built with rule='threshold' (TEAL's rule on the "
                "transformed inputs); a fixed count per token (rule='topk') needs a top-k kernel "
                "it does not have."
            )
        if "q" in t:
            if getattr(plan, "options", {}).get("basis") != "global":
                raise EngineError(
                    "the engine folds one basis for the whole residual stream (basis='global') "
                    "or none; a basis per layer or site turns the stream with a d x d GEMV it "
                    "does not have."
                )
            rotations["residual"] = t["q"].float()
        thr = float(sp.threshold)
        if "norms" in t:  # score |y_j| · ||W[:, j]|| > t, i.e. |y_j| > t / ||W[:, j]||
            thr = (thr / t["norms"].float().clamp_min(1e-12)).contiguous()
        thresholds[(i, site)] = thr
        if "qh" in t:  # per query head its group's basis: one per group
            rotations[i] = t["qh"][:: arch.heads_per_kv].float()
        if getattr(sp, "rank", 0) > 0:
            wt = _stacked(w, i, site)
            s, b = t["s"].float().to(wt.device), t["b"].float().to(wt.device)
            factors[(i, site)] = ((wt * s) @ b, (b / s[:, None]).T.contiguous())
    return thresholds, rotations, factors


def _stacked(w: DecoderWeights, i: int, site: str) -> torch.Tensor:
    """The site's weight stacked by rows ([Wq; Wk; Wv], W_O, [W_gate; W_up], W_down), fp32."""
    lw = w.layers[i]
    if site == "attn_in":
        m = lw.w_qkv if lw.w_qkv is not None else lw.w_qkv_t.T
    elif site == "mlp_in":
        m = lw.w_in if lw.w_in is not None else lw.w_in_t.T
    elif site == "o_in":
        m = lw.w_o_t.T
    else:
        m = lw.w_down_t.T
    return m.float()


@torch.no_grad()
def fold_rotations(w: DecoderWeights, rotations: dict) -> DecoderWeights:
    """Weights with each layer's K/V group bases ``rotations[layer]`` [kv_heads, d_head,
    d_head] folded in: W_V's rows of group g turned to ``Q_gᵀ W_V,g`` (its bias too) and W_O's
    columns of head h to ``W_O,h Q_g(h)``. A new :class:`DecoderWeights` that shares every other
    tensor with ``w`` (``w`` is left as it was); its dense output is ``w``'s. A key
    ``"residual"`` (fp32 [d, d]) also turns the residual stream (:func:`fold_residual`).

    >>> from dejavu_lab.engine import Decoder, decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> w = decoder_weights(random_model("tiny-llama").model)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> folded = fold_rotations(w, random_rotations(w.arch, seed=1))
    >>> torch.allclose(Decoder(folded, max_seq_len=8).prefill(ids),
    ...                Decoder(w, max_seq_len=8).prefill(ids), atol=1e-4)
    True
    """
    a = w.arch
    H, Hkv, dh = a.n_heads, a.n_kv_heads, a.d_head
    v0, v1 = (H + Hkv) * dh, (H + 2 * Hkv) * dh  # W_V's rows in W_QKV
    layers = list(w.layers)
    heads = {i: q for i, q in rotations.items() if i != "residual"}
    for i, q in heads.items():
        if not (isinstance(i, int) and 0 <= i < a.n_layers):
            raise EngineError(
                f"rotations has layer {i!r} but the model has layers 0..{a.n_layers - 1}."
            )
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (Hkv, dh, dh):
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise EngineError(
                f"rotations[{i}] must be fp32 [{Hkv}, {dh}, {dh}] (a basis per K/V head), got {got}."
            )
        lw = layers[i]
        qf = q.to(lw.w_o_t.device, torch.float32)
        new = {}
        if lw.w_qkv is not None:  # rows: V_g [dh, d] -> Q_gᵀ V_g
            m = lw.w_qkv.clone()
            v = m[v0:v1].float().view(Hkv, dh, -1)
            m[v0:v1] = torch.einsum("gde,gdk->gek", qf, v).reshape(Hkv * dh, -1).to(m.dtype)
            new["w_qkv"] = m
        if lw.w_qkv_t is not None:  # columns: the same, transposed
            m = lw.w_qkv_t.clone()
            v = m[:, v0:v1].float().view(-1, Hkv, dh)
            m[:, v0:v1] = torch.einsum("kgd,gde->kge", v, qf).reshape(-1, Hkv * dh).to(m.dtype)
            new["w_qkv_t"] = m
        if lw.b_qkv is not None:
            b = lw.b_qkv.clone()
            bv = b[v0:v1].float().view(Hkv, dh)
            b[v0:v1] = torch.einsum("gde,gd->ge", qf, bv).reshape(-1).to(b.dtype)
            new["b_qkv"] = b
        qh = qf.repeat_interleave(H // Hkv, dim=0)  # [H, dh, dh]
        o = lw.w_o_t.float().view(H, dh, -1)  # W_O^T: head h's rows are W_O,hᵀ
        new["w_o_t"] = torch.einsum("hde,hdk->hek", qh, o).reshape(H * dh, -1).to(lw.w_o_t.dtype)
        layers[i] = replace(lw, **new)
    out = replace(w, layers=layers)
    return fold_residual(out, rotations["residual"]) if "residual" in rotations else out


@torch.no_grad()
def fold_residual(w: DecoderWeights, q: torch.Tensor) -> DecoderWeights:
    """Weights whose residual stream lives in the basis ``q`` (fp32 [d, d], orthogonal): every
    vector of the stream ``r`` becomes ``r Q``. The embedding's rows and every writer's
    outputs (W_O, W_down) turn with it; every reader (W_QKV, W_in, ``lm_head``) takes its
    norm's gain and ``Q`` into its columns, ``W diag(g) Q``, and its RMSNorm runs with gain 1
    (``rms(r Q) = rms(r)``), so a reader's input is ``(r / rms(r)) Q``: the rotated inputs
    LaRoSA's global basis thresholds. A copy of the model's matrices; dense output unchanged.

    >>> from dejavu_lab.engine import Decoder, decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> w = decoder_weights(random_model("tiny-llama").model, layout="both")
    >>> q = torch.linalg.qr(torch.randn(64, 64)).Q
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> torch.allclose(Decoder(fold_residual(w, q), max_seq_len=8).prefill(ids),
    ...                Decoder(w, max_seq_len=8).prefill(ids), atol=1e-4)
    True
    """
    d = w.arch.d_model
    if w.norm != "rms" or w.project_in is not None or w.pos_embed is not None:
        raise EngineError(
            "the engine folds a rotated residual stream into RMSNorm models only; a LayerNorm "
            "model would need its mean subtraction folded too (SliceGPT)."
        )
    if not isinstance(q, torch.Tensor) or tuple(q.shape) != (d, d):
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise EngineError(f"the residual basis must be fp32 [{d}, {d}], got {got}.")
    qf = q.to(w.device, torch.float32)

    def rows(m):  # a stream vector per row: m Q
        return None if m is None else (m.float() @ qf).to(m.dtype)

    def reader_t(m, g):  # stored transposed [d, out]: (W diag(g) Q)^T = Q^T diag(g) W^T
        return None if m is None else (qf.T @ (g.float()[:, None] * m.float())).to(m.dtype)

    def reader(m, g):  # stored [out, d]: W diag(g) Q
        return None if m is None else ((m.float() * g.float()) @ qf).to(m.dtype)

    def unit(norm):  # the gain folded into the readers
        return (torch.ones_like(norm[0]), norm[1], norm[2])

    layers = []
    for lw in w.layers:
        ga, gm = lw.ln_attn[0], lw.ln_mlp[0]
        layers.append(replace(
            lw, ln_attn=unit(lw.ln_attn), ln_mlp=unit(lw.ln_mlp),
            w_qkv=reader(lw.w_qkv, ga), w_qkv_t=reader_t(lw.w_qkv_t, ga),
            w_in=reader(lw.w_in, gm), w_in_t=reader_t(lw.w_in_t, gm),
            w_o_t=rows(lw.w_o_t), b_o=rows(lw.b_o),
            w_down_t=rows(lw.w_down_t), b_down=rows(lw.b_down),
        ))  # fmt: skip
    gf = w.final_norm[0] if w.final_norm is not None else torch.ones(d, device=w.device)
    return replace(
        w, layers=layers, embed=rows(w.embed), lm_head=reader(w.lm_head, gf),
        final_norm=None if w.final_norm is None else unit(w.final_norm),
    )  # fmt: skip


def random_rotations(arch, *, seed: int = 0, device="cpu") -> dict:
    """``{layer: fp32 [kv_heads, d_head, d_head]}`` random orthogonal bases (QR of a Gaussian):
    LaRoSA's rotations on random weights, for speed runs, where only their shapes matter.

    >>> from dejavu_lab.models import random_model
    >>> q = random_rotations(random_model("tiny-llama").arch)[1]
    >>> torch.allclose(q[0] @ q[0].T, torch.eye(16), atol=1e-5)
    True
    """
    g = torch.Generator().manual_seed(seed)
    shape = (arch.n_kv_heads, arch.d_head, arch.d_head)
    return {
        i: torch.linalg.qr(torch.randn(shape, generator=g)).Q.to(device)
        for i in range(arch.n_layers)
    }


def random_factors(arch, ranks: dict, *, seed: int = 0, device="cpu", dtype=torch.float16) -> dict:
    """``{(layer, site): (U [d_out, r], V [r, d_in])}`` random factors of rank ``ranks[site]``
    at every layer (R-Sparse on random weights, for speed runs: only their shapes matter).

    >>> from dejavu_lab.models import random_model
    >>> f = random_factors(random_model("tiny-llama").arch, {"mlp_in": 3})
    >>> [tuple(t.shape) for t in f[(0, "mlp_in")]]  # [W_gate; W_up] is 384 x 64
    [(384, 3), (3, 64)]
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for site, r in ranks.items():
        d_in, d_out = site_shape(arch, site)
        for i in range(arch.n_layers):
            if r > 0:
                u = torch.randn(d_out, r, generator=g) / r**0.5 * 0.02
                v = torch.randn(r, d_in, generator=g) / d_in**0.5
                out[(i, site)] = (u.to(device, dtype), v.to(device, dtype))
    return out


def site_shape(arch, site: str) -> tuple[int, int]:
    """``(d_in, d_out)`` of the site's weight, stacked by rows ([Wq; Wk; Wv], [W_gate; W_up]).

    >>> from dejavu_lab.models import random_model
    >>> site_shape(random_model("tiny-llama").arch, "attn_in")  # 4 query + 2 x 2 K/V heads of 16
    (64, 128)
    """
    d, hd, kv = arch.d_model, arch.n_heads * arch.d_head, arch.n_kv_heads * arch.d_head
    n = arch.d_mlp * (2 if arch.gated else 1)
    shapes = {"attn_in": (d, hd + 2 * kv), "o_in": (hd, d), "mlp_in": (d, n),
              "down_in": (arch.d_mlp, d)}  # fmt: skip
    if site not in shapes:
        raise EngineError(f"site {site!r} has no weight; use attn_in, o_in, mlp_in, down_in.")
    return shapes[site]


def check_factors(factors: dict, arch) -> None:
    """Raise :class:`EngineError` unless each ``(layer, site): (U, V)`` is [d_out, r], [r, d_in].

    >>> from dejavu_lab.models import random_model
    >>> check_factors({(0, "o_in"): (torch.zeros(64, 2), torch.zeros(3, 64))},
    ...               random_model("tiny-llama").arch)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: factors[(0, 'o_in')] must be (U [64, r], V [r, 64]) tensors of one rank r, got shapes (64, 2) and (3, 64).
    """
    for (i, site), uv in factors.items():
        if not (isinstance(i, int) and 0 <= i < arch.n_layers):
            raise EngineError(
                f"factors has layer {i!r} but the model has layers 0..{arch.n_layers - 1}."
            )
        d_in, d_out = site_shape(arch, site)
        ok = isinstance(uv, tuple) and len(uv) == 2 and all(isinstance(t, torch.Tensor) for t in uv)
        shapes = tuple(tuple(t.shape) for t in uv) if ok else ()
        r = shapes[0][-1] if ok and shapes[0] else -1
        if not ok or shapes != ((d_out, r), (r, d_in)):
            got = f"shapes {shapes[0]} and {shapes[1]}" if ok else type(uv).__name__
            raise EngineError(
                f"factors[{(i, site)!r}] must be (U [{d_out}, r], V [r, {d_in}]) tensors of one "
                f"rank r, got {got}."
            )


def factor_bytes(factors: dict, esize: int = 2) -> int:
    """Bytes one step reads for the low-rank terms: ``r · (d_in + d_out)`` elements per site
    (all of ``V_r`` counted, as ``sparsify.rsparse`` does).

    >>> factor_bytes({(0, "mlp_in"): (torch.zeros(384, 3), torch.zeros(3, 64))})
    2688
    """
    return sum((u.numel() + v.numel()) * esize for u, v in factors.values())
