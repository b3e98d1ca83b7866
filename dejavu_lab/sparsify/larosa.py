"""LaRoSA: a fixed top-k of each linear input in a rotated basis (Liu et al., ICML 2025, §3).

For a linear layer ``W x``, any orthogonal ``Q`` gives ``W x = (W Q)(Qᵀ x)``: store ``W Q`` as
the weight, and the sparse kernels read the columns of the entries kept of ``y = Qᵀ x``. With
``Q`` the eigenvectors of the input's second-moment matrix E[xxᵀ] on calibration text (PCA),
``y``'s energy sits in few entries, and keeping the top-k ``|y_j|`` per token loses less than
keeping the top-k ``|x_j|`` (TEAL). The count is fixed per (layer, site), so every token reads
the same columns' worth of bytes.

Where the rotation can be folded into the weights, and what it costs where it cannot:

- ``attn_in``, ``mlp_in`` (a norm's output ``g ⊙ u + b``): the norm's gain ``g`` folds into the
  weights (``W diag(g)``, QuaRot's move), and ``u = h / rms(h)`` commutes with a rotation of the
  residual stream ``h``. With one basis for the whole residual stream (``basis="global"``:
  embedding rows, every writer's rows — o_proj, down_proj — and every reader's columns rotated,
  SliceGPT-style; the tied embedding is untied, and a LayerNorm model would also need its mean
  subtraction folded as SliceGPT does) the rotation is free. A basis per layer (``"layer"``,
  shared by the layer's two norms) needs the stream turned from one layer's basis to the next:
  one d × d matrix read per layer. A basis per site (``"site"``, as LaRoSA's code has one for
  attention's input and one for the MLP's) turns it twice per layer: 2 d². These are counted
  as extra elements per token (the same bytes as computing ``Qᵀx`` online).
- ``o_in`` (attention's output ``z``, per head): a rotation per key/value head group folds into
  W_V's rows and W_O's columns (``z_h = P_h V_g`` and ``V_g Q_g`` stays a value), so it is free.
  A rotation mixing heads could not be folded (each head has its own probabilities).
- ``down_in`` (``act(gate) ⊙ up``): an elementwise product; no rotation folds into its producer,
  and an online one reads n × n weights, n/d times down_proj itself (2.7× for the demo model).
  This site keeps TEAL's top-k of ``|a_j|`` in its own basis, as LaRoSA's code does.

``score="weighted"`` ranks ``|y_j| · ‖(W Q)[:, j]‖`` (WINA's weighting in the rotated basis);
``rule="threshold"`` keeps ``|y_j|`` above a calibrated threshold instead of a fixed count (TEAL's
rule in the rotated basis: what the engine's threshold kernels would run on ``W Q``);
``basis="none"`` leaves attn_in and mlp_in unrotated (with ``rotate_o=False`` too: the plain
top-k, the ablation). The budget is spread over
a layer's sites uniformly, as TEAL's greedy search spread it (``allocation="greedy"``), or by
the same search run on this method's own sites (``"search"``,
:mod:`~dejavu_lab.sparsify.search`), which a fixed count needs: TEAL's shares were chosen for a
threshold. The hooks compute ``x' = g ⊙ Q·topk(Qᵀ u) + b``: the same vector the folded layer
sees, so the model's own forward measures the quality. :func:`folded_weights` writes the
weights an engine would store; the decode engine runs plans with ``rule="threshold"`` and
``basis="none"`` or ``"global"`` itself, their rotations folded into its weights
(:mod:`dejavu_lab.engine.plans`).

What paid on the demo model (``results/designs_*demo*.json``): the one free rotation,
of attention's output, with TEAL's rule and the method's own search (``basis="none",
rule="threshold", allocation="search"``) reads fewer bytes than TEAL greedy for the same
perplexity; a rotated residual stream (global basis) did worse than none under the threshold
rule, and per-layer bases cost more bytes (d² a layer) than they saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..arch import Arch, get_arch
from ..budgets import n_keep
from ..collect import fingerprint
from ..vocab import SITES, site_width
from .core import SparseContext, column_norms, register, site_weights
from .moments import Moments, norm_affine
from .search import search_path
from .topk import RULES, SitePlan, TopkPlan, plan_for, quantile, sample_scores, site_shares

__all__ = ["BASES", "fold_into", "folded_weights", "larosa_hooks", "plan"]

# one rotation for the residual stream / per layer / per site; "none": TEAL's inputs, top-k
BASES = ("global", "layer", "site", "none")
_NORMED = ("attn_in", "mlp_in")


def _eig(c: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a symmetric matrix, largest eigenvalue first, fp32 (float64 solve)."""
    return torch.linalg.eigh(c.double()).eigenvectors.flip(-1).float()


def _bases(moments: Moments, arch: Arch, basis: str, gains: dict | None = None) -> dict:
    """``(layer, site) -> Q`` [d, d] for attn_in, mlp_in; cached on the moments. ``gains``:
    ``(layer, site) -> g`` to take the PCA of the norm's output ``g ⊙ u`` instead of ``u``."""
    key = ("larosa", basis, gains is not None)
    if key in moments.cache:
        return moments.cache[key]

    def cov(i, s):
        c = moments.cov(i, s)
        if gains is None:
            return c
        g = gains[(i, s)].double()
        return c * g[:, None] * g[None, :]

    L, out = arch.n_layers, {}
    if basis == "global":
        q = _eig(sum(cov(i, s) for i in range(L) for s in _NORMED))
        out = {(i, s): q for i in range(L) for s in _NORMED}
    elif basis == "layer":
        for i in range(L):
            q = _eig(cov(i, "attn_in") + cov(i, "mlp_in"))
            out.update({(i, s): q for s in _NORMED})
    elif basis == "site":
        out = {(i, s): _eig(cov(i, s)) for i in range(L) for s in _NORMED}
    moments.cache[key] = out
    return out


def _head_bases(moments: Moments, arch: Arch, layer: int) -> torch.Tensor:
    """Per query head the basis of its key/value group: [h, dh, dh]."""
    c = moments.cov(layer, "o_in")  # [h, dh, dh]
    groups = c.reshape(arch.n_kv_heads, arch.heads_per_kv, *c.shape[1:]).sum(1)
    q = _eig(groups)  # [kv, dh, dh]
    return q.repeat_interleave(arch.heads_per_kv, dim=0)


def plan(
    model: nn.Module,
    moments: Moments,
    sparsity,
    *,
    allocation: str = "uniform",
    teal=None,
    basis: str = "global",  # free (folded); measured better at equal bytes than "layer"
    rotate_o: bool = True,
    score: str = "magnitude",
    fold_gain: bool = True,
    rule: str = "topk",
    dense_layers: Sequence[int] = (),
    arch: Arch | None = None,
) -> TopkPlan:
    """LaRoSA's plan for a per-layer budget ``sparsity`` (share of each layer's columns removed,
    in [0, 1)), spread over the sites by ``allocation`` (``"uniform"``; ``"greedy"``: TEAL's
    shares, from ``teal``, a calibration with TEAL's greedy path; ``"search"``: the same greedy
    search run on this method's own sites, :mod:`~dejavu_lab.sparsify.search`); ``basis``: one of :data:`BASES`; ``rotate_o``: rotate
    attention's output per head group; ``score``: ``"magnitude"`` or ``"weighted"``;
    ``rule``: ``"topk"`` (a fixed count per token) or ``"threshold"`` (TEAL's rule on the
    rotated scores, thresholds from their quantiles on the calibration text);
    ``fold_gain=False``: PCA and rotate the norm's output ``g ⊙ u`` itself (as LaRoSA's code does;
    the rotation then cannot be global).

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 16)), cache=False,
    ...                        progress=False)
    >>> p = plan(m.model, mo, 0.5, basis="layer")
    >>> p.sites[(0, "attn_in")].keep, p.sites[(0, "down_in")].keep, p.layer_extra[0]  # d² a layer
    (32, 96, 4096.0)
    >>> plan(m.model, mo, 0.5).layer_extra  # one basis for the residual stream: folded, free
    {}
    >>> plan(m.model, mo, 0.5, basis="random")
    Traceback (most recent call last):
    ...
    ValueError: basis must be one of global, layer, site, none, got 'random'.
    """
    arch = arch or get_arch(model)
    if basis not in BASES:
        raise ValueError(f"basis must be one of {', '.join(BASES)}, got {basis!r}.")
    if score not in ("magnitude", "weighted"):
        raise ValueError(f"score must be 'magnitude' or 'weighted', got {score!r}.")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}.")
    if not fold_gain and basis == "global":
        raise ValueError("a global basis needs fold_gain=True (the norms' gains differ by layer).")
    moments.check_model(model, arch)
    gains = None
    if not fold_gain:
        gains = {
            (i, s): norm_affine(model, arch, i, s)[0] for i in range(arch.n_layers) for s in _NORMED
        }
    bases = _bases(moments, arch, basis, gains)
    opts = dict(basis=basis, rotate_o=rotate_o, score=score, fold_gain=fold_gain)
    cached: dict = {}

    def tensors(i: int, site: str) -> dict:
        if (i, site) not in cached:
            cached[(i, site)] = _site_tensors(model, arch, moments, i, site, bases, opts)
        return cached[(i, site)]

    def scorer(i: int, site: str, x: torch.Tensor) -> torch.Tensor:
        return _score(tensors(i, site), site, x)[1]

    def site_plan(i: int, site: str, share: float) -> SitePlan:
        width = site_width(arch, site)
        sp = SitePlan(n_keep(share, width), width, tensors(i, site))
        if rule == "threshold":
            sample = sample_scores(model, moments, scorer, ("larosa", opts), arch)[(i, site)]
            sp.threshold = quantile(sample, share)
        return sp

    def search():
        key = ("larosa", {**opts, "rule": rule})
        return search_path(model, moments, site_plan, _transform, key, arch=arch)

    shares = site_shares(
        arch.n_layers, sparsity, allocation, teal=teal, search=search, dense_layers=dense_layers
    )
    d = arch.d_model
    sites = {k: site_plan(*k, share) for k, share in sorted(shares.items())}
    turns = {"global": 0.0, "layer": float(d * d), "site": 2.0 * d * d, "none": 0.0}[basis]
    # the residual stream's turns: one per layer ("layer"), two ("site"), none ("global")
    layer_extra = {i: turns for (i, s) in sites if s in _NORMED and turns}
    return TopkPlan(
        "larosa",
        sites,
        fingerprint(model, arch),
        {**opts, "rule": rule, "allocation": allocation},
        layer_extra,
    )


def _site_tensors(model, arch, moments, i, site, bases, opts) -> dict:
    """What the hook of (layer, site) needs: basis, gain and bias, column norms."""
    t: dict = {}
    if site in _NORMED and opts["basis"] != "none":
        g, b = norm_affine(model, arch, i, site)
        if not opts["fold_gain"]:  # rotate the norm's output itself: Q of g ⊙ u, read online
            g, b = torch.ones_like(g), torch.zeros_like(b)
        t.update(q=bases[(i, site)], g=g, b=b)
    elif site == "o_in" and opts["rotate_o"]:
        t["qh"] = _head_bases(moments, arch, i)
    if opts["score"] == "weighted":
        t["norms"] = _column_norms(model, arch, i, site, t)
    return t


def _column_norms(model, arch, i, site, t) -> torch.Tensor:
    """‖(W Q)[:, j]‖ of the folded weights (or ‖W[:, j]‖ where nothing is rotated)."""
    if "q" in t:
        w = torch.cat([m.weight.detach().float() for m in site_weights(model, arch, i, site)])
        return (w * t["g"]).matmul(t["q"]).norm(dim=0)
    if "qh" in t:
        w = arch.part(model, i, "o").weight.detach().float()  # [d, h * dh]
        wh = w.reshape(w.shape[0], arch.n_heads, arch.d_head)
        return torch.einsum("ohd,hde->ohe", wh, t["qh"]).flatten(1).norm(dim=0)
    return column_norms(model, arch, i, site)


@register("larosa")
def larosa_hooks(ctx: SparseContext) -> list:
    """Builder of method ``"larosa"``: keep the top-k rotated entries per token and site.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import sparse_eval
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> model = random_model("tiny-llama").model
    >>> ids = torch.randint(0, 128, (2, 32))
    >>> mo = calibrate_moments(model, ids, cache=False, progress=False)
    >>> r = sparse_eval(model, ids, method="larosa", sparsity=0.5, thresholds=mo, progress=False)
    >>> r.kept["attn_in"], round(r.bytes_per_token_fraction, 3)  # half the columns, Q folded
    (0.5, 0.5)
    """
    p = plan_for(ctx, plan)
    p_fp = p.fingerprint
    if p_fp != fingerprint(ctx.model, ctx.arch):
        raise ValueError("this plan was built for another model; build it for this one.")
    fns = []
    for (i, site), sp in sorted(p.sites.items()):
        if i in ctx.dense:
            continue
        fns.append((f"blocks.{i}.{SITES[site]}", _rotated_topk(ctx, i, site, sp, p.layer_extra)))
    return fns


def _rotated_topk(ctx, i, site, sp: SitePlan, layer_extra):
    cache: dict = {}

    def fn(x: torch.Tensor, name: str) -> torch.Tensor:
        out, keep = _transform(sp, site, x, cache)
        if ctx.kept is not None:
            ctx.kept.add(i, site, keep)
            if layer_extra.get(i):
                ctx.kept.add_extra(i, "rotation", layer_extra[i])
        return out

    return fn


def _score(t: dict, site: str, x: torch.Tensor):
    """``(y, score)``: the site's input in its basis (flat [..., width]) and what ranks it."""
    if "q" in t:  # [b, p, d]: u = (x - b) / g, y = Qᵀ u
        g = t["g"]
        u = torch.where(g != 0, (x.float() - t["b"]) / g, torch.zeros((), device=x.device))
        y = u @ t["q"]
    elif "qh" in t:  # [b, p, h, dh]: per head y_h = Q_gᵀ z_h
        y = torch.einsum("bphd,hde->bphe", x.float(), t["qh"]).flatten(2)
    else:
        y = x.float().flatten(2) if site == "o_in" else x.float()
    return y, (y.abs() * t["norms"] if "norms" in t else y.abs())


def _transform(sp: SitePlan, site: str, x: torch.Tensor, cache: dict):
    """``(x', keep)``: the site's input as the folded layer sees it, and the kept mask."""
    t = cache.get(x.device)
    if t is None:
        t = cache[x.device] = {k: v.to(x.device) for k, v in sp.tensors.items()}
    shape = x.shape
    y, score = _score(t, site, x)
    keep = sp.select(score)
    y = torch.where(keep, y, torch.zeros((), device=y.device))
    if "q" in t:
        out = (y @ t["q"].T) * t["g"] + t["b"]
    elif "qh" in t:
        out = torch.einsum("bphe,hde->bphd", y.reshape(shape), t["qh"])
    else:
        out = y
    return out.reshape(shape).to(x.dtype), keep


@torch.no_grad()
def folded_weights(model: nn.Module, p: TopkPlan, arch: Arch | None = None) -> dict:
    """The weights an engine stores to run plan ``p`` with sparse column kernels, fp32.

    Per layer ``i``: ``{i}.{attn_in,mlp_in}.weight`` = ``[W…] diag(g) Q`` (stacked rows of
    q/k/v or gate/up; the norm then runs without its gain) and ``.bias`` = ``[W…] b`` plus the
    layers' own bias; ``{i}.{site}.rotation`` = its Q (the residual stream's turn into the
    site's basis is ``Q_nextᵀ Q_prev``, read where the basis is not global); ``{i}.v.weight`` (rows turned per head group)
    and ``{i}.o.weight`` (columns turned) when attention's output is rotated. Dense output is
    unchanged: ``W x = folded (Qᵀ u) + bias``.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 16)), cache=False,
    ...                        progress=False)
    >>> w = folded_weights(m.model, plan(m.model, mo, 0.5))
    >>> w["0.mlp_in.weight"].shape, w["0.o.weight"].shape  # [W_gate; W_up] diag(g) Q, W_O turned
    (torch.Size([384, 64]), torch.Size([64, 64]))
    >>> q = w["0.mlp_in.rotation"]
    >>> torch.allclose(q.T @ q, torch.eye(64), atol=1e-5)  # orthogonal
    True
    """
    arch = arch or get_arch(model)
    out = {}
    for (i, site), sp in sorted(p.sites.items()):
        t = sp.tensors
        if "q" in t:
            mods = site_weights(model, arch, i, site)
            w = torch.cat([m.weight.detach().float() for m in mods])
            bias = torch.cat(
                [
                    m.bias.detach().float() if m.bias is not None else torch.zeros(m.out_features)
                    for m in mods
                ]
            )
            out[f"{i}.{site}.weight"] = (w * t["g"]) @ t["q"]
            out[f"{i}.{site}.bias"] = w @ t["b"] + bias
            out[f"{i}.{site}.rotation"] = t["q"]
        elif "qh" in t:
            kv = t["qh"][:: arch.heads_per_kv]  # [kv, dh, dh]
            wv = arch.part(model, i, "v").weight.detach().float()  # [kv * dh, d]
            wv = wv.reshape(arch.n_kv_heads, arch.d_head, -1)
            out[f"{i}.v.weight"] = torch.einsum("gde,gdk->gek", kv, wv).flatten(0, 1)
            bv = arch.part(model, i, "v").bias
            if bv is not None:  # Qwen2's value bias turns with its rows
                bv = bv.detach().float().reshape(arch.n_kv_heads, arch.d_head)
                out[f"{i}.v.bias"] = torch.einsum("gde,gd->ge", kv, bv).flatten()
            wo = arch.part(model, i, "o").weight.detach().float()  # [d, h * dh]
            wo = wo.reshape(wo.shape[0], arch.n_heads, arch.d_head)
            out[f"{i}.o.weight"] = torch.einsum("ohd,hde->ohe", wo, t["qh"]).flatten(1)
    return out


@torch.no_grad()
def fold_into(model: nn.Module, p: TopkPlan, arch: Arch | None = None) -> dict:
    """Write plan ``p``'s rotation of attention's output into ``model`` (W_V rows, W_O columns,
    in place) and return the TEAL thresholds that then run it: ``{(layer, site): t}``, as
    :class:`~dejavu_lab.sparsify.thresholds.Thresholds` and the engine's
    ``SparseConfig("teal", thresholds=...)`` take them. The folded model's dense output is the
    original's; with these thresholds, TEAL's hooks and kernels run this plan at TEAL's cost.

    Only plans whose residual-stream sites are unrotated (``basis="none"``) and that keep by
    threshold (``rule="threshold"``) fold this way.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (1, 16))
    >>> mo = calibrate_moments(m.model, ids, cache=False, progress=False)
    >>> p = plan(m.model, mo, 0.5, basis="none", rule="threshold")
    >>> with torch.no_grad():
    ...     dense = m.model(ids).logits
    ...     t = fold_into(m.model, p)
    ...     torch.allclose(m.model(ids).logits, dense, atol=1e-5)  # W_V, W_O turned in place
    True
    >>> len(t), sorted(t)[:2]  # a threshold per (layer, site)
    (8, [(0, 'attn_in'), (0, 'down_in')])
    """
    arch = arch or get_arch(model)
    if p.options.get("basis") != "none" or p.options.get("rule") != "threshold":
        raise ValueError(
            "only plans with basis='none' and rule='threshold' fold into TEAL's thresholds; "
            "store folded_weights() for the others."
        )
    w = folded_weights(model, p, arch)
    for i in range(arch.n_layers):
        if f"{i}.o.weight" not in w:
            continue
        v, o = arch.part(model, i, "v"), arch.part(model, i, "o")
        v.weight.copy_(w[f"{i}.v.weight"].to(v.weight.dtype))
        if v.bias is not None:
            v.bias.copy_(w[f"{i}.v.bias"].to(v.bias.dtype))
        o.weight.copy_(w[f"{i}.o.weight"].to(o.weight.dtype))
    return {k: float(sp.threshold) for k, sp in sorted(p.sites.items())}
