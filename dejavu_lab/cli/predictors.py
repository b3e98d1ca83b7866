"""``dejavu-lab collect``, ``train-predictors`` and ``eval``: DejaVu's predictors from the command
line (data collection, training, recall; :mod:`dejavu_lab.collect`, :mod:`dejavu_lab.predictors`).

>>> import argparse
>>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
>>> add_parsers(sub)
>>> sorted(sub.choices)
['collect', 'eval', 'train-predictors']
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .args import budget, common_args, corpus_windows, count, load


def add_parsers(sub) -> None:
    """The three subcommands' options, on ``sub`` (an argparse subparsers object).

    >>> import argparse
    >>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> add_parsers(sub)
    >>> sub.choices["train-predictors"].parse_args(["--mode", "same"]).mode
    'same'
    """
    p = sub.add_parser("collect", help="stream per-layer predictor training data to disk")
    common_args(p)
    p.add_argument("--max-tokens", type=count(2), default=8192, help="cap on collected tokens")
    p.add_argument(
        "--mlp-label-sparsity",
        type=budget("mlp_label_sparsity", per_layer=False),
        default=0.5,
        help="gated MLP labels",
    )
    p.add_argument("--out", type=Path, default=None, help="folder (default: the cache)")

    p = sub.add_parser("train-predictors", help="train DejaVu predictors (collects if needed)")
    common_args(p)
    p.add_argument("--collection", type=Path, help="a folder from `collect` (default: cached)")
    p.add_argument("--max-tokens", type=count(2), default=8192, help="tokens to collect if needed")
    p.add_argument("--mode", choices=["same", "lookahead", "both"], default="both")
    p.add_argument("--mlp-rank", type=count(1), default=64)
    p.add_argument("--head-rank", type=count(1), default=32)
    p.add_argument("--epochs", type=count(1), default=8)
    p.add_argument("--out", type=Path, default=None, help="file (one mode) or folder")

    p = sub.add_parser("eval", help="per-layer recall/precision/mass of trained predictors")
    common_args(p)
    p.add_argument("--predictors", type=Path, nargs="+", required=True)
    p.add_argument("--mlp-sparsity", type=budget("mlp_sparsity", per_layer=False), default=0.5)
    p.add_argument("--head-sparsity", type=budget("head_sparsity", per_layer=False), default=0.3)
    p.add_argument("--windows", type=count(1), default=2, help="held-out windows to evaluate on")
    p.add_argument("--skip-windows", type=count(0), default=16, help="skip the training windows")
    p.add_argument("--per-layer", action="store_true", help="print every layer's row")


def cmd_collect(args) -> None:
    """``dejavu-lab collect``: collect predictor training data and print its folder.

    >>> from dejavu_lab.cli.main import parser
    >>> import os, tempfile
    >>> out = tempfile.mkdtemp()
    >>> cmd_collect(parser().parse_args(
    ...     f"collect --window 8 --max-tokens 16 --out {out} --no-progress".split()))
    /...
    >>> sorted(os.listdir(out))
    ['chunk_00000.safetensors', 'chunk_00001.safetensors', 'manifest.json']
    """
    from ..collect import CollectConfig, collect

    model, tok, arch = load(args)
    cfg = CollectConfig(
        corpus=args.corpus,
        window=args.window,
        max_tokens=args.max_tokens,
        mlp_label_sparsity=args.mlp_label_sparsity,
    )
    col = collect(model, tok, cfg, args.out, arch=arch, progress=not args.no_progress)
    print(col.path)


def cmd_train(args) -> None:
    """``dejavu-lab train-predictors``: train, save and print each mode's file and recall.

    >>> from dejavu_lab.cli.main import parser
    >>> import tempfile, torch
    >>> from dejavu_lab.collect import CollectConfig, collect
    >>> from dejavu_lab.models import random_model
    >>> tmp = tempfile.mkdtemp()
    >>> _ = collect(random_model("tiny-llama").model, None, CollectConfig(window=8, max_tokens=32),
    ...             f"{tmp}/col", windows=torch.randint(0, 128, (4, 8)), progress=False)
    >>> cmd_train(parser().parse_args(["train-predictors", "--model", "random:tiny-llama",
    ...     "--collection", f"{tmp}/col", "--mode", "same", "--out", f"{tmp}/p.safetensors"]))
    same: /.../p.safetensors  mean validation recall: MLP ..., heads ...
    """
    from ..collect import CollectConfig, collect, open_collection
    from ..predictors import PredictorConfig, default_path, train_predictors

    model, tok, arch = load(args)
    cfg_c = CollectConfig(corpus=args.corpus, window=args.window, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    if args.collection is not None:
        col = open_collection(args.collection, model, arch)  # from this model, or one sentence
    else:
        col = collect(model, tok, cfg_c, arch=arch, progress=not args.no_progress)
    t1 = time.perf_counter()
    modes = ["same", "lookahead"] if args.mode == "both" else [args.mode]
    for mode in modes:
        cfg = PredictorConfig(
            mode=mode, mlp_rank=args.mlp_rank, head_rank=args.head_rank, epochs=args.epochs
        )
        pred = train_predictors(col, cfg, progress=not args.no_progress)
        if args.out is None:
            path = default_path(col.manifest["fingerprint"], col, cfg)  # keyed by what trained
        elif len(modes) == 1 and args.out.suffix == ".safetensors":
            path = args.out
        else:
            path = args.out / f"predictors-{mode}.safetensors"
        pred.save(path)
        recall = {
            k: sum(h["val_recall"] for h in pred.history if h["kind"] == k) / arch.n_layers
            for k in ("mlp", "heads")
        }
        print(
            f"{mode}: {path}  mean validation recall: MLP {recall['mlp']:.3f}, "
            f"heads {recall['heads']:.3f}"
        )
    print(
        f"collection {t1 - t0:.0f} s, training {time.perf_counter() - t1:.0f} s",
        file=sys.stderr,
    )


def cmd_eval(args) -> None:
    """``dejavu-lab eval``: print the mean recall, precision and mass kept per mode and kind.

    >>> from dejavu_lab.cli.main import parser
    >>> import tempfile
    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import load_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> p = Predictors(fingerprint(load_model("demo").model), PredictorConfig()).save(
    ...     f"{tempfile.mkdtemp()}/p.safetensors")  # untrained: shows the table only
    >>> cmd_eval(parser().parse_args(f"eval --predictors {p} --window 8 --windows 1".split()))
                     recall  precision  mass_kept  oracle_mass
    mode      kind
    lookahead heads  ...
              mlp    ...
    """
    from ..predictors import evaluate, load_predictors

    model, tok, arch = load(args)
    preds = [load_predictors(p, model, arch) for p in args.predictors]
    windows = corpus_windows(args, tok, args.windows, args.skip_windows)
    df = evaluate(
        model,
        windows,
        preds,
        mlp_sparsity=args.mlp_sparsity,
        head_sparsity=args.head_sparsity,
        arch=arch,
        progress=not args.no_progress,
    )
    cols = ["recall", "precision", "mass_kept", "oracle_mass"]
    if args.per_layer:
        print(df.to_string(index=False, float_format="%.3f"))
    else:
        print(df.groupby(["mode", "kind"])[cols].mean().to_string(float_format="%.3f"))
