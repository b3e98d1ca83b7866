"""``dejavu-lab``: collect activations, train and evaluate DejaVu predictors, measure perplexity.

::

    dejavu-lab perplexity --model demo --corpus demo --window 512
    dejavu-lab perplexity --model demo --mlp-sparsity 0.5 --head-sparsity 0.3 --mode oracle
    dejavu-lab perplexity --model demo --method teal --sparsity 0.5 --json   # any method
    dejavu-lab collect --model demo --max-tokens 8192            # resumable; prints the folder
    dejavu-lab train-predictors --model demo --mode both         # collects first if needed
    dejavu-lab eval --model demo --predictors P.safetensors --mlp-sparsity 0.5
    dejavu-lab eval-tasks --model demo --method oracle --sparsity 0.5 --limit 50  # lm-eval

Every subcommand prints its result on stdout, progress bars on stderr, and on a bad input one
line ``dejavu-lab: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import sys
from pathlib import Path

from . import cli_predictors, cli_tasks
from .cli_args import (
    _budget,
    _check_text_files,
    _common,
    _count,
    _load,
    _Parser,
    _positive,
    _sparsity_args,
    _static_sets,
    _text_source,
    _windows,
)
from .vocab import METHODS

__all__ = ["main", "parser"]


METHOD_NAMES = tuple(METHODS)
TRAIN_TOKENS = 8192  # a corpus's first tokens are training text (chapter 40's predictors)
CALIBRATION_TOKENS = TRAIN_TOKENS  # thresholds calibrate on all of it (sparsify.frontier's too)


def _method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=METHOD_NAMES, default=None, help="sparsity method")
    p.add_argument(
        "--sparsity",
        type=_budget("sparsity"),
        default=None,
        help="fraction removed (0 = dense): heads and neurons (oracle, static, dejavu), "
        "bytes-weighted linear inputs (teal, wina), MLP neurons (cats)",
    )
    p.add_argument(
        "--calibration",
        type=_text_source,
        default=None,
        help="calibration text, a corpus name or a file (default: the corpus's first tokens)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=_positive("--calibration-tokens"),
        default=CALIBRATION_TOKENS,
        help=f"calibration tokens (thresholds, static sets; default {CALIBRATION_TOKENS}: the "
        "training text)",
    )
    p.add_argument(
        "--max-tokens", type=_positive("--max-tokens"), default=None, help="cap on evaluated tokens"
    )
    p.add_argument(
        "--allocation",
        choices=["uniform", "greedy"],
        default=None,
        help="teal/wina: spread over a layer's inputs (default greedy)",
    )
    p.add_argument(
        "--predictor-mode", choices=["same", "lookahead"], default="lookahead", help="dejavu"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


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
    _common(p, corpus=False)
    p.add_argument(
        "--corpus", type=_text_source, default="demo", help="demo, wikitext-2, c4 or a text file"
    )
    p.add_argument("--window", type=_count(2), default=512, help="tokens per window")
    p.add_argument("--max-windows", type=_count(1), default=None, help="cap on windows evaluated")
    p.add_argument(
        "--skip-windows",
        type=_count(0),
        default=None,
        help="start after this many windows (default 0; with --method and no other "
        f"--calibration text: the corpus's first {TRAIN_TOKENS} training tokens)",
    )
    _sparsity_args(p)
    _method_args(p)
    p.add_argument("--mode", choices=["oracle", "static", "predicted"], default="oracle")
    p.add_argument("--predictors", type=Path, help="predictor file (--mode predicted)")
    p.add_argument(
        "--static-windows", type=_count(1), default=4, help="calibration windows (static)"
    )

    cli_predictors.add_parsers(sub)
    cli_tasks.add_parser(sub)
    return ap


def cmd_perplexity(args) -> None:
    """``dejavu-lab perplexity``: print the perplexity on the corpus, dense or sparsified.

    Without ``--method`` the older options apply (``--mode``, ``--mlp-sparsity``,
    ``--head-sparsity``); with it, any method at ``--sparsity`` (:func:`_perplexity_method`).

    >>> cmd_perplexity(parser().parse_args(
    ...     "perplexity --window 8 --max-windows 1 --mlp-sparsity 0.5 --no-progress".split()))
    200.2
    """
    if args.window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {args.window}.")
    if args.method is not None:
        return _perplexity_method(args)
    if args.sparsity is not None or args.calibration is not None:
        raise ValueError("--sparsity and --calibration go with --method; pass --method too.")
    from .sparsify import sparse_eval, static_sets

    _check_text_files(args)
    model, tok, arch = _load(args)
    windows = _windows(args, tok, args.max_windows, args.skip_windows or 0)
    ms = 0.0 if args.mlp_sparsity is None else args.mlp_sparsity
    hs = 0.0 if args.head_sparsity is None else args.head_sparsity
    kw = dict(mlp_sparsity=ms, head_sparsity=hs, dense_layers=args.dense_layers, mode=args.mode)
    if args.mode == "predicted":
        from .predictors import load_predictors

        if args.predictors is None:
            raise ValueError("--mode predicted needs --predictors FILE (see train-predictors).")
        kw["predictors"] = load_predictors(args.predictors, model, arch)
    if args.mode == "static":
        calib = _windows(args, tok, args.static_windows)
        kw["static"] = static_sets(model, calib, mlp_sparsity=ms, head_sparsity=hs)
    r = sparse_eval(model, windows, progress=not args.no_progress, **kw)
    if args.json:
        out = {**_result_json(r, args, windows), "mode": args.mode}
        print(json.dumps(out))
    else:
        print(f"{r.perplexity:.4f}")


def _result_json(r, args, windows) -> dict:
    return {
        "perplexity": r.perplexity,
        "tokens": r.tokens,
        "method": r.method,
        "sparsity": r.sparsity,
        "bytes_per_token_fraction": r.bytes_per_token_fraction,
        "kept": r.kept,
        "model": args.model,
        "corpus": args.corpus,
        "window": args.window,
        "windows": int(windows.shape[0]),
    }


def _perplexity_method(args) -> None:
    """``perplexity --method M --sparsity S``: quality and bytes of any method, as JSON or text.

    The corpus's first 8192 tokens (``TRAIN_TOKENS``: chapter 40's training text) are
    training text: with no other ``--calibration``, calibration (thresholds, static sets, the
    predictors) reads its first ``--calibration-tokens`` and evaluation starts after it.

    >>> import contextlib, io, json
    >>> out = io.StringIO()
    >>> argv = ("perplexity --method cats --sparsity 0.5 --window 16 --max-tokens 16 "
    ...         "--calibration-tokens 32 --json --no-progress").split()
    >>> with contextlib.redirect_stdout(out):  # calibrates once, then reads the cache
    ...     cmd_perplexity(parser().parse_args(argv))
    >>> r = json.loads(out.getvalue())
    >>> r["method"], r["tokens"], r["sparsity"], round(r["bytes_per_token_fraction"], 1)
    ('cats', 16, 0.5, 0.7)
    """
    from .corpus import CorpusError
    from .sparsify import sparse_eval

    method = args.method
    sparsity = 0.0 if args.sparsity is None or method == "dense" else args.sparsity
    allocation = args.allocation or ("greedy" if method in ("teal", "wina") else "uniform")
    same_text = args.calibration is None or args.calibration == args.corpus
    calib_source = args.corpus if same_text else args.calibration
    if args.max_tokens is not None and args.max_tokens < args.window:
        raise ValueError(
            f"--max-tokens {args.max_tokens} is less than one window of {args.window} tokens."
        )
    train_windows = math.ceil(TRAIN_TOKENS / args.window)
    skip = args.skip_windows
    if skip is None:
        skip = train_windows if same_text else 0
    n_eval = None if args.max_tokens is None else args.max_tokens // args.window
    n_eval = args.max_windows if n_eval is None else n_eval
    _check_text_files(args)
    model, tok, arch = _load(args)
    try:
        windows = _windows(args, tok, n_eval, skip)
    except CorpusError:
        if not same_text or skip == 0 or args.skip_windows is not None:
            raise
        raise CorpusError(
            f"{args.corpus} has no {args.window}-token windows after its first {TRAIN_TOKENS} "
            "tokens, which are calibration text when --calibration is not given; pass "
            "--calibration demo (or another text) or a longer corpus."
        ) from None
    n_calib = max(1, math.ceil(args.calibration_tokens / args.window))
    kw: dict = dict(method=method, dense_layers=args.dense_layers)
    calib_info: dict = {}
    if method in ("oracle", "static", "dejavu"):
        kw["mlp_sparsity"] = sparsity if args.mlp_sparsity is None else args.mlp_sparsity
        kw["head_sparsity"] = sparsity if args.head_sparsity is None else args.head_sparsity
    elif method != "dense":
        kw["sparsity"] = sparsity
    if method in ("static", "teal", "cats", "wina"):
        calib = _windows(args, tok, n_calib, 0, source=calib_source)
        if same_text and n_calib > skip:
            raise ValueError(
                f"--calibration-tokens {args.calibration_tokens} overlap the evaluated text "
                f"(it starts after {skip} windows); calibrate on fewer tokens or another text."
            )
        calib_info = {"calibration": calib_source, "calibration_tokens": int(calib.numel())}
    if method == "static":
        kw["static"] = _static_sets(model, calib, kw, args)
    if method in ("teal", "cats", "wina"):
        from .sparsify import calibrate

        greedy = [method] if allocation == "greedy" and method != "cats" else []
        kw["thresholds"] = calibrate(
            model, calib, greedy=greedy, arch=arch, progress=not args.no_progress
        )
        kw["allocation"] = allocation
        calib_info["calibration_file"] = str(kw["thresholds"].path)
    if method == "dejavu":
        kw["predictors"] = _predictors(args, model, tok, arch, calib_source)
        calib_info = {"predictors": kw["predictors"].info.get("path")}
    r = sparse_eval(model, windows, progress=not args.no_progress, **kw)
    out = {**_result_json(r, args, windows), "sparsity": sparsity, "skip_windows": skip}
    if method in ("teal", "wina"):
        out["allocation"] = allocation
    out.update(calib_info)
    print(json.dumps(out) if args.json else f"{r.perplexity:.4f}")


def _predictors(args, model, tok, arch, source: str):
    """DejaVu predictors: ``--predictors FILE``, or trained once on the training text (cached)."""
    from .corpus import CORPORA
    from .predictors import PredictorConfig, get_or_train, load_predictors

    if args.predictors is not None:
        pred = load_predictors(args.predictors, model, arch)
        pred.info = {"path": str(args.predictors)}
        return pred
    if source not in CORPORA:
        raise ValueError(
            "--method dejavu trains its predictors on a named corpus; with a text file pass "
            "--predictors FILE (see `dejavu-lab train-predictors`)."
        )
    from .collect import CollectConfig

    cfg = CollectConfig(corpus=source, window=args.window, max_tokens=TRAIN_TOKENS)
    return get_or_train(
        model,
        tok,
        PredictorConfig(mode=args.predictor_mode),
        cfg,
        arch=arch,
        progress=not args.no_progress,
    )


COMMANDS = {
    "perplexity": cmd_perplexity,
    "collect": cli_predictors.cmd_collect,
    "train-predictors": cli_predictors.cmd_train,
    "eval": cli_predictors.cmd_eval,
    "eval-tasks": cli_tasks.cmd_eval_tasks,
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
