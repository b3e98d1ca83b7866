"""Rotary position embedding and the decode step's epilogues: :mod:`.rotate` (RoPE in place),
:mod:`.qkv` (the kept heads' QKV rows, RoPE and the KV write in one launch) and :mod:`.epilogue`
(a threshold GEMV's sums finished with RoPE, or with the residual add and the next norm)."""
