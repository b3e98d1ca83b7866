"""Second moments of every linear input over calibration text: what rotations and low-rank
factors are computed from (LaRoSA's PCA bases, R-Sparse's activation-aware SVD).

One dense pass over the calibration windows adds, per layer, with ``u = (x - b) / g`` the
norm's output with its gain ``g`` (and LayerNorm bias ``b``) taken out — the vector a weight
with the gain folded in (``W diag(g)``) reads:

==============  ======================================  ==========================
key             what                                    shape
==============  ======================================  ==========================
``i.attn_in``   Σ uuᵀ of the attention norm's output    [d, d]
``i.mlp_in``    Σ uuᵀ of the MLP norm's output          [d, d]
``i.o_in``      Σ z_h z_hᵀ per query head               [h, dh, dh]
``i.SITE.sq``   Σ x² of the site's raw input            [d_in] (every site)
==============  ======================================  ==========================

The MLP's inner input (``down_in``, width n) keeps only its diagonal: an n × n matrix per layer
would be 2 GB for a 1.5B model, and no rotation of that site can be folded anyway (it follows
an elementwise product; :mod:`~dejavu_lab.sparsify.rotated`). Sums are added in float64,
kept and saved in float32 (half the file: ~0.5 GB instead of 1 GB for a 1.5B model; a rounding
of 6e-8 relative, far below what a basis or a factor resolves), and divided by the token count
in float64 on use, so moments computed and moments loaded give the same bases. :func:`calibrate_moments` caches them under
``cache_dir()/calibration`` keyed by the model fingerprint and the text's hash; the file carries
the fingerprint, and loading it for another model is a ``CalibrationError``. Files are written
under a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..arch import Arch, get_arch
from ..collect import fingerprint, fingerprint_id
from ..hooks import hooks
from .core import SITES, _check_windows
from .thresholds import CalibrationError, _check_fingerprint, _load, _save

__all__ = [
    "MOMENTS_FORMAT",
    "Moments",
    "calibrate_moments",
    "default_path",
    "load_moments",
    "norm_affine",
]

MOMENTS_FORMAT = "dejavu-lab-moments/1"
_NORMED = {"attn_in": "ln_attn", "mlp_in": "ln_mlp"}  # sites that are a norm's output


def norm_affine(model: nn.Module, arch: Arch, layer: int, site: str):
    """``(g, b)``, fp32 [d]: the site's input is ``g ⊙ u + b`` with ``u`` the bare normalised
    vector (``b`` zero for RMSNorm). Folding ``g`` into the weights (``W diag(g)``) and ``b``
    into their bias is what lets a rotation of ``u`` be folded too.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> g, b = norm_affine(m.model, m.arch, 0, "mlp_in")
    >>> g.shape, float(b.abs().sum())
    (torch.Size([64]), 0.0)
    """
    norm = arch.part(model, layer, _NORMED[site])
    g = arch.table.norm_offset + norm.weight.detach().float()
    bias = getattr(norm, "bias", None)
    b = torch.zeros_like(g) if bias is None else bias.detach().float()
    return g, b


@dataclass
class Moments:
    """Summed second moments per (layer, site) over ``n_tokens`` calibration tokens.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 16)), cache=False,
    ...                        progress=False)
    >>> mo.cov(0, "attn_in").shape, mo.cov(1, "o_in").shape, mo.sq(0, "down_in").shape
    (torch.Size([64, 64]), torch.Size([4, 16, 16]), torch.Size([192]))
    """

    fingerprint: dict
    text_sha: str  # text_hash of the calibration windows
    n_tokens: int
    sums: dict[str, torch.Tensor]  # key of the table above -> float32 sum over tokens
    # the first calibration windows [≤ 4, p]: the search's text and the thresholds' quantiles
    ids: torch.Tensor | None = None
    path: Path | None = None
    # bases and factors computed from these moments, kept for the next plan (not saved)
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def cov(self, layer: int, site: str) -> torch.Tensor:
        """E[uuᵀ] (attn_in, mlp_in; u without the norm's gain) or E[z_h z_hᵀ] per head
        (o_in), float64."""
        if site not in ("attn_in", "mlp_in", "o_in"):
            raise CalibrationError(
                f"second-moment matrices exist for attn_in, mlp_in, o_in, not {site!r}."
            )
        return self.sums[f"{layer}.{site}"].double() / self.n_tokens

    def sq(self, layer: int, site: str) -> torch.Tensor:
        """E[x_j²] of the site's raw input, float64 [d_in]."""
        return self.sums[f"{layer}.{site}.sq"].double() / self.n_tokens

    def check_model(self, model, arch: Arch | None = None) -> None:
        """Raise :class:`CalibrationError` unless these moments belong to ``model``."""
        _check_fingerprint(self.fingerprint, model, arch, "These moments were collected")

    def save(self, path: str | os.PathLike) -> Path:
        """Write a safetensors file (atomically) with the fingerprint in its metadata."""
        meta = {
            "format": MOMENTS_FORMAT,
            "fingerprint": json.dumps(self.fingerprint),
            "text_sha": self.text_sha,
            "n_tokens": str(self.n_tokens),
        }
        tensors = {k: v.float() for k, v in self.sums.items()}
        if self.ids is not None:
            tensors["ids"] = self.ids
        self.path = _save(tensors, meta, path)
        return self.path


def load_moments(path: str | os.PathLike, model=None, arch: Arch | None = None) -> Moments:
    """Load :meth:`Moments.save`'s file; with ``model``, check it belongs to it.

    >>> import tempfile
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 8)), cache=False,
    ...                        progress=False)
    >>> path = mo.save(f"{tempfile.mkdtemp()}/m.safetensors")
    >>> torch.equal(load_moments(path, m.model).cov(0, "mlp_in"), mo.cov(0, "mlp_in"))
    True
    >>> load_moments(path, random_model("tiny-llama", seed=1).model)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CalibrationError: These moments were collected for another model ...
    """
    tensors, meta = _load(path, MOMENTS_FORMAT, "moments")
    ids = tensors.pop("ids", None)
    fp = json.loads(meta["fingerprint"])
    mo = Moments(fp, meta["text_sha"], int(meta["n_tokens"]), tensors, ids, Path(path))
    if model is not None:
        mo.check_model(model, arch)
    return mo


def default_path(fp: dict, text_sha: str) -> Path:
    """The cache file :func:`calibrate_moments` uses (nothing is created).

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> p = default_path(fingerprint(m.model, m.arch), "0123456789abcdef" * 4)
    >>> p.parent.name, p.name.endswith("-0123456789ab.safetensors"), p.exists()
    ('calibration', True, False)
    """
    from ..assets import cache_dir

    return cache_dir() / "calibration" / f"moments-{fingerprint_id(fp)}-{text_sha[:12]}.safetensors"


@torch.no_grad()
def calibrate_moments(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    arch: Arch | None = None,
    cache: bool = True,
    progress: bool = True,
) -> Moments:
    """The second moments of every site's input over ``windows`` [n, window], cached.

    ``cache``: read and write ``default_path(...)`` under :func:`dejavu_lab.assets.cache_dir`
    (a damaged file is recomputed and overwritten).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (2, 16)), cache=False,
    ...                        progress=False)
    >>> mo.n_tokens, mo.ids.shape, mo.cov(1, "mlp_in").shape  # ids: the first windows, kept
    (32, torch.Size([2, 16]), torch.Size([64, 64]))
    >>> c = mo.cov(0, "attn_in")
    >>> ev = torch.linalg.eigvalsh(c)  # symmetric, PSD to the float32 rounding of the sums
    >>> torch.equal(c, c.T), bool(ev.min() > -1e-6 * ev.max())
    (True, True)
    """
    from .calibration import text_hash

    arch = arch or get_arch(model)
    windows = _check_windows(windows)
    fp, sha = fingerprint(model, arch), text_hash(windows)
    path = default_path(fp, sha)
    if cache and path.exists():
        try:
            mo = load_moments(path, model, arch)
            if mo.ids is not None:  # a file without the search's text is stale
                return mo
        except CalibrationError:
            pass  # damaged or stale: recompute and overwrite
    sums: dict[str, torch.Tensor] = {}
    affine = {(i, s): norm_affine(model, arch, i, s) for i in range(arch.n_layers) for s in _NORMED}

    def add(key: str, value: torch.Tensor) -> None:
        value = value.double().cpu()
        sums[key] = value if key not in sums else sums[key] + value

    def on_site(site):
        def fn(x: torch.Tensor, name: str) -> None:
            i = int(name.split(".")[1])
            x = x.detach().float()
            if site == "o_in":  # z: [b, p, h, dh]
                z = x.reshape(-1, *x.shape[-2:]).double()
                add(f"{i}.o_in", torch.einsum("thd,the->hde", z, z))
            flat = x.reshape(-1, x.shape[-2] * x.shape[-1] if site == "o_in" else x.shape[-1])
            add(f"{i}.{site}.sq", flat.double().pow(2).sum(0))
            if site in _NORMED:
                g, b = affine[(i, site)]
                g, b = g.to(x.device), b.to(x.device)
                u = torch.where(g != 0, (flat - b) / g, torch.zeros((), device=x.device)).double()
                add(f"{i}.{site}", u.T @ u)

        return fn

    fns = [(f"blocks.*.{point}", on_site(site)) for site, point in SITES.items()]
    device = next(model.parameters()).device
    with hooks(model, fns, arch):
        for w in tqdm(windows, desc="moments", disable=not progress, leave=False):
            model(input_ids=w[None].to(device), use_cache=False)
    sums = {k: v.float() for k, v in sums.items()}  # as saved: computed equals loaded
    mo = Moments(fp, sha, int(windows.numel()), sums, windows[:4].to(torch.int64).cpu())
    if cache:
        mo.save(path)
    return mo
