"""Perplexity on 4-bit weights, dense and under activation sparsity, beside the loaded weights.

Activation sparsity and weight quantisation multiply in bytes (half the columns of a 4-bit matrix
are an eighth of the fp16 bytes, :mod:`dejavu_lab.step_bytes`); this study asks whether they
compound in error. Each *format* swaps every decoder linear for its dequantised int4 values
(:func:`dejavu_lab.quant.swap.dequantized`) and runs chapter 40's study on it
(:func:`dejavu_lab.sparsify.frontier.frontier`: the same held-out windows, TEAL/WINA/CATS at
each sparsity). The thresholds are calibrated on the quantised model, since they follow the
activations, which the format changes (calibrations are cached per weights' fingerprint).

Formats: ``"fp"`` — the weights as loaded; ``"gguf"`` — the model's own GGUF file read into
int4 (:func:`dejavu_lab.quant.gguf_model.import_gguf`: exact from Q4_0/Q4_1/Q4_K blocks,
round-to-nearest from the others); ``"rtn-g32"``, ``"rtn-g64"``, ``"rtn-g128"`` —
round-to-nearest of the loaded weights (:func:`dejavu_lab.quant.swap.rtn_weights`);
``"mse-g32"``, ``"mse-g64"``, ``"mse-g128"`` — the same groups with each (scale, min) searched
for the smallest squared error (:func:`dejavu_lab.quant.refine.quantize_mse`); ``"act-gN"`` —
that error with each input channel weighed by its mean squared activation on the study's first
calibration windows (:func:`input_moments`). A model
loaded from a 4-bit GGUF *is* 4-bit: the demo's "fp" weights are its Q4_1 values dequantised,
so its "gguf" format is those same values and re-quantising them at group 32 gives them back.

From a shell — the recorded runs (one CPU thread; the demo's ~15 CPU-minutes, Qwen's ~10)::

    python -m dejavu_lab.measure.quant_quality --model demo --sparse-formats fp rtn-g128 \\
        --eval-windows 4 --calibration-tokens 4096 --record quant_quality_demo
    python -m dejavu_lab.measure.quant_quality --model qwen2.5-0.5b.gguf --dtype bfloat16 \\
        --formats fp gguf rtn-g32 rtn-g128 --sparse-formats fp gguf rtn-g32 \\
        --variants "teal (uniform)" --sparsities 0.4 0.5 --eval-windows 4 \\
        --calibration-tokens 2048 --record quant_quality_qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext

import pandas as pd
import torch

from ..arch import get_arch
from ..errors import QuantError
from ..quant import GROUPS
from ..quant.gguf_file import GGUFFile, read_gguf
from ..quant.gguf_model import import_gguf
from ..quant.int4 import Int4Weight, quantize
from ..quant.refine import quantize_mse
from ..quant.swap import decoder_linears, dequantized
from ..sparsify.frontier import VARIANTS as FRONTIER_VARIANTS
from ..sparsify.frontier import frontier
from ..sparsify.windows import study_windows
from ..step_bytes import step_bytes

__all__ = [
    "ALL_VARIANTS",
    "FORMATS",
    "HEAD_FORMATS",
    "SPARSITIES",
    "VARIANTS",
    "format_weights",
    "gguf_source",
    "input_moments",
    "main",
    "quant_frontier",
    "weight_error",
]

FORMATS = ("fp", "gguf", "rtn-g32", "rtn-g64", "rtn-g128", "mse-g32", "mse-g64", "mse-g128",
           "act-g32", "act-g64", "act-g128")  # fmt: skip
#: a rounding format with ``+head``: the output projection (``lm_head``, tied or not) in int4
#: too, rounded the same way (the engine keeps it in fp16: a fifth of Llama-3-8B's int4 bytes)
HEAD_FORMATS = tuple(f + "+head" for f in FORMATS if f not in ("fp", "gguf"))
MOMENT_WINDOWS = 4  # calibration windows whose inputs weigh the act-gN formats' channels
# name -> frontier spec: the threshold methods with one threshold per layer's sites (uniform),
# which needs only the calibration's histograms; the greedy allocations (frontier.VARIANTS) cost
# a few CPU-minutes per method and per format on the demo model
VARIANTS: dict[str, dict] = {
    "teal (uniform)": FRONTIER_VARIANTS["teal (uniform)"],
    "wina (uniform)": {"method": "wina", "allocation": "uniform"},
    "cats": FRONTIER_VARIANTS["cats"],
}
ALL_VARIANTS = {**FRONTIER_VARIANTS, **VARIANTS}
SPARSITIES = (0.25, 0.4, 0.5)


def format_weights(
    model,
    fmt: str,
    *,
    gguf: str | os.PathLike | GGUFFile | None = None,
    dtype: torch.dtype | None = None,
    arch=None,
    calibration: torch.Tensor | None = None,
) -> tuple[dict[str, Int4Weight] | None, dict]:
    """(int4 weights of ``fmt``, or None for ``"fp"``; what they are, as a flat dict).

    ``calibration``: token windows whose inputs weigh each channel of the ``act-gN`` formats
    (:func:`input_moments`; :func:`~dejavu_lab.quant.refine.quantize_mse` with ``importance``).

    ``dtype``: the scales' (default: fp16 for an fp32 model, else the model's dtype; the
    ``"gguf"`` format keeps fp32 scales, exact for every 4-bit block). A ``rtn-gN`` group that
    does not divide a matrix's input width falls back to the largest of
    :data:`~dejavu_lab.quant.GROUPS` that does (the demo's 576-wide inputs take 64 for 128).

    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-llama").model
    >>> w, info = format_weights(model, "rtn-g128")
    >>> len(w), info["groups"]  # 64-wide inputs take group 64; down_proj's 192 take 64 too
    (14, '64')
    >>> w, info = format_weights(model, "rtn-g128+head")  # and the output projection
    >>> len(w), info["head"]
    (15, 'lm_head int4 g64')
    """
    arch = arch or get_arch(model)
    if fmt not in FORMATS + HEAD_FORMATS:
        raise QuantError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)} (a rounding "
                         "format may end in '+head').")  # fmt: skip
    fmt, head = fmt.removesuffix("+head"), fmt.endswith("+head")
    if fmt == "fp":
        return None, {"groups": "", "scale_dtype": "", "gguf_types": "", "head": ""}
    if fmt == "gguf":
        if gguf is None:
            raise QuantError(
                "the 'gguf' format reads the model's GGUF file; pass gguf=<the file it was loaded from>."
            )
        imp = import_gguf(model, gguf, dtype=torch.float32, arch=arch)
        counts = json.dumps(imp.type_counts())
        return imp.weights, {"groups": "32", "scale_dtype": "float32", "gguf_types": counts,
                             "head": ""}  # fmt: skip
    kind, group = fmt.split("-g")
    group = int(group)
    moments = {}
    if kind == "act":
        if calibration is None:
            raise QuantError(f"the {fmt!r} format weighs channels by their activations; pass "
                             "calibration=<token windows>.")  # fmt: skip
        moments = input_moments(model, calibration, arch=arch)

    def rounding(w_t, name, **kw):
        if kind == "rtn":
            return quantize(w_t, **kw)
        return quantize_mse(w_t, importance=moments.get(name), **kw)

    w0 = next(iter(model.parameters()))
    dtype = dtype or (torch.float16 if w0.dtype == torch.float32 else w0.dtype)
    mods = dict(model.named_modules())
    by_width: dict[int, int] = {}
    for name in decoder_linears(model, arch):
        n_in = mods[name].in_features
        fits = [g for g in GROUPS if g <= group and n_in % g == 0]
        if not fits:
            raise QuantError(
                f"{name} has {n_in} inputs, which no group of {GROUPS} divides; use the fp format."
            )
        by_width[n_in] = max(fits)
    weights = {
        n: rounding(mods[n].weight.detach().T, n, group=by_width[mods[n].in_features], dtype=dtype)
        for n in decoder_linears(model, arch)
    }
    groups = "/".join(str(g) for g in sorted(set(by_width.values()), reverse=True))
    info = {"groups": groups, "scale_dtype": str(dtype).removeprefix("torch."), "gguf_types": "",
            "head": ""}  # fmt: skip
    if head:
        out = model.get_output_embeddings()
        name = next(n for n, m in mods.items() if m is out)
        fits = [g for g in GROUPS if g <= group and out.in_features % g == 0]
        if not fits:
            raise QuantError(f"{name} has {out.in_features} inputs, which no group of {GROUPS} "
                             "divides; use a format without '+head'.")  # fmt: skip
        weights[name] = rounding(out.weight.detach().T, name, group=max(fits), dtype=dtype)
        info["head"] = f"{name} int4 g{max(fits)}"
    return weights, info


def input_moments(model, ids: torch.Tensor, *, arch=None) -> dict[str, torch.Tensor]:
    """Each decoder linear's mean squared input per channel (fp32 [in]) over the token windows
    ``ids`` [n, window], one forward per window.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama").model
    >>> h = input_moments(m, torch.randint(0, 100, (2, 8)))
    >>> len(h), tuple(h["model.layers.0.mlp.down_proj"].shape), bool((h["model.layers.0.mlp.down_proj"] > 0).all())
    (14, (192,), True)
    """
    names = list(decoder_linears(model, arch))
    mods = dict(model.named_modules())
    sums = {n: torch.zeros(mods[n].in_features) for n in names}

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[name] += x.pow(2).sum(0).cpu()

        return pre

    handles = [mods[n].register_forward_pre_hook(hook(n)) for n in names]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for row in ids:
                model(row[None].to(device))
    finally:
        for h in handles:
            h.remove()
    return {n: v / max(ids.numel(), 1) for n, v in sums.items()}  # each linear saw every token


def weight_error(model, weights: dict[str, Int4Weight] | None) -> float:
    """Relative rms difference of the dequantised weights from the loaded ones (all linears).

    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-llama").model
    >>> w, _ = format_weights(model, "rtn-g32")
    >>> weight_error(model, None), 0.01 < weight_error(model, w) < 0.1
    (0.0, True)
    """
    if weights is None:
        return 0.0
    mods = dict(model.named_modules())
    num = den = 0.0
    for name, q in weights.items():
        w = mods[name].weight.detach().float()
        num += float(((q.dequantize(torch.float32).T - w) ** 2).sum())
        den += float((w**2).sum())
    return math.sqrt(num / den)


def _bytes_vs_fp16(arch, kept_json: str, info: dict) -> float:
    """Decoder-layer weight bytes a step reads in this format and sparsity, against dense fp16.

    From the kept fractions by site (averaged over layers) and the independence estimate of
    the scale groups touched (:func:`dejavu_lab.step_bytes.groups_touched`); a mixed-group
    format counts its smallest group (the most scale bytes).
    """
    kept = json.loads(kept_json)
    kw = {}
    if info["groups"]:
        kw["int4_group"] = min(int(g) for g in info["groups"].split("/"))
        kw["scale_esize"] = torch.finfo(getattr(torch, info["scale_dtype"])).bits // 8
    b = step_bytes(arch, vocab=0, context=0, site_kept=kept, **kw)
    dense = step_bytes(arch, vocab=0, context=0, site_kept={})
    return (b["attention"] + b["mlp"]) / (dense["attention"] + dense["mlp"])


def quant_frontier(
    model,
    tokenizer,
    formats: Sequence[str] = FORMATS,
    variants: Sequence[str] = tuple(VARIANTS),
    sparsities: Sequence[float] = SPARSITIES,
    *,
    sparse_formats: Sequence[str] | None = None,
    gguf: str | os.PathLike | GGUFFile | None = None,
    dtype: torch.dtype | None = None,
    eval_windows: int = 8,
    window: int = 512,
    progress: bool = False,
    **frontier_kwargs,
) -> pd.DataFrame:
    """One frontier (:func:`~dejavu_lab.sparsify.frontier.frontier`) per format, stacked.

    ``variants``: names of :data:`ALL_VARIANTS` (this module's and the frontier's).
    ``sparse_formats``: the formats that also run ``variants`` × ``sparsities`` (default: all);
    the others give their dense row only. Adds per row: ``format``, ``groups``, ``scale_dtype``,
    ``gguf_types``, ``weight_rel_err`` (:func:`weight_error`), ``bytes_vs_fp16`` (the decoder
    layers' weight bytes per step against dense fp16, :mod:`dejavu_lab.step_bytes`), and ``vs_fp_pct`` — perplexity
    against the ``"fp"`` row of the same variant and sparsity, in percent (the quality target
    reads it at TEAL 40%), when ``"fp"`` ran that row.

    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> df = quant_frontier(model, tok, ["fp", "rtn-g32"], ["cats"], [0.5], window=32,
    ...                     eval_windows=1, train_tokens=64, calibration_tokens=64)
    >>> df[["format", "variant", "groups", "vs_fp_pct"]].round(3)  # the demo IS Q4_1 at g=32
        format variant groups  vs_fp_pct
    0       fp   dense              0.0
    1       fp    cats              0.0
    2  rtn-g32   dense     32       0.0
    3  rtn-g32    cats     32       0.0
    """
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        raise QuantError(f"unknown variants {unknown}; choose from {', '.join(ALL_VARIANTS)}.")
    specs = {v: ALL_VARIANTS[v] for v in variants}
    arch = get_arch(model)
    sparse_formats = formats if sparse_formats is None else sparse_formats
    calibration = None
    if any(f.startswith("act-") for f in formats):  # the study's calibration text, not held out
        cut = {k: frontier_kwargs[k] for k in ("train_tokens", "calibration_tokens", "corpus",
                                                "calibration") if k in frontier_kwargs}  # fmt: skip
        calibration = study_windows(tokenizer, window=window, eval_windows=eval_windows,
                                    **cut)[0][:MOMENT_WINDOWS]  # fmt: skip
    frames = []
    for fmt in formats:
        t0 = time.perf_counter()
        weights, info = format_weights(model, fmt, gguf=gguf, dtype=dtype, arch=arch,
                                       calibration=calibration)  # fmt: skip
        err = weight_error(model, weights)
        swap = dequantized(model, weights) if weights is not None else nullcontext()
        with swap:
            df = frontier(
                model,
                tokenizer,
                specs if fmt in sparse_formats else {},
                sparsities,
                window=window,
                eval_windows=eval_windows,
                progress=progress,
                **frontier_kwargs,
            )
        df.insert(0, "format", fmt)
        for k, v in info.items():
            df[k] = v
        df["weight_rel_err"] = err
        df["bytes_vs_fp16"] = [_bytes_vs_fp16(arch, k, info) for k in df["kept"]]
        df["format_seconds"] = round(time.perf_counter() - t0, 1)
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    fp = out[out.format == "fp"].set_index(["variant", "sparsity"])["perplexity"]
    key = pd.MultiIndex.from_frame(out[["variant", "sparsity"]])
    out["vs_fp_pct"] = 100 * (out["perplexity"].to_numpy() / fp.reindex(key).to_numpy() - 1)
    out.attrs.update(frames[0].attrs)
    return out


def _gguf_title(gf: GGUFFile | None) -> str | None:
    """``general.name (file name)`` of a read GGUF file, None without one."""
    if gf is None:
        return None
    return f"{gf.metadata.get('general.name', '?')} ({os.path.basename(gf.path)})"


def gguf_source(spec: str):
    """Where the 'gguf' format reads the blocks of model ``spec``: the pinned asset of the demo
    model or of a named checkpoint (fetched and verified on use), the GGUF file a path names,
    or None (a model that is not a GGUF: the format is refused in one sentence).

    >>> from dejavu_lab.models import NAMED
    >>> gguf_source("qwen2.5-0.5b").filename == NAMED["qwen2.5-0.5b"]
    True
    >>> gguf_source("demo").filename.endswith(".gguf"), gguf_source("facebook/opt-125m")
    (True, None)
    """
    from .. import assets
    from ..models import DEMO_ASSET, NAMED, gguf_file

    if spec == "demo":
        return assets.ASSETS[DEMO_ASSET]
    if spec in NAMED:
        return assets.ASSETS[NAMED[spec]]
    return gguf_file(spec)


def main(argv: list[str] | None = None) -> int:
    """``python -m dejavu_lab.measure.quant_quality``: run the study; print it or record it.

    >>> import contextlib, io
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stdout(out):
    ...     rc = main(["--formats", "fp", "rtn-g64", "--variants", "cats", "--sparsities", "0.5",
    ...                "--window", "32", "--eval-windows", "1", "--calibration-tokens", "64"])
    >>> rc, out.getvalue().split()[:6]
    (0, ['format', 'variant', 'sparsity', 'perplexity', 'vs_fp_pct', 'bytes_vs_fp16'])
    """
    ap = argparse.ArgumentParser(prog="python -m dejavu_lab.measure.quant_quality")
    ap.add_argument("--model", default="demo",
                    help="'demo', a named checkpoint (qwen2.5-0.5b, qwen2.5-1.5b) or a GGUF file")  # fmt: skip
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    forms = f"{', '.join(FORMATS)}; a rounding format may end in '+head'"
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS + HEAD_FORMATS,
                    metavar="FORMAT", help=forms)  # fmt: skip
    ap.add_argument("--sparse-formats", nargs="+", default=None, choices=FORMATS + HEAD_FORMATS,
                    metavar="FORMAT", help="the formats that also run the variants (default: all)")  # fmt: skip
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(ALL_VARIANTS))
    ap.add_argument("--sparsities", nargs="+", type=float, default=list(SPARSITIES))
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calibration-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--record", default=None, help="save to results/<RECORD>.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from .. import assets
    from ..models import DEMO_NAME, load_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tok, _ = load_model(args.model, dtype=dtype)
    source = gguf_source(args.model)
    gguf = assets.fetch(source) if isinstance(source, assets.Asset | assets.SplitAsset) else source
    gguf = read_gguf(gguf) if gguf is not None else None  # its header read once: import, title
    kw = {}
    if args.calibration_tokens:
        kw["calibration_tokens"] = args.calibration_tokens
    df = quant_frontier(
        model, tok, args.formats, args.variants, args.sparsities,
        sparse_formats=args.sparse_formats, gguf=gguf, eval_windows=args.eval_windows,
        window=args.window, **kw,
    )  # fmt: skip
    cols = ["format", "variant", "sparsity", "perplexity", "vs_fp_pct", "bytes_vs_fp16"]
    print(df[cols].to_string(index=False, float_format="%.3f"))
    if args.record:
        from .. import results

        name = DEMO_NAME if args.model == "demo" else _gguf_title(gguf) or str(args.model)
        extra = {
            "model": name,
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "corpus": "demo",
            "text": "chapter 40's cut: held-out windows after the 8192 training tokens",
            "tokens": df.attrs["tokens"],
            "calibration_tokens": df.attrs["calibration_tokens"],
            "threads": args.threads,
        }
        command = "python -m dejavu_lab.measure.quant_quality " + " ".join(argv or sys.argv[1:])
        print(results.save(args.record, df.to_dict("records"), command=command, extra=extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
