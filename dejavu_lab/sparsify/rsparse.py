"""R-Sparse: the large input channels through sparse columns, the rest through a low-rank term
(Zhang et al., ICLR 2025, §3–4).

TEAL drops the small entries of a linear layer's input; R-Sparse keeps their contribution in
low rank. Per (layer, site), with ``S`` the ``k`` entries of largest ``|x_j|`` for this token
and ``R`` the rest:

    W x  ≈  W[:, S] x_S  +  U_r (V_r x_R)

where ``U_r V_r`` is the rank-``r`` truncated SVD of ``W`` — here activation-aware
(``scaling="diag"``, ASVD's choice): the SVD of ``W diag(s)`` with ``s_j = sqrt(E[x_j²])`` on
calibration text, then ``V_r ← V_r diag(1/s)``, so the rank goes to the directions the inputs
actually take; ``scaling="plain"`` is the paper's SVD of ``W`` itself. ``W`` is the site's
weights stacked by rows ([Wq; Wk; Wv], [Wgate; Wup]), so one mask and one factor pair serve the
layers that share an input.

Bytes per token of one site: ``k`` columns of ``W`` (``k · d_out``) plus both factors
(``r · (d_in + d_out)``; a kernel could read only the ``d_in − k`` columns of ``V_r`` that ``R``
selects, we count them all). A site's byte share ``1 − s`` is split by ``lowrank`` (the share of
it spent on the factors): ``r = ⌊lowrank · (1 − s) · d_in d_out / (d_in + d_out)⌋``, and ``k``
takes what is left. Since ``U_r V_r = W P_r`` with ``P_r = diag(s) B_r B_rᵀ diag(1/s)`` (``B_r``
the top right singular vectors of ``W diag(s)``), the hooks replace the site's input by
``x_S + P_r x_R``: the model's own layers then compute exactly the sparse + low-rank output.
:func:`factors` gives the ``U_r``, ``V_r`` an engine stores (one extra small GEMV pair; the
decode engine runs a threshold plan: :mod:`dejavu_lab.engine.lowrank`); :func:`split_budget` is
the split of a site's bytes between columns and factors.

On the demo model (``results/designs_*lowrank*demo*.json``) the factors did not pay for
their bytes: at equal bytes R-Sparse stayed above TEAL greedy at every budget we measured,
with a tenth or a quarter of a site's bytes in the factors, plain or activation-aware SVD, a
fixed count or TEAL's rule, TEAL's shares or its own search.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..arch import Arch, get_arch
from ..collect import fingerprint
from ..vocab import SITES, site_width
from .core import SparseContext, column_norms, register, site_weights
from .moments import Moments
from .search import search_path
from .topk import RULES, SitePlan, TopkPlan, plan_for, quantile, sample_scores, site_shares

__all__ = ["SCALINGS", "factors", "plan", "rsparse_hooks", "split_budget"]

SCALINGS = ("diag", "plain")  # activation-aware SVD (ASVD's diagonal) or the weights' own SVD


def _stacked(model, arch, i, site) -> torch.Tensor:
    """The site's weights stacked by rows, fp32 [d_out, d_in]."""
    return torch.cat([m.weight.detach().float() for m in site_weights(model, arch, i, site)])


def _svd(model, arch, moments: Moments, i: int, site: str, scaling: str):
    """``(s [d_in], B [d_in, m])``: scales and right singular vectors of ``W diag(s)``."""
    key = ("rsparse", scaling, i, site)
    if key not in moments.cache:
        w = _stacked(model, arch, i, site)
        if scaling == "diag":
            sq = moments.sq(i, site).float()
            s = sq.sqrt() + 1e-6 * float(sq.mean().sqrt()) + 1e-12  # no zero scale
        else:
            s = torch.ones(w.shape[1])
        vh = torch.linalg.svd(w.double() * s.double(), full_matrices=False).Vh
        moments.cache[key] = (s, vh.T.float().contiguous())
    return moments.cache[key]


def split_budget(share: float, d_in: int, d_out: int, lowrank: float,
                 rank: int | None = None) -> tuple[int, int]:  # fmt: skip
    """``(r, k)``: the rank and the kept columns of a site of weight [d_out, d_in] whose
    ``share`` of bytes is removed, ``lowrank`` of what is left spent on the factors (or the
    given ``rank``, ``k`` taking what it leaves).

    >>> split_budget(0.5, 4096, 6144, 0.1)  # Llama-3-8B's attn_in at half its bytes
    (122, 1845)
    """
    budget = (1 - share) * d_in * d_out  # elements this site may read
    r = int(lowrank * budget / (d_in + d_out)) if rank is None else rank
    keep = max(0, min(d_in, round((budget - r * (d_in + d_out)) / d_out)))
    return r, keep


def plan(
    model: nn.Module,
    moments: Moments,
    sparsity,
    *,
    allocation: str = "uniform",
    teal=None,
    lowrank: float = 0.25,
    scaling: str = "diag",
    score: str = "magnitude",
    ranks: Mapping[tuple[int, str], int] | None = None,
    rule: str = "topk",
    dense_layers: Sequence[int] = (),
    arch: Arch | None = None,
) -> TopkPlan:
    """R-Sparse's plan for a per-layer budget ``sparsity`` (share of each site's bytes removed,
    in [0, 1)), spread over the sites by ``allocation`` (``"uniform"``, ``"greedy"`` with ``teal``, or
    ``"search"``: see :func:`~dejavu_lab.sparsify.topk.site_shares`). ``lowrank``: share of a site's kept bytes
    spent on the factors, in [0, 1); ``ranks``: ``{(layer, site): r}`` instead (k then takes
    what the rank leaves); ``scaling``: one of :data:`SCALINGS`; ``score``: ``"magnitude"``
    ``|x_j|`` or ``"weighted"`` ``|x_j| · ‖W[:, j]‖``; ``rule``: ``"topk"`` (``k`` entries per
    token) or ``"threshold"`` (entries above the score's quantile that keeps ``k / d_in`` on the
    calibration text: a count varying per token, TEAL's rule).

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 16)), cache=False,
    ...                        progress=False)
    >>> sp = plan(m.model, mo, 0.5, lowrank=0.25).sites[(0, "mlp_in")]  # W: 384 x 64
    >>> sp.rank, sp.keep, sp.extra  # 6 · (64 + 384) factor elements = 7 of the 32 columns' worth
    (6, 25, 2688.0)
    >>> plan(m.model, mo, 0.5, ranks={(0, "mlp_in"): 65})
    Traceback (most recent call last):
    ...
    ValueError: rank of (0, 'mlp_in') must be in 0..64 (min(d_in, d_out)), got 65.
    """
    arch = arch or get_arch(model)
    if not isinstance(lowrank, (int, float)) or not 0 <= lowrank < 1:
        raise ValueError(f"lowrank must be in [0, 1) (a share of the kept bytes), got {lowrank!r}.")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}.")
    if score not in ("magnitude", "weighted"):
        raise ValueError(f"score must be 'magnitude' or 'weighted', got {score!r}.")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}.")
    moments.check_model(model, arch)
    ranks = dict(ranks or {})
    for (i, site), r in ranks.items():
        top = min(site_width(arch, site), _d_out(model, arch, i, site))
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= top:
            raise ValueError(
                f"rank of {(i, site)} must be in 0..{top} (min(d_in, d_out)), got {r!r}."
            )
    norms: dict = {}

    def norms_of(i: int, site: str) -> torch.Tensor:
        if (i, site) not in norms:
            norms[(i, site)] = column_norms(model, arch, i, site)
        return norms[(i, site)]

    def site_plan(i: int, site: str, share: float) -> SitePlan:
        d_in, d_out = site_width(arch, site), _d_out(model, arch, i, site)
        r, keep = split_budget(share, d_in, d_out, lowrank, ranks.get((i, site)))
        extra = float(r * (d_in + d_out))
        t: dict = {}
        if r > 0:
            s, b = _svd(model, arch, moments, i, site, scaling)
            t.update(s=s, b=b[:, :r])
        if score == "weighted":
            t["norms"] = norms_of(i, site)
        sp = SitePlan(keep, d_in, t, extra, r)
        if rule == "threshold":
            sample = sample_scores(model, moments, scorer, ("rsparse", score), arch)[(i, site)]
            sp.threshold = quantile(sample, 1 - keep / d_in)
        return sp

    def scorer(i: int, site: str, x: torch.Tensor) -> torch.Tensor:
        t = {"norms": norms_of(i, site)} if score == "weighted" else {}
        return _score(t, site, x)[1]

    opts = dict(lowrank=lowrank, scaling=scaling, score=score, rule=rule)

    def search():
        return search_path(model, moments, site_plan, _transform, ("rsparse", opts), arch=arch)

    shares = site_shares(
        arch.n_layers, sparsity, allocation, teal=teal, search=search, dense_layers=dense_layers
    )
    unused = sorted(set(ranks) - set(shares))
    if unused:
        raise ValueError(f"ranks name sites without a budget: {unused}.")
    sites = {k: site_plan(*k, share) for k, share in sorted(shares.items())}
    return TopkPlan("rsparse", sites, fingerprint(model, arch), {**opts, "allocation": allocation})


def _d_out(model, arch, i, site) -> int:
    return sum(m.out_features for m in site_weights(model, arch, i, site))


@register("rsparse")
def rsparse_hooks(ctx: SparseContext) -> list:
    """Builder of method ``"rsparse"``: the top-k entries through W, the rest in low rank.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import sparse_eval
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> model = random_model("tiny-llama").model
    >>> ids = torch.randint(0, 128, (2, 32))
    >>> mo = calibrate_moments(model, ids, cache=False, progress=False)
    >>> r = sparse_eval(model, ids, method="rsparse", sparsity=0.5, thresholds=mo, progress=False)
    >>> round(r.bytes_per_token_fraction, 2)  # columns + factors: half the bytes
    0.5
    """
    p = plan_for(ctx, plan)
    if p.fingerprint != fingerprint(ctx.model, ctx.arch):
        raise ValueError("this plan was built for another model; build it for this one.")
    return [
        (f"blocks.{i}.{SITES[site]}", _sparse_lowrank(ctx, i, site, sp))
        for (i, site), sp in sorted(p.sites.items())
        if i not in ctx.dense
    ]


def _sparse_lowrank(ctx, i, site, sp: SitePlan):
    cache: dict = {}

    def fn(x: torch.Tensor, name: str) -> torch.Tensor:
        out, keep = _transform(sp, site, x, cache)
        if ctx.kept is not None:
            ctx.kept.add(i, site, keep)
            if sp.extra:
                ctx.kept.add_extra(i, f"{site}.lowrank", sp.extra)
        return out

    return fn


def _score(t: dict, site: str, x: torch.Tensor):
    """``(x flat [..., d_in], score)``: heads flattened to ``h · dh`` columns for o_in."""
    flat = x.float().flatten(2) if site == "o_in" else x.float()
    return flat, (flat.abs() * t["norms"] if "norms" in t else flat.abs())


def _transform(sp: SitePlan, site: str, x: torch.Tensor, cache: dict):
    """``(x_S + P_r x_R, keep)``: the input whose dense product is the sparse + low-rank one."""
    t = cache.get(x.device)
    if t is None:
        t = cache[x.device] = {k: v.to(x.device) for k, v in sp.tensors.items()}
    shape = x.shape
    flat, score = _score(t, site, x)
    keep = sp.select(score)
    kept = torch.where(keep, flat, torch.zeros((), device=flat.device))
    if "b" in t:  # x_S + P_r x_R, P_r = diag(s) B_r B_rᵀ diag(1/s)
        kept = kept + (((flat - kept) / t["s"]) @ t["b"]) @ t["b"].T * t["s"]
    return kept.reshape(shape).to(x.dtype), keep


@torch.no_grad()
def factors(model: nn.Module, p: TopkPlan, arch: Arch | None = None) -> dict:
    """``{i}.{site}.u`` [d_out, r] and ``.v`` [r, d_in], fp32: the low-rank term an engine adds
    (``y = W[:, S] x_S + u (v x_R)``), for every site of plan ``p`` with a rank.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 16)), cache=False,
    ...                        progress=False)
    >>> f = factors(m.model, plan(m.model, mo, 0.5, lowrank=0.25))
    >>> f["0.mlp_in.u"].shape, f["0.mlp_in.v"].shape  # rank 6 of [W_gate; W_up]
    (torch.Size([384, 6]), torch.Size([6, 64]))
    >>> full = factors(m.model, plan(m.model, mo, 0.5, ranks={(0, "mlp_in"): 64}))
    >>> w = _stacked(m.model, m.arch, 0, "mlp_in")
    >>> torch.allclose(full["0.mlp_in.u"] @ full["0.mlp_in.v"], w, atol=1e-5)  # full rank: W
    True
    """
    arch = arch or get_arch(model)
    out = {}
    for (i, site), sp in sorted(p.sites.items()):
        if sp.rank == 0:
            continue
        w, s, b = _stacked(model, arch, i, site), sp.tensors["s"], sp.tensors["b"]
        out[f"{i}.{site}.u"] = (w * s) @ b
        out[f"{i}.{site}.v"] = (b / s[:, None]).T.contiguous()
    return out
