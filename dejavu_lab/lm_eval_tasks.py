"""Zero-shot tasks through lm-evaluation-harness, dense or sparsified (Deja Vu §5.1, Table 4).

The paper reports zero-shot accuracy on CB, COPA, Lambada, OpenBookQA, PIQA, RTE and Winogrande
(:data:`PAPER_TASKS`, lm-eval's names) through EleutherAI's harness (Gao et al. 2021). We call
the harness's own Python API — its ``HFLM`` wrapper around the model we already hold, evaluated
inside :func:`dejavu_lab.sparsify.sparsified` — so the numbers are lm-eval's, for any method.

Offline, the harness cannot fetch those datasets. :data:`LOCAL_TASK` is a LAMBADA-style
last-word task that ships with the package as code: built from held-out demo-corpus text (one
passage per news article after the first 40, whose ~9.3k tokens hold the training/calibration
text the chapters use), written at run time into the cache as a JSONL file plus an lm-eval YAML
task in LAMBADA's own format (:func:`local_task_dir`). It needs the optional ``eval`` extra:
``pip install 'dejavu-lab[eval]'``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import cache
from pathlib import Path

from . import assets  # stdlib only: `dejavu-lab --help` stays fast
from .errors import LmEvalError
from .vocab import ALIASES, METHODS

__all__ = [
    "LOCAL_TASK",
    "PAPER_TASKS",
    "LmEvalError",
    "demo_lambada",
    "lm_eval_tasks",
    "local_task_dir",
]

# The paper's zero-shot tasks (§5.1–5.2, Table 4) under their lm-evaluation-harness names.
PAPER_TASKS = ("cb", "copa", "lambada_openai", "openbookqa", "piqa", "rte", "winogrande")
LOCAL_TASK = "dejavu_demo_lambada"  # the offline task built from the demo corpus
TRAIN_ARTICLES = 40  # the demo corpus's first 40 articles (~9.3k tokens) are training text
MIN_WORDS = 50  # a passage's context holds at least this many words (LAMBADA: ~4.6 sentences)
_BORING = {"said", "says", "say"}  # news boilerplate ("..., he said."): not a test of context
_VERSION = 1  # of the task's construction; part of its cache folder's name


def demo_lambada() -> list[dict[str, str]]:
    """The local task's examples: ``{"text": passage}``, its last word the target (as LAMBADA).

    One passage per held-out demo-corpus article: its first sentences, at least
    :data:`MIN_WORDS` words of context, ending where the sentence's last word is a real word
    (letters only, 3+ of them, not "said"); the final punctuation is dropped.

    >>> docs = demo_lambada()
    >>> len(docs), docs[0]["text"].split(" ")[-1]  # the word to predict
    (259, 'shire')
    """
    articles = assets.fetch("lee_background.cor").read_text(encoding="utf-8").splitlines()
    articles = [a.strip() for a in articles if a.strip()][TRAIN_ARTICLES:]
    out = []
    for art in articles:
        words: list[str] = []
        for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", art):
            words += sent.split()
            last = words[-1].rstrip(".!?\"',;:)") if words else ""
            if len(words) > MIN_WORDS and last.isalpha() and len(last) >= 3:
                if last.lower() not in _BORING:
                    out.append({"text": " ".join([*words[:-1], last])})
                    break
    return out


_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
"""


def local_task_dir() -> Path:
    """The folder holding the local task (``<task>.yaml`` + ``<task>.jsonl``), built once.

    Pass it to lm-eval as ``TaskManager(include_path=...)``; the YAML is lambada_openai's
    format over the JSONL from :func:`demo_lambada`.

    >>> folder = local_task_dir()
    >>> sorted(p.name for p in folder.iterdir())
    ['dejavu_demo_lambada.jsonl', 'dejavu_demo_lambada.yaml']
    """
    corpus = assets.ASSETS["lee_background.cor"].sha256[:12]
    out = assets.cache_dir() / "lm_eval" / f"{LOCAL_TASK}-v{_VERSION}-{corpus}"
    yaml_path, data = out / f"{LOCAL_TASK}.yaml", out / f"{LOCAL_TASK}.jsonl"
    if yaml_path.exists() and data.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(d) + "\n" for d in demo_lambada())
    _write(data, lines)  # data first: the YAML's presence means both are complete
    _write(yaml_path, _YAML.format(task=LOCAL_TASK, data=data, version=_VERSION))
    return out


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def lm_eval_tasks(
    model,
    tokenizer,
    tasks: Sequence[str] = (LOCAL_TASK,),
    *,
    method: str | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    add_bos: bool | None = None,
    progress: bool = True,
    require_network: bool | None = None,
    **sparsified_kwargs,
) -> dict[str, dict[str, float]]:
    """Zero-shot scores of ``model`` on lm-eval ``tasks``, with a sparsity method applied.

    ``method`` and ``sparsified_kwargs`` (``mlp_sparsity``, ``head_sparsity``, ``static``,
    ``sparsity``, ``thresholds``, …) go to :func:`dejavu_lab.sparsify.sparsified`; with neither
    the model runs dense. ``limit``: examples per task (lm-eval's ``limit``). ``add_bos``
    (default: :func:`dejavu_lab.corpus.wants_bos`) prepends BOS to every request. The
    harness's prints and progress bars go to stderr (fewer with ``progress=False``), so stdout
    stays the caller's.
    :data:`LOCAL_TASK` runs offline; any other task name is lm-eval's and needs its dataset
    (a network or a filled ``HF_DATASETS`` cache). Returns task -> {metric: value}, lm-eval's
    aggregated metrics without their ``,none`` filter suffix, plus ``n`` (examples scored).

    >>> import pytest; _ = pytest.importorskip("lm_eval")  # pip install 'dejavu-lab[eval]'
    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> sparse = lm_eval_tasks(model, tok, limit=4, progress=False, method="oracle",
    ...                        mlp_sparsity=0.8)  # 4 examples, 80% of the MLP neurons removed
    >>> sparse[LOCAL_TASK]["n"], 0 <= sparse[LOCAL_TASK]["acc"] <= 1
    (4, True)
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise LmEvalError(
            "lm_eval_tasks needs lm-evaluation-harness: pip install 'dejavu-lab[eval]' "
            "(or lm-eval); use sparse_perplexity without it."
        ) from None
    import torch

    from .corpus import wants_bos

    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    if not tasks:
        raise LmEvalError(f"No task given; pass lm-eval task names, e.g. {LOCAL_TASK!r}.")
    for name in ("lm_eval", "lm-eval", "datasets", "evaluate"):  # e.g. "pretrained is not a str"
        logging.getLogger(name).setLevel(logging.ERROR)
    manager = _task_manager(any(t != LOCAL_TASK for t in tasks))
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise LmEvalError(
            f"Unknown lm-eval task(s) {', '.join(map(repr, unknown))}; use {LOCAL_TASK!r} "
            f"offline or lm-eval's names, e.g. the paper's {', '.join(PAPER_TASKS)}."
        )
    remote = [t for t in tasks if t != LOCAL_TASK]
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE")
    if remote and offline and require_network is not False:
        raise LmEvalError(
            f"lm-eval needs a network to fetch {', '.join(remote)}, but HF_HUB_OFFLINE or "
            f"HF_DATASETS_OFFLINE is set; unset it, or run {LOCAL_TASK!r} offline."
        )
    bos = wants_bos(tokenizer) if add_bos is None else bool(add_bos)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, add_bos_token=bos)
    with torch.no_grad(), _quiet(progress), _sparse(model, method, sparsified_kwargs):
        try:
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=manager,
                log_samples=False,
                verbosity="ERROR",
            )
        except (ConnectionError, OSError) as e:
            raise LmEvalError(
                f"lm-eval could not fetch the data of {', '.join(remote) or tasks[0]} "
                f"({type(e).__name__}); it needs a network or a filled HF_DATASETS cache, or "
                f"run {LOCAL_TASK!r} offline."
            ) from None
    n = out.get("n-samples", {})
    return {
        task: {
            **{
                k.split(",")[0]: float(v)
                for k, v in metrics.items()
                if k != "alias" and isinstance(v, (int, float))
            },
            "n": int(n.get(task, {}).get("effective", 0)),
        }
        for task, metrics in out["results"].items()
    }


@contextmanager
def _quiet(progress: bool) -> Iterator[None]:
    """The harness prints to stdout (e.g. "bootstrapping for stddev"): send that to stderr,
    and without ``progress`` switch off the tqdm bars that do not force themselves on."""
    old = os.environ.get("TQDM_DISABLE")
    if not progress:
        os.environ["TQDM_DISABLE"] = "1"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if old is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = old


@cache
def _task_manager(defaults: bool):
    """lm-eval's task index: the local task, plus lm-eval's own (seconds to index) if asked."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(local_task_dir()), include_defaults=defaults)


def _sparse(model, method: str | None, kwargs: dict):
    """``sparsified(model, method=..., **kwargs)``, or nothing for a dense run."""
    spec = METHODS.get(ALIASES.get(method, method)) if method is not None else None
    if (method is None or (spec is not None and spec.family == "dense")) and not kwargs:
        return nullcontext()
    from .sparsify import sparsified

    if method is not None:
        kwargs = {**kwargs, "method": method}
    return sparsified(model, **kwargs)
