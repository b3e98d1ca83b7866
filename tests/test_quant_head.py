"""The ``+head`` quantisation formats: the output projection in int4 too, and a tied one leaves
the input embeddings as they were."""

import torch

from dejavu_lab.measure.quant_quality import format_weights
from dejavu_lab.models import random_model
from dejavu_lab.quant.swap import dequantized


def test_head_format_rounds_the_output_projection_and_not_the_tied_embeddings():
    model = random_model("tiny-llama").model
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in SmolLM2 and Qwen2.5
    emb = model.model.embed_tokens.weight.detach().clone()
    w, info = format_weights(model, "rtn-g64+head")
    assert info["head"] == "lm_head int4 g64" and "lm_head" in w
    layers_only = {k: v for k, v in w.items() if k != "lm_head"}
    ids = torch.arange(16)[None]
    with torch.no_grad():
        with dequantized(model, layers_only):
            layers = model(ids).logits
        with dequantized(model, w):
            both = model(ids).logits
            assert torch.equal(model.model.embed_tokens.weight, emb)  # the input side untouched
            head = model.lm_head.weight.detach().clone()
        hidden = model.model(ids).last_hidden_state
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie is back
    assert torch.equal(head, w["lm_head"].dequantize(torch.float32).T.to(head.dtype))
    assert not torch.equal(both, layers)
    assert torch.equal(model.model.embed_tokens.weight, emb)
    assert hidden.shape[-1] == w["lm_head"].shape[0]
