"""lm-eval for real: the local LAMBADA-style task, through lm-eval's HFLM, dense and sparsified.

The harness's accuracy on the local task is checked against the same last-word test computed
here directly from the model's logits, dense and under oracle sparsity, so both the plumbing
(requests, BOS, tokenisation) and the sparsity's reach into the harness's forwards are tested.
"""

import contextlib
import io
import json
import re
import sys

import pytest
import torch
import yaml

from dejavu_lab.cli.main import main
from dejavu_lab.lm_eval_tasks import (
    LOCAL_TASK,
    TRAIN_ARTICLES,
    LmEvalError,
    demo_lambada,
    lm_eval_tasks,
    local_task_dir,
)
from dejavu_lab.sparsify import sparsified


def test_local_task_is_held_out_lambada_style_text():
    docs = demo_lambada()
    assert docs == demo_lambada() and 200 < len(docs) < 300  # deterministic, ~1 per article
    from dejavu_lab.corpus import load_text

    train = "\n\n".join(load_text("demo").split("\n\n")[:TRAIN_ARTICLES])
    for d in docs:
        words = d["text"].split(" ")
        assert len(words) > 50 and words[-1].isalpha() and words[-1].lower() != "said"
        assert " ".join(words[:12]) not in train  # held out
    folder = local_task_dir()
    cfg = yaml.safe_load((folder / f"{LOCAL_TASK}.yaml").read_text())
    assert cfg["task"] == LOCAL_TASK and cfg["output_type"] == "loglikelihood"
    lines = (folder / f"{LOCAL_TASK}.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == docs


def last_word_accuracy(model, tok, docs):
    """LAMBADA's accuracy computed here: every target token is the greedy next token."""
    hits = []
    for d in docs:
        context, target = d["text"].rsplit(" ", 1)
        ctx = tok(context, add_special_tokens=False).input_ids
        whole = tok(context + " " + target, add_special_tokens=False).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([whole])).logits[0]
        pred = logits[len(ctx) - 1 : len(whole) - 1].argmax(-1)
        hits.append(pred.tolist() == whole[len(ctx) :])
    return sum(hits) / len(hits)


@pytest.mark.slow
def test_harness_accuracy_matches_the_models_own_dense_and_sparse(demo):
    pytest.importorskip("lm_eval")
    model, tok, _ = demo
    docs = demo_lambada()[:12]
    dense = lm_eval_tasks(model, tok, limit=12)[LOCAL_TASK]
    assert dense["n"] == 12 and dense["acc"] == pytest.approx(last_word_accuracy(model, tok, docs))
    kw = dict(mlp_sparsity=0.8, head_sparsity=0.5)
    sparse = lm_eval_tasks(model, tok, limit=12, method="oracle", **kw)[LOCAL_TASK]
    with sparsified(model, mode="oracle", **kw):
        assert sparse["acc"] == pytest.approx(last_word_accuracy(model, tok, docs))
    assert sparse["perplexity"] > dense["perplexity"]  # of the target word


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dense", "static"])
def test_cli_eval_tasks_json(method):
    pytest.importorskip("lm_eval")
    out = io.StringIO()
    argv = ["eval-tasks", "--method", method, "--limit", "3", "--json", "--no-progress"]
    if method != "dense":  # dense reads no budget and no calibration text: those flags are refused
        argv += ["--sparsity", "0.5", "--window", "64", "--calibration-windows", "2"]
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    r = json.loads(out.getvalue())
    assert r["method"] == method and r["tasks"][LOCAL_TASK]["n"] == 3
    assert 0 <= r["tasks"][LOCAL_TASK]["acc"] <= 1


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--limit", "0"], r"argument --limit: .*\b1\b"),
        (["--method", "magic"], "invalid choice: 'magic'"),
        (["--sparsity", "1.5"], r"sparsity must be in \[0, 1\)"),
        (["--tasks", "no_such_task", "--model", "random:tiny-llama"], "has no tokenizer"),
    ],
)
def test_cli_eval_tasks_bad_input_is_one_line(argv, match, capsys):
    assert main(["eval-tasks", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dejavu-lab: error:") and err.count("\n") == 1
    assert re.search(match, err), err


def test_unknown_task_and_offline_remote_task_are_one_sentence(monkeypatch):
    pytest.importorskip("lm_eval")
    with pytest.raises(LmEvalError, match="Unknown lm-eval task.*'no_such_task'.*piqa"):
        lm_eval_tasks(None, None, ["no_such_task"])  # refused before the model is used
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(LmEvalError, match="needs a network to fetch piqa"):
        lm_eval_tasks(None, None, [LOCAL_TASK, "piqa"])


def test_without_lm_eval_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    with pytest.raises(LmEvalError, match=r"pip install 'dejavu-lab\[eval\]'"):
        lm_eval_tasks(None, None)
