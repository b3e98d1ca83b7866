"""``dejavu-lab eval-tasks``: zero-shot tasks through lm-evaluation-harness, dense or with any
sparsity method (:mod:`dejavu_lab.lm_eval_tasks`).

What a method needs before it runs is read from its row of :data:`dejavu_lab.vocab.METHODS`
(:func:`prepare`).

>>> import argparse
>>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
>>> add_parser(sub)
>>> list(sub.choices), sub.choices["eval-tasks"].parse_args(["--method", "predicted"]).method
(['eval-tasks'], 'predicted')
"""

from __future__ import annotations

import time
from pathlib import Path

from ..vocab import ALIASES, method_names
from ..vocab import method as method_spec
from .args import budget, common_args, corpus_windows, count, layer_list, load
from .options import check as check_options
from .prepare import from_calibration

__all__ = ["add_parser", "cmd_eval_tasks", "prepare"]


def add_parser(sub) -> None:
    """The ``eval-tasks`` options, on ``sub`` (an argparse subparsers object).

    >>> import argparse
    >>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> add_parser(sub)
    >>> sub.choices["eval-tasks"].parse_args(["--method", "teal"]).method
    'teal'
    """
    from ..lm_eval_tasks import LOCAL_TASK

    p = sub.add_parser("eval-tasks", help="zero-shot lm-eval tasks, dense or sparsified")
    common_args(p)  # --corpus / --window: the calibration text of static and threshold methods
    p.add_argument(
        "--tasks",
        type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
        default=[LOCAL_TASK],
        help=f"comma-separated lm-eval task names (offline: {LOCAL_TASK})",
    )
    p.add_argument(
        "--method", choices=(*method_names(), *ALIASES), default="oracle", help="sparsity method"
    )
    p.add_argument(
        "--sparsity",
        type=budget("sparsity"),
        default=0.0,
        help="fraction removed: heads and neurons (oracle, static, dejavu), the method's own "
        "budget (teal, wina, cats); 0 = dense",
    )
    for kind, what in (("mlp", "neurons"), ("head", "heads")):  # override --sparsity per kind
        p.add_argument(
            f"--{kind}-sparsity", type=budget(f"{kind}_sparsity"), default=None, help=what
        )
    p.add_argument("--dense-layers", type=layer_list, default=[], help="e.g. 0,1 (left dense)")
    p.add_argument("--limit", type=count(1), default=None, help="examples per task")
    p.add_argument("--num-fewshot", type=count(0), default=0)
    p.add_argument("--batch-size", type=count(1), default=1)
    p.add_argument("--predictors", type=Path, help="predictor file (--method dejavu)")
    p.add_argument(
        "--calibration-windows",
        type=count(1),
        default=4,
        help="windows of the corpus's start (training text) for static sets / thresholds",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def prepare(args, model, tok, arch) -> dict:
    """What :func:`dejavu_lab.sparsify.sparsified` gets for ``--method`` at ``--sparsity``.

    The method's family says which budgets it takes, its ``needs`` what to build first from
    the corpus's first ``--calibration-windows`` (static sets, a calibration) or to load
    (``--predictors``), by the same rule as ``perplexity`` (:mod:`~dejavu_lab.cli.prepare`):
    TEAL's greedy shares for teal/wina, second moments for larosa/rsparse.

    >>> from dejavu_lab.cli.main import parser
    >>> args = parser().parse_args("eval-tasks --method predicted --sparsity 0.5".split())
    >>> prepare(args, None, None, None)
    Traceback (most recent call last):
    ...
    ValueError: --method dejavu needs --predictors FILE (see train-predictors).
    """
    spec = method_spec(args.method)
    if spec.family == "dense":
        return {}
    kw: dict = {"dense_layers": args.dense_layers}
    if spec.family == "unit":
        kw["mlp_sparsity"] = args.sparsity if args.mlp_sparsity is None else args.mlp_sparsity
        kw["head_sparsity"] = args.sparsity if args.head_sparsity is None else args.head_sparsity
    else:
        kw["sparsity"] = args.sparsity
    if spec.needs in ("static sets", "calibration"):
        calib = corpus_windows(args, tok, args.calibration_windows)
        from_calibration(args, spec, model, calib, kw, arch)
    elif spec.needs == "predictors":
        from ..predictors import load_predictors

        if args.predictors is None:
            raise ValueError(
                f"--method {spec.name} needs --predictors FILE (see train-predictors)."
            )
        kw["predictors"] = load_predictors(args.predictors, model, arch)
    return {"method": spec.name, **kw}


def cmd_eval_tasks(args) -> None:
    """``dejavu-lab eval-tasks``: lm-eval zero-shot scores, dense or with ``--method``.

    >>> from dejavu_lab.cli.main import parser
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

    from ..lm_eval_tasks import lm_eval_tasks

    check_options(args)  # a flag the method does not read is an error
    if not args.tasks:
        raise ValueError("--tasks is empty; pass comma-separated lm-eval task names.")
    model, tok, arch = load(args)
    if tok is None:
        raise ValueError(
            f"Model {args.model!r} has no tokenizer, so lm-eval cannot feed it text; use "
            "'demo', a Hugging Face id, a folder with tokenizer files or a GGUF file."
        )
    kw = prepare(args, model, tok, arch)
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
