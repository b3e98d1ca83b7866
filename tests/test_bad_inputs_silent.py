"""Inputs that used to be accepted without a word, and two messages that misled.

- the model fingerprint hashed 8 rows of 3 matrices: a model differing elsewhere was served
  another model's cached calibration (its CATS thresholds off by up to 0.21); now every
  parameter and buffer is hashed, and entries under the older fingerprint are recomputed once;
- an argument the method does not read (``method="dense", sparsity=0.5``; ``--allocation
  greedy`` with CATS; ``--predictor-mode`` with TEAL; ``--mode`` next to ``--method``) was
  dropped; a config or input that cannot be meant (NaN bins, whitespace text, nested
  ``sparsified`` blocks, NaN thresholds in the engine) ran anyway;
- the whole ``load_model()`` result given as the model, and ``load_calibration`` of a folder;
- two processes converting the demo model at once.

Each refusal is checked as the rest of the audit does (:mod:`_audit`): the error type, one
sentence saying what to do, and no file changed; through the CLI: exit 2, one stderr line,
nothing on stdout.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from _audit import refuse, sentence, tree
from _tiny_folder import build
from safetensors import safe_open

from dejavu_lab import gguf_cache, models
from dejavu_lab.assets import ASSETS, fetch
from dejavu_lab.checks import InputError
from dejavu_lab.cli.main import main
from dejavu_lab.collect import (
    CollectConfig,
    CollectionError,
    collect,
    fingerprint,
    open_collection,
)
from dejavu_lab.corpus import CorpusError, token_windows
from dejavu_lab.engine import EngineError, SparseConfig
from dejavu_lab.errors import AssetError
from dejavu_lab.kernels import sparse_mlp_up
from dejavu_lab.models import load_model, random_model
from dejavu_lab.predictors import PredictorConfig, PredictorError, Predictors, load_predictors
from dejavu_lab.sparsify import (
    CalibrationConfig,
    CalibrationError,
    calibrate,
    load_calibration,
    load_thresholds,
    sparse_eval,
    sparse_perplexity,
    sparsified,
    static_sets,
)
from dejavu_lab.sparsify.calibration import default_path, text_hash

W = 8


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    root = tmp_path_factory.mktemp("silent")
    lm = random_model("tiny-llama")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    cal = calibrate(lm.model, ids, cache=False, progress=False)
    folder = build(root / "tiny")
    return SimpleNamespace(
        root=root,
        lm=lm,
        model=lm.model,
        ids=ids,
        cal=cal,
        pred=Predictors(fingerprint(lm.model), PredictorConfig(mlp_rank=4, head_rank=2)),
        static=static_sets(lm.model, ids, progress=False),
        tok=load_model(folder).tokenizer,
        folder=folder,
    )


def changed_copy(model, edit):
    """A deep copy of ``model`` with ``edit(copy)`` applied to its weights."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        edit(other)
    return other


# ---------------------------------------------------------------------------------------------
# the fingerprint


def test_one_weight_changed_anywhere_changes_the_fingerprint():
    """Every parameter and buffer, each at its last entry (outside the 8 rows the older
    fingerprint read), on the same model object: a new fingerprint each time, and the old one
    back when the weight is restored."""
    m = random_model("tiny-llama").model
    base = fingerprint(m)
    seen = {base["weights_sha256"]}
    tensors = [*m.named_parameters(), *m.named_buffers()]
    assert len(tensors) > 10
    for name, t in tensors:
        with torch.no_grad():
            flat = t.view(-1)
            old = flat[-1].item()
            flat[-1] += 1.0
            fp = fingerprint(m)
            flat[-1] = old
        assert fp["weights_sha256"] not in seen, name
        seen.add(fp["weights_sha256"])
        assert fingerprint(m) == base, name


def test_a_cached_calibration_is_not_served_to_a_changed_model(w, tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    a = random_model("tiny-llama").model

    def last_row(m):  # the last row of the last layer's down_proj
        m.model.layers[-1].mlp.down_proj.weight[-1] += 0.5

    def gates(m):  # the gate rows the older fingerprint never read: CATS's thresholds move
        m.model.layers[0].mlp.gate_proj.weight[8:] *= 2

    ca = calibrate(a, w.ids, progress=False)
    for edit in (last_row, gates):
        b = changed_copy(a, edit)
        assert fingerprint(b)["weights_sha256"] != fingerprint(a)["weights_sha256"]
        assert default_path(fingerprint(b), text_hash(w.ids), CalibrationConfig()) != ca.path
        cb = calibrate(b, w.ids, progress=False)
        assert cb.path != ca.path and cb.fingerprint == fingerprint(b)
        refuse([tmp_path], lambda b=b: load_calibration(ca.path, b), CalibrationError,
               "another model", "calibrate on this model")  # fmt: skip
        if edit is gates:
            assert not torch.equal(cb.hist["cats"][0], ca.hist["cats"][0])
    assert calibrate(a, w.ids, progress=False).path == ca.path  # still served to its own model


def _older(fp: dict) -> dict:
    """The fingerprint an older version wrote: no version, another hash of 8 rows."""
    old = {k: v for k, v in fp.items() if k != "version"}
    old["weights_sha256"] = "89abcdef01234567"
    return old


def test_cache_entries_under_the_older_fingerprint_are_recomputed_once(w, tmp_path, monkeypatch,
                                                                        capsys):  # fmt: skip
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    fp = fingerprint(w.model)
    new = default_path(fp, text_hash(w.ids), CalibrationConfig())
    old = new.with_name(new.name.replace(fp["weights_sha256"][:12], "89abcdef"))
    stale = copy.copy(w.cal)
    stale.fingerprint = _older(fp)
    stale.save(old)
    capsys.readouterr()
    cal = calibrate(w.model, w.ids, progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and old.name in err[0] and "older model fingerprint" in err[0], err
    assert "recomputing it once" in err[0]
    assert cal.path == new and cal.fingerprint == fp
    calibrate(w.model, w.ids, progress=False)  # found under the new key: nothing said
    assert capsys.readouterr().err == ""
    refuse([tmp_path], lambda: load_calibration(old, w.model), CalibrationError,
           "older model fingerprint", "calibrate on this model again")  # fmt: skip


def test_files_under_the_older_fingerprint_are_refused(w, tmp_path):
    pred = Predictors(_older(fingerprint(w.model)), PredictorConfig(mlp_rank=4, head_rank=2))
    path = pred.save(tmp_path / "p.safetensors")
    refuse([tmp_path], lambda: load_predictors(path, w.model), PredictorError,
           "older model fingerprint", "train them again")  # fmt: skip
    thr = w.cal.thresholds("cats", 0.5)
    thr.fingerprint = _older(thr.fingerprint)
    tpath = thr.save(tmp_path / "t.safetensors")
    refuse([tmp_path], lambda: load_thresholds(tpath, w.model), CalibrationError,
           "older model fingerprint")  # fmt: skip
    col = collect(w.model, None, CollectConfig(window=16, max_tokens=32), tmp_path / "col",
                  windows=w.ids, progress=False)  # fmt: skip
    manifest = json.loads((col.path / "manifest.json").read_text())
    manifest["fingerprint"] = _older(manifest["fingerprint"])
    (col.path / "manifest.json").write_text(json.dumps(manifest))
    refuse([tmp_path], lambda: open_collection(col.path, w.model), CollectionError,
           "older model fingerprint", "collect again")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# one rule for options, through the API


OPTIONS = [
    ("cats-with-mlp-sparsity", dict(method="cats", sparsity=0.5, mlp_sparsity=0.9, thresholds="cal"),
     "method='cats' does not use mlp_sparsity", "it takes sparsity, thresholds"),
    ("dense-with-sparsity", dict(method="dense", sparsity=0.5), "method='dense' runs the model"),
    ("dense-with-head-sparsity", dict(method="dense", head_sparsity=0.3), "takes no head_sparsity"),
    ("cats-greedy", dict(method="cats", sparsity=0.5, thresholds="cal", allocation="greedy"),
     "does not use allocation"),
    ("oracle-with-predictors", dict(method="oracle", mlp_sparsity=0.5, predictors="pred"),
     "method='oracle' does not use predictors"),
    ("oracle-with-static-sets", dict(method="oracle", mlp_sparsity=0.5, static="static"),
     "does not use static"),
    ("teal-with-static-sets", dict(method="teal", sparsity=0.5, thresholds="cal", static="static"),
     "method='teal' does not use static"),
    ("static-with-thresholds", dict(method="static", static="static", thresholds="cal"),
     "does not use thresholds"),
    ("mode-with-another-method", dict(method="teal", mode="static"), "not both"),
    ("sparsity-beside-both-budgets", dict(mlp_sparsity=0.5, head_sparsity=0.3, sparsity=0.2),
     "both are given", "pass sparsity alone"),
]  # fmt: skip


def _kwargs(w, kw: dict) -> dict:
    objects = {"thresholds": w.cal, "predictors": w.pred, "static": w.static}
    return {k: objects[k] if k in objects else v for k, v in kw.items()}


@pytest.mark.parametrize("kw,words", [pytest.param(c[1], c[2:], id=c[0]) for c in OPTIONS])
def test_an_argument_the_method_does_not_read_is_refused(w, kw, words):
    kw = _kwargs(w, kw)
    refuse([w.root], lambda: sparsified(w.model, **kw).__enter__(), ValueError, *words)
    refuse([w.root], lambda: sparse_eval(w.model, w.ids, progress=False, **kw), ValueError, *words)
    refuse([w.root], lambda: sparse_perplexity(w.model, w.ids, progress=False, **kw), ValueError,
           *words)  # fmt: skip


def test_what_each_method_takes_still_runs(w):
    """The rule's other side: each method with the options its row names."""
    base = dict(cats={"thresholds": w.cal}, teal={"thresholds": w.cal, "allocation": "uniform"},
                static={"static": w.static}, dejavu={"predictors": w.pred.eval()})  # fmt: skip
    for name in ("dense", "oracle", "static", "dejavu", "teal", "wina", "cats"):
        kw = dict(base.get(name, {"thresholds": w.cal} if name == "wina" else {}))
        if name != "dense":
            kw["sparsity"] = 0.5
        r = sparse_eval(w.model, w.ids, method=name, dense_layers=[1], progress=False, **kw)
        assert r.perplexity > 1, name


# ---------------------------------------------------------------------------------------------
# configs and inputs that cannot be meant


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"bins": float("nan")}, "bins must be a whole number in [16, 65536], got nan"),
        ({"bins": 1e9}, "got 1000000000.0; pass e.g. bins=65536"),
        ({"bins": 8}, "bins must be"),
        ({"log10_max": float("inf")}, "log10_max must be a finite number"),
        ({"greedy_step": float("nan")}, "greedy_step must be in (0, 1]"),
        ({"greedy_tokens": 2.5}, "greedy_tokens must be at least 2"),
    ],
)
def test_calibration_configs_out_of_range(fields, words, tmp_path):
    refuse([tmp_path], lambda: CalibrationConfig(**fields), CalibrationError, words)


def test_calibration_config_whole_floats_are_the_same_key():
    assert CalibrationConfig(bins=4096.0).key() == CalibrationConfig().key()


@pytest.mark.parametrize(
    "text,words",
    [
        (" \n\t " * 2000, "the text is only whitespace (8000 characters)"),
        ("", "the text is empty"),
        ("A short line.", "fewer than one window of 16"),
    ],
)
def test_texts_without_a_window(w, text, words):
    refuse([w.root], lambda: token_windows(w.tok, text, 16), CorpusError, words)


def test_sparsified_blocks_do_not_nest(w):
    ids = w.ids[:1]
    want = sparse_perplexity(w.model, ids, progress=False, mlp_sparsity=0.5)
    with torch.no_grad():
        dense = w.model(input_ids=ids).logits
        with sparsified(w.model, mlp_sparsity=0.5):
            outer = w.model(input_ids=ids).logits
            inner = sparsified(w.model, method="cats", sparsity=0.5, thresholds=w.cal)
            refuse([w.root], inner.__enter__, InputError, "sparsified blocks do not nest",
                   "runs method 'oracle'", "leave that block first")  # fmt: skip
            assert torch.equal(w.model(input_ids=ids).logits, outer)  # the outer block stands
            # a block that asks for nothing measures the outer one (sparse_perplexity's way)
            with sparsified(w.model):
                assert torch.equal(w.model(input_ids=ids).logits, outer)
            assert sparse_perplexity(w.model, ids, progress=False) == want
            refuse([w.root], lambda: sparse_perplexity(w.model, ids, progress=False, method="dense"),
                   InputError, "do not nest")  # fmt: skip
        assert torch.equal(w.model(input_ids=ids).logits, dense)
        with sparsified(w.model, mlp_sparsity=0.5):  # after it, a new block is fine
            assert torch.equal(w.model(input_ids=ids).logits, outer)


@pytest.mark.parametrize(
    "thr,words",
    [
        (float("nan"), "is nan"),
        (float("inf"), "is inf"),
        (torch.full((64,), float("nan")), "holds 64 NaN or -inf of 64"),
        (torch.tensor([0.1] * 63 + [float("-inf")]), "holds 1 NaN or -inf"),
        (torch.zeros(64, dtype=torch.long), "1-D tensor of floats"),
    ],
    ids=["nan", "inf", "nan-tensor", "minus-inf-in-tensor", "integer-tensor"],
)
def test_engine_thresholds_must_be_finite(thr, words, tmp_path):
    refuse([tmp_path], lambda: SparseConfig(method="teal", thresholds={(0, "mlp_in"): thr}),
           EngineError, words)  # fmt: skip


def test_engine_thresholds_may_mark_columns_never_read():
    t = torch.tensor([0.1] * 63 + [float("inf")])  # WINA: a zero column's t / ||W[:, i]||
    assert SparseConfig(method="wina", thresholds={(0, "mlp_in"): t}).method == "wina"


def test_sparse_mlp_up_says_what_validate_false_does():
    x, weight = torch.randn(2, 16, dtype=torch.float16), torch.randn(64, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"must lie in \[0, 63\]"):
        sparse_mlp_up(x, weight, torch.tensor([3, 64]))
    doc = " ".join(sparse_mlp_up.__doc__.split())
    assert "validate=False`` trusts ``idx``: an index past the rows makes the kernel read" in doc


# ---------------------------------------------------------------------------------------------
# two messages


def test_the_whole_load_model_result_is_refused_with_what_to_pass(w):
    words = ("whole load_model() result", "pass its .model")
    for call in (
        lambda: sparsified(w.lm, mlp_sparsity=0.5).__enter__(),
        lambda: sparsified(w.lm, mlp_sparsity=0.5, arch=w.lm.arch).__enter__(),
        lambda: sparse_eval(w.lm, w.ids, mlp_sparsity=0.5, progress=False),
        lambda: calibrate(w.lm, w.ids, cache=False, progress=False),
        lambda: fingerprint(w.lm),
    ):
        refuse([w.root], call, InputError, *words)


def test_load_calibration_of_a_folder_says_it_is_a_folder(w, tmp_path):
    w.cal.save(tmp_path / "cal.safetensors")
    msg = refuse([tmp_path], lambda: load_calibration(tmp_path), CalibrationError,
                 "is a folder, not a calibration file", "cal.safetensors", "pass the path")  # fmt: skip
    assert "damaged" not in msg and "truncated" not in msg
    refuse([tmp_path], lambda: load_thresholds(tmp_path), CalibrationError, "is a folder")


# ---------------------------------------------------------------------------------------------
# the demo model's conversion


HOLD = """
import fcntl, os, pathlib, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()  # converting...
out = pathlib.Path(sys.argv[2])
out.mkdir()
(out / "config.json").write_text("{}")
(out / "model.safetensors").write_bytes(b"converted")
"""


def test_two_processes_never_convert_a_gguf_at_once(tmp_path, monkeypatch, capsys):
    """Another process holds a GGUF's conversion lock (the demo model's here): a converter with
    a timeout gives up in one sentence; one without waits, says so once, and finds the folder the
    other one wrote (it fetches nothing: the source is never called)."""
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    asset = ASSETS[models.DEMO_ASSET]
    out = gguf_cache.entry_dir(asset.filename, asset.sha256)
    lock = out.parent / f".{out.name}.lock"
    lock.parent.mkdir(parents=True)

    def convert():
        def source():
            raise AssertionError("the other process converts it")

        return gguf_cache.converted("demo", asset.filename, asset.sha256, source)

    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(out)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert p.stdout.readline().strip() == b"held"
        monkeypatch.setenv("DEJAVU_LAB_LOCK_TIMEOUT", "0.2")
        refuse([tmp_path], convert, AssetError, "Another process is converting")
        monkeypatch.delenv("DEJAVU_LAB_LOCK_TIMEOUT")
        got = []
        waiter = threading.Thread(target=lambda: got.append(convert()))
        waiter.start()
        time.sleep(1.0)  # the waiter says once that it waits
        assert not got
        p.stdin.write(b"done\n")
        p.stdin.flush()
        waiter.join(60)
        assert got == [out] and (out / "model.safetensors").read_bytes() == b"converted"
        err = capsys.readouterr().err
        assert err.count("another process is converting") == 1, err
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------------------------------------
# through the CLI


@pytest.fixture(scope="module")
def world(w):
    cache = w.root / "cache"
    cache.mkdir(exist_ok=True)
    shutil.copy(fetch("lee_background.cor"), cache)
    blank = w.root / "blank.txt"
    blank.write_text(" \n" * 3000)
    return {"root": w.root, "cache": cache, "tiny": w.folder, "blank": blank}


CLI = [
    ("dense-with-sparsity", "perplexity --method dense --sparsity 0.5",
     "--method dense runs the model unchanged and reads no --sparsity"),
    ("mode-beside-method", "perplexity --method teal --mode static",
     "--mode is the older name of --method", "--method static for --mode static"),
    ("allocation-with-cats", "perplexity --method cats --allocation greedy",
     "--method cats does not use --allocation", "it takes --sparsity, --calibration"),
    ("uniform-allocation-with-cats", "perplexity --method cats --allocation uniform",
     "does not use --allocation"),
    ("predictor-mode-with-teal", "perplexity --method teal --predictor-mode same",
     "--method teal does not use --predictor-mode"),
    ("predictor-mode-default-typed", "perplexity --method teal --predictor-mode lookahead",
     "does not use --predictor-mode"),
    ("calibration-tokens-with-dejavu", "perplexity --method dejavu --calibration-tokens 64",
     "--method dejavu does not use --calibration-tokens"),
    ("mlp-sparsity-with-cats", "perplexity --method cats --sparsity 0.5 --mlp-sparsity 0.9",
     "--method cats does not use --mlp-sparsity"),
    ("max-tokens-below-a-window", "perplexity --method cats --window 16 --max-tokens 8",
     "--max-tokens 8 is less than one window of 16 tokens"),
    ("max-tokens-without-method", "perplexity --window 16 --max-tokens 8",
     "--max-tokens goes with --method"),
    ("allocation-without-method", "perplexity --allocation greedy", "--allocation goes with --method"),
    ("static-windows-with-method", "perplexity --method static --static-windows 2",
     "--static-windows goes with the older --mode"),
    ("predictors-with-mode-oracle", "perplexity --mode oracle --predictors p.safetensors",
     "--mode oracle does not use --predictors"),
    ("static-windows-with-mode-oracle", "perplexity --static-windows 2",
     "--mode oracle does not use --static-windows"),
    ("eval-tasks-dense-with-sparsity", "eval-tasks --method dense --sparsity 0.5",
     "--method dense runs the model unchanged"),
    ("eval-tasks-calibration-windows-with-oracle", "eval-tasks --calibration-windows 2",
     "--method oracle does not use --calibration-windows"),
    ("eval-tasks-predictors-with-teal", "eval-tasks --method teal --predictors p.safetensors",
     "--method teal does not use --predictors"),
    ("blank-corpus", "perplexity --model {tiny} --corpus {blank} --window 16 --max-windows 1",
     "the text is only whitespace"),
    ("blank-calibration-text",
     "perplexity --model {tiny} --method cats --sparsity 0.5 --calibration {blank} --window 16 "
     "--max-tokens 16", "the text is only whitespace"),
]  # fmt: skip


@pytest.mark.parametrize("spec,words", [pytest.param(c[1], c[2:], id=c[0]) for c in CLI])
def test_refused_by_the_cli(world, capsys, monkeypatch, spec, words):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(world["cache"]))
    args = [a.format(**{k: str(v) for k, v in world.items()}) for a in spec.split()]
    before = tree(world["root"])
    capsys.readouterr()
    code = main([*args, "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dejavu-lab: error: "), err
    msg = sentence(lines[0].removeprefix("dejavu-lab: error: "))
    for word in words:
        assert word in msg, f"{word!r} not in: {msg}"
    assert tree(world["root"]) == before, "a refused command changed a file"


def test_the_cli_still_runs_what_a_method_takes(world, capsys, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(world["cache"]))
    argv = (f"perplexity --model {world['tiny']} --method teal --sparsity 0.5 --allocation "
            "uniform --window 16 --max-tokens 16 --calibration-tokens 32 --json --no-progress")  # fmt: skip
    capsys.readouterr()
    assert main(argv.split()) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["method"] == "teal" and r["allocation"] == "uniform" and r["tokens"] == 15
    with safe_open(world["cache"] / r["calibration_file"], "pt") as f:
        assert json.loads(f.metadata()["fingerprint"])["version"] == 2
