"""The paper's observations (Deja Vu §3.1–3.3, App. C.1) as a few numbers per model, recorded.

The observation chapters measure, live on the demo model: MLP and head sparsity at +1% / +10%
perplexity, contextual (oracle) and static (chapter 10, §3.1 Fig. 3); the median cosine of
consecutive layers' residual states and the median ‖X‖/‖F(X)‖ (chapter 20, §3.3 Fig. 5); the
Spearman correlation of a head's attention entropy with its output norm (chapter 30, §3.2);
the MLP union sparsity of a batch of 32 sequences (chapter 35, App. C.1). This module computes
the same numbers with the same functions and settings for any loaded model:

- the ``*_quantities`` functions turn what a chapter measures (a sweep, the cosine and norm
  tables, the per-head table, the union table) into named scalars — the chapters call them on
  their live frames, the recorder on its own, so both say the same thing the same way;
- :func:`measure_stage` runs one chapter's measurement at :class:`Sizes`;
- :func:`record` runs every stage for one model and writes ``results/<name>.json`` after each
  stage (atomically, :func:`dejavu_lab.results.save`), so a killed run resumes at the stage it
  was in.

From a shell — the recorded runs (bf16 for Qwen, one CPU thread)::

    python -m dejavu_lab.measure.observations --model demo --record observations_demo
    python -m dejavu_lab.measure.observations --model qwen2.5-1.5b --dtype bfloat16 \\
        --record observations_qwen2.5-1.5b

Each row of the recording is one quantity: ``stage``, ``name``, ``value`` (plus ``bracketed``
for a sparsity read off a perplexity curve, False where the curve never crossed the rise), or
one point of the perplexity sweep (``name = "ppl"`` with ``target``, ``mode``, ``sparsity``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields

import pandas as pd
import torch
from scipy.stats import spearmanr

from .. import results
from ..arch import Arch, get_arch
from ..corpus import load_text, token_windows
from .embeddings import layer_cosine, residual_norms
from .heads import classify_heads, head_stats
from .quality import perplexity_sweep, sparsity_at_rise
from .sparsity import contextual_sparsity
from .union import token_scores, union_sparsity

__all__ = [
    "STAGES",
    "STAGE_SIZES",
    "Sizes",
    "embedding_quantities",
    "head_levels",
    "head_quantities",
    "main",
    "measure_stage",
    "record",
    "sparsity_quantities",
    "sweep_quantities",
    "union_quantities",
]

# stage -> the chapter whose numbers it reproduces
STAGES = {
    "sparsity": "10_contextual_sparsity",
    "sweep": "10_contextual_sparsity",
    "embeddings": "20_slowly_changing_embeddings",
    "heads": "30_mean_shift_heads",
    "union": "35_union_sparsity",
}


# stage -> the sizes it depends on (a recording keeps a finished stage while these stay put)
STAGE_SIZES = {
    "sparsity": ("window", "eval_windows", "mass"),
    "sweep": ("window", "eval_windows", "calib_windows", "mlp_levels", "head_fractions"),
    "embeddings": ("window", "embed_windows"),
    "heads": ("window", "head_windows"),
    "union": ("union_window", "union_windows", "union_positions", "union_min_pos",
              "union_batches", "union_draws", "union_keep", "mass"),
}  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """How much text each stage reads; the defaults are the chapters' full (book) sizes.

    >>> Sizes().window, Sizes(eval_windows=4).eval_windows, Sizes().union_batches[-1]
    (256, 4, 32)
    """

    window: int = 256  # tokens per window (chapters 10, 20, 30)
    eval_windows: int = 2  # chapter 10: evaluated windows, from the start of the demo corpus
    calib_windows: int = 2  # chapter 10: windows from the corpus's end that choose static sets
    embed_windows: int = 4  # chapter 20: windows for the cosines and norms
    head_windows: int = 2  # chapter 30: windows for the head statistics
    mass: float = 0.9  # "active": fewest units holding this share of the mass (ch. 10, 35)
    mlp_levels: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)  # chapter 10's MLP sweep
    head_fractions: tuple[float, ...] = (1 / 9, 2 / 9, 4 / 9, 6 / 9)  # rounded to whole heads
    union_window: int = 64  # chapter 35: tokens per sequence
    union_windows: int = 64  # chapter 35: sequences to draw batches from
    union_positions: int = 4  # sampled decoding positions per sequence
    union_min_pos: int = 24  # positions sampled at or after this
    union_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # the paper's batch sizes (plus 1)
    union_draws: int = 48  # random batches per batch size
    union_keep: float = 0.1  # each token's top 10% of MLP neurons (the paper's regime)


def head_levels(fractions, n_heads: int) -> tuple[float, ...]:
    """Head sparsities as whole heads: each fraction rounded to ``k / n_heads``, k ≥ 1, distinct.

    >>> head_levels((1 / 9, 2 / 9, 4 / 9, 6 / 9), 9) == (1 / 9, 2 / 9, 4 / 9, 6 / 9)
    True
    >>> [round(12 * s) for s in head_levels((1 / 9, 2 / 9, 4 / 9, 6 / 9), 12)]
    [1, 3, 5, 8]
    """
    ks = sorted({min(n_heads - 1, max(1, round(f * n_heads))) for f in fractions})
    return tuple(k / n_heads for k in ks)


def sparsity_quantities(sp: pd.DataFrame) -> dict[str, float]:
    """Median per-token sparsity of MLP neurons and heads, from
    :func:`~dejavu_lab.measure.contextual_sparsity` (chapter 10's first table).

    >>> sparsity_quantities(pd.DataFrame({"block": ["mlp", "mlp", "heads"],
    ...                                   "sparsity": [0.4, 0.6, 0.1]}))
    {'mlp_token_sparsity': 0.5, 'heads_token_sparsity': 0.1}
    """
    med = sp.groupby("block")["sparsity"].median()
    return {"mlp_token_sparsity": float(med["mlp"]), "heads_token_sparsity": float(med["heads"])}


def sweep_quantities(sweep: pd.DataFrame, rises=(0.01, 0.10)) -> dict[str, tuple[float, bool]]:
    """``{target}_rise{NN}_{mode}`` → (sparsity at that perplexity rise, bracketed), read off a
    :func:`~dejavu_lab.measure.perplexity_sweep` by :func:`~dejavu_lab.measure.sparsity_at_rise`.

    >>> sweep = pd.DataFrame({"target": "mlp", "mode": "oracle", "sparsity": [0.5, 0.8],
    ...                       "rise": [0.0, 0.2]})
    >>> sweep_quantities(sweep, rises=(0.10,))
    {'mlp_rise10_oracle': (0.65, True)}
    """
    at = sparsity_at_rise(sweep, rises)
    return {
        f"{r.target}_rise{round(100 * r.rise):02d}_{r.mode}": (float(r.sparsity), bool(r.bracketed))
        for r in at.itertuples()
    }


def embedding_quantities(cos: pd.DataFrame, norms: pd.DataFrame) -> dict[str, float]:
    """Chapter 20's medians over tokens and layers l ≥ 1: cosine of consecutive layers (and at
    each larger gap), ‖X‖/‖F(X)‖ for attention and for the MLP.

    ``cos``: :func:`~dejavu_lab.measure.layer_cosine`; ``norms``:
    :func:`~dejavu_lab.measure.residual_norms`.

    >>> cos = pd.DataFrame({"gap": [1, 1, 1, 2], "layer": [0, 1, 2, 1],
    ...                     "cosine": [0.1, 0.9, 0.95, 0.8]})
    >>> norms = pd.DataFrame({"block": ["attn", "mlp", "mlp"], "layer": [1, 0, 1],
    ...                       "ratio": [5.0, 0.1, 3.0]})
    >>> embedding_quantities(cos, norms)
    {'cos_consecutive': 0.925, 'cos_gap2': 0.8, 'norm_ratio_attn': 5.0, 'norm_ratio_mlp': 3.0}
    """
    later = cos[cos["layer"] >= 1]
    out = {"cos_consecutive": float(later[later["gap"] == 1]["cosine"].median())}
    for gap in sorted(set(later["gap"]) - {1}):
        out[f"cos_gap{gap}"] = float(later[later["gap"] == gap]["cosine"].median())
    n = norms[norms["layer"] >= 1]
    for block in ("attn", "mlp"):
        out[f"norm_ratio_{block}"] = float(n[n["block"] == block]["ratio"].median())
    return out


def head_quantities(heads: pd.DataFrame) -> dict[str, float]:
    """Chapter 30's numbers from :func:`~dejavu_lab.measure.classify_heads`: Spearman ρ of mean
    attention entropy against mean relative output norm over heads, and each kind's share.

    >>> heads = pd.DataFrame({"entropy": [0.2, 0.5, 0.9], "rel_norm": [0.5, 1.0, 1.5],
    ...                       "kind": ["sink", "heavy-hitter", "uniform-mixing"]})
    >>> head_quantities(heads)["rho_entropy_norm"]
    1.0
    """
    out = {"rho_entropy_norm": float(spearmanr(heads["entropy"], heads["rel_norm"]).statistic)}
    share = heads["kind"].value_counts(normalize=True)
    for kind in ("sink", "uniform-mixing", "heavy-hitter"):
        out[f"share_{kind.replace('-', '_')}"] = float(share.get(kind, 0.0))
    return out


def union_quantities(union: pd.DataFrame, batch: int, prefix: str) -> dict[str, float]:
    """Union sparsity at ``batch`` (mean over draws, then over layers) and what uniform random
    active sets of the same per-token density would leave, per block, from
    :func:`~dejavu_lab.measure.union_sparsity`; keys ``{prefix}_{block}`` and
    ``{prefix}_{block}_uniform``.

    >>> union = pd.DataFrame({"block": "mlp", "layer": [0, 0, 1], "batch_size": 32,
    ...                       "draw": [0, 1, 0], "union_sparsity": [0.1, 0.3, 0.4],
    ...                       "uniform": [0.0, 0.0, 0.1]})
    >>> union_quantities(union, 32, "union_top10")
    {'union_top10_mlp': 0.3, 'union_top10_mlp_uniform': 0.05}
    """
    at = union[union["batch_size"] == batch]
    per_layer = at.groupby(["block", "layer"])[["union_sparsity", "uniform"]].mean()
    out = {}
    for block, g in per_layer.groupby(level="block", sort=False):
        out[f"{prefix}_{block}"] = round(float(g["union_sparsity"].mean()), 12)
        out[f"{prefix}_{block}_uniform"] = round(float(g["uniform"].mean()), 12)
    return out


def _windows(tokenizer, window: int, n: int | None = None) -> torch.Tensor:
    return token_windows(tokenizer, load_text("demo"), window=window, max_windows=n)


def measure_stage(model, tokenizer, stage: str, sizes: Sizes = Sizes(), *,
                  arch: Arch | None = None) -> list[dict]:  # fmt: skip
    """Rows (``stage``, ``name``, ``value``, ...) of one stage of :data:`STAGES`, measured on
    the demo corpus at ``sizes`` with the chapter's functions and settings.

    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> rows = measure_stage(model, tok, "embeddings", Sizes(window=32, embed_windows=1))
    >>> [r["name"] for r in rows]
    ['cos_consecutive', 'cos_gap2', 'cos_gap4', 'cos_gap8', 'norm_ratio_attn', 'norm_ratio_mlp']
    """
    arch = arch or get_arch(model)
    s = sizes
    if stage == "sparsity":
        evalw = _windows(tokenizer, s.window)[: s.eval_windows]
        q = sparsity_quantities(contextual_sparsity(model, evalw, mass=s.mass, arch=arch))
    elif stage == "sweep":
        windows = _windows(tokenizer, s.window)
        evalw, calib = windows[: s.eval_windows], windows[-s.calib_windows :]
        sweep = perplexity_sweep(model, evalw, calib=calib, mlp=s.mlp_levels, arch=arch,
                                 heads=head_levels(s.head_fractions, arch.n_heads),
                                 modes=("oracle", "static"))  # fmt: skip
        rows = [{"stage": stage, "name": "dense_ppl", "value": float(sweep["dense_ppl"].iloc[0])}]
        rows += [{"stage": stage, "name": k, "value": v, "bracketed": b}
                 for k, (v, b) in sweep_quantities(sweep).items()]  # fmt: skip
        rows += [{"stage": stage, "name": "ppl", "value": float(r.ppl), "target": r.target,
                  "mode": r.mode, "sparsity": float(r.sparsity)}
                 for r in sweep.itertuples()]  # fmt: skip
        return rows
    elif stage == "embeddings":
        windows = _windows(tokenizer, s.window, s.embed_windows)
        q = embedding_quantities(
            layer_cosine(model, windows, gaps=(1, 2, 4, 8), arch=arch),
            residual_norms(model, windows, arch=arch),
        )
    elif stage == "heads":
        windows = _windows(tokenizer, s.window, s.head_windows)
        q = head_quantities(classify_heads(head_stats(model, windows, arch=arch)))
    elif stage == "union":
        windows = _windows(tokenizer, s.union_window, s.union_windows)
        scores = token_scores(model, windows, positions=s.union_positions,
                              min_pos=s.union_min_pos, batch_size=8, arch=arch)  # fmt: skip
        batches = tuple(b for b in s.union_batches if b <= windows.shape[0])  # as chapter 35
        q = {"union_batch": max(batches)}  # the largest batch: the one quoted
        for prefix, sets in (
            ("union_top10", scores.active("topk", keep=s.union_keep, head_mass=s.mass)),
            ("union_mass90", scores.active(mass=s.mass, head_mass=s.mass)),
        ):  # all the batch sizes, so that the random draws are the chapter's
            union = union_sparsity(sets, batches, n_draws=s.union_draws)
            q |= union_quantities(union, max(batches), prefix)
        q.pop("union_top10_heads", None)  # heads: the mass criterion either way (counted once)
        q.pop("union_top10_heads_uniform", None)
    else:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}.")
    return [{"stage": stage, "name": k, "value": v} for k, v in q.items()]


def _sizes_dict(sizes: Sizes) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(sizes).items()}


def record(model, tokenizer, name: str, *, sizes: Sizes = Sizes(), stages=tuple(STAGES),
           command: str, extra: dict | None = None, progress: bool = True):  # fmt: skip
    """Measure each of ``stages`` and save ``results/<name>.json`` after each one; return the
    path. A file already there keeps each finished stage whose sizes (:data:`STAGE_SIZES`)
    are unchanged (resume) and measures the others again. ``extra`` (model name, dtype) joins
    the provenance, with the sizes, each stage's seconds and the commit each stage ran at.

    >>> import os, tempfile
    >>> from unittest import mock
    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> with mock.patch.dict(os.environ, {results.ENV_DIR: tempfile.mkdtemp()}):
    ...     path = record(model, tok, "obs", sizes=Sizes(window=32, head_windows=1),
    ...                   stages=("heads",), command="example", progress=False)
    ...     frame, prov = results.load(path)
    >>> frame["name"].tolist()[0], prov["sizes"]["head_windows"], sorted(prov["stage_seconds"])
    ('rho_entropy_norm', 1, ['heads'])
    """
    arch = get_arch(model)
    bad = [st for st in stages if st not in STAGES]
    if bad:
        raise ValueError(f"stages must be among {', '.join(STAGES)}, got {bad!r}.")
    want = _sizes_dict(sizes)
    rows: list[dict] = []
    seconds: dict[str, float] = {}
    commits: dict[str, str] = {}
    path = results.results_dir() / f"{name}.json"
    if path.is_file():
        old, prov = results.load(path)
        had = prov.get("sizes") or {}
        keep = {st for st in STAGES if all(had.get(k) == want[k] for k in STAGE_SIZES[st])}
        rows = [{k: v for k, v in r.items() if not _missing(v)}
                for r in old.to_dict("records") if r["stage"] in keep]  # fmt: skip
        seconds = {k: v for k, v in (prov.get("stage_seconds") or {}).items() if k in keep}
        commits = {k: v for k, v in (prov.get("stage_git_sha") or {}).items() if k in keep}
        commits |= {st: prov["git_sha"] for st in keep if st not in commits}
    done = {r["stage"] for r in rows}
    for stage in stages:
        if stage in done:
            if progress:
                print(f"{name}: {stage} already recorded", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        rows += measure_stage(model, tokenizer, stage, sizes, arch=arch)
        seconds[stage] = round(time.perf_counter() - t0, 1)
        commits[stage] = results.provenance("")["git_sha"]
        if progress:
            print(f"{name}: {stage} in {seconds[stage]:.0f} s", file=sys.stderr)
        info = {**(extra or {}), "sizes": want, "stage_seconds": seconds,
                "stage_git_sha": commits,
                "n_layers": arch.n_layers, "n_heads": arch.n_heads, "d_mlp": arch.d_mlp,
                "threads": torch.get_num_threads(), "corpus": "demo"}  # fmt: skip
        path = results.save(name, rows, command=command, extra=info)
    return path


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def main(argv: list[str] | None = None) -> int:
    """``python -m dejavu_lab.measure.observations``: record (or print) a model's observations.

    >>> import contextlib, io
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stdout(out):
    ...     rc = main(["--stages", "heads", "--window", "32", "--head-windows", "1"])
    >>> rc, out.getvalue().split()[:3]
    (0, ['stage', 'name', 'value'])
    """
    ap = argparse.ArgumentParser(prog="python -m dejavu_lab.measure.observations")
    ap.add_argument("--model", default="demo", help="load_model's spec: demo, qwen2.5-1.5b, ...")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    scalar = {"int": int, "float": float}
    for f in fields(Sizes):  # every scalar size is an option; the level lists stay the chapters'
        if f.type in scalar:
            ap.add_argument("--" + f.name.replace("_", "-"), type=scalar[f.type], default=f.default)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--record", default=None, help="save to results/<RECORD>.json (resumable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ..models import DEMO_NAME, NAMED, gguf_file, load_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tok, arch = load_model(args.model, dtype=dtype)
    sizes = Sizes(**{f.name: getattr(args, f.name) for f in fields(Sizes) if hasattr(args, f.name)})
    if args.record:
        gguf = gguf_file(args.model) if args.model not in NAMED else NAMED[args.model]
        extra = {
            "model": DEMO_NAME if args.model == "demo" else str(args.model),
            "model_file": str(getattr(gguf, "name", gguf)),
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        }
        command = "python -m dejavu_lab.measure.observations " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        path = record(model, tok, args.record, sizes=sizes, stages=args.stages,
                      command=command, extra=extra)  # fmt: skip
        frame, _ = results.load(path)
        print(path, file=sys.stderr)
    else:
        frame = pd.DataFrame(
            [r for st in args.stages for r in measure_stage(model, tok, st, sizes, arch=arch)]
        )
    print(frame[frame["name"] != "ppl"][["stage", "name", "value"]].to_string(index=False))
    print(json.dumps({"model": args.model, "sizes": _sizes_dict(sizes)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
