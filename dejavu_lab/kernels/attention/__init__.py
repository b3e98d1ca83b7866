"""Sparse attention over the selected heads (Deja Vu §4.4): :mod:`.sparse` (QKV of the kept
heads, attention, W_O), :mod:`.core` (attention over their KV cache) and :mod:`.kv_window` (the
KV cache's write of a window of tokens)."""
