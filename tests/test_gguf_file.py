"""read_gguf against gguf's own GGUFReader on files gguf's writer made: every metadata value
type, string and number arrays, a custom alignment, plain and block-quantised tensors; and the
one-sentence refusals for files that are not whole GGUF files."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from dejavu_lab.errors import QuantError
from dejavu_lab.quant.gguf_file import read_gguf


def write(path, alignment=None):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_name("a small test file")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 700)
    w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.5)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.25)
    w.add_bool("t.bool", True)
    w.add_token_list(["a", "bb", "ccc", "ünï"])  # a string array: skipped
    w.add_token_scores([0.0, 1.0, 2.0, 3.0])  # a number array: skipped
    w.add_array("t.nested", [[1, 2], [3]])  # an array of arrays: skipped
    tensors = {
        "plain.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "plain.f16": rng.standard_normal((4, 8)).astype(np.float16),
        "blocks.q4_1": rng.standard_normal((6, 64)).astype(np.float32),
        "blocks.q8_0": rng.standard_normal((2, 96)).astype(np.float32),
    }
    kinds = {"blocks.q4_1": T.Q4_1, "blocks.q8_0": T.Q8_0}
    for name, a in tensors.items():
        if name in kinds:
            w.add_tensor(name, gguf_quantize(a, kinds[name]), raw_dtype=kinds[name])
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_and_metadata_equal_gguf_readers(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    write(path, alignment)
    got, want = read_gguf(path), gguf.GGUFReader(path)
    assert list(got.tensors) == [t.name for t in want.tensors]
    for t in want.tensors:
        g = got.tensors[t.name]
        assert g.tensor_type == t.tensor_type and g.shape == tuple(int(d) for d in t.shape)
        assert g.data.dtype == t.data.dtype and g.data.shape == t.data.shape, t.name
        assert np.array_equal(g.data, t.data), t.name
        assert not g.data.flags.writeable
    meta = got.metadata
    assert meta["general.name"] == "a small test file" and meta["general.architecture"] == "llama"
    assert (meta["t.u8"], meta["t.i8"], meta["t.u16"], meta["t.i16"]) == (7, -7, 700, -700)
    assert (meta["t.u32"], meta["t.i32"], meta["t.u64"], meta["t.i64"]) == (
        70000,
        -70000,
        2**40,
        -(2**40),
    )
    assert (meta["t.f32"], meta["t.f64"], meta["t.bool"]) == (0.5, 0.25, True)
    assert "tokenizer.ggml.tokens" not in meta and "t.nested" not in meta
    assert meta.get("general.alignment") == alignment


def test_files_that_are_not_whole_gguf_files_are_refused(tmp_path):
    path = tmp_path / "t.gguf"
    write(path)
    raw = path.read_bytes()
    cases = {
        "missing.gguf": None,
        "empty.gguf": b"",
        "text.gguf": b"not a model at all\n" * 4,
        "v1.gguf": raw[:4] + (1).to_bytes(4, "little") + raw[8:],
        "header_cut.gguf": raw[:200],
        "data_cut.gguf": raw[:-100],
    }
    expect = {
        "missing.gguf": "Cannot open",
        "empty.gguf": "Cannot open",
        "text.gguf": "is not a GGUF file",
        "v1.gguf": "GGUF version 1",
        "header_cut.gguf": "damaged or cut short",
        "data_cut.gguf": "damaged or cut short",
    }
    for name, data in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
        with pytest.raises(QuantError, match=expect[name]) as e:
            read_gguf(tmp_path / name)
        assert str(e.value).count(". ") == 0 and str(e.value).endswith("."), str(e.value)
