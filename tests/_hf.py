"""A forward of a transformers model with its KV cache, by the keyword its version takes
(:func:`dejavu_lab.deferred_kv.cache_keyword`). The tests' references decode with it."""

from __future__ import annotations

from dejavu_lab.deferred_kv import cache_keyword


def kv_forward(model, ids, cache=None):
    """``(logits, cache)`` of ``model(ids)`` with ``use_cache=True``, continuing ``cache``."""
    key = cache_keyword(model)
    out = model(ids, use_cache=True, **({key: cache} if cache is not None else {}))
    return out.logits, (out.cache if key == "cache" else out.past_key_values)
