"""Fixed top-k per token on a transformed site input: the plans LaRoSA and R-Sparse run.

TEAL's threshold keeps a different number of entries for every token; the methods here keep a
fixed count ``k`` per (layer, site) of a *transformed* input — a rotated one
(:mod:`~dejavu_lab.sparsify.larosa`) or the large entries beside a low-rank term for the rest
(:mod:`~dejavu_lab.sparsify.rsparse`) — so the bytes a step reads are exact, not an average:
``k`` weight columns of the site plus the method's extra weights (an online rotation, low-rank
factors), counted through :meth:`~dejavu_lab.sparsify.kept.Kept.add_extra` into
:func:`~dejavu_lab.step_bytes.bytes_per_token_fraction`.

A :class:`TopkPlan` is what the hooks run: per (layer, site) the kept count, the method's
tensors and the extra elements. Plans are built from calibration moments
(:mod:`~dejavu_lab.sparsify.moments`) and a per-layer budget, spread over a layer's sites
uniformly or as TEAL's greedy search spreads it (:func:`site_shares`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..budgets import budgets, topk_mask
from ..vocab import SITES
from .thresholds import CalibrationError

__all__ = [
    "DEFAULT_DESIGN",
    "DESIGNS",
    "RULES",
    "SitePlan",
    "TopkPlan",
    "plan_for",
    "quantile",
    "sample_scores",
    "site_shares",
]

RULES = ("topk", "threshold")  # a fixed count per token, or TEAL's rule on the transformed input
# the frontier's designs of the top-k methods: "search" runs TEAL's greedy search on
# the method's own transform, "greedy" takes TEAL's shares; the other keys are plan options
DESIGNS: dict[str, dict] = {
    "larosa (search)": {"method": "larosa", "allocation": "search", "basis": "global"},
    # attention's output rotated per K/V group only (folded into W_V and W_O: free)
    "larosa (o_in, threshold, search)": {
        "method": "larosa", "allocation": "search", "basis": "none", "rule": "threshold"
    },
    "larosa (o_in, search)": {"method": "larosa", "allocation": "search", "basis": "none"},
    "larosa (threshold, search)": {
        "method": "larosa", "allocation": "search", "basis": "global", "rule": "threshold"
    },
    "larosa (layer basis, threshold, search)": {
        "method": "larosa", "allocation": "search", "basis": "layer", "rule": "threshold"
    },
    "topk (search)": {  # LaRoSA without its rotation: what the rotation adds
        "method": "larosa", "allocation": "search", "basis": "none", "rotate_o": False
    },
    "rsparse (search)": {
        "method": "rsparse", "allocation": "search", "lowrank": 0.1, "scaling": "plain"
    },
    "rsparse (threshold, search)": {
        "method": "rsparse", "allocation": "search", "lowrank": 0.1, "scaling": "plain",
        "rule": "threshold",
    },
}  # fmt: skip
# what a plain "larosa" / "rsparse" runs: the design that measured best on the demo model at
# equal bytes (sparsify/larosa.py's docstring)
DEFAULT_DESIGN = {
    "larosa": "larosa (o_in, threshold, search)",
    "rsparse": "rsparse (threshold, search)",
}
_SAMPLE = 1 << 14  # scores kept per site and window for the thresholds' quantiles


@dataclass
class SitePlan:
    """One (layer, site) of a plan.

    >>> sp = SitePlan(keep=2, width=4)
    >>> sp.select(torch.tensor([0.1, 3.0, 0.5, 2.0]))  # the top 2
    tensor([False,  True, False,  True])
    >>> sp.threshold = 0.4
    >>> sp.select(torch.tensor([0.1, 3.0, 0.5, 2.0]))  # rule "threshold": above it
    tensor([False,  True,  True,  True])
    """

    keep: int  # entries of the (transformed) input kept per token: weight columns read
    width: int  # entries of the site's input (d_in)
    tensors: dict = field(default_factory=dict)  # the method's tensors (bases, factors, norms)
    extra: float = 0.0  # weight elements read per token besides the kept columns
    rank: int = 0  # R-Sparse: rank of the low-rank term
    # rule "threshold": keep the entries whose score exceeds this (a count varying per token,
    # TEAL's rule on the transformed input; None: the fixed top-``keep``)
    threshold: float | None = None

    def select(self, score: torch.Tensor) -> torch.Tensor:
        """The kept mask for ``score`` [..., width]: top-``keep`` or ``score > threshold``."""
        if self.threshold is not None:
            return score > self.threshold
        if self.keep == 0:
            return torch.zeros_like(score, dtype=torch.bool)
        return topk_mask(score, self.keep)


@dataclass
class TopkPlan:
    """What a top-k method's hooks apply: per (layer, site) a :class:`SitePlan`.

    ``layer_extra``: elements read per token once per layer besides the sites (LaRoSA's
    residual-stream rotation).

    >>> p = TopkPlan("rsparse", {(0, "mlp_in"): SitePlan(16, 64, extra=100.0)}, {},
    ...              layer_extra={0: 10.0})
    >>> p.kept_fractions(), p.extra_elements()
    ({(0, 'mlp_in'): 0.25}, 110.0)
    """

    method: str
    sites: dict[tuple[int, str], SitePlan]
    fingerprint: dict  # the model it was built for
    options: dict = field(default_factory=dict)  # how it was built (basis, rank share, ...)
    layer_extra: dict[int, float] = field(default_factory=dict)

    def kept_fractions(self) -> dict[tuple[int, str], float]:
        """(layer, site) -> kept share of its columns: exact under the rule ``"topk"`` (the
        same for every token), the calibrated share under ``"threshold"``."""
        return {k: p.keep / p.width for k, p in sorted(self.sites.items())}

    def extra_elements(self) -> float:
        """Weight elements per token besides the kept columns, over every layer."""
        return sum(p.extra for p in self.sites.values()) + sum(self.layer_extra.values())


def site_shares(
    n_layers: int,
    sparsity,
    allocation: str = "uniform",
    *,
    teal=None,
    search=None,
    dense_layers: Sequence[int] = (),
) -> dict[tuple[int, str], float]:
    """(layer, site) -> share of the site's columns removed, for a per-layer budget.

    ``"uniform"``: every site at the layer's budget. ``"greedy"``: the shares TEAL's greedy
    search chose for the same budget (``teal``: a
    :class:`~dejavu_lab.sparsify.calibration.Calibration` with TEAL's greedy path).
    ``"search"``: the shares the same search chose on the method's own transform (``search()``
    gives its path, :func:`~dejavu_lab.sparsify.search.search_path`).

    >>> site_shares(2, [0.5, 0.0])
    {(0, 'attn_in'): 0.5, (0, 'o_in'): 0.5, (0, 'mlp_in'): 0.5, (0, 'down_in'): 0.5}
    >>> site_shares(2, 1.0)
    Traceback (most recent call last):
    ...
    ValueError: sparsity must be in [0, 1) ...
    """
    s = budgets(sparsity, n_layers, "sparsity")
    for i in dense_layers:
        s[i % n_layers] = 0.0
    if allocation == "search":
        if search is None:
            raise CalibrationError("allocation='search' needs the method's search (its plan).")
        from .calibration_data import _interp_path

        path, out = search(), {}
        for i, si in enumerate(s):
            if si > 0:
                row = _interp_path(path[i], si, "search")
                out.update({(i, site): v for site, v in zip(SITES, row, strict=True) if v > 0})
        return out
    if allocation == "greedy":
        if teal is None or teal.greedy_table("teal") is None:
            raise CalibrationError(
                "allocation='greedy' takes TEAL's greedy shares: pass teal=calibrate(model, "
                "windows, greedy=['teal'])."
            )
        return teal._site_sparsities("teal", s, "greedy")
    if allocation != "uniform":
        raise CalibrationError(
            f"allocation must be 'uniform', 'greedy' or 'search', got {allocation!r}."
        )
    return {(i, site): si for i, si in enumerate(s) if si > 0 for site in SITES}


def plan_for(ctx, build) -> TopkPlan:
    """The plan a builder applies: ``ctx.thresholds`` as it is (a :class:`TopkPlan`), or
    ``build(model, moments, sparsity, allocation=..., arch=...)`` from
    :class:`~dejavu_lab.sparsify.moments.Moments` and ``sparsified``'s ``sparsity=`` and
    ``allocation=`` (``"greedy"`` there is the search on the method's own sites, ``"search"``;
    ``sparsified`` has already zeroed the budget of its dense layers).

    >>> from dataclasses import replace
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import rsparse
    >>> from dejavu_lab.sparsify.core import SparseContext
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 16)), cache=False,
    ...                        progress=False)
    >>> ctx = SparseContext(m.model, m.arch, "rsparse", [0.0, 0.0], [0.0, 0.0],
    ...                     sparsity=[0.5, 0.5], thresholds=mo)
    >>> p = plan_for(ctx, rsparse.plan)  # built from the moments
    >>> p.method, len(p.sites)
    ('rsparse', 8)
    >>> plan_for(replace(ctx, sparsity=None, thresholds=p), rsparse.plan) is p  # a ready plan
    True
    """
    from .moments import Moments

    src, method = ctx.thresholds, ctx.method
    if isinstance(src, TopkPlan):
        if src.method != method:
            raise ValueError(f"this plan is for {src.method!r}, not {method!r}.")
        if ctx.sparsity is not None:
            raise ValueError("a ready plan carries its own budget; drop sparsity=.")
        return src
    if isinstance(src, Moments):
        if ctx.sparsity is None:
            raise ValueError(f"method={method!r} with Moments needs sparsity=.")
        # from moments alone, the greedy allocation is the search on the method's own sites
        alloc = "search" if ctx.allocation == "greedy" else ctx.allocation
        return build(ctx.model, src, ctx.sparsity, allocation=alloc, arch=ctx.arch)
    raise ValueError(
        f"method={method!r} needs thresholds=calibrate_moments(model, windows) (Moments) or a "
        f"plan from dejavu_lab.sparsify.{method}.plan; got {type(src).__name__}."
    )


@torch.no_grad()
def sample_scores(model, moments, scorer, key, arch) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, site) -> a sorted sample of the scores ``scorer(layer, site, x)`` [..., width]
    over the calibration windows the moments kept (dense forward): the quantiles the rule
    ``"threshold"`` takes. Cached on ``moments.cache`` under ``key``.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 16)), cache=False,
    ...                        progress=False)
    >>> s = sample_scores(m.model, mo, lambda i, site, x: x.abs(), "abs", m.arch)
    >>> s[(0, "mlp_in")].shape, s[(1, "down_in")].shape  # 16 tokens x width
    (torch.Size([1024]), torch.Size([3072]))
    >>> bool((s[(0, "mlp_in")].diff() >= 0).all())  # sorted
    True
    """
    from ..hooks import hooks

    ck = ("scores", repr(key))  # the method's options: a dict, not hashable
    if ck in moments.cache:
        return moments.cache[ck]
    parts: dict[tuple[int, str], list[torch.Tensor]] = {}
    gen = torch.Generator().manual_seed(0)

    def on_site(site):
        def fn(x: torch.Tensor, name: str) -> None:
            i = int(name.split(".")[1])
            flat = scorer(i, site, x).flatten().float().cpu()
            if flat.numel() > _SAMPLE:
                flat = flat[torch.randint(0, flat.numel(), (_SAMPLE,), generator=gen)]
            parts.setdefault((i, site), []).append(flat)

        return fn

    device = next(model.parameters()).device
    with hooks(model, [(f"blocks.*.{pt}", on_site(s)) for s, pt in SITES.items()], arch):
        for w in moments.ids:
            model(input_ids=w[None].to(device), use_cache=False)
    out = {k: torch.cat(v).sort().values for k, v in parts.items()}
    moments.cache[ck] = out
    return out


def quantile(sorted_scores: torch.Tensor, share: float) -> float:
    """The score below which a share ``share`` of the sample lies.

    >>> quantile(torch.arange(101.0), 0.25)
    25.0
    """
    n = sorted_scores.numel()
    return float(sorted_scores[min(n - 1, max(0, round(share * (n - 1))))])
