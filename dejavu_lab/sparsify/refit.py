"""Refit: read a thresholded input through the least-squares weights, at no byte's cost.

A threshold method (TEAL, WINA) keeps ``x_m = x ⊙ m`` of a linear input and the layer reads
``W x_m``: the columns of ``W`` where ``m`` is 1. The dropped entries are small, but they are
not independent of the kept ones — a post-norm residual vector's channels move together — so
the best linear guess of ``x`` from ``x_m`` is not ``x_m`` itself. With ``R`` that guess,

    R = argmin_R  E‖x − R x_m‖² + λ ‖R − I‖²   (ridge toward the identity)
      = (C_xm + λ I)(C_mm + λ I)⁻¹,   C_xm = E[x x_mᵀ],  C_mm = E[x_m x_mᵀ],

the layer reads ``W' = W R`` instead of ``W``: a matrix of ``W``'s shape whose columns are read
where ``m`` is 1, exactly as before. So the bytes per token do not change; the weights do, once
per budget (``R`` is fitted under the thresholds it will run with). The engine stores ``W R``
(:func:`folded_weights`); the hooks here compute ``R x_m`` in place of ``x_m``, the same
product. ``x`` is the model's own input at the site, so ``R`` undoes the site's own masking,
and ``λ = ridge · mean(diag C_mm)`` scales with the site.

Where it pays was settled by a side run on Qwen2.5-0.5B, WINA at 50% (frontier text, not
recorded): attention's and the MLP's inputs, the residual stream after a norm, whose channels
are correlated, gain the most. The MLP's inner input (``down_in``, after an elementwise product)
got worse: its n × n fit over-fits 8,192 calibration tokens, and the entries it drops are the
near-zero outputs of the activation, with little to recover. So :data:`SITES` leaves it out;
``o_in`` (attention's output, heads concatenated) is in but gains little. The same run chose
the ridge (:data:`RIDGE`; 0.3 and 3 did worse) and the model's own input as the target: fitting
toward the dense model's input instead, or fitting again with the first refit applied
upstream, did worse; four times the calibration text (32,768 tokens) moved the perplexity
by -0.7%, less than a rerun of the same point moves it, and with it ridge 0.3 still did worse
(+1.2%). The recorded effect is in ``results/frontier_qwen2.5-*.json`` (variants
marked "refit"; chapter 42).

A :class:`Refit` is tied to one model (its fingerprint) and one set of thresholds (their
digest): passing it with other thresholds is an error, not a silent mismatch. Fits are cached
under ``cache_dir()/calibration`` and written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..arch import Arch, get_arch
from ..collect import fingerprint, fingerprint_id
from ..hooks import hooks
from ..vocab import SITES as HOOK_OF
from .core import SparseContext, _check_windows, site_weights, threshold_hooks
from .thresholds import CalibrationError, _check_fingerprint, _load, _save

__all__ = ["REFIT_FORMAT", "SITES", "Refit", "apply", "default_path", "fit_refit",
           "folded_weights", "load_refit", "refitted", "thresholds_digest"]  # fmt: skip

REFIT_FORMAT = "dejavu-lab-refit/1"
SITES = ("attn_in", "mlp_in", "o_in")  # down_in over-fits and loses (module docstring)
RIDGE = 1.0  # λ in units of mean(diag C_mm); 0.3 and 3 were worse on Qwen2.5-0.5B at 50%


def thresholds_digest(thresholds: dict) -> str:
    """sha256 (16 hex digits) of ``{(layer, site): float | tensor}``: what a refit was fitted
    under.

    >>> thresholds_digest({(0, "mlp_in"): 0.5}) == thresholds_digest({(0, "mlp_in"): 0.5001})
    False
    """
    h = hashlib.sha256()
    for (i, site), t in sorted(thresholds.items()):
        h.update(f"{i}.{site}:".encode())
        t = torch.as_tensor(t, dtype=torch.float32).reshape(-1)
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class Refit:
    """``R`` per (layer, site) fitted under one set of thresholds on one model.

    ``maps``: ``(layer, site) -> fp32 [d_in, d_in]`` (``o_in``: heads concatenated, h·dh).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> thr = {(0, "attn_in"): 0.4}
    >>> r = fit_refit(m.model, torch.randint(0, 128, (1, 16)), thr, cache=False, progress=False)
    >>> r.check(m.model, thr)  # the model and thresholds it was fitted for: no error
    >>> r.check(m.model, {(0, "attn_in"): 0.5})
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CalibrationError: This refit was fitted under other thresholds ...
    """

    fingerprint: dict
    thresholds_sha: str  # thresholds_digest of the site thresholds it was fitted under
    text_sha: str  # text_hash of the calibration windows
    ridge: float
    maps: dict
    path: Path | None = None

    def check(self, model, thresholds: dict, arch: Arch | None = None) -> None:
        """Raise :class:`CalibrationError` unless this refit belongs to ``model`` and was
        fitted under ``thresholds`` (``{(layer, site): t}`` as the hooks take them)."""
        _check_fingerprint(self.fingerprint, model, arch, "This refit was fitted")
        have = thresholds_digest(thresholds)
        if have != self.thresholds_sha:
            raise CalibrationError(
                f"This refit was fitted under other thresholds ({self.thresholds_sha}, these are "
                f"{have}): a refit holds for one method and budget; fit one for these with "
                "dejavu_lab.sparsify.refit.fit_refit."
            )

    def save(self, path: str | os.PathLike) -> Path:
        """Write a safetensors file (atomically) with the fingerprint in its metadata."""
        meta = {
            "format": REFIT_FORMAT,
            "fingerprint": json.dumps(self.fingerprint),
            "thresholds_sha": self.thresholds_sha,
            "text_sha": self.text_sha,
            "ridge": repr(self.ridge),
        }
        tensors = {f"{i}.{site}": r.float() for (i, site), r in self.maps.items()}
        self.path = _save(tensors, meta, path)
        return self.path


def load_refit(path: str | os.PathLike, model=None, arch: Arch | None = None) -> Refit:
    """Load :meth:`Refit.save`'s file; with ``model``, check it belongs to it.

    >>> import tempfile
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> r = fit_refit(m.model, torch.randint(0, 128, (1, 16)), {(1, "mlp_in"): 0.4},
    ...               cache=False, progress=False)
    >>> path = r.save(f"{tempfile.mkdtemp()}/r.safetensors")
    >>> torch.equal(load_refit(path, m.model).maps[(1, "mlp_in")], r.maps[(1, "mlp_in")])
    True
    >>> load_refit(path, random_model("tiny-llama", seed=1).model)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CalibrationError: This refit was fitted for another model ...
    """
    tensors, meta = _load(path, REFIT_FORMAT, "refit")
    maps = {}
    for key, r in tensors.items():
        i, _, site = key.partition(".")
        maps[(int(i), site)] = r
    fp = json.loads(meta["fingerprint"])
    out = Refit(fp, meta["thresholds_sha"], meta["text_sha"], float(meta["ridge"]), maps,
                Path(path))  # fmt: skip
    if model is not None:
        _check_fingerprint(fp, model, arch, "This refit was fitted")
    return out


def _flat(x: torch.Tensor, site: str) -> torch.Tensor:
    return x.reshape(*x.shape[:2], -1) if site == "o_in" else x


def apply(r: torch.Tensor, x: torch.Tensor, site: str) -> torch.Tensor:
    """``R x_m`` for a site's (thresholded) input ``x`` in its hook's shape, in ``x``'s dtype.

    >>> x = torch.randn(1, 3, 4)
    >>> torch.equal(apply(torch.eye(4), x, "mlp_in"), x)
    True
    """
    f = _flat(x, site)
    r = r.to(f.device)
    return (f.float() @ r.T).to(x.dtype).reshape(x.shape)


def _solve(cxm: torch.Tensor, cmm: torch.Tensor, ridge: float) -> torch.Tensor:
    """``(C_xm + λI)(C_mm + λI)⁻¹`` in float64, λ = ridge · mean(diag C_mm); fp32 out."""
    cxm, cmm = cxm.double(), cmm.double()
    eye = torch.eye(cmm.shape[0], dtype=torch.float64, device=cmm.device)
    lam = ridge * float(torch.diagonal(cmm).mean().clamp_min(1e-30))
    # R (C_mm + λI) = C_xm + λI  <=>  (C_mm + λI) Rᵀ = (C_xm + λI)ᵀ (C_mm symmetric)
    return torch.linalg.solve(cmm + lam * eye, (cxm + lam * eye).T).T.float().cpu()


def default_path(fp: dict, text_sha: str, thr_sha: str, ridge: float) -> Path:
    """The cache file :func:`fit_refit` uses (nothing is created).

    >>> fp = {"model_type": "llama", "n_layers": 2, "d_model": 64, "weights_sha256": "0" * 64}
    >>> p = default_path(fp, "ab" * 8, "cd" * 8, 1.0)
    >>> p.parent.name, p.name.endswith("-cdcdcdcdcdcd-r1.safetensors")
    ('calibration', True)
    """
    from ..assets import cache_dir

    tag = f"{fingerprint_id(fp)}-{text_sha[:12]}-{thr_sha[:12]}-r{ridge:g}"
    return cache_dir() / "calibration" / f"refit-{tag}.safetensors"


@torch.no_grad()
def fit_refit(
    model: nn.Module,
    windows: torch.Tensor,
    thresholds: dict,
    *,
    sites: tuple[str, ...] = SITES,
    ridge: float = RIDGE,
    arch: Arch | None = None,
    cache: bool = True,
    progress: bool = True,
) -> Refit:
    """Fit ``R`` for every thresholded site in ``sites`` over the calibration ``windows``.

    ``thresholds``: ``{(layer, site): float | fp32 [d_in]}``, the hooks' form
    (:meth:`~dejavu_lab.sparsify.thresholds.Thresholds.site_thresholds`). One pass runs the
    model with every threshold applied (the inputs each site sees under sparsity) and adds
    ``x x_mᵀ`` and ``x_m x_mᵀ`` per site in fp32; each ``R`` is then solved in float64.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (2, 16))
    >>> r = fit_refit(m.model, ids, {(0, "mlp_in"): 0.5, (1, "down_in"): 0.1}, cache=False,
    ...               progress=False)
    >>> sorted(r.maps), r.maps[(0, "mlp_in")].shape  # down_in is not refitted
    ([(0, 'mlp_in')], torch.Size([64, 64]))
    """
    from .calibration import text_hash

    arch = arch or get_arch(model)
    windows = _check_windows(windows)
    bad = sorted(set(sites) - set(HOOK_OF))
    if bad or not ridge > 0:
        raise ValueError(
            f"sites must be among {', '.join(HOOK_OF)} and ridge > 0, got sites={sites!r}, "
            f"ridge={ridge!r}."
        )
    fp, sha, thr_sha = fingerprint(model, arch), text_hash(windows), thresholds_digest(thresholds)
    path = default_path(fp, sha, thr_sha, ridge)
    if cache and path.exists():
        try:
            r = load_refit(path, model, arch)
            if r.thresholds_sha == thr_sha and set(r.maps) == _fitted(thresholds, sites):
                return r
        except CalibrationError:
            pass  # damaged or stale: refit and overwrite
    # the method's own masks (threshold_hooks), each fitted site's sums added around its mask
    sums: dict = {}
    ctx = SparseContext(model, arch, "teal", mlp=[0.0] * arch.n_layers,
                        heads=[0.0] * arch.n_layers)  # fmt: skip
    where = _hook_names(_fitted(thresholds, sites))
    fns = [(name, _summing(fn, sums, *where[name]) if name in where else fn)
           for name, fn in threshold_hooks(ctx, thresholds)]  # fmt: skip
    device = next(model.parameters()).device
    for w in tqdm(windows, desc="refit", disable=not progress, leave=False):
        with hooks(model, fns, arch):
            model(input_ids=w[None].to(device))
    maps = {k: _solve(cxm, cmm, ridge) for k, (cxm, cmm) in sorted(sums.items())}
    out = Refit(fp, thr_sha, sha, float(ridge), maps)
    if cache:
        out.save(path)
    return out


def _fitted(thresholds: dict, sites) -> set:
    return {k for k in thresholds if k[1] in sites}


def _hook_names(keys) -> dict:
    """``{hook name: (layer, site)}`` of the sites ``keys``."""
    return {f"blocks.{i}.{HOOK_OF[site]}": (i, site) for i, site in keys}


def _summing(fn, sums: dict, i: int, site: str):
    """The threshold hook ``fn``, adding ``x x_mᵀ`` and ``x_m x_mᵀ`` of its input and output."""

    def summed(x: torch.Tensor, name: str) -> torch.Tensor:
        xm = fn(x, name)
        a, b = (_flat(t, site) for t in (x, xm))
        a, b = (t.reshape(-1, t.shape[-1]).float() for t in (a, b))
        cxm, cmm = sums.get((i, site), (0.0, 0.0))
        sums[(i, site)] = (cxm + a.T @ b, cmm + b.T @ b)
        return xm

    return summed


def folded_weights(model: nn.Module, refit: Refit, arch: Arch | None = None) -> dict:
    """``{(layer, site): [W R for each linear reading the site]}`` in the weights' dtype: what
    an engine stores so that its threshold kernels, reading the kept columns of ``W R``,
    compute the refitted product.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> r = Refit({}, "", "", 1.0, {(0, "attn_in"): torch.eye(64)})
    >>> w = folded_weights(m.model, r)[(0, "attn_in")]
    >>> [tuple(t.shape) for t in w], torch.equal(w[0], m.arch.part(m.model, 0, "q").weight)
    ([(64, 64), (32, 64), (32, 64)], True)
    """
    arch = arch or get_arch(model)
    out = {}
    for (i, site), r in sorted(refit.maps.items()):
        out[(i, site)] = [
            (lin.weight.detach().float() @ r.to(lin.weight.device)).to(lin.weight.dtype)
            for lin in site_weights(model, arch, i, site)
        ]
    return out


def refitted(ctx, thresholds: dict, fns: list) -> list:
    """The threshold hooks ``fns`` with ``R`` applied after each refitted site's mask, when
    ``ctx.refit`` holds a :class:`Refit` (checked against the model and ``thresholds``).

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.core import SparseContext, threshold_hooks
    >>> m = random_model("tiny-llama")
    >>> thr = {(0, "mlp_in"): 0.4, (0, "down_in"): 0.1}
    >>> ctx = SparseContext(m.model, m.arch, "teal", mlp=[0.0] * 2, heads=[0.0] * 2)
    >>> ctx.refit = fit_refit(m.model, torch.randint(0, 128, (1, 16)), thr, cache=False,
    ...                       progress=False)
    >>> [fn.__name__ for _, fn in refitted(ctx, thr, threshold_hooks(ctx, thr))]  # down_in, mlp_in
    ['fn', 'wrapped']
    """
    refit = ctx.refit
    if refit is None:
        return fns
    if not isinstance(refit, Refit):
        raise TypeError(f"refit must be a Refit from fit_refit or load_refit, got {type(refit)}.")
    refit.check(ctx.model, thresholds, ctx.arch)
    where = _hook_names(refit.maps)
    return [(name, _then(fn, where[name][1], refit.maps[where[name]]) if name in where else fn)
            for name, fn in fns]  # fmt: skip


def _then(fn, site: str, r: torch.Tensor):
    cache: dict = {}

    def wrapped(x: torch.Tensor, name: str) -> torch.Tensor:
        rd = cache.get(x.device)
        if rd is None:
            rd = cache[x.device] = r.to(x.device)
        return apply(rd, fn(x, name), site)

    return wrapped
