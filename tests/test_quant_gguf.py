"""GGUF's 4-bit blocks into Int4Weight, against gguf's and transformers' own dequantisation."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from dejavu_lab import assets
from dejavu_lab.errors import QuantError
from dejavu_lab.models import DEMO_ASSET, load_model, random_model
from dejavu_lab.quant import quantize
from dejavu_lab.quant.gguf_blocks import decode_blocks, int4_from_blocks
from dejavu_lab.quant.gguf_file import read_gguf
from dejavu_lab.quant.gguf_model import gguf_names, import_gguf
from dejavu_lab.quant.swap import decoder_linears, dequantized, rtn_weights


def _q4_k_blocks(rng, rows: int, n_in: int) -> np.ndarray:
    """Random but valid Q4_K rows: any bytes are codes and 6-bit scales; d, dmin finite fp16."""
    b = rng.integers(0, 256, (rows, n_in // 256, 144), dtype=np.uint8)
    b[..., 0:4] = (rng.random((rows, n_in // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def _gguf(data, kind) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, kind))


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1])
def test_q4_0_and_q4_1_blocks_are_exact_in_fp32_and_fp16(kind):
    w = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    data = gguf_quantize(w, kind)  # [out, bytes]: gguf's own quantiser
    ref = _gguf(data, kind)
    for dtype in (torch.float32, torch.float16):
        q = int4_from_blocks(data, kind, 256, dtype=dtype)
        assert q.shape == (256, 48) and q.group == 32
        assert torch.equal(q.dequantize(torch.float32).T, ref)


def test_q4_k_blocks_are_exact_in_fp32_and_round_in_fp16():
    data = _q4_k_blocks(np.random.default_rng(1), 16, 512)
    ref = _gguf(data, T.Q4_K)
    assert torch.equal(int4_from_blocks(data, "Q4_K", 512).dequantize().T, ref)
    exact = int4_from_blocks(data, "Q4_K", 512)
    half = int4_from_blocks(data, "Q4_K", 512, dtype=torch.float16)
    # d · sc has up to 17 significant bits; fp16 keeps 11: each scale within 2^-11 relative
    rel = (half.scales.float() - exact.scales).abs() / exact.scales.abs().clamp(min=1e-30)
    assert 0 < rel.max() <= 2**-11
    codes, scales, mins = decode_blocks(data, "Q4_K", 512)
    assert codes.max() <= 15 and scales.shape == mins.shape == (16, 16)


def test_output_rows_permute_whole_columns():
    w = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    data = gguf_quantize(w, T.Q4_1)
    rows = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    q = int4_from_blocks(data, "Q4_1", 64, rows=rows)
    assert torch.equal(q.dequantize().T, _gguf(data, T.Q4_1)[rows])


@pytest.fixture(scope="module")
def demo():
    return load_model("demo"), read_gguf(assets.fetch(DEMO_ASSET))


def test_demo_tensors_import_bitwise(demo):
    """Q4_1 layers: equal to gguf's dequantisation and to transformers' loaded weights (which
    un-permutes W_Q/W_K), bit for bit in fp32 — on a few tensors, not the whole model."""
    (model, _, arch), path = demo
    last = arch.n_layers - 1
    want = [f"model.layers.0.self_attn.{p}_proj" for p in ("q", "k", "v")]
    want += [f"model.layers.{last}.mlp.down_proj", "model.layers.3.mlp.gate_proj"]
    imp = import_gguf(model, path, modules=want)
    assert sorted(imp.weights) == sorted(want) and set(imp.types.values()) == {"Q4_1"}
    assert sorted(imp.exact) == sorted(want)
    mods = dict(model.named_modules())
    for name, q in imp.weights.items():
        assert torch.equal(q.dequantize().T, mods[name].weight), name
    # fp16 scales and mins hold Q4_1's d and m exactly
    half = import_gguf(model, path, dtype=torch.float16, modules=want[:1])
    assert torch.equal(half.weights[want[0]].dequantize(torch.float32).T, mods[want[0]].weight)
    # the demo IS 4-bit at group 32: round-to-nearest gives its Q4_1 values back
    w = mods[want[3]].weight.detach()
    assert torch.equal(quantize(w.T, group=32, dtype=torch.float32).dequantize().T, w)


def test_gguf_names_and_refusals(demo):
    (model, _, arch), path = demo
    names = gguf_names(model)
    assert names["blk.0.attn_output.weight"] == "model.layers.0.self_attn.o_proj"
    assert len(names) == 7 * arch.n_layers
    with pytest.raises(QuantError, match="not a decoder linear"):
        import_gguf(model, path, modules=["model.embed_tokens"])
    tiny = random_model("tiny-llama").model
    with pytest.raises(QuantError, match=r"is \[576, 576\] but model.layers.0.self_attn.q_proj"):
        import_gguf(tiny, path)
    deeper = random_model("tiny-llama", num_hidden_layers=31).model  # one layer more than the file
    with pytest.raises(QuantError, match="lacks 7 of the model's linears"):
        import_gguf(deeper, path)
    with pytest.raises(QuantError, match="is not a GGUF file"):
        import_gguf(tiny, __file__)
    with pytest.raises(QuantError, match="GGUF import maps gated"):
        gguf_names(random_model("tiny-opt").model)
    with pytest.raises(QuantError, match="not 4-bit"):
        decode_blocks(np.zeros((1, 34), np.uint8), "Q8_0", 32)
    with pytest.raises(QuantError, match="not whole rows"):
        decode_blocks(np.zeros((1, 21), np.uint8), "Q4_1", 32)


def test_dequantized_swaps_and_restores_exactly():
    model, _, arch = random_model("tiny-llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (1, 12))
    weights = rtn_weights(model, group=32, dtype=torch.float16)
    assert sorted(weights) == sorted(decoder_linears(model, arch))
    with torch.no_grad():
        dense = model(ids).logits
        with dequantized(model, weights):
            mods = dict(model.named_modules())
            for name, q in weights.items():
                assert torch.equal(mods[name].weight, q.dequantize(torch.float32).T)
            quant = model(ids).logits
        assert not torch.equal(dense, quant)
        with pytest.raises(RuntimeError), dequantized(model, weights):
            raise RuntimeError("a failing forward")
        assert torch.equal(model(ids).logits, dense)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(QuantError, match="not a linear layer"):
        with dequantized(model, {"model.norm": next(iter(weights.values()))}):
            pass
