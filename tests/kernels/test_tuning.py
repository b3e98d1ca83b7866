"""The tuned-configuration tables (:mod:`dejavu_lab.kernels.tuning`): a recorded table is read
back, and a lookup takes the fastest configuration of the nearest recorded shape."""

import pytest
from helpers import DEVICE, on_device

FIXTURES = (on_device,)  # pytest finds fixtures by name in this module


@pytest.mark.skipif(DEVICE != "cpu", reason="table logic only")
def test_tuning_lookup_reads_recorded_tables(tmp_path, monkeypatch):
    from dejavu_lab import results
    from dejavu_lab.kernels import tuning

    fast, slow = {"BLOCK_R": 16, "tag": "fast", "mode": "tile"}, {"BLOCK_R": 32, "tag": "slow"}
    rows = [
        {
            "op": "threshold_gemv",
            "d_in": 11008,
            "d_out": 4096,
            "batch": 1,
            "kept": kept,
            "config": cfg,
            "us": us,
        }
        for kept, cfg, us in [
            (0.1, fast, 5.0),
            (0.1, slow, 6.0),
            (0.5, fast, 14.0),
            (0.5, slow, 12.0),
            (0.2, slow, 9.0),
            (0.2, fast, 7.0),
        ]
    ]
    monkeypatch.setenv(results.ENV_DIR, str(tmp_path))
    path = results.save("tuning_test", rows, command="test")
    gpu = results.provenance("x")["gpu"]
    monkeypatch.setenv(tuning.ENV, str(path))
    tuning.reload()
    try:
        assert tuning._lookup("threshold_gemv", 11008, 4096, 0.5, 1, gpu)["tag"] == "slow"
        assert tuning._lookup("threshold_gemv", 11008, 4096, 0.12, 1, gpu)["tag"] == "fast"
        assert tuning._lookup("threshold_gemv", 11008, 4096, None, 1, gpu)["tag"] == "fast"
        assert tuning._lookup("threshold_gemv", 14336, 4096, 0.1, 1, gpu)["tag"] == "fast"  # near
        assert tuning._lookup("threshold_gemv", 2048, 512, 0.1, 1, gpu) is None  # too far
        assert tuning._lookup("threshold_gemv", 11008, 4096, 0.1, 16, gpu) is None  # batch path
        assert tuning._lookup("threshold_gemv", 11008, 4096, 0.1, 1, "other GPU") is None
        # asked for a mode: the fastest of that mode ("split" also takes configs without one)
        assert tuning._lookup("threshold_gemv", 11008, 4096, 0.1, 1, gpu, "split")["tag"] == "slow"
        assert tuning._lookup("threshold_gemv", 11008, 4096, 0.5, 1, gpu, "tile")["tag"] == "fast"
        assert tuning._lookup("threshold_gemv", 11008, 4096, 0.5, 1, gpu, "other") is None
    finally:
        monkeypatch.delenv(tuning.ENV)
        tuning.reload()
