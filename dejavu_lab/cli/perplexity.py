"""``dejavu-lab perplexity``: perplexity on a corpus, dense or with any sparsity method, and the
bytes per token a sparse step would read (:func:`dejavu_lab.sparsify.sparse_eval`).

What a method needs before it runs (a calibration, static sets, predictors) is read from its row
of :data:`dejavu_lab.vocab.METHODS` (:func:`prepare`), so a new method needs nothing here.

Which tokens are scored depends on the corpus and the window options only, never on the method
or on ``--calibration`` (:func:`eval_skip`), so a dense and a sparse run compare the same text: a
named corpus's first 8192 tokens are its training text (calibration, predictors) and are never
scored; a text file is scored from its first token. The JSON says which range it scored
(``eval_tokens``: [first, last + 1] text-token offsets) and how many predictions (``tokens``).

>>> import argparse
>>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
>>> add_parser(sub)
>>> sub.choices["perplexity"].parse_args(["--method", "teal"]).method
'teal'
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ..vocab import Method, method_names
from ..vocab import method as method_spec
from .args import (
    budget,
    check_text_files,
    common_args,
    corpus_windows,
    count,
    load,
    positive,
    sparsity_args,
    text_source,
)
from .options import check as check_options
from .prepare import cache_relative, from_calibration

__all__ = ["CALIBRATION_TOKENS", "TRAIN_TOKENS", "add_parser", "cmd_perplexity", "prepare"]

TRAIN_TOKENS = 8192  # a corpus's first tokens are training text (chapter 40's predictors)
CALIBRATION_TOKENS = TRAIN_TOKENS  # thresholds calibrate on all of it (sparsify.frontier's too)


def add_parser(sub) -> None:
    """The ``perplexity`` options, on ``sub`` (an argparse subparsers object); ``--method``
    offers every method of the table.

    >>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> add_parser(sub)
    >>> sub.choices["perplexity"].parse_args(["--method", "teal", "--sparsity", "0.4"]).sparsity
    0.4
    """
    p = sub.add_parser("perplexity", help="perplexity on a corpus, dense or sparsified")
    common_args(p, corpus=False)
    p.add_argument(
        "--corpus", type=text_source, default="demo", help="demo, wikitext-2, c4 or a text file"
    )
    p.add_argument("--window", type=count(2), default=512, help="tokens per window")
    p.add_argument("--max-windows", type=count(1), default=None, help="cap on windows evaluated")
    p.add_argument(
        "--skip-windows",
        type=count(0),
        default=None,
        help="start after this many windows (default: after a named corpus's first "
        f"{TRAIN_TOKENS} tokens, its training text, for every method and with or without "
        "--calibration; 0 for a text file)",
    )
    sparsity_args(p)
    _method_args(p)
    p.add_argument("--mode", choices=["oracle", "static", "predicted"], default="oracle")
    p.add_argument("--predictors", type=Path, help="predictor file (--mode predicted)")
    p.add_argument(
        "--static-windows", type=count(1), default=4, help="calibration windows (static)"
    )


def _method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=method_names(), default=None, help="sparsity method")
    p.add_argument(
        "--sparsity",
        type=budget("sparsity"),
        default=None,
        help="fraction removed (0 = dense): heads and neurons (oracle, static, dejavu), "
        "bytes-weighted linear inputs (teal, wina), MLP neurons (cats)",
    )
    p.add_argument(
        "--calibration",
        type=text_source,
        default=None,
        help="calibration text, a corpus name or a file (default: the corpus's first tokens)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=positive("--calibration-tokens"),
        default=CALIBRATION_TOKENS,
        help=f"calibration tokens (thresholds, static sets; default {CALIBRATION_TOKENS}: the "
        "training text)",
    )
    p.add_argument(
        "--max-tokens", type=positive("--max-tokens"), default=None, help="cap on evaluated tokens"
    )
    p.add_argument(
        "--allocation",
        choices=["uniform", "greedy"],
        default=None,
        help="teal/wina: spread over a layer's inputs (default greedy); larosa/rsparse: greedy "
        "is the same search run on their own transform",
    )
    p.add_argument(
        "--predictor-mode", choices=["same", "lookahead"], default="lookahead", help="dejavu"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (files in it: as given on the command line; cache files "
        "relative to the cache directory, $DEJAVU_LAB_CACHE)",
    )


def cmd_perplexity(args) -> None:
    """``dejavu-lab perplexity``: print the perplexity on the corpus, dense or sparsified.

    Without ``--method`` the older options apply (``--mode``, ``--mlp-sparsity``,
    ``--head-sparsity``); with it, any method at ``--sparsity`` (:func:`_perplexity_method`).

    >>> from dejavu_lab.cli.main import parser
    >>> cmd_perplexity(parser().parse_args(
    ...     "perplexity --window 8 --max-windows 1 --mlp-sparsity 0.5 --no-progress".split()))
    81.7
    """
    if args.window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {args.window}.")
    check_options(args)  # a flag the method or mode does not read is an error
    if args.method is not None:
        return _perplexity_method(args)
    if args.sparsity is not None or args.calibration is not None:
        raise ValueError("--sparsity and --calibration go with --method; pass --method too.")
    from ..sparsify import sparse_eval, static_sets

    check_text_files(args)
    model, tok, arch = load(args)
    windows = _eval_windows(args, tok, args.max_windows, eval_skip(args))
    ms = 0.0 if args.mlp_sparsity is None else args.mlp_sparsity
    hs = 0.0 if args.head_sparsity is None else args.head_sparsity
    kw = dict(mlp_sparsity=ms, head_sparsity=hs, dense_layers=args.dense_layers, mode=args.mode)
    needs = method_spec(args.mode).needs  # the older --mode names are methods or their aliases
    if needs == "predictors":
        from ..predictors import load_predictors

        if args.predictors is None:
            raise ValueError("--mode predicted needs --predictors FILE (see train-predictors).")
        kw["predictors"] = load_predictors(args.predictors, model, arch)
    if needs == "static sets":
        calib = corpus_windows(args, tok, args.static_windows)
        kw["static"] = static_sets(model, calib, mlp_sparsity=ms, head_sparsity=hs)
    r = sparse_eval(model, windows, progress=not args.no_progress, **kw)
    if args.json:
        out = {**_result_json(r, args, windows, model), "mode": args.mode}
        print(json.dumps(out))
    else:
        print(f"{r.perplexity:.4f}")


def _result_json(r, args, windows, model) -> dict:
    import torch

    n, width = windows.shape
    step = width - 1 if windows.add_bos else width  # text tokens per window
    start = eval_skip(args) * step
    return {
        "perplexity": r.perplexity,
        "tokens": n * (width - 1),  # predictions scored: each window's tokens 2..window
        "method": r.method,
        "sparsity": r.sparsity,
        "bytes_per_token_fraction": r.bytes_per_token_fraction,
        "kept": r.kept,
        "model": args.model,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "corpus": args.corpus,
        "window": args.window,
        "windows": int(n),
        "eval_tokens": [start, start + n * step],  # text-token offsets in the tokenised corpus
    }


def eval_skip(args) -> int:
    """Windows of the corpus before the scored text: ``--skip-windows``, else a named corpus's
    training text (its first ``TRAIN_TOKENS``), else 0 (a text file) -- whatever the method and
    whether or not ``--calibration`` is given.

    >>> from dejavu_lab.cli.main import parser
    >>> eval_skip(parser().parse_args("perplexity --method dense".split()))
    16
    >>> eval_skip(parser().parse_args("perplexity --method teal --calibration wikitext-2".split()))
    16
    """
    from ..vocab import CORPORA

    if args.skip_windows is not None:
        return args.skip_windows
    return math.ceil(TRAIN_TOKENS / args.window) if args.corpus in CORPORA else 0


def _eval_windows(args, tok, n: int | None, skip: int):
    """The scored windows; a named corpus with nothing after its training text, one sentence."""
    from ..corpus import CorpusError

    try:
        return corpus_windows(args, tok, n, skip)
    except CorpusError:
        if skip == 0 or args.skip_windows is not None:
            raise
        corpus_windows(args, tok, 1, 0)  # not even one window in all of it: say that instead
        raise CorpusError(
            f"{args.corpus} has no {args.window}-token windows after its first {TRAIN_TOKENS} "
            "tokens, its training text, which are never scored; pass --skip-windows 0 to score "
            "it from the start (with --calibration on other text) or use a longer corpus."
        ) from None


def _perplexity_method(args) -> None:
    """``perplexity --method M --sparsity S``: quality and bytes of any method, as JSON or text.

    A named corpus's first 8192 tokens (``TRAIN_TOKENS``: chapter 40's training text) are
    training text, never scored (:func:`eval_skip`): with no other ``--calibration``,
    calibration (thresholds, static sets, the predictors) reads its first
    ``--calibration-tokens``.

    >>> import contextlib, io, json
    >>> from dejavu_lab.cli.main import parser
    >>> out = io.StringIO()
    >>> argv = ("perplexity --method cats --sparsity 0.5 --window 16 --max-tokens 16 "
    ...         "--calibration-tokens 32 --json --no-progress").split()
    >>> with contextlib.redirect_stdout(out):  # calibrates once, then reads the cache
    ...     cmd_perplexity(parser().parse_args(argv))
    >>> r = json.loads(out.getvalue())
    >>> r["method"], r["tokens"], r["eval_tokens"], r["sparsity"]  # 15 predictions per window
    ('cats', 15, [8192, 8208], 0.5)
    """
    from ..sparsify import sparse_eval

    spec = method_spec(args.method)
    if args.max_tokens is not None and args.max_tokens < args.window:
        raise ValueError(
            f"--max-tokens {args.max_tokens} is less than one window of {args.window} tokens."
        )
    skip = eval_skip(args)
    n_eval = None if args.max_tokens is None else args.max_tokens // args.window
    n_eval = args.max_windows if n_eval is None else n_eval
    check_text_files(args)
    model, tok, arch = load(args)
    windows = _eval_windows(args, tok, n_eval, skip)
    kw, calib_info = prepare(args, spec, model, tok, arch, skip=skip)
    r = sparse_eval(model, windows, progress=not args.no_progress, **kw)
    out = {
        **_result_json(r, args, windows, model),
        "sparsity": _sparsity(args, spec),
        "skip_windows": skip,
    }
    if spec.allocation == "greedy":  # the methods with a choice of allocation say which ran
        out["allocation"] = args.allocation or spec.allocation
    out.update(calib_info)
    print(json.dumps(out) if args.json else f"{r.perplexity:.4f}")


def _sparsity(args, spec: Method):
    """The budget ``--sparsity`` gives the method (0 for dense; checked while parsing)."""
    return 0.0 if args.sparsity is None or spec.family == "dense" else args.sparsity


def prepare(args, spec: Method, model, tok, arch, *, skip: int = 0) -> tuple[dict, dict]:
    """What :func:`~dejavu_lab.sparsify.sparsified` gets for ``spec`` at ``--sparsity``, and
    where what it needed came from: ``(kwargs, info for the JSON)``.

    The method's family says which budgets it takes (``unit``: neurons and heads; ``threshold``:
    its own), its ``needs`` what to build first from the calibration text (the corpus's first
    ``--calibration-tokens``, or ``--calibration``), and its ``allocation`` the default
    spread of a threshold budget over a layer's sites. ``skip``: the evaluated text starts
    after this many windows of the same text.

    >>> from dejavu_lab.cli.main import parser
    >>> from dejavu_lab.vocab import method
    >>> args = parser().parse_args("perplexity --method oracle --sparsity 0.5".split())
    >>> prepare(args, method("oracle"), None, None, None)
    ({'method': 'oracle', 'dense_layers': [], 'mlp_sparsity': 0.5, 'head_sparsity': 0.5}, {})
    """
    sparsity = _sparsity(args, spec)
    same_text = args.calibration is None or args.calibration == args.corpus
    source = args.corpus if same_text else args.calibration
    kw: dict = dict(method=spec.name, dense_layers=args.dense_layers)
    info: dict = {}
    if spec.family == "unit":
        kw["mlp_sparsity"] = sparsity if args.mlp_sparsity is None else args.mlp_sparsity
        kw["head_sparsity"] = sparsity if args.head_sparsity is None else args.head_sparsity
    elif spec.family != "dense":
        kw["sparsity"] = sparsity
    if spec.needs in ("static sets", "calibration"):
        n_calib = max(1, math.ceil(args.calibration_tokens / args.window))
        if same_text and skip == 0:
            raise ValueError(
                f"{args.corpus} is scored from its first token, so {spec.name}'s calibration "
                "text must come from elsewhere; pass --calibration (a corpus name or another "
                "text file), or --skip-windows N to calibrate on its first N windows."
            )
        if same_text and n_calib > skip:
            raise ValueError(
                f"--calibration-tokens {args.calibration_tokens} overlap the evaluated text "
                f"(it starts after {skip} windows); calibrate on fewer tokens or another text."
            )
        calib = corpus_windows(args, tok, n_calib, 0, source=source)
        info = {"calibration": source, "calibration_tokens": int(calib.numel())}
        info.update(from_calibration(args, spec, model, calib, kw, arch))
    if spec.needs == "predictors":
        kw["predictors"] = _predictors(args, model, tok, arch, source)
        info = {"predictors": cache_relative(kw["predictors"].info.get("path"))}
    return kw, info


def _predictors(args, model, tok, arch, source: str):
    """DejaVu predictors: ``--predictors FILE``, or trained once on the training text (cached)."""
    from ..predictors import PredictorConfig, get_or_train, load_predictors
    from ..vocab import CORPORA

    if args.predictors is not None:
        pred = load_predictors(args.predictors, model, arch)
        pred.info = {"path": str(args.predictors)}
        return pred
    if source not in CORPORA:
        raise ValueError(
            "--method dejavu trains its predictors on a named corpus; with a text file pass "
            "--predictors FILE (see `dejavu-lab train-predictors`)."
        )
    from ..collect import CollectConfig

    cfg = CollectConfig(corpus=source, window=args.window, max_tokens=TRAIN_TOKENS)
    return get_or_train(
        model,
        tok,
        PredictorConfig(mode=args.predictor_mode),
        cfg,
        arch=arch,
        progress=not args.no_progress,
    )
