"""dejavu-lab CLI: perplexity, collect → train-predictors → eval, and one-line errors."""

import subprocess
import sys

import pytest

from dejavu_lab.cli.main import main

pytestmark = pytest.mark.slow  # loads the demo model


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out.strip(), err.strip()


def test_perplexity_prints_a_number(capsys):
    rc, out, _ = _run(
        capsys,
        "perplexity",
        "--model",
        "demo",
        "--window",
        "64",
        "--max-windows",
        "1",
        "--no-progress",
    )
    assert rc == 0 and 1 < float(out) < 1e4
    rc, sparse, _ = _run(
        capsys,
        "perplexity",
        "--window",
        "64",
        "--max-windows",
        "1",
        "--mlp-sparsity",
        "0.9",
        "--head-sparsity",
        "0.5",
        "--no-progress",
    )
    assert rc == 0 and float(sparse) > float(out)


def test_collect_train_eval(capsys, tmp_path):
    col = tmp_path / "col"
    rc, out, _ = _run(
        capsys,
        "collect",
        "--window",
        "64",
        "--max-tokens",
        "192",
        "--out",
        str(col),
        "--no-progress",
    )
    assert rc == 0 and out == str(col) and len(list(col.glob("chunk_*.safetensors"))) == 3
    pfile = tmp_path / "p.safetensors"
    rc, out, _ = _run(
        capsys,
        "train-predictors",
        "--collection",
        str(col),
        "--mode",
        "same",
        "--epochs",
        "1",
        "--mlp-rank",
        "8",
        "--head-rank",
        "4",
        "--out",
        str(pfile),
        "--no-progress",
    )
    assert rc == 0 and "mean validation recall" in out and pfile.exists()
    rc, out, _ = _run(
        capsys,
        "eval",
        "--predictors",
        str(pfile),
        "--window",
        "64",
        "--windows",
        "1",
        "--skip-windows",
        "3",
        "--no-progress",
    )
    assert rc == 0 and "recall" in out and "heads" in out and "mlp" in out
    rc, out, _ = _run(
        capsys,
        "perplexity",
        "--window",
        "64",
        "--max-windows",
        "1",
        "--mode",
        "predicted",
        "--predictors",
        str(pfile),
        "--mlp-sparsity",
        "0.5",
        "--no-progress",
    )
    assert rc == 0 and float(out) > 1
    rc, out, _ = _run(capsys, "perplexity", "--method", "dejavu", "--predictors", str(pfile),
                      "--sparsity", "0.5", "--window", "64", "--max-tokens", "64", "--json",
                      "--no-progress")  # fmt: skip
    assert rc == 0 and '"method": "dejavu"' in out and '"bytes_per_token_fraction"' in out
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(pfile.read_bytes()[:1000])
    rc, _, err = _run(capsys, "eval", "--predictors", str(cut), "--window", "64", "--no-progress")
    assert rc == 2 and "truncated or damaged" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["perplexity", "--mlp-sparsity", "1.0"], "mlp_sparsity must be in [0, 1)"),
        (["perplexity", "--head-sparsity", "-0.1"], "head_sparsity must be in [0, 1)"),
        (["perplexity", "--mlp-sparsity", "0.5,0.5"], "has 2 entries but the model has 30"),
        (["perplexity", "--window", "10000000"], "fewer than one window"),
        (["perplexity", "--mode", "predicted"], "needs --predictors"),
        (["perplexity", "--model", "./no-such-model"], "is not a model directory"),
        (["perplexity", "--model", "random:tiny-opt"], "has no tokenizer"),
    ],
)
def test_errors_are_one_line(capsys, argv, msg):
    rc, out, err = _run(capsys, *argv, "--no-progress")
    assert rc == 2 and out == ""
    assert err.startswith("dejavu-lab: error: ") and msg in err and len(err.splitlines()) == 1


def test_bad_budget_syntax_is_an_argparse_error(capsys):
    rc, out, err = _run(capsys, "perplexity", "--mlp-sparsity", "half")
    assert rc == 2 and out == "" and "expected a number in [0, 1)" in err
    assert err.startswith("dejavu-lab: error: ") and len(err.splitlines()) == 1


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "dejavu_lab.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    for cmd in ("perplexity", "collect", "train-predictors", "eval"):
        assert cmd in proc.stdout


# perplexity --method: the JSON keys it prints, its refusals -----------------------------

KEYS = {"perplexity", "tokens", "method", "sparsity", "bytes_per_token_fraction"}


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """A fresh cache folder for calibrations that still holds the demo model and corpus."""
    from dejavu_lab.assets import cache_dir
    from dejavu_lab.models import load_model

    load_model("demo")  # make sure the real cache holds the converted model
    real, tmp = cache_dir(), tmp_path / "cache"
    tmp.mkdir()
    for entry in real.iterdir():
        if entry.name not in ("calibration", "predictors", "collections"):
            (tmp / entry.name).symlink_to(entry)
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp))
    return tmp


def _json(capsys, *argv):
    import json

    rc, out, err = _run(capsys, "perplexity", *argv, "--json", "--no-progress")
    assert rc == 0, err
    assert len(out.splitlines()) == 1
    return json.loads(out)


SMALL = ["--window", "64", "--max-tokens", "128", "--calibration-tokens", "128"]


def test_perplexity_methods_print_one_json_object(capsys, tmp_cache):
    dense = _json(capsys, "--method", "dense", "--window", "64", "--max-tokens", "128")
    assert KEYS <= set(dense) and dense["method"] == "dense" and dense["sparsity"] == 0.0
    assert dense["tokens"] == 126 and dense["bytes_per_token_fraction"] == 1.0  # 2 x 63 scored
    assert dense["skip_windows"] == 8192 // 64  # after the training text
    # each method with the flags it reads (another one is refused: test_bad_inputs_silent.py)
    for method, extra in (
        ("oracle", []),
        ("static", ["--calibration-tokens", "128"]),
        ("cats", ["--calibration-tokens", "128"]),
        ("wina", ["--calibration-tokens", "128", "--allocation", "uniform"]),
    ):
        r = _json(capsys, "--method", method, "--sparsity", "0.5", *SMALL[:4], *extra)
        assert KEYS <= set(r) and r["method"] == method and r["sparsity"] == 0.5
        assert r["tokens"] == 126 and r["perplexity"] > dense["perplexity"]
        assert r["eval_tokens"] == dense["eval_tokens"]  # the same text as the dense run
        assert 0.3 < r["bytes_per_token_fraction"] < 0.9
    assert list(tmp_cache.glob("calibration/*.safetensors"))  # the calibration was cached
    heads = _json(
        capsys, "--method", "oracle", "--sparsity", "0.5", "--head-sparsity", "0", *SMALL[:4]
    )
    assert heads["kept"] == {"mlp": 0.5}  # explicit per-kind budgets override --sparsity


def test_teal_defaults_to_the_greedy_allocation(capsys, tmp_cache, monkeypatch):
    import torch

    from dejavu_lab.sparsify import greedy

    def fake_path(model, windows, cal, method, arch=None, progress=True):  # a uniform "path"
        s = torch.linspace(0, 0.8, 9)
        return torch.stack([s] * 5, -1).expand(arch.n_layers, 9, 5).clone()

    monkeypatch.setattr(greedy, "greedy_path", fake_path)
    r = _json(capsys, "--method", "teal", "--sparsity", "0.4", *SMALL)
    assert r["allocation"] == "greedy" and r["method"] == "teal"
    u = _json(capsys, "--method", "teal", "--sparsity", "0.4", "--allocation", "uniform", *SMALL)
    assert u["allocation"] == "uniform" and u["perplexity"] == pytest.approx(r["perplexity"])


def test_corpus_and_calibration_files(capsys, tmp_cache, tmp_path):
    from dejavu_lab.corpus import load_text

    text = load_text("demo")
    corpus = tmp_path / "eval.txt"
    corpus.write_text(text[-3000:], encoding="utf-8")
    calib = tmp_path / "calib.txt"
    calib.write_text(text[:6000], encoding="utf-8")
    r = _json(capsys, "--method", "cats", "--sparsity", "0.3", "--corpus", str(corpus),
              "--calibration", str(calib), "--window", "64", "--calibration-tokens", "256")  # fmt: skip
    assert r["corpus"] == str(corpus) and r["calibration"] == str(calib) and r["tokens"] >= 63
    assert r["skip_windows"] == 0 and r["eval_tokens"][0] == 0  # a text file is scored whole
    dense = _json(capsys, "--method", "dense", "--corpus", str(corpus), "--window", "64")
    assert dense["eval_tokens"] == r["eval_tokens"]


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--method", "magic"], "argument --method: invalid choice: 'magic'"),
        (["--method", "teal", "--sparsity", "1.0"], "sparsity must be in [0, 1)"),
        (["--method", "cats", "--sparsity", "-0.2"], "sparsity must be in [0, 1)"),
        (["--method", "teal", "--corpus", "/no/such.txt"], "no corpus named '/no/such.txt'"),
        (["--method", "teal", "--calibration", "wiki"], "no corpus named 'wiki'"),
        (["--method", "teal", "--corpus", "TINY"], "fewer than one window of 512"),
        (["--method", "teal", "--corpus", "LATIN1"], "is not UTF-8 text"),
        (["--method", "wina", "--max-tokens", "100"], "less than one window of 512"),
        (["--sparsity", "0.5"], "goes with --method"),
        (["--method", "dense", "--max-tokens", "0"], "--max-tokens must be a positive integer"),
    ],
)
def test_bad_values_fail_before_the_model_loads(capsys, monkeypatch, tmp_path, argv, msg):
    from dejavu_lab.cli import perplexity

    (tmp_path / "tiny.txt").write_text("Too short.", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("café ".encode("latin-1") * 200)
    paths = {"TINY": str(tmp_path / "tiny.txt"), "LATIN1": str(tmp_path / "latin1.txt")}
    argv = [paths.get(a, a) for a in argv]

    def no_model(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(perplexity, "load", no_model)
    rc, out, err = _run(capsys, "perplexity", *argv, "--no-progress")
    assert rc == 2 and out == ""
    assert err.startswith("dejavu-lab: error: ") and msg in err and len(err.splitlines()) == 1


def test_text_shorter_than_one_window_after_tokenising(capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("word " * 120, encoding="utf-8")  # 600 bytes, ~120 tokens
    rc, out, err = _run(capsys, "perplexity", "--method", "dense", "--corpus", str(short),
                        "--skip-windows", "0", "--no-progress")  # fmt: skip
    assert rc == 2 and out == "" and "fewer than one window" in err


def test_cli_calibrates_on_the_chapters_training_text():
    """The CLI's default split is the chapters' (sparsify.frontier): the same training text, and
    thresholds calibrated on all of it, so `dejavu-lab perplexity` reproduces chapter 42's points."""
    from dejavu_lab.cli import perplexity
    from dejavu_lab.cli.main import parser
    from dejavu_lab.sparsify import frontier

    assert (perplexity.TRAIN_TOKENS, perplexity.CALIBRATION_TOKENS) == (
        frontier.TRAIN_TOKENS,
        frontier.CALIBRATION_TOKENS,
    )
    args = parser().parse_args(["perplexity", "--method", "teal", "--sparsity", "0.5"])
    assert args.calibration_tokens == frontier.CALIBRATION_TOKENS
