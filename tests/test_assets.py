"""dejavu_lab.assets: real downloads from the registry, verified, cached, and every failure."""

import errno
import os

import pytest

from dejavu_lab import assets
from dejavu_lab.assets import ASSETS, Asset, AssetError, fetch

LEE = ASSETS["lee_background.cor"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def no_registry(monkeypatch):
    """pip with no config files and an index nobody listens on."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")


def files(d):
    return sorted(p.name for p in d.rglob("*")) if d.exists() else []


def test_fetch_verifies_caches_and_then_needs_no_network(cache, monkeypatch):
    path = fetch("lee_background.cor")
    assert path.parent == cache and assets.sha256_file(path) == LEE.sha256
    assert path.read_text().startswith("Hundreds of people have been forced")
    assert files(cache) == ["lee_background.cor"]  # no temp files or wheels left behind
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    assert fetch("lee_background.cor") == path  # second call: from the cache, offline


def test_wrong_checksum_caches_nothing(cache):
    bad = Asset(LEE.requirement, LEE.member, "0" * 64, LEE.pip_args)
    with pytest.raises(AssetError, match="sha256 .* not the pinned 000000000000"):
        fetch(bad)
    assert files(cache) == []


def test_missing_registry_is_one_clear_error(cache, no_registry):
    with pytest.raises(AssetError, match="Could not download gensim==4.4.0 .* check the network"):
        fetch("lee_background.cor")
    assert files(cache) == []


def test_full_disk_leaves_no_partial_file(cache, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(assets.shutil, "copyfileobj", disk_full)
    with pytest.raises(AssetError, match="No space left .* DEJAVU_LAB_CACHE"):
        fetch("lee_background.cor")
    assert files(cache) == []


def test_corrupt_cached_file_is_reported_and_kept(cache):
    cache.mkdir()
    (cache / "lee_background.cor").write_text("truncated")
    with pytest.raises(AssetError, match="corrupt .* delete it"):
        fetch("lee_background.cor")
    assert (cache / "lee_background.cor").read_text() == "truncated"


def test_unknown_asset_lists_known_ones(cache):
    with pytest.raises(AssetError, match="Unknown asset 'nope'.*lee_background.cor"):
        fetch("nope")
