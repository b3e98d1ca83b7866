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
        from .budgets import budgets

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
        "--mlp-sparsity", type=_budget("mlp_sparsity"), default=None, help="neurons removed (0)"
    )
    p.add_argument(
        "--head-sparsity", type=_budget("head_sparsity"), default=None, help="heads removed (0)"
    )
    p.add_argument("--dense-layers", type=_layers, default=[], help="e.g. 0,1 (left dense)")


METHOD_NAMES = ("dense", "oracle", "static", "dejavu", "teal", "cats", "wina")
TRAIN_TOKENS = 8192  # a corpus's first tokens are training text (chapter 40's predictors)


def _text_source(text: str) -> str:
    """An argparse ``type=`` for ``--corpus`` / ``--calibration``: a corpus name or a file."""
    from .corpus import CORPORA

    if text in CORPORA:
        return text
    path = Path(text).expanduser()
    if path.is_file():
        return str(path)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} is not a file; pass a UTF-8 text file.")
    raise argparse.ArgumentTypeError(
        f"no corpus named {text!r} and no file at {text}; pass one of {', '.join(CORPORA)} "
        "or the path of a UTF-8 text file."
    )


def _positive(what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(f"{what} must be a positive integer, got {text!r}.")
        return v

    return parse


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
        default=2048,
        help="calibration tokens (thresholds, static sets)",
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

    _eval_tasks_parser(sub)
    return ap


def _load(args):
    from .models import load_model

    return load_model(args.model)


def _windows(args, tokenizer, n: int | None, skip: int = 0, source: str | None = None):
    from .corpus import CorpusError, token_windows

    if tokenizer is None:
        raise ValueError(
            f"Model {args.model!r} has no tokenizer, so it cannot read a corpus; "
            "use 'demo', a Hugging Face id or a folder with tokenizer files."
        )
    total = None if n is None else n + skip
    w = token_windows(tokenizer, _read_text(source or args.corpus), args.window, total)[skip:]
    if w.shape[0] == 0:
        raise CorpusError(
            f"The corpus has no {args.window}-token windows left after skipping {skip}; "
            "skip fewer windows or use a smaller --window."
        )
    return w


def _read_text(source: str) -> str:
    """A corpus by name, or a UTF-8 text file."""
    from .corpus import CORPORA, CorpusError, load_text

    if source in CORPORA:
        return load_text(source)
    try:
        return Path(source).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CorpusError(f"{source} is not UTF-8 text; pass a UTF-8 text file.") from None


def _check_text_files(args) -> None:
    """Fail before the model loads when a text file is not UTF-8 or cannot hold one window
    (a token spans at least one byte)."""
    from .corpus import CORPORA, CorpusError

    for what, source in (("--corpus", args.corpus), ("--calibration", args.calibration)):
        if source is None or source in CORPORA:
            continue
        raw = Path(source).read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorpusError(
                f"{what} {source} is not UTF-8 text; pass a UTF-8 text file."
            ) from None
        if len(raw) < args.window:
            raise CorpusError(
                f"{what} {source} has {len(raw)} bytes, fewer than one window of {args.window} "
                "tokens; pass a longer text or a smaller --window."
            )


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


# ---------------------------------------------------------------------------------------------
# eval-tasks: zero-shot tasks through lm-evaluation-harness (dejavu_lab.lm_eval_tasks)

EVAL_METHODS = ("dense", "oracle", "static", "predicted", "dejavu", "teal", "wina", "cats")


def _static_sets(model, calib, kw: dict, args):
    """The static method's sets, chosen on ``calib`` at the budgets of ``kw``."""
    from .sparsify import static_sets

    return static_sets(model, calib, mlp_sparsity=kw["mlp_sparsity"],
                       head_sparsity=kw["head_sparsity"], progress=not args.no_progress)  # fmt: skip


def _eval_tasks_parser(sub) -> None:
    from .lm_eval_tasks import LOCAL_TASK

    p = sub.add_parser("eval-tasks", help="zero-shot lm-eval tasks, dense or sparsified")
    _common(p)  # --corpus / --window: the calibration text of static and threshold methods
    p.add_argument(
        "--tasks",
        type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
        default=[LOCAL_TASK],
        help=f"comma-separated lm-eval task names (offline: {LOCAL_TASK})",
    )
    p.add_argument("--method", choices=EVAL_METHODS, default="oracle", help="sparsity method")
    p.add_argument(
        "--sparsity",
        type=_budget("sparsity"),
        default=0.0,
        help="fraction removed: heads and neurons (oracle, static, dejavu), the method's own "
        "budget (teal, wina, cats); 0 = dense",
    )
    for kind, what in (("mlp", "neurons"), ("head", "heads")):  # override --sparsity per kind
        p.add_argument(
            f"--{kind}-sparsity", type=_budget(f"{kind}_sparsity"), default=None, help=what
        )
    p.add_argument("--dense-layers", type=_layers, default=[], help="e.g. 0,1 (left dense)")
    p.add_argument("--limit", type=_count(1), default=None, help="examples per task")
    p.add_argument("--num-fewshot", type=_count(0), default=0)
    p.add_argument("--batch-size", type=_count(1), default=1)
    p.add_argument("--predictors", type=Path, help="predictor file (--method dejavu)")
    p.add_argument(
        "--calibration-windows",
        type=_count(1),
        default=4,
        help="windows of the corpus's start (training text) for static sets / thresholds",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _eval_tasks_kwargs(args, model, tok, arch) -> dict:
    """What :func:`dejavu_lab.sparsify.sparsified` gets for ``--method`` at ``--sparsity``."""
    method = "dejavu" if args.method == "predicted" else args.method
    if method == "dense":
        return {}
    kw: dict = {"dense_layers": args.dense_layers}
    if method in ("oracle", "static", "dejavu"):
        kw["mlp_sparsity"] = args.sparsity if args.mlp_sparsity is None else args.mlp_sparsity
        kw["head_sparsity"] = args.sparsity if args.head_sparsity is None else args.head_sparsity
    else:
        kw["sparsity"] = args.sparsity
    if method in ("static", "teal", "wina", "cats"):
        calib = _windows(args, tok, args.calibration_windows)
    if method == "static":
        kw["static"] = _static_sets(model, calib, kw, args)
    elif method == "dejavu":
        from .predictors import load_predictors

        if args.predictors is None:
            raise ValueError("--method dejavu needs --predictors FILE (see train-predictors).")
        kw["predictors"] = load_predictors(args.predictors, model, arch)
    elif method in ("teal", "wina", "cats"):
        from . import sparsify

        if not hasattr(sparsify, "calibrate"):
            raise ValueError(f"--method {method} needs a dejavu_lab.sparsify with calibration.")
        kw["thresholds"] = sparsify.calibrate(
            model, calib, arch=arch, progress=not args.no_progress
        )
    return {"method": "predicted" if method == "dejavu" and _old_sparsify() else method, **kw}


def _old_sparsify() -> bool:
    """True for the sparsify module without named methods (``mode=`` only)."""
    from . import sparsify

    return not hasattr(sparsify, "METHODS")


def cmd_eval_tasks(args) -> None:
    """``dejavu-lab eval-tasks``: lm-eval zero-shot scores, dense or with ``--method``.

    >>> import contextlib, io, json, pytest
    >>> _ = pytest.importorskip("lm_eval")  # the optional extra: pip install 'dejavu-lab[eval]'
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stdout(out):
    ...     cmd_eval_tasks(parser().parse_args("eval-tasks --sparsity 0.5 --limit 2 --json "
    ...         "--no-progress".split()))
    >>> r = json.loads(out.getvalue())
    >>> r["method"], r["sparsity"], r["tasks"]["dejavu_demo_lambada"]["n"]
    ('oracle', 0.5, 2)
    """
    import json

    from .lm_eval_tasks import lm_eval_tasks

    if not args.tasks:
        raise ValueError("--tasks is empty; pass comma-separated lm-eval task names.")
    model, tok, arch = _load(args)
    if tok is None:
        raise ValueError(
            f"Model {args.model!r} has no tokenizer, so lm-eval cannot feed it text; use "
            "'demo', a Hugging Face id, a folder with tokenizer files or a GGUF file."
        )
    kw = _eval_tasks_kwargs(args, model, tok, arch)
    t0 = time.perf_counter()
    results = lm_eval_tasks(
        model,
        tok,
        args.tasks,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        **kw,
    )
    seconds = time.perf_counter() - t0
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "method": args.method,
                    "sparsity": args.sparsity,
                    "mlp_sparsity": kw.get("mlp_sparsity"),
                    "head_sparsity": kw.get("head_sparsity"),
                    "limit": args.limit,
                    "num_fewshot": args.num_fewshot,
                    "seconds": round(seconds, 1),
                    "tasks": results,
                }
            )
        )
        return
    for task, metrics in results.items():
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith("_stderr"))
        print(f"{task}: {shown}")


COMMANDS = {
    "perplexity": cmd_perplexity,
    "collect": cmd_collect,
    "train-predictors": cmd_train,
    "eval": cmd_eval,
    "eval-tasks": cmd_eval_tasks,
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
