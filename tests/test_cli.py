"""dejavu-lab CLI: perplexity, collect → train-predictors → eval, and one-line errors."""

import subprocess
import sys

import pytest

from dejavu_lab.cli import main

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
