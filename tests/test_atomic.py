"""dejavu_lab.atomic and its users: whole files only, a lock that makes the second writer wait,
one sentence for a full or read-only disk (naming the folder), and cache keys that name what was
cached."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
import sys
import time

import pytest
import torch
from _tiny_folder import build

from dejavu_lab import atomic, results
from dejavu_lab.cli.main import main as cli
from dejavu_lab.collect import CollectConfig, collect, default_dir, fingerprint, open_collection
from dejavu_lab.models import load_model, random_model
from dejavu_lab.predictors import (
    PredictorConfig,
    Predictors,
    default_path,
    get_or_train,
    load_predictors,
)

W = 8
WINDOWS = torch.randint(0, 128, (4, W), generator=torch.Generator().manual_seed(0))


def tree(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def fail_writes(monkeypatch, err: int, when=lambda f: True):
    """Make atomic writes fail with ``err`` (a full disk, a read-only folder) where ``when``."""
    real = atomic._write

    def write(f, data):
        if when(f):
            f.write(data[: len(data) // 3])  # part of it reached the disk, then no more
            raise OSError(err, os.strerror(err))
        real(f, data)

    monkeypatch.setattr(atomic, "_write", write)


@pytest.fixture(scope="module")
def tiny():
    return random_model("tiny-llama")


# ----------------------------------------------------------------------------- writes


def test_write_replaces_whole_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.bin"
    atomic.write_bytes(path, b"old")
    atomic.write_bytes(path, b"new contents")
    assert path.read_bytes() == b"new contents" and os.listdir(tmp_path) == ["f.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # like any other file


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO])
def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch, err):
    path = tmp_path / "f.bin"
    atomic.write_bytes(path, b"old")
    fail_writes(monkeypatch, err)
    with pytest.raises(atomic.WriteError) as e:
        atomic.write_bytes(path, b"new" * 1000, hint="pass --out")
    msg = str(e.value)
    assert str(tmp_path) in msg and msg.endswith("pass --out.") and "\n" not in msg
    assert {errno.ENOSPC: "free space", errno.EROFS: "read-only", errno.EACCES: "writable"}.get(
        err, "Could not write"
    ) in msg
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]


def test_ctrl_c_during_a_write_leaves_no_temporary(tmp_path, monkeypatch):
    def interrupted(f, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_json(tmp_path / "m.json", {"a": 1})
    assert os.listdir(tmp_path) == []


def test_temporaries_are_unique_per_process_and_call(tmp_path, monkeypatch):
    seen = []
    real = atomic._write
    monkeypatch.setattr(atomic, "_write", lambda f, data: (seen.append(f.name), real(f, data)))
    for _ in range(3):
        atomic.write_bytes(tmp_path / "chunk.safetensors", b"x")
    assert len(set(seen)) == 3 and all(f".{os.getpid()}-" in n for n in seen)


def test_clean_partials_removes_only_dead_writers_files(tmp_path):
    dead = tmp_path / f".chunk_00001.safetensors.999999999-00000000{atomic.PARTIAL}"
    mine = tmp_path / f".chunk_00002.safetensors.{os.getpid()}-00000000{atomic.PARTIAL}"
    for p in (dead, mine):
        p.write_bytes(b"half")
    assert atomic.clean_partials(tmp_path) == [dead]
    assert sorted(os.listdir(tmp_path)) == [mine.name]


def test_make_dirs_on_a_file_is_one_sentence(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(atomic.WriteError, match="exists and is not a folder; remove it"):
        atomic.make_dirs(tmp_path / "out" / "sub")


# ----------------------------------------------------------------------------- locks


HOLD = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); " + (
    "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(float(sys.argv[2]))"
)


def hold(folder, seconds: float) -> subprocess.Popen:
    """Another process holding the folder's lock for ``seconds``."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(seconds)], stdout=-1)
    assert p.stdout.readline().strip() == b"held"
    return p


def test_second_process_waits_for_the_lock_and_says_so(tmp_path, capsys):
    p = hold(tmp_path, 1.0)
    t0 = time.monotonic()
    with atomic.locked(tmp_path, what="collecting into this folder"):
        waited = time.monotonic() - t0
    p.wait()
    err = capsys.readouterr().err
    assert waited > 0.3 and err.count("\n") == 1
    assert "another process is collecting into this folder" in err and "Ctrl-C" in err


def test_lock_timeout_is_one_sentence(tmp_path, monkeypatch):
    p = hold(tmp_path, 30)
    try:
        monkeypatch.setenv(atomic.ENV_TIMEOUT, "0.2")
        with pytest.raises(atomic.BusyError) as e:
            with atomic.locked(tmp_path, what="collecting into this folder"):
                pass
        msg = str(e.value)
        assert "Another process is collecting" in msg and "wait for it to finish" in msg
    finally:
        p.kill()
        p.wait()


def test_a_killed_holder_releases_the_lock(tmp_path):
    p = hold(tmp_path, 30)
    p.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
    p.wait()
    with atomic.locked(tmp_path, what="collecting", timeout=5):
        pass


def test_collect_while_another_process_collects_there_waits_or_says_so(tiny, tmp_path, monkeypatch):
    cfg = CollectConfig(window=W, max_tokens=2 * W)
    out = tmp_path / "col"
    collect(tiny.model, None, cfg, out, windows=WINDOWS, progress=False)
    before = tree(out)
    p = hold(out, 30)
    try:
        monkeypatch.setenv(atomic.ENV_TIMEOUT, "0.2")
        with pytest.raises(atomic.BusyError, match="collecting into this folder"):
            collect(tiny.model, None, cfg, out, windows=WINDOWS, progress=False)
    finally:
        p.kill()
        p.wait()
    assert tree(out) == before


# ----------------------------------------------------------------------------- disks


@pytest.mark.parametrize(
    "err,words",
    [(errno.ENOSPC, "No space left on the device holding"), (errno.EROFS, "it is read-only")],
)
def test_full_or_read_only_disk_mid_collect_is_one_sentence_and_resumes(
    tiny, tmp_path, monkeypatch, err, words
):
    cfg = CollectConfig(window=W, max_tokens=4 * W)
    ref = collect(tiny.model, None, cfg, tmp_path / "ref", windows=WINDOWS, progress=False)
    out = tmp_path / "col"
    fail_writes(monkeypatch, err, when=lambda f: "chunk_00002" in f.name)
    with pytest.raises(atomic.WriteError) as e:
        collect(tiny.model, None, cfg, out, windows=WINDOWS, progress=False)
    msg = str(e.value)
    assert words in msg and str(out) in msg and "\n" not in msg
    assert "out_dir (--out)" in msg and "DEJAVU_LAB_CACHE" in msg
    assert sorted(os.listdir(out)) == [
        "chunk_00000.safetensors",
        "chunk_00001.safetensors",
        "manifest.json",
    ]  # whole files only, no half-written chunk
    monkeypatch.undo()
    collect(tiny.model, None, cfg, out, windows=WINDOWS, progress=False)  # the disk is back
    assert tree(out) == tree(ref.path)


def test_full_disk_message_says_how_much_is_needed(tiny, tmp_path, monkeypatch):
    cfg = CollectConfig(window=64, max_tokens=64 * 40, chunk_windows=40)
    windows = torch.randint(0, 128, (40, 64))
    fail_writes(monkeypatch, errno.ENOSPC, when=lambda f: "chunk" in f.name)
    with pytest.raises(atomic.WriteError, match=r"\(about \d+ MB more are needed\)"):
        collect(tiny.model, None, cfg, tmp_path / "col", windows=windows, progress=False)


def test_full_disk_through_the_cli_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path / "cache"))
    fail_writes(monkeypatch, errno.ENOSPC, when=lambda f: "chunk_00001" in f.name)
    model = build(tmp_path / "tiny")
    capsys.readouterr()
    code = cli(["collect", "--model", str(model), "--window", "16", "--max-tokens", "48",
                "--out", str(tmp_path / "col"), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith(f"dejavu-lab: error: No space left on the device holding {tmp_path}")
    assert "free space there or pass another out_dir (--out)" in err


def test_failed_predictor_and_results_saves_keep_the_old_files(tiny, tmp_path, monkeypatch):
    pred = Predictors(fingerprint(tiny.model), PredictorConfig(mlp_rank=4))
    path = pred.save(tmp_path / "p.safetensors")
    monkeypatch.setenv(results.ENV_DIR, str(tmp_path / "results"))
    res = results.save("bench", [{"ms": 1.0}], command="test")
    before = tree(tmp_path)
    fail_writes(monkeypatch, errno.ENOSPC)
    with pytest.raises(atomic.WriteError, match="No space left"):
        Predictors(fingerprint(tiny.model), PredictorConfig(mlp_rank=8)).save(path)
    with pytest.raises(atomic.WriteError, match=f"No space left .*{results.ENV_DIR}"):
        results.save("bench", [{"ms": 2.0}], command="test")
    assert tree(tmp_path) == before
    assert load_predictors(path).config.mlp_rank == 4 and results.load(res)[0]["ms"][0] == 1.0


# ----------------------------------------------------------------------------- cache keys


def test_collection_key_names_the_windows_it_holds(tiny, tmp_path):
    cfg = CollectConfig(window=W, max_tokens=2 * W)
    a = collect(tiny.model, None, cfg, tmp_path / "a", windows=WINDOWS, progress=False)
    b = collect(tiny.model, None, cfg, tmp_path / "b", windows=WINDOWS + 1, progress=False)
    assert a.key() != b.key() != cfg.key()  # windows passed in are not the corpus
    assert open_collection(a.path).key() == a.key()
    fp = fingerprint(tiny.model)
    assert default_dir(fp, cfg, a.manifest["windows_sha256"]) != default_dir(fp, cfg)
    with pytest.raises(Exception, match="another model or config"):  # other windows, one folder
        collect(tiny.model, None, cfg, tmp_path / "a", windows=WINDOWS + 1, progress=False)


def test_train_predictors_from_a_collection_saves_under_its_key(
    tiny, tmp_path, monkeypatch, capsys
):
    """Seen: ``--collection X`` saved under the key of the default settings."""
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path / "cache"))
    cfg = CollectConfig(window=W, max_tokens=4 * W)
    col = collect(tiny.model, None, cfg, tmp_path / "col", windows=WINDOWS, progress=False)
    code = cli(["train-predictors", "--model", "random:tiny-llama", "--collection",
                str(col.path), "--mode", "same", "--epochs", "1", "--mlp-rank", "4",
                "--head-rank", "2", "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    saved = capsys.readouterr().out.split()[1]
    pcfg = PredictorConfig(mode="same", mlp_rank=4, head_rank=2, epochs=1)
    fp = fingerprint(tiny.model)
    assert saved == str(default_path(fp, col, pcfg))
    assert saved != str(default_path(fp, CollectConfig(), pcfg))  # not the defaults' key
    assert load_predictors(saved).collection["key"] == col.key()


def test_get_or_train_retrains_an_entry_saved_under_a_wrong_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path / "cache"))
    model, tok, arch = load_model(build(tmp_path / "tiny"))
    ccfg, pcfg = CollectConfig(window=W, max_tokens=2 * W), PredictorConfig(epochs=1, mlp_rank=4)
    wrong = Predictors(fingerprint(model, arch), pcfg)  # e.g. trained on another collection
    wrong.collection = {"key": "0123456789"}
    wrong.save(default_path(fingerprint(model, arch), ccfg, pcfg))
    got = get_or_train(model, tok, pcfg, ccfg, progress=False)
    assert got.info["trained_now"] and got.collection["key"] == ccfg.key()
    again = get_or_train(model, tok, pcfg, ccfg, progress=False)
    assert not again.info["trained_now"]  # now the entry names what it holds
