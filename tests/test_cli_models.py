"""The CLI on one's own checkpoint: --dtype, --threads, a GGUF converted once and cached, and
perplexity's scored tokens (the same with and without --calibration, counted as scored).

A tiny Llama folder with its own tokenizer (tests/_tiny_folder.py) and a tiny GGUF written here
stand in for a real checkpoint: every run takes a fraction of a second.
"""

import json
import math

import pytest
import torch
from _tiny_folder import build
from test_gemma_gguf import tiny, write_gguf

from dejavu_lab import gguf_cache
from dejavu_lab.cli.args import load
from dejavu_lab.cli.main import COMMANDS, main, parser
from dejavu_lab.corpus import load_text
from dejavu_lab.models import load_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder that still holds the demo corpus (no download)."""
    from dejavu_lab.assets import cache_dir, fetch

    corpus = fetch("lee_background.cor")
    assert corpus.parent == cache_dir()
    tmp = tmp_path / "cache"
    tmp.mkdir()
    (tmp / corpus.name).symlink_to(corpus)
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp))
    return tmp


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that sets it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build(tmp_path_factory.mktemp("tiny")))


def _json(capsys, *argv):
    rc = main(["perplexity", *argv, "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_dtype_and_threads_on_every_subcommand_that_computes(folder, threads):
    for command in COMMANDS:
        extra = ["--predictors", "p.safetensors"] if command == "eval" else []
        args = parser().parse_args([command, *extra, "--dtype", "float16", "--threads", "1"])
        assert (args.dtype, args.threads) == ("float16", 1), command
    args = parser().parse_args(["perplexity", "--model", folder, "--dtype", "bfloat16"])
    model = load(args).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    args = parser().parse_args(["perplexity", "--model", folder, "--threads", "1"])
    assert {p.dtype for p in load(args).model.parameters()} == {torch.float32}  # its own
    assert torch.get_num_threads() == 1


def test_bad_dtype_and_threads_fail_while_parsing(capsys):
    for argv, msg in (
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["--threads", "0"], "argument --threads: must be at least 1 threads"),
    ):
        assert main(["perplexity", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.splitlines()) == 1


def test_help_says_what_model_and_dtype_take(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["perplexity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("qwen2.5-0.5b", "Hugging Face id", "local folder", ".gguf file",
                  "default bfloat16 for a .gguf file", "torch.set_num_threads"):  # fmt: skip
        assert words in text


def test_json_names_dtype_threads_and_scored_tokens(capsys, cache, folder, threads):
    r = _json(capsys, "--model", folder, "--method", "dense", "--window", "32", "--max-windows",
              "3", "--dtype", "bfloat16", "--threads", "1")  # fmt: skip
    assert (r["dtype"], r["threads"]) == ("bfloat16", 1)
    assert r["windows"] == 3 and r["tokens"] == 3 * 31  # each window predicts its tokens 2..32
    start, stop = r["eval_tokens"]
    assert start == math.ceil(8192 / 32) * 32 and stop == start + 3 * 32  # no BOS: 32 per window
    # the range names the scored text: the same tokens, cut by hand, give the same perplexity
    model, tok, _ = load_model(folder)
    ids = tok(load_text("demo"), return_tensors="pt", add_special_tokens=False).input_ids[0]
    windows = ids[start:stop].view(3, 32)
    with torch.no_grad():
        logits = model(windows).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                            windows[:, 1:].reshape(-1))  # fmt: skip
    dense = _json(capsys, "--model", folder, "--method", "dense", "--window", "32",
                  "--max-windows", "3")  # fmt: skip
    assert dense["perplexity"] == pytest.approx(math.exp(nll.item()), rel=1e-4)


def test_the_same_tokens_are_scored_with_and_without_calibration(capsys, cache, folder, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text(load_text("demo")[-20000:])
    common = ["--model", folder, "--window", "32", "--max-windows", "2"]
    cats = [*common, "--method", "cats", "--sparsity", "0.3", "--calibration-tokens", "64"]
    runs = {  # (dense takes no --calibration: the CLI refuses what a method does not read)
        "dense": _json(capsys, *common, "--method", "dense"),
        "cats": _json(capsys, *cats),
        "cats, --calibration": _json(capsys, *cats, "--calibration", str(calib)),
        "no --method": _json(capsys, "--model", folder, "--window", "32", "--max-windows", "2"),
    }
    ranges = {name: (tuple(r["eval_tokens"]), r["tokens"]) for name, r in runs.items()}
    assert len(set(ranges.values())) == 1, ranges
    assert runs["dense"]["perplexity"] == pytest.approx(runs["no --method"]["perplexity"])
    assert runs["cats"]["calibration"] == "demo"  # the corpus's own training text
    assert runs["cats, --calibration"]["calibration"] == str(calib)
    for name in ("cats", "cats, --calibration"):  # a cache file, named relative to the cache
        assert runs[name]["calibration_file"].startswith("calibration/")


def test_a_text_file_is_scored_whole_and_calibrates_elsewhere(capsys, cache, folder, tmp_path):
    text = load_text("demo")
    corpus = tmp_path / "eval.txt"
    corpus.write_text(text[-3000:])
    r = _json(capsys, "--model", folder, "--method", "dense", "--corpus", str(corpus),
              "--window", "32")  # fmt: skip
    assert r["eval_tokens"][0] == 0 and r["skip_windows"] == 0
    rc = main(["perplexity", "--model", folder, "--method", "cats", "--sparsity", "0.3",
               "--corpus", str(corpus), "--window", "32", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "must come from elsewhere; pass --calibration" in err
    assert len(err.splitlines()) == 1


def test_a_gguf_is_dequantised_once_then_read_from_the_cache(cache, tmp_path, monkeypatch):
    model, arch = tiny("tiny-llama")
    write_gguf(model, tmp_path / "tiny.gguf")
    first, tok, _ = load_model(tmp_path / "tiny.gguf")
    entries = list((cache / "gguf").iterdir())
    names = sorted(p.name for p in entries if not p.name.startswith("."))
    assert len(names) == 1 and names[0].startswith("tiny-")
    entry = cache / "gguf" / names[0]
    cfg = json.loads((entry / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert not [p for p in entries if ".convert-" in p.name]  # no temporary folder left

    def no_dequantising(*args, **kwargs):
        raise AssertionError("the GGUF was dequantised again")

    monkeypatch.setattr(gguf_cache, "_convert", no_dequantising)
    (tmp_path / "moved").mkdir()
    (tmp_path / "tiny.gguf").rename(tmp_path / "moved" / "renamed.gguf")  # keyed by content
    again, tok2, got_arch = load_model(tmp_path / "moved" / "renamed.gguf")
    half, _, _ = load_model(tmp_path / "moved" / "renamed.gguf", dtype=torch.bfloat16)
    assert got_arch == arch and tok2("ab c").input_ids == tok("ab c").input_ids
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 120, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, first(ids).logits, atol=0, rtol=0)
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(half(ids).logits.float(), first(ids).logits, atol=0.1, rtol=0)


def test_calibration_shows_its_progress_on_stderr(capsys, cache, folder):
    rc = main(["perplexity", "--model", folder, "--method", "teal", "--sparsity", "0.5",
               "--window", "32", "--max-windows", "1", "--calibration-tokens", "64", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0 and json.loads(out)["method"] == "teal"  # stdout: the result only
    assert "calibration:" in err and "teal greedy:" in err  # the histograms, then TEAL's search
