"""A forward of a transformers model with its KV cache, by the keyword its version takes:
``cache`` (transformers 5.2x; ``past_key_values`` is deprecated there and goes in 5.40) or
``past_key_values`` (earlier 5.x, the GPU image's 5.17). The tests' references decode with it."""

from __future__ import annotations

import inspect


def kv_forward(model, ids, cache=None):
    """``(logits, cache)`` of ``model(ids)`` with ``use_cache=True``, continuing ``cache``."""
    new = "cache" in inspect.signature(model.forward).parameters
    key = "cache" if new else "past_key_values"
    out = model(ids, use_cache=True, **({key: cache} if cache is not None else {}))
    return out.logits, (out.cache if new else out.past_key_values)
