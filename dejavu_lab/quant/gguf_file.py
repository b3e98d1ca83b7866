"""The tensors of a GGUF file, mapped in a fraction of a second.

A GGUF file is a header — key/value metadata, then one entry per tensor (name, dimensions,
ggml type, offset) — followed by the tensors' blocks. ``gguf.GGUFReader`` turns every metadata
value into numpy views, the tokenizer's vocabulary included: about 10 s for the demo model's
49k tokens on one CPU core, before the first weight is read. :func:`read_gguf` walks the same
header with :mod:`struct`, skips array values (the vocabulary, merges and scores: a reader of
weights has no use for them), and maps each tensor's bytes read-only, shaped as
``GGUFReader`` shapes them, so :func:`gguf.quants.dequantize` and
:func:`~dejavu_lab.quant.gguf_blocks.int4_from_blocks` take them as they are.

Little-endian GGUF versions 2 and 3 (what llama.cpp has written since 2023); anything else is
refused in one sentence.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import QuantError

__all__ = ["GGUFFile", "GGUFTensor", "read_gguf"]

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: 0-7 and 10-12 are scalars, 8 a string, 9 an array
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in ggml order (``shape[0]``, the row width, first), ``data`` a
    read-only view of its bytes — the elements for the plain types (F32, F16, F64, I8 to I64),
    else uint8 ``[..., bytes of one row]``, as ``gguf.GGUFReader`` gives them.

    >>> from dejavu_lab import assets
    >>> from dejavu_lab.models import DEMO_ASSET
    >>> t = read_gguf(assets.fetch(DEMO_ASSET)).tensors["output_norm.weight"]
    >>> t.tensor_type.name, t.shape, t.data.dtype, t.data.flags.writeable
    ('F32', (576,), dtype('float32'), False)
    """

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """What :func:`read_gguf` found: the scalar and string metadata (arrays skipped) and the
    tensors by name, in file order.

    >>> from dejavu_lab import assets
    >>> from dejavu_lab.models import DEMO_ASSET
    >>> f = read_gguf(assets.fetch(DEMO_ASSET))
    >>> f.version, f.metadata["llama.block_count"], "tokenizer.ggml.tokens" in f.metadata
    (3, 30, False)
    """

    path: str
    version: int
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]


class _Header:
    def __init__(self, buf):
        self.buf, self.off = buf, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.off)
        self.off += struct.calcsize("<" + fmt)
        return v

    def string(self) -> str:
        n = self.take("Q")
        s = bytes(self.buf[self.off : self.off + n])
        if len(s) != n:
            raise struct.error("string past the end of the file")
        self.off += n
        return s.decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind in _SCALARS:
            self.off += struct.calcsize("<" + _SCALARS[kind])
        elif kind == _STRING:
            n = self.take("Q")  # the length, then that many bytes
            self.off += n
        elif kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS:
                self.off += count * struct.calcsize("<" + _SCALARS[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise struct.error(f"unknown metadata value type {kind}")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        self.skip_value(kind)
        return None


def read_gguf(path) -> GGUFFile:
    """Map the GGUF file at ``path``: its metadata (scalars and strings) and its tensors.

    >>> from dejavu_lab import assets
    >>> from dejavu_lab.models import DEMO_ASSET
    >>> f = read_gguf(assets.fetch(DEMO_ASSET))  # the demo model: 272 tensors, 49k-token vocabulary
    >>> f.metadata["general.architecture"], len(f.tensors)
    ('llama', 272)
    >>> t = f.tensors["blk.0.attn_k.weight"]
    >>> t.tensor_type.name, t.shape, t.data.shape  # 576 inputs in 18 Q4_1 blocks of 20 bytes
    ('Q4_1', (576, 192), (192, 360))
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise QuantError(
            f"Cannot open {path!r} ({type(e).__name__}); pass an existing .gguf file."
        ) from None
    h = _Header(buf)
    try:
        if bytes(buf[:4]) != MAGIC:
            raise QuantError(f"{path!r} is not a GGUF file (no GGUF magic); pass a .gguf file.")
        h.off = 4
        version = h.take("I")
        if version not in (2, 3):
            raise QuantError(
                f"{path!r} is GGUF version {version} (or big-endian); convert it with a current "
                "llama.cpp (versions 2 and 3, little-endian, are read)."
            )
        n_tensors, n_kv = h.take("Q"), h.take("Q")
        metadata = {}
        for _ in range(n_kv):
            key = h.string()
            value = h.value(h.take("I"))
            if value is not None:
                metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = h.string()
            dims = tuple(h.take("Q") for _ in range(h.take("I")))
            infos.append((name, GGMLQuantizationType(h.take("I")), dims, h.take("Q")))
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-h.off // align) * align
        tensors = {}
        for name, kind, dims, offset in infos:
            n = int(np.prod(dims, dtype=np.int64))
            block, size = GGML_QUANT_SIZES[kind]
            np_dims = tuple(reversed(dims))
            if kind.name in _PLAIN:
                dtype, count = _PLAIN[kind.name], n
            else:  # blocks: uint8 [..., bytes of one row]
                dtype, count = np.uint8, n * size // block
                np_dims = (*np_dims[:-1], np_dims[-1] * size // block)
            data = np.frombuffer(buf, dtype=dtype, count=count, offset=start + offset)
            tensors[name] = GGUFTensor(name, kind, dims, data.reshape(np_dims))
    except (struct.error, ValueError, KeyError) as e:
        raise QuantError(
            f"{path!r} is damaged or cut short ({type(e).__name__}: {e}); fetch the file again."
        ) from None
    return GGUFFile(path, version, metadata, tensors)
