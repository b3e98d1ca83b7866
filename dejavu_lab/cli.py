"""``dejavu-lab``: collect activations, train and evaluate DejaVu predictors, measure perplexity.

::

    dejavu-lab perplexity --model demo --corpus demo --window 512
    dejavu-lab perplexity --model demo --mlp-sparsity 0.5 --head-sparsity 0.3 --mode oracle
    dejavu-lab collect --model demo --max-tokens 8192            # resumable; prints the folder
    dejavu-lab train-predictors --model demo --mode both         # collects first if needed
    dejavu-lab eval --model demo --predictors P.safetensors --mlp-sparsity 0.5

Every subcommand prints its result on stdout, progress bars on stderr, and on a bad input one
line ``dejavu-lab: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import sys
import time
from pathlib import Path

__all__ = ["main", "parser"]


class _Parser(argparse.ArgumentParser):
    """An argument error is one line ``dejavu-lab: error: ...`` and exit status 2, as any other."""

    def error(self, message: str):
        if not message.endswith("."):  # argparse's own words: say where the usage is
            message += f"; run `{self.prog} --help` for the options."
        self.exit(2, f"dejavu-lab: error: {message}\n")


def _budget(what: str, per_layer: bool = True):
    """An argparse ``type=`` for the sparsity ``what``, checked while parsing (no model loaded).

    A number in [0, 1) or, with ``per_layer``, comma-separated numbers each in [0, 1); whether
    their count matches the model's layers is checked once the model has loaded.
    """

    def parse(text: str):
        parts = [p for p in text.split(",") if p.strip()] if per_layer else [text]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if not values:
            extra = " or a comma-separated list" if per_layer else ""
            raise argparse.ArgumentTypeError(
                f"expected a number in [0, 1){extra}, got {text!r}; pass e.g. 0.5."
            )
        from .sparsify import budgets

        try:
            budgets(values, len(values), what)  # each in [0, 1), one sentence if not
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{str(e).rstrip('.')}; pass e.g. 0.5.") from None
        return values[0] if len(values) == 1 else values

    return parse


def _count(minimum: int, what: str = ""):
    """An argparse ``type=`` for a whole number >= ``minimum`` (``--epochs 0`` fails here)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}{what}, got {text!r}; pass e.g. {minimum}."
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be at least {minimum}{what}, got {value}; pass {minimum} or more."
            )
        return value

    return parse


def _corpus(text: str) -> str:
    from .corpus import CORPORA

    if text not in CORPORA:
        raise argparse.ArgumentTypeError(
            f"unknown corpus {text!r}; choose one of {', '.join(CORPORA)}."
        )
    return text


def _layers(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices, got {text!r}; pass e.g. 0,1."
        ) from None


def _common(p: argparse.ArgumentParser, corpus: bool = True) -> None:
    p.add_argument("--model", default="demo", help="'demo', a Hugging Face id or a local folder")
    if corpus:
        p.add_argument("--corpus", type=_corpus, default="demo", help="demo, wikitext-2 or c4")
        p.add_argument("--window", type=_count(2, " tokens"), default=512, help="tokens per window")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _sparsity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mlp-sparsity", type=_budget("mlp_sparsity"), default=0.0, help="neurons removed"
    )
    p.add_argument(
        "--head-sparsity", type=_budget("head_sparsity"), default=0.0, help="heads removed"
    )
    p.add_argument("--dense-layers", type=_layers, default=[], help="e.g. 0,1 (left dense)")


def parser() -> argparse.ArgumentParser:
    """The ``dejavu-lab`` argument parser; budgets are checked here, before any model loads.

    >>> args = parser().parse_args("eval --predictors p.safetensors --mlp-sparsity 0.8".split())
    >>> args.command, args.mlp_sparsity, args.head_sparsity
    ('eval', 0.8, 0.3)
    >>> parser().parse_args("perplexity --head-sparsity 0.5,0.25".split()).head_sparsity
    [0.5, 0.25]
    """
    ap = _Parser(
        prog="dejavu-lab", description="Contextual sparsity (Deja Vu, ICML 2023) on HF models."
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("perplexity", help="perplexity on a corpus, dense or sparsified")
    _common(p)
    p.add_argument("--max-windows", type=_count(1), default=None, help="cap on windows evaluated")
    p.add_argument(
        "--skip-windows", type=_count(0), default=0, help="start after this many windows"
    )
    _sparsity_args(p)
    p.add_argument("--mode", choices=["oracle", "static", "predicted"], default="oracle")
    p.add_argument("--predictors", type=Path, help="predictor file (--mode predicted)")
    p.add_argument(
        "--static-windows", type=_count(1), default=4, help="calibration windows (static)"
    )

    p = sub.add_parser("collect", help="stream per-layer predictor training data to disk")
    _common(p)
    p.add_argument("--max-tokens", type=_count(2), default=8192, help="cap on collected tokens")
    p.add_argument(
        "--mlp-label-sparsity",
        type=_budget("mlp_label_sparsity", per_layer=False),
        default=0.5,
        help="gated MLP labels",
    )
    p.add_argument("--out", type=Path, default=None, help="folder (default: the cache)")

    p = sub.add_parser("train-predictors", help="train DejaVu predictors (collects if needed)")
    _common(p)
    p.add_argument("--collection", type=Path, help="a folder from `collect` (default: cached)")
    p.add_argument("--max-tokens", type=_count(2), default=8192, help="tokens to collect if needed")
    p.add_argument("--mode", choices=["same", "lookahead", "both"], default="both")
    p.add_argument("--mlp-rank", type=_count(1), default=64)
    p.add_argument("--head-rank", type=_count(1), default=32)
    p.add_argument("--epochs", type=_count(1), default=8)
    p.add_argument("--out", type=Path, default=None, help="file (one mode) or folder")

    p = sub.add_parser("eval", help="per-layer recall/precision/mass of trained predictors")
    _common(p)
    p.add_argument("--predictors", type=Path, nargs="+", required=True)
    p.add_argument("--mlp-sparsity", type=_budget("mlp_sparsity", per_layer=False), default=0.5)
    p.add_argument("--head-sparsity", type=_budget("head_sparsity", per_layer=False), default=0.3)
    p.add_argument("--windows", type=_count(1), default=2, help="held-out windows to evaluate on")
    p.add_argument("--skip-windows", type=_count(0), default=16, help="skip the training windows")
    p.add_argument("--per-layer", action="store_true", help="print every layer's row")
    return ap


def _load(args):
    from .models import load_model

    return load_model(args.model)


def _windows(args, tokenizer, n: int | None, skip: int = 0):
    from .corpus import load_text, token_windows

    if tokenizer is None:
        raise ValueError(
            f"Model {args.model!r} has no tokenizer, so it cannot read a corpus; "
            "use 'demo', a Hugging Face id or a folder with tokenizer files."
        )
    total = None if n is None else n + skip
    w = token_windows(tokenizer, load_text(args.corpus), args.window, total)[skip:]
    if w.shape[0] == 0:
        from .corpus import CorpusError

        raise CorpusError(
            f"The corpus has no {args.window}-token windows left after skipping {skip}; "
            "skip fewer windows or use a smaller --window."
        )
    return w


def cmd_perplexity(args) -> None:
    """``dejavu-lab perplexity``: print the perplexity on the corpus, dense or sparsified.

    >>> cmd_perplexity(parser().parse_args(
    ...     "perplexity --window 8 --max-windows 1 --mlp-sparsity 0.5 --no-progress".split()))
    200.2
    """
    from .sparsify import sparse_perplexity, static_sets

    model, tok, arch = _load(args)
    windows = _windows(args, tok, args.max_windows, args.skip_windows)
    kw = dict(
        mlp_sparsity=args.mlp_sparsity,
        head_sparsity=args.head_sparsity,
        dense_layers=args.dense_layers,
        mode=args.mode,
    )
    if args.mode == "predicted":
        from .predictors import load_predictors

        if args.predictors is None:
            raise ValueError("--mode predicted needs --predictors FILE (see train-predictors).")
        kw["predictors"] = load_predictors(args.predictors, model, arch)
    if args.mode == "static":
        calib = _windows(args, tok, args.static_windows)
        kw["static"] = static_sets(
            model, calib, mlp_sparsity=args.mlp_sparsity, head_sparsity=args.head_sparsity
        )
    ppl = sparse_perplexity(model, windows, progress=not args.no_progress, **kw)
    print(f"{ppl:.4f}")


def cmd_collect(args) -> None:
    """``dejavu-lab collect``: collect predictor training data and print its folder.

    >>> import os, tempfile
    >>> out = tempfile.mkdtemp()
    >>> cmd_collect(parser().parse_args(
    ...     f"collect --window 8 --max-tokens 16 --out {out} --no-progress".split()))
    /...
    >>> sorted(os.listdir(out))
    ['chunk_00000.safetensors', 'chunk_00001.safetensors', 'manifest.json']
    """
    from .collect import CollectConfig, collect

    model, tok, arch = _load(args)
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
    from .collect import CollectConfig, collect, open_collection
    from .predictors import PredictorConfig, default_path, train_predictors

    model, tok, arch = _load(args)
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
    from .predictors import evaluate, load_predictors

    model, tok, arch = _load(args)
    preds = [load_predictors(p, model, arch) for p in args.predictors]
    windows = _windows(args, tok, args.windows, args.skip_windows)
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


COMMANDS = {
    "perplexity": cmd_perplexity,
    "collect": cmd_collect,
    "train-predictors": cmd_train,
    "eval": cmd_eval,
}


def main(argv: list[str] | None = None) -> int:
    """Run ``dejavu-lab`` with ``argv`` (default: the command line); return the exit status.

    A bad budget or count fails while parsing, before any model loads, and every other bad
    input (a model, a file, a collection, a full or read-only disk) where it is found: one line
    ``dejavu-lab: error: ...`` on stderr and status 2, never a traceback. Ctrl-C is one line
    and status 130 (an interrupted ``collect`` resumes when rerun).

    >>> import contextlib, sys
    >>> with contextlib.redirect_stderr(sys.stdout):
    ...     main(["eval", "--predictors", "p.safetensors", "--mlp-sparsity", "1.0"])
    dejavu-lab: error: argument --mlp-sparsity: mlp_sparsity must be in [0, 1) (the fraction ...
    2
    """
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2): argparse has printed why
        return e.code or 0
    from transformers.utils import logging as hf_logging

    from .assets import AssetError
    from .results import ResultsError

    if args.no_progress:
        hf_logging.disable_progress_bar()

    try:
        COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("dejavu-lab: interrupted; rerun the same command to resume.", file=sys.stderr)
        return 130
    except (ValueError, OSError, KeyError, AssetError, ResultsError) as e:  # one sentence each
        print(f"dejavu-lab: error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def _one_line(e: BaseException) -> str:
    """The message of ``e`` on one line; a bare OSError from a library gets its path and a hint."""
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0]).splitlines()[0]
    if type(e) in (OSError, PermissionError, FileNotFoundError, IsADirectoryError) and e.errno:
        where = f" ({e.filename})" if e.filename else ""
        full = e.errno == errno.ENOSPC
        return f"{e.strerror}{where}; " + (
            "free space there or write somewhere else."
            if full
            else "check the path and its permissions."
        )
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
