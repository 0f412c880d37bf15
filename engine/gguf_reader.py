"""A small, fast GGUF (v2/v3) reader: metadata as python values, tensors as numpy views.

gguf.GGUFReader builds a numpy view per array element (~5 s for SmolLM2's 100k-entry token
tables); this reader walks the header with struct and memory-maps the tensor data instead.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]     # numpy order (outermost first), in elements
    ggml_type: int
    offset: int                # byte offset of the data in the file


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            return [self.value(item_type) for _ in range(count)]
        return self.unpack(_SCALARS[vtype])


def read_gguf(path: Path) -> tuple[dict[str, Any], list[TensorInfo], np.ndarray]:
    """Return (metadata, tensor infos, whole file as a read-only uint8 memmap).

    Raises ValueError when the file is not GGUF v2/v3.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        infos.append(TensorInfo(name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    for t in infos:
        t.offset += start
    return meta, infos, np.memmap(path, dtype=np.uint8, mode="r")


def tensor_float32(data: np.ndarray, info: TensorInfo) -> np.ndarray:
    """Dequantize one tensor to a float32 array of info.shape."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.ggml_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(info.shape))
    raw = data[info.offset: info.offset + n // block * type_size]
    row_bytes = info.shape[-1] // block * type_size
    raw = raw.reshape(*info.shape[:-1], row_bytes)
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(info.shape)
    return dequantize(raw, qtype).reshape(info.shape).astype(np.float32, copy=False)
