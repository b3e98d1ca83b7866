"""What :mod:`dejavu_lab.bench.engine` times: the models, DejaVu's predictors, the engine's
variants and the decoder of each (Deja Vu §5.1).

:func:`build` makes a random-weight model at a preset shape (or loads a checkpoint);
:func:`make_predictors` gives it DejaVu's predictors at their default rank (random weights: only
their cost matters); :func:`variants` lists the engine configurations of ``--methods``
(:class:`Variant`); :func:`make_decoder` builds one, and :func:`planned_config` gives LaRoSA's and
R-Sparse's configs at the bytes TEAL reads. ``kernels/profile_engine.py`` calls these too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..engine import (
    SITES,
    Decoder,
    SparseConfig,
    calibrate_thresholds,
    factor_bytes,
    fold_rotations,
    keep_all,
    random_factors,
    random_rotations,
)
from ..engine.plans import site_shape
from ..engine.weights import layout_for
from ..models import PRESETS, load_model, random_model
from ..sparsify.rsparse import split_budget
from ..vocab import method_names

THRESHOLD = method_names(family="threshold")  # the methods timed at each --sparsity
PLANNED = method_names(family="topk", engine=True)  # LaRoSA, R-Sparse: also at each --sparsity
LOWRANK = 0.1  # R-Sparse: share of a site's kept bytes in its factors (sparsify.topk.DESIGNS)

__all__ = [
    "LOWRANK",
    "PLANNED",
    "THRESHOLD",
    "Variant",
    "build",
    "does_not_fit",
    "make_decoder",
    "make_predictors",
    "planned_config",
    "skipped_too_large",
    "variants",
]


def build(preset: str, device: str, dtype=torch.float16):
    """A random-weight model at a preset shape, materialised on ``device`` without a CPU copy;
    a Hugging Face id or a local folder (``facebook/opt-6.7b``) loads the real checkpoint.

    >>> model, arch = build("tiny-opt", "cpu")
    >>> arch.family, next(model.parameters()).dtype
    ('opt', torch.float16)
    """
    if preset not in PRESETS:
        m = load_model(preset, dtype=dtype, device=device)
        m.model.generation_config.pad_token_id = m.tokenizer.pad_token_id or 0
        return m.model, m.arch
    m = random_model(preset, device="meta", dtype=dtype)
    model, arch = m.model, m.arch
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.02)
        rot = getattr(getattr(model, "model", None), "rotary_emb", None)
        if rot is not None:  # its inv_freq buffer was left empty by to_empty
            model.model.rotary_emb = type(rot)(config=model.config).to(device)
    model.generation_config.pad_token_id = 0
    return model, arch


def does_not_fit(preset: str, device, dtype=torch.float16) -> str | None:
    """Why ``preset`` cannot be built on ``device`` (its weights in ``dtype``, plus two layers'
    copies while the engine takes them over, :func:`~dejavu_lab.engine.decoder_weights` with
    ``release=True``, and 2 GB for caches and workspaces, past the GPU's free memory), or None
    when it fits (always on a CPU, and for a checkpoint that is not a preset).

    >>> does_not_fit("opt-30b", "cpu") is None
    True
    """
    if preset not in PRESETS or torch.device(device).type != "cuda":
        return None
    m = random_model(preset, device="meta", dtype=dtype)  # shapes only, no memory
    weights = sum(p.numel() for p in m.model.parameters()) * torch.finfo(dtype).bits // 8
    need = weights * (1 + 2 / m.arch.n_layers) + 2e9
    free = torch.cuda.mem_get_info(torch.device(device))[0]
    if need <= free:
        return None
    kind = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    return (f"its {kind} weights and the engine's working memory ({need / 1e9:.0f} GB) do not fit "
            f"the {free / 1e9:.0f} GB free on this GPU")  # fmt: skip


def skipped_too_large(preset: str, device, rows: list[dict]) -> bool:
    """Whether a bench skips ``preset`` on ``device`` (:func:`does_not_fit`): if so it prints
    the reason in one sentence and appends a ``skip`` row to ``rows``.

    >>> rows = []
    >>> skipped_too_large("opt-30b", "cpu", rows), rows
    (False, [])
    """
    if (reason := does_not_fit(preset, device)) is None:
        return False
    print(f"{preset}: skipped: {reason}")
    rows.append({"model": preset, "kind": "skip", "reason": reason})
    return True


def make_predictors(model, arch, device):
    """DejaVu's predictors at their default rank (random weights: only their cost matters).

    >>> model, arch = build("tiny-opt", "cpu")
    >>> type(make_predictors(model, arch, "cpu")).__name__
    'Predictors'
    """
    try:
        from dejavu_lab.collect import fingerprint
        from dejavu_lab.predictors import PredictorConfig, Predictors
    except ImportError as exc:  # the predictors module is optional for this script
        print(f"predictors unavailable ({exc}); sparse runs use fixed random sets only")
        return None
    cfg = PredictorConfig(mode="lookahead")
    return Predictors(fingerprint(model, arch, weights=False), cfg).to(device).eval()


@dataclass
class Variant:
    """One engine configuration timed per prompt: a row ``engine`` of the results.

    >>> v = Variant("teal", "teal", sparsity=0.5, columns=True)
    >>> v.engine, v.sparse, v.ops
    ('teal', None, None)
    """

    engine: str  # dense, dense_triton, sparse, sparse_select_kernel, sparse_torch_scores,
    #              sparse_untuned, sparse_side_priority_0, sparse_down_tile,
    #              sparse_fixed_sets,
    #              sparse_inline_predictors, teal, wina, cats, larosa, rsparse
    method: str = "dense"  # the SparseConfig method ("dense": sparse=None)
    sparsity: float = 0.0  # teal/wina/cats: the calibrated fraction of entries dropped per site;
    # larosa, rsparse: the fraction of each site's bytes removed (TEAL's at the same number)
    sparse: SparseConfig | None = None  # dejavu's config (teal/wina/cats: built per prompt)
    predictors: bool = False  # dejavu: lookahead predictors choose the kept sets
    ops: str | None = None  # dense_ops of this decoder (None: --dense-ops)
    only_at_parts: bool = False  # time only at the breakdown's prompt
    columns: bool = False  # reads the columns layout (teal, wina, larosa, rsparse, dense_columns)
    topk_kernel: bool = False  # dejavu: kept sets by our one-launch select (else torch.topk)
    score_kernel: bool = True  # dejavu: predictor scores by kernels/predict.py (else torch ops)
    down_mode: str = "engine"  # dejavu: the down projections' kernel (KeptSets.down_mode)


def variants(methods, sparsities, dejavu_budget, preds) -> list[Variant]:
    """The variants of --methods; rows-layout methods first (TEAL/WINA convert the weights).

    >>> [v.engine for v in variants(["teal", "dense"], [0.5], (0.5, 0.5), None)]
    ['dense', 'teal']
    """
    out, ms_, hs_ = [], *dejavu_budget
    for m in methods:
        if m == "dense":
            out.append(Variant("dense"))
        elif m == "dense_triton":
            out.append(Variant("dense_triton", ops="triton"))
        elif m == "dense_columns":  # our threshold kernels over every column
            out.append(Variant("dense_columns", ops="triton", columns=True))
        elif m == "dense_auto":  # the faster of torch and ours per op, timed first
            out.append(Variant("dense_auto", ops="auto"))
        elif m == "dejavu":
            sp = SparseConfig(ms_, hs_)  # the engine's: its first capture times the kernels
            pin = replace(sp, tune_kernels=False)  # the rows below change one thing each
            if preds is not None:
                out.append(Variant("sparse", "dejavu", sparse=sp, predictors=True))
                out.append(Variant("sparse_untuned", "dejavu", sparse=pin, predictors=True))
                out.append(Variant("sparse_select_kernel", "dejavu", sparse=pin, predictors=True,
                                   topk_kernel=True))  # fmt: skip
                out.append(Variant("sparse_torch_scores", "dejavu", sparse=pin, predictors=True,
                                   score_kernel=False))  # fmt: skip
                out.append(Variant("sparse_side_priority_0", "dejavu", predictors=True,
                                   sparse=replace(pin, side_priority=0)))  # fmt: skip
                out.append(Variant("sparse_down_tile", "dejavu", sparse=pin, predictors=True,
                                   down_mode="tile"))  # fmt: skip
            out.append(Variant("sparse_fixed_sets", "dejavu", sparse=sp))
            out.append(Variant("sparse_fixed_sets_down_split", "dejavu", sparse=pin,
                               down_mode="split"))  # fmt: skip
            if preds is not None:
                out.append(Variant("sparse_inline_predictors", "dejavu", predictors=True,
                                   sparse=replace(pin, side_stream=False),
                                   only_at_parts=True))  # fmt: skip
        else:
            cols = layout_for(m) == "columns"
            out += [Variant(m, m, sparsity=s, columns=cols) for s in sparsities]
    return sorted(out, key=lambda v: v.columns)  # stable: rows layout first


def make_decoder(v: Variant, w, arch, max_len, preds, dense_ops, thresholds=None):
    """The :class:`~dejavu_lab.engine.Decoder` of variant ``v`` (DejaVu without predictors:
    fixed random kept sets, one per layer; TEAL/WINA/CATS: with ``thresholds``).

    >>> from dejavu_lab.engine import decoder_weights
    >>> model, arch = build("tiny-llama", "cpu", torch.bfloat16)
    >>> v = Variant("sparse_fixed_sets", "dejavu", sparse=SparseConfig(0.5, 0.5))
    >>> dec = make_decoder(v, decoder_weights(model, arch), arch, 32, None, None)
    >>> dec.k_mlp, arch.d_mlp
    (96, 192)
    """
    if v.method in THRESHOLD:
        sp = SparseConfig(method=v.method, thresholds=thresholds)
    elif v.method in PLANNED:  # planned_config's SparseConfig
        sp = thresholds
    else:
        sp = v.sparse
    dec = Decoder(w, max_seq_len=max_len, sparse=sp, predictors=preds if v.predictors else None,
                  dense_ops=v.ops or dense_ops)  # fmt: skip
    if v.predictors:
        dec.sets.topk_kernel = v.topk_kernel
        dec.sets.score_kernel = v.score_kernel
    if v.method == "dejavu" and v.down_mode != "engine":
        dec.sets.down_mode = v.down_mode
    if v.method == "dejavu" and not v.predictors:  # fixed random kept sets, one per layer
        g = torch.Generator(device="cpu").manual_seed(0)
        for i in range(arch.n_layers):
            dec.set_indices(i, mlp=torch.randperm(arch.d_mlp, generator=g)[: dec.k_mlp],
                            heads=torch.randperm(arch.n_heads, generator=g)[: dec.k_heads])  # fmt: skip
    return dec


def planned_config(v: Variant, w, arch, ids, *, lowrank: float = LOWRANK, keep: bool = False):
    """``(SparseConfig, weights, site_kept, extra bytes)`` of a LaRoSA or R-Sparse variant on
    random weights, at the bytes TEAL reads at ``v.sparsity``: LaRoSA over ``w`` with random
    K/V-group rotations folded in (:func:`~dejavu_lab.engine.fold_rotations`), TEAL's thresholds
    calibrated on it (the same kept fractions); R-Sparse with random factors of the rank its
    ``lowrank`` share of each site's bytes buys (:func:`~dejavu_lab.sparsify.rsparse.split_budget`)
    and thresholds for the columns left. ``keep``: every column kept (thresholds -1; R-Sparse's
    term then adds zero), for the keep-all check.

    >>> from dejavu_lab.engine import decoder_weights
    >>> model, arch = build("tiny-llama", "cpu", torch.bfloat16)
    >>> w = decoder_weights(model, arch, layout="columns")
    >>> ids = torch.randint(0, 128, (1, 16))
    >>> sp, _, kept, extra = planned_config(Variant("rsparse", "rsparse", 0.5), w, arch, ids)
    >>> kept["mlp_in"], tuple(sp.factors[(0, "mlp_in")][0].shape)  # ~0.5 x 0.9 of the columns
    (0.46875, (384, 2))
    >>> extra  # bf16 factor bytes of every site and layer: rank x (d_in + d_out) x 2 bytes
    7680
    """
    if v.method == "larosa":
        wf = fold_rotations(w, random_rotations(arch, device=w.device))
        thr = keep_all(wf) if keep else calibrate_thresholds(wf, ids, v.sparsity, method="teal")
        kept = dict.fromkeys(SITES["larosa"], 1 - v.sparsity)
        return SparseConfig(method="larosa", thresholds=thr), wf, kept, 0
    ranks, kept, thr = {}, {}, {}
    for site in SITES["rsparse"]:
        d_in, d_out = site_shape(arch, site)
        ranks[site], k = split_budget(v.sparsity, d_in, d_out, lowrank)
        kept[site] = k / d_in
        if not keep:  # calibrated for this site's share of columns
            thr.update(calibrate_thresholds(w, ids, 1 - kept[site], method="teal", sites=[site]))
    thr = keep_all(w) if keep else thr
    factors = random_factors(arch, ranks, device=w.device, dtype=w.dtype)
    sp = SparseConfig(method="rsparse", thresholds=thr, factors=factors)
    return sp, w, kept, factor_bytes(factors, w.dtype.itemsize)
