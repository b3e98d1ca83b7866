"""``dejavu-lab``: collect activations, train and evaluate DejaVu predictors, measure perplexity.

::

    dejavu-lab perplexity --model demo --corpus demo --window 512
    dejavu-lab perplexity --model demo --mlp-sparsity 0.5 --head-sparsity 0.3 --mode oracle
    dejavu-lab collect --model demo --max-tokens 8192            # resumable; prints the folder
    dejavu-lab train-predictors --model demo --mode both         # collects first if needed
    dejavu-lab eval --model demo --predictors P.safetensors --mlp-sparsity 0.5
    dejavu-lab eval-tasks --model demo --method oracle --sparsity 0.5 --limit 50  # lm-eval

Every subcommand prints its result on stdout, progress bars on stderr, and on a bad input one
line ``dejavu-lab: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main", "parser"]


class _Parser(argparse.ArgumentParser):
    """An argument error is one line ``dejavu-lab: error: ...`` and exit status 2, as any other."""

    def error(self, message: str):
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
            raise argparse.ArgumentTypeError(f"expected a number in [0, 1){extra}, got {text!r}.")
        from .sparsify import budgets

        try:
            budgets(values, len(values), what)  # each in [0, 1), one sentence if not
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return values[0] if len(values) == 1 else values

    return parse


def _layers(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices, got {text!r}"
        ) from None


def _common(p: argparse.ArgumentParser, corpus: bool = True) -> None:
    p.add_argument("--model", default="demo", help="'demo', a Hugging Face id or a local folder")
    if corpus:
        p.add_argument("--corpus", default="demo", help="demo, wikitext-2 or c4")
        p.add_argument("--window", type=int, default=512, help="tokens per window")
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
    p.add_argument("--max-windows", type=int, default=None, help="cap on windows evaluated")
    p.add_argument("--skip-windows", type=int, default=0, help="start after this many windows")
    _sparsity_args(p)
    p.add_argument("--mode", choices=["oracle", "static", "predicted"], default="oracle")
    p.add_argument("--predictors", type=Path, help="predictor file (--mode predicted)")
    p.add_argument("--static-windows", type=int, default=4, help="calibration windows (static)")

    p = sub.add_parser("collect", help="stream per-layer predictor training data to disk")
    _common(p)
    p.add_argument("--max-tokens", type=int, default=8192, help="cap on collected tokens")
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
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens to collect if needed")
    p.add_argument("--mode", choices=["same", "lookahead", "both"], default="both")
    p.add_argument("--mlp-rank", type=int, default=64)
    p.add_argument("--head-rank", type=int, default=32)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--out", type=Path, default=None, help="file (one mode) or folder")

    p = sub.add_parser("eval", help="per-layer recall/precision/mass of trained predictors")
    _common(p)
    p.add_argument("--predictors", type=Path, nargs="+", required=True)
    p.add_argument("--mlp-sparsity", type=_budget("mlp_sparsity", per_layer=False), default=0.5)
    p.add_argument("--head-sparsity", type=_budget("head_sparsity", per_layer=False), default=0.3)
    p.add_argument("--windows", type=int, default=2, help="held-out windows to evaluate on")
    p.add_argument("--skip-windows", type=int, default=16, help="skip the training windows")
    p.add_argument("--per-layer", action="store_true", help="print every layer's row")

    _eval_tasks_parser(sub)
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
        col = open_collection(args.collection)
        if col.manifest["fingerprint"]["weights_sha256"] != _fp(model, arch)["weights_sha256"]:
            raise ValueError(f"{args.collection} was collected from another model.")
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
            path = default_path(col.manifest["fingerprint"], cfg_c, cfg)
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


def _fp(model, arch):
    from .collect import fingerprint

    return fingerprint(model, arch)


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


def _count(what: str, minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = minimum - 1
        if v < minimum:
            raise argparse.ArgumentTypeError(
                f"{what} must be an integer >= {minimum}, got {text!r}."
            )
        return v

    return parse


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
    p.add_argument("--limit", type=_count("--limit", 1), default=None, help="examples per task")
    p.add_argument("--num-fewshot", type=_count("--num-fewshot", 0), default=0)
    p.add_argument("--batch-size", type=_count("--batch-size", 1), default=1)
    p.add_argument("--predictors", type=Path, help="predictor file (--method dejavu)")
    p.add_argument(
        "--calibration-windows",
        type=_count("--calibration-windows", 1),
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
        from .sparsify import static_sets

        kw["static"] = static_sets(
            model,
            calib,
            mlp_sparsity=kw["mlp_sparsity"],
            head_sparsity=kw["head_sparsity"],
            progress=not args.no_progress,
        )
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

    A bad budget fails while parsing, before any model loads: one line on stderr, status 2.

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

    if args.no_progress:
        hf_logging.disable_progress_bar()

    try:
        COMMANDS[args.command](args)
    except (ValueError, OSError, AssetError) as e:  # our errors are one sentence
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"dejavu-lab: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
