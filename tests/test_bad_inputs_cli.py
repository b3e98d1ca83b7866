"""Bad inputs through the CLI: each one reaches the user as exactly one line
``dejavu-lab: error: ...`` on stderr that says what to do, exit status 2, nothing on stdout, no
traceback, and no file changed (the test folders and the cache).

The model is a tiny local Llama folder with its own tokenizer (:mod:`_tiny_folder`), so a case
that loads it takes a fraction of a second; ``{name}`` in an argument is one of the prepared
paths of :func:`world`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _audit import sentence, tree
from _tiny_folder import build
from safetensors.torch import load_file, save_file

from dejavu_lab.assets import fetch
from dejavu_lab.cli.main import main
from dejavu_lab.collect import CollectConfig, collect, fingerprint
from dejavu_lab.models import load_model, random_model
from dejavu_lab.predictors import PredictorConfig, Predictors


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs-cli")
    cache = root / "cache"
    cache.mkdir()
    shutil.copy(fetch("lee_background.cor"), cache)  # the demo corpus, offline
    tiny = build(root / "tiny")
    p = {"root": root, "cache": cache, "tiny": tiny}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEJAVU_LAB_CACHE", str(cache))
        argv = ["collect", "--model", str(tiny), "--window", "16", "--max-tokens", "96"]
        assert main([*argv, "--out", str(root / "col"), "--no-progress"]) == 0
    p["col"] = root / "col"
    other = random_model("tiny-llama").model
    ids = torch.randint(0, 128, (2, 16))
    p["other-col"] = collect(
        other,
        None,
        CollectConfig(window=16, max_tokens=32),
        root / "other-col",
        windows=ids,
        progress=False,
    ).path
    model = load_model(tiny).model
    p["pred"] = Predictors(fingerprint(model), PredictorConfig()).save(root / "p.safetensors")
    p["other-pred"] = Predictors(fingerprint(other), PredictorConfig()).save(root / "o.safetensors")
    t = load_file(p["pred"])
    t["mlp.0.up.bias"][0] = float("nan")
    from safetensors import safe_open

    with safe_open(str(p["pred"]), "pt") as f:
        meta = f.metadata()
    save_file(t, str(root / "nan.safetensors"), metadata=meta)
    p["nan-pred"] = root / "nan.safetensors"
    for name, damage in {
        "no-weights": lambda d: (d / "model.safetensors").unlink(),
        "no-tokenizer": lambda d: (d / "tokenizer.json").unlink(),
        "truncated": lambda d: (d / "model.safetensors").write_bytes(
            (tiny / "model.safetensors").read_bytes()[:5000]
        ),
    }.items():
        shutil.copytree(tiny, root / name)
        damage(root / name)
        p[name] = root / name
    for name, manifest in {"empty-manifest": "", "list-manifest": "[]"}.items():
        shutil.copytree(p["col"], root / name)
        (root / name / "manifest.json").write_text(manifest)
        p[name] = root / name
    shutil.copytree(p["col"], root / "missing-chunk")
    (root / "missing-chunk" / "chunk_00003.safetensors").unlink()
    p["missing-chunk"] = root / "missing-chunk"
    (root / "not-a-collection").mkdir()
    p["not-a-collection"] = root / "not-a-collection"
    (root / "a-file").write_text("not a folder")
    p["a-file"] = root / "a-file"
    p["chunk"] = p["col"] / "chunk_00000.safetensors"
    return p


# (id, argv, words in the message); {tiny} etc. name the paths prepared by `world`
PARSE = [
    ("max-windows-negative", "perplexity --max-windows -1", "--max-windows: must be at least 1"),
    ("max-windows-zero", "perplexity --max-windows 0", "pass 1 or more"),
    ("skip-windows-negative", "perplexity --skip-windows -3", "--skip-windows: must be at least 0"),
    ("window-one", "perplexity --window 1", "--window: must be at least 2"),
    ("window-not-a-number", "perplexity --window abc", "expected a whole number >= 2"),
    ("window-fractional", "collect --window 8.5", "expected a whole number"),
    ("static-windows-zero", "perplexity --static-windows 0", "--static-windows"),
    ("unknown-corpus", "perplexity --corpus wiki", "demo, wikitext-2, c4"),
    ("mlp-sparsity-one", "perplexity --mlp-sparsity 1.0", "[0, 1)"),
    ("head-sparsity-list-with-text", "perplexity --head-sparsity 0.5,x", "pass e.g. 0.5"),
    ("dense-layers-not-numbers", "perplexity --dense-layers a,b", "layer indices"),
    ("mode-unknown", "perplexity --mode magic", "invalid choice: 'magic'"),
    ("max-tokens-zero", "collect --max-tokens 0", "--max-tokens: must be at least 2"),
    ("label-sparsity-above-one", "collect --mlp-label-sparsity 1.5", "[0, 1)"),
    ("epochs-zero", "train-predictors --epochs 0", "--epochs: must be at least 1"),
    ("mlp-rank-negative", "train-predictors --mlp-rank -1", "--mlp-rank: must be at least 1"),
    ("head-rank-zero", "train-predictors --head-rank 0", "--head-rank"),
    ("train-mode-unknown", "train-predictors --mode all", "invalid choice: 'all'"),
    ("eval-windows-zero", "eval --predictors p.safetensors --windows 0", "--windows"),
    ("eval-skip-negative", "eval --predictors p.safetensors --skip-windows -1", "--skip-windows"),
    ("eval-without-predictors", "eval", "required: --predictors"),
    ("eval-sparsity-list", "eval --predictors p --mlp-sparsity 0.5,0.5", "expected a number"),
    ("no-command", "", "required: command"),
    ("unknown-command", "colect", "invalid choice: 'colect'"),
    ("unknown-option", "collect --max-tokns 5", "unrecognized arguments"),
]

RUN = [
    ("model-missing-folder", "perplexity --model ./no/such/model", "not a model directory"),
    ("model-empty-spec", ["perplexity", "--model", ""], "non-empty string"),
    ("model-folder-without-weights", "perplexity --model {no-weights}", "no weights"),
    ("model-folder-without-tokenizer", "perplexity --model {no-tokenizer}", "no tokenizer files"),
    ("model-folder-truncated-weights", "perplexity --model {truncated}", "is truncated"),
    (
        "model-without-tokenizer-reads-corpus",
        "perplexity --model random:tiny-llama",
        "has no tokenizer",
    ),
    ("window-beyond-positions", "perplexity --model {tiny} --window 100", "64 positions"),
    (
        "skip-past-the-corpus",
        "perplexity --model {tiny} --window 16 --skip-windows 100000",
        "no 16-token windows left",
    ),
    (
        "predicted-without-predictors",
        "perplexity --model {tiny} --window 16 --max-windows 1 --mode predicted --mlp-sparsity 0.5",
        "--predictors FILE",
    ),
    (
        "predicted-with-nan-predictors",
        "perplexity --model {tiny} --window 16 --max-windows 1 "
        "--mode predicted --mlp-sparsity 0.5 --predictors {nan-pred}",
        "NaN or infinite",
    ),
    (
        "predicted-with-missing-file",
        "perplexity --model {tiny} --window 16 --max-windows 1 "
        "--mode predicted --mlp-sparsity 0.5 --predictors {root}/none.safetensors",
        "No predictor file",
    ),
    (
        "sparsity-per-layer-count",
        "perplexity --model {tiny} --window 16 --max-windows 1 --mlp-sparsity 0.5,0.5,0.5",
        "the model has 2 layers",
    ),
    (
        "collect-window-beyond-positions",
        "collect --model {tiny} --window 128 --max-tokens 256",
        "64 positions",
    ),
    (
        "collect-max-tokens-below-window",
        "collect --model {tiny} --window 16 --max-tokens 8",
        "max_tokens must be at least 16",
    ),
    (
        "collect-out-is-a-file",
        "collect --model {tiny} --window 16 --max-tokens 32 --out {a-file}",
        "exists and is not a folder",
    ),
    (
        "collect-out-is-under-a-file",
        "collect --model {tiny} --window 16 --max-tokens 32 --out {a-file}/sub",
        "exists and is not a folder",
    ),
    (
        "collect-into-another-config",
        "collect --model {tiny} --window 16 --max-tokens 32 --out {col}",
        "another model or config",
    ),
    (
        "collect-into-another-model",
        "collect --model {tiny} --window 16 --max-tokens 32 --out {other-col}",
        "collected from another model",
    ),
    (
        "collect-into-empty-manifest",
        "collect --model {tiny} --window 16 --max-tokens 96 --out {empty-manifest}",
        "is empty",
    ),
    (
        "train-not-a-collection",
        "train-predictors --model {tiny} --collection {not-a-collection}",
        "run `dejavu-lab collect` first",
    ),
    (
        "train-other-models-collection",
        "train-predictors --model {tiny} --collection {other-col}",
        "collected from another model",
    ),
    (
        "train-empty-manifest",
        "train-predictors --model {tiny} --collection {empty-manifest}",
        "is empty",
    ),
    (
        "train-list-manifest",
        "train-predictors --model {tiny} --collection {list-manifest}",
        "holds a list",
    ),
    (
        "train-missing-chunk",
        "train-predictors --model {tiny} --collection {missing-chunk}",
        "rerun the same collect command",
    ),
    (
        "eval-missing-file",
        "eval --model {tiny} --predictors {root}/none.safetensors",
        "No predictor file",
    ),
    ("eval-nan-predictors", "eval --model {tiny} --predictors {nan-pred}", "NaN or infinite"),
    (
        "eval-other-models-predictors",
        "eval --model {tiny} --predictors {other-pred}",
        "trained for another model",
    ),
    ("eval-a-chunk-file", "eval --model {tiny} --predictors {chunk}", "not dejavu-lab predictors"),
    (
        "eval-a-folder",
        "eval --model {tiny} --predictors {root}",
        "is a folder; pass one of its predictor files",
    ),
    (
        "eval-skip-past-the-corpus",
        "eval --model {tiny} --predictors {pred} --window 16 --skip-windows 100000",
        "windows left",
    ),
]


def argv(world, spec) -> list[str]:
    words = spec.split() if isinstance(spec, str) else spec
    return [w.format(**{k: str(v) for k, v in world.items()}) for w in words]


def refused_by_the_cli(world, capsys, monkeypatch, args, *words, env=None):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(world["cache"]))
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    before = tree(world["root"])
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dejavu-lab: error: "), err
    msg = sentence(lines[0].removeprefix("dejavu-lab: error: "))
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    assert tree(world["root"]) == before, "a refused command changed a file"
    return msg


@pytest.mark.parametrize("spec,words", [pytest.param(c[1], c[2:], id=c[0]) for c in PARSE])
def test_refused_while_parsing(world, capsys, monkeypatch, spec, words):
    refused_by_the_cli(world, capsys, monkeypatch, argv(world, spec), *words)


@pytest.mark.parametrize("spec,words", [pytest.param(c[1], c[2:], id=c[0]) for c in RUN])
def test_refused_once_running(world, capsys, monkeypatch, spec, words):
    args = [*argv(world, spec), "--no-progress"]
    refused_by_the_cli(world, capsys, monkeypatch, args, *words)


def test_collect_into_a_busy_folder(world, capsys, monkeypatch):
    hold = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); " + (
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
    )
    busy = world["root"] / "busy"
    busy.mkdir(exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", hold, str(busy)], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"held"
        args = argv(world, "collect --model {tiny} --window 16 --max-tokens 32 --no-progress")
        refused_by_the_cli(
            world,
            capsys,
            monkeypatch,
            [*args, "--out", str(busy)],
            "Another process is collecting into this folder",
            env={"DEJAVU_LAB_LOCK_TIMEOUT": "0.2"},
        )
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("errno_,words", [(28, "No space left"), (30, "it is read-only")])
def test_collect_onto_a_full_or_read_only_disk(world, capsys, monkeypatch, errno_, words):
    import os

    from dejavu_lab import atomic

    def fail(f, data):
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(atomic, "_write", fail)
    out = world["root"] / f"disk-{errno_}"
    args = argv(world, "collect --model {tiny} --window 16 --max-tokens 32 --no-progress")
    msg = refused_by_the_cli(world, capsys, monkeypatch, [*args, "--out", str(out)], words)
    assert str(out) in msg and "pass another out_dir (--out)" in msg
    shutil.rmtree(out)  # created (empty) before the first write failed


def test_the_console_script_prints_no_traceback(tmp_path):
    """The real entry point, in a subprocess: the same one line and status 2."""
    out = subprocess.run(
        [sys.executable, "-m", "dejavu_lab.cli", "train-predictors", "--epochs", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert (
        out.stderr
        == "dejavu-lab: error: argument --epochs: must be at least 1, got 0; pass 1 or more.\n"
    )


def test_train_with_a_collection_does_not_touch_the_default_key(world, capsys, monkeypatch):
    """Not a bad input, the fix it relies on: ``--collection`` saves under that collection's key."""
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(world["cache"]))
    args = argv(
        world,
        "train-predictors --model {tiny} --collection {col} --mode same "
        "--epochs 1 --mlp-rank 4 --head-rank 2 --no-progress",
    )
    assert main(args) == 0
    saved = Path(capsys.readouterr().out.split()[1])
    manifest = json.loads((world["col"] / "manifest.json").read_text())
    assert CollectConfig(**manifest["config"]).key() in saved.name
    assert CollectConfig().key() not in saved.name
    saved.unlink()
