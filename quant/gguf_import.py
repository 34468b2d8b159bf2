"""GGUF import: a .gguf file -> (ModelConfig, weights by HF name, tokenizer metadata).

The container is parsed by quant.gguf_reader; this module maps names, types and layouts.

Quantized types become the engine's int4/int8 formats block by block (quant.gguf_blocks has the
table: Q4_0/Q4_1/Q8_0/Q5_0/Q5_1 bit for bit, Q4_K/Q5_K/Q6_K up to the fp16 rounding of their
scale products). F32/F16/BF16 stay as they are. Other types (Q2_K, Q3_K, IQ*) are dequantized by
the gguf package and re-quantized to int4 g32, with one warning per file naming them and the
error measured; a type the gguf package cannot read either is refused with ModelFileError.

For arch llama, llama.cpp's converter permutes the rows of Q and K so its interleaved RoPE
matches HF's rotate-half RoPE; we undo that permutation (rows only, so quantized rows move
unchanged) and the model uses one RoPE for every source. The per-architecture metadata and
tensor names are quant.gguf_arch's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeinfer.config import ModelConfig
from quant import gguf_blocks
from quant.formats import QuantizedTensor
from quant.gguf_arch import (
    ModelFileError,
    check_weights,
    hf_name,
    permutes_rope_rows,
    read_config,
    tokenizer_fields,
    unpermute_rope_rows,
)
from quant.gguf_reader import (
    GGUF_MAGIC,
    GGMLType,
    GGUFFile,
    GGUFFormatError,
    TensorInfo,
    open_gguf,
    read_rows_reference,
    read_tensor,
)

log = logging.getLogger(__name__)

# The types with their own decoder (quant.gguf_blocks); the rest are re-quantized with a warning.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def require_gguf_file(path: Path) -> None:
    """Raise ModelFileError unless the file at ``path`` starts with the GGUF magic."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (magic {magic!r}) nor a model folder")


Weight = torch.Tensor | QuantizedTensor


@dataclass(frozen=True)
class GGUFModel:
    config: ModelConfig
    weights: LazyWeights
    tokenizer_metadata: dict[str, Any]


def read_tokenizer_metadata(reader: GGUFFile) -> dict[str, Any]:
    meta = tokenizer_fields(reader)
    if "ggml.tokens" not in meta:
        raise ModelFileError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    return meta


def convert_tensor(tensor: TensorInfo, raw: np.ndarray) -> Weight:
    """One tensor's raw bytes -> a torch tensor or QuantizedTensor (see the module docstring).
    Types without a decoder are dequantized by the gguf package; 2-D ones are re-quantized to
    int4 g32 (open_gguf_model has warned about them, naming the types and the error)."""
    # GGUF lists dims fastest-first; torch wants (rows, cols).
    shape = tuple(reversed(tensor.shape))
    kind = tensor.ggml_type
    if kind == GGMLType.F32:
        return torch.from_numpy(raw.view(np.float32).copy()).reshape(shape)
    if kind == GGMLType.F16:
        return torch.from_numpy(raw.view(np.float16).copy()).reshape(shape)
    if kind == GGMLType.BF16:
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(shape)
    if len(shape) == 2 and kind in gguf_blocks.DECODERS:
        return gguf_blocks.DECODERS[kind](raw, *shape)
    values = gguf_blocks.dequantize_other(kind, raw, shape)
    if len(shape) == 2 and shape[1] % gguf_blocks.Q_BLOCK == 0:
        return gguf_blocks.requantize_int4(values)[0]
    return torch.from_numpy(values).reshape(shape)


def _warn_requantized(path: Path, tensors: Mapping[str, TensorInfo]) -> None:
    """One warning line for the whole file: the types that are re-quantized to int4, how many
    tensors each, and the relative RMS error it adds, measured on each type's smallest tensor
    (so the warning costs one small conversion per type). A type the gguf package cannot
    dequantize is refused here, before anything is loaded."""
    found = gguf_blocks.requantized_types(tensors.values())
    if not found:
        return
    parts = []
    for kind, group in sorted(found.items()):
        sample = min(group, key=lambda t: t.nbytes)
        name = gguf_blocks.type_name(kind)
        try:
            values = gguf_blocks.dequantize_other(kind, read_tensor(path, sample), tuple(reversed(sample.shape)))
            _, error = gguf_blocks.requantize_int4(values)
        except NotImplementedError as exc:
            raise ModelFileError(f"{path}: tensor {sample.name} has GGUF type {name}, which edgeinfer cannot "
                                 f"read ({exc}); supported: {', '.join(SUPPORTED_TYPES)}") from exc
        parts.append(f"{name} ({len(group)} tensors, +{error:.1%} RMS on {sample.name})")
    log.warning("%s: GGUF types without an int kernel are dequantized and re-quantized to int4 g32, adding "
                "weight error relative to the tensor's RMS: %s", path, "; ".join(parts))


@dataclass(frozen=True)
class GGUFSource:
    """An opened GGUF file whose tensors are converted one at a time (the conversion tool
    streams them; load_gguf takes them all)."""

    path: Path
    config: ModelConfig
    tokenizer_metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]  # HF name -> where the tensor lies

    def load(self, name: str) -> Weight:
        tensor = self.tensors[name]
        try:
            raw = read_tensor(self.path, tensor)
            c = self.config
            if permutes_rope_rows(c.architecture, name):
                raw = unpermute_rope_rows(raw, tensor.shape[-1], c.num_heads if "q_proj" in name else c.num_kv_heads)
            return convert_tensor(tensor, raw)
        except NotImplementedError as exc:
            raise ModelFileError(
                f"{self.path}: tensor {tensor.name} has a GGUF type that cannot be read: {exc}"
            ) from exc
        except ValueError as exc:
            raise ModelFileError(f"{self.path}: tensor {tensor.name} is damaged: {exc}") from exc


def open_gguf_model(path: str | os.PathLike[str]) -> GGUFSource:
    """Parse a GGUF file's metadata and tensor index; errors name the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        reader = open_gguf(path)
    except (GGUFFormatError, UnicodeDecodeError, OSError, struct.error) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    config = read_config(reader)
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, config.architecture)
        if name is None:
            log.info("ignoring GGUF tensor %s", tensor.name)
        else:
            tensors[name] = tensor
    _warn_requantized(path, tensors)
    return GGUFSource(path, config, read_tokenizer_metadata(reader), tensors)


# GGUF types kernels.cpu_ops.read_rows decodes (a tensor of another type is loaded whole).
_ROW_TYPES = {GGMLType.F32: None, GGMLType.F16: None, GGMLType.BF16: None,
              GGMLType.Q4_0: "int4", GGMLType.Q4_1: "int4", GGMLType.Q8_0: "int8", GGMLType.Q5_0: "int8",
              GGMLType.Q5_1: "int8", GGMLType.Q4_K: "int4", GGMLType.Q5_K: "int8", GGMLType.Q6_K: "int8"}


# (fd, offset, n, k, type, ids, cache, cache_ids): kernels.cpu_ops.read_rows
RowReader = Callable[[int, int, int, int, int, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
# Bytes of a FileRows' cache of rows read (see FileRows).
ROW_CACHE_BYTES = 4 << 20


class FileRows:
    """The rows of one 2-D GGUF tensor, read from the file when asked; only an open file is held.

    For the embedding, which a decode step touches a row per token of (plus the head's refined
    candidates when tied): the default model's 49152 x 576 Q8_0 table is 29 MB of resident
    memory when loaded. A row costs one pread and its decoding (kernels.cpu_ops.read_rows), except
    a row still in the read rows' cache: ROW_CACHE_BYTES of the file's bytes (6,853 of those 49,152
    rows), direct-mapped, filled as rows are read. A decode step reads ~65 rows a token, mostly
    the same likely tokens' from step to step, at ~1.2-1.8 us a pread on the VM measured.
    """

    def __init__(self, path: Path, tensor: TensorInfo) -> None:
        if len(tensor.shape) != 2 or tensor.ggml_type not in _ROW_TYPES:
            raise ValueError(f"tensor {tensor.name} cannot be read by rows (shape {tensor.shape}, "
                             f"GGUF type {tensor.ggml_type})")
        k, n = tensor.shape
        self.shape = (n, k)
        self.format = _ROW_TYPES[tensor.ggml_type]  # QuantizedTensor format of read(), None: dense
        self._path = path
        self._tensor = tensor
        self._row_bytes = tensor.nbytes // n
        self._fd = os.open(path, os.O_RDONLY)  # open as long as the model lives
        slots = max(1, min(n, ROW_CACHE_BYTES // self._row_bytes))
        self._cache = torch.empty(slots, self._row_bytes, dtype=torch.uint8)  # pages used as filled
        self._cache_ids = torch.full((slots,), -1, dtype=torch.int64)
        self._cache_lock = threading.Lock()  # read_rows updates the cache: one call at a time

    def __del__(self) -> None:
        if hasattr(self, "_fd"):
            os.close(self._fd)

    def read(self, row_ids: torch.Tensor, reader: RowReader | None = None, cached: bool = True) -> torch.Tensor:
        """fp32 (len(row_ids), K): rows ``row_ids`` (1-D, any order, repeats allowed), decoded by
        ``reader`` (kernels.cpu_ops.read_rows, which sits above this file format), else by
        read_reference. ``cached``: through the cache of rows read (reader only); a pass over
        the whole table would only fill it with rows no step asked for."""
        t = self._tensor
        try:
            if reader is None:
                return self.read_reference(row_ids)
            if not cached:
                return reader(self._fd, t.offset, *self.shape, t.ggml_type, row_ids, None, None)
            with self._cache_lock:
                return reader(self._fd, t.offset, *self.shape, t.ggml_type, row_ids, self._cache, self._cache_ids)
        except RuntimeError as exc:
            raise ModelFileError(f"{self._path}: reading rows of tensor {t.name}: {exc}") from exc

    def read_reference(self, row_ids: torch.Tensor) -> torch.Tensor:
        """read() through the importer's conversion: one pread per row, convert, dequantize."""
        raw = read_rows_reference(self._fd, self._tensor.offset, self._row_bytes, self.shape[0], row_ids)
        selected = dataclasses.replace(self._tensor, shape=(self.shape[1], raw.shape[0]), nbytes=raw.numel())
        rows = convert_tensor(selected, raw.numpy().reshape(-1))
        return rows.dequantize(torch.float32) if isinstance(rows, QuantizedTensor) else rows.float()

    def load(self) -> Weight:
        """The whole tensor, converted."""
        return convert_tensor(self._tensor, read_tensor(self._path, self._tensor))


class LazyWeights(Mapping[str, Weight]):
    """A GGUF file's weights by HF name, each read and converted on first use.

    Reading all of them up front held a second copy of the model (~100 MB) while the model
    prepared its own, and left their freed blocks as holes in the heap; with LlamaModel trimming
    the heap per layer, peak RSS of `bench` went 458 -> 439 MB. ``pop`` hands a tensor over
    without keeping it (LlamaModel's take_weights); ``[]`` keeps it for later readers.
    """

    def __init__(self, source: GGUFSource) -> None:
        self._source = dataclasses.replace(source, tokenizer_metadata={})  # the vocabulary is ~10 MB
        self._names = list(source.tensors)
        self._kept: dict[str, Weight] = {}

    def __getitem__(self, name: str) -> Weight:
        if name not in self._kept:
            if name not in self._names:
                raise KeyError(name)
            self._kept[name] = self._source.load(name)
        return self._kept[name]

    def file_rows(self, name: str, take: bool = False) -> FileRows | None:
        """Tensor ``name`` as FileRows, or None where its rows do not convert on their own (type,
        or a Q/K permutation). ``take`` drops the name, as ``pop`` does."""
        if name not in self._names:
            raise KeyError(name)
        tensor = self._source.tensors[name]
        if name.endswith(("q_proj.weight", "k_proj.weight")) or len(tensor.shape) != 2 or \
                tensor.ggml_type not in _ROW_TYPES:
            return None
        if take:
            self._kept.pop(name, None)
            self._names.remove(name)
        return FileRows(self._source.path, tensor)

    def pop(self, name: str) -> Weight:
        if name not in self._names:
            raise KeyError(name)
        weight = self._kept.pop(name, None)
        if weight is None:
            weight = self._source.load(name)
        self._names.remove(name)
        return weight

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def load_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Open a GGUF file: config, tokenizer metadata, and its weights read when used."""
    source = open_gguf_model(path)
    check_weights(dict.fromkeys(source.tensors), source.config, str(path))
    return GGUFModel(source.config, LazyWeights(source), source.tokenizer_metadata)
