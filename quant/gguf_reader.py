"""A fast GGUF (v2/v3) container reader: metadata, tensor index, and one tensor's bytes at a time.

The gguf package's GGUFReader builds a numpy memmap view for every string of the vocabulary
(~250k views for a 49k-token model: 9 s here, and the whole file mapped). This reader parses the
metadata block from one buffered read with `struct` (~0.3 s), and reads each tensor's bytes with
a plain file read when asked, so nothing stays mapped (and a matrix's rows one by one:
read_rows_reference). The gguf package still provides the
quantization type table and dequantization of types we do not map natively.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGMLType(IntEnum):
    """The GGML tensor types edgeinfer converts itself; any other goes through the gguf package
    (imported only then: it pulls in sentencepiece and yaml, ~4 MB of RSS)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# (elements, bytes) per block, as ggml defines them.
_BLOCK_SIZES = {GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2),
                GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q8_0: (32, 34),
                GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24), GGMLType.Q4_K: (256, 144),
                GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210)}


def block_size(ggml_type: int) -> tuple[int, int] | None:
    """(elements, bytes) per block of a GGML type; None for a type unknown to ggml."""
    if ggml_type in _BLOCK_SIZES:
        return _BLOCK_SIZES[GGMLType(ggml_type)]
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES.get(ggml_type)


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Reads little-endian values from a growing buffer of the file's head."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._buf = b""
        self.pos = 0

    def take(self, n: int) -> bytes:
        while self.pos + n > len(self._buf):
            chunk = self._f.read(max(1 << 20, n))
            if not chunk:
                raise GGUFFormatError(f"file ends inside the metadata at byte {self.pos} (truncated)")
            self._buf += chunk
        out = self._buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * size)))
            return [self.value(item_type) for _ in range(count)]
        raise GGUFFormatError(f"unknown GGUF value type {value_type} at byte {self.pos}")


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


def read_tensor(path: Path, tensor: TensorInfo) -> np.ndarray:
    """The raw bytes (uint8) of one tensor of the GGUF file at ``path``."""
    with open(path, "rb") as f:
        f.seek(tensor.offset)
        data = np.frombuffer(f.read(tensor.nbytes), dtype=np.uint8)
    if data.size != tensor.nbytes:
        raise GGUFFormatError(f"tensor {tensor.name} is cut short: {data.size} of {tensor.nbytes} bytes")
    return data


def read_rows_reference(fd: int, offset: int, row_bytes: int, num_rows: int, row_ids: torch.Tensor) -> torch.Tensor:
    """(len(row_ids), row_bytes) uint8: rows of the matrix of ``num_rows`` rows that starts at
    byte ``offset`` of the open file ``fd``, one pread each (kernels.cpu_ops.read_rows is the fast
    version; raises IndexError for a row outside the matrix, RuntimeError where the file ends)."""
    out = torch.empty((row_ids.numel(), row_bytes), dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")
    for i, row in enumerate(row_ids.tolist()):
        if not 0 <= row < num_rows:
            raise IndexError(f"row id {row} is outside [0, {num_rows})")
        done = 0
        while done < row_bytes:
            got = os.preadv(fd, [view[i * row_bytes + done:(i + 1) * row_bytes]], offset + row * row_bytes + done)
            if got == 0:
                raise RuntimeError(f"reading row {row}: the file ends at byte {offset + row * row_bytes + done} "
                                   "(changed while in use?)")
            done += got
    return out


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        cur = _Cursor(f)
        magic = cur.take(4)
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (expected 2 or 3)")
        num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, ggml_type, rel in infos:
        sizes = block_size(ggml_type)
        if sizes is None:
            raise GGUFFormatError(f"tensor {name} has unknown GGML type {ggml_type}")
        block, type_size = sizes
        count = int(np.prod(dims)) if dims else 1
        nbytes = count // block * type_size
        info = TensorInfo(name, dims, ggml_type, data_start + rel, nbytes)
        if info.offset + nbytes > size:
            raise GGUFFormatError(
                f"tensor {name} needs bytes up to {info.offset + nbytes} but the file has {size} (truncated)"
            )
        tensors.append(info)
    return GGUFFile(path, version, metadata, tuple(tensors))
