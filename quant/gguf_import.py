"""GGUF import: a .gguf file -> (ModelConfig, weights by HF name, tokenizer metadata).

The container is parsed by quant.gguf_reader; this module maps names, types and layouts.

Q4_0 / Q4_1 become int4 group-32 QuantizedTensors and Q8_0 becomes int8 group-32, bit for bit
(the fp16 block scales are kept as fp16). F32/F16/BF16 stay as they are. Any other type is
dequantized by the gguf package and returned in fp32, with a warning naming it.

llama.cpp's converter permutes the rows of Q and K so its interleaved RoPE matches HF's
rotate-half RoPE; we undo that permutation (rows only, so quantized rows move unchanged) and the
model uses one RoPE for every source.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeinfer.config import ModelConfig
from quant.formats import QuantizedTensor
from quant.gguf_eog import end_of_generation_ids
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

SUPPORTED_ARCHITECTURES = ("llama",)
Q4_BLOCK = 32

# GGUF tensor name -> HF name ("{i}" is the layer index)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelFileError(ValueError):
    """A model file that cannot be used: wrong architecture, truncated, missing tensors."""


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


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def read_config(reader: GGUFFile) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"unsupported architecture {arch!r}; edgeinfer runs {SUPPORTED_ARCHITECTURES}"
        )
    names = {t.name for t in reader.tensors}

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelFileError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=end_of_generation_ids(_tokenizer_fields(reader)),
        architecture=arch,
    )


def _tokenizer_fields(reader: GGUFFile) -> dict[str, Any]:
    return {k.removeprefix("tokenizer."): v for k, v in reader.metadata.items() if k.startswith("tokenizer.")}


def read_tokenizer_metadata(reader: GGUFFile) -> dict[str, Any]:
    meta = _tokenizer_fields(reader)
    if "ggml.tokens" not in meta:
        raise ModelFileError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    return meta


def _q4_blocks(raw: np.ndarray, n: int, k: int, has_min: bool) -> QuantizedTensor:
    """Q4_0/Q4_1 blocks -> int4 group-32. Block: d (fp16) [, m (fp16)], 16 bytes of nibbles where
    byte j holds element j (low) and element j + 16 (high)."""
    block_bytes = 20 if has_min else 18
    blocks = raw.reshape(n, k // Q4_BLOCK, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if has_min:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:]
    else:
        m = (-8.0 * d.astype(np.float32)).astype(np.float16)
        qs = blocks[..., 2:]
    elements = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # (n, k // 32, 32) in order
    packed = (elements[..., 0::2] | (elements[..., 1::2] << 4)).reshape(n, k // 2)  # pack_int4's layout
    scales = torch.from_numpy(d.copy())
    mins = torch.from_numpy(m.copy())
    if not has_min:
        # -8 * d in fp16 can round; keep it exact in fp32 instead.
        mins = -8.0 * scales.float()
    return QuantizedTensor("int4", (n, k), Q4_BLOCK, torch.from_numpy(packed), scales, mins)


def _q8_blocks(raw: np.ndarray, n: int, k: int) -> QuantizedTensor:
    blocks = raw.reshape(n, k // Q4_BLOCK, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return QuantizedTensor("int8", (n, k), Q4_BLOCK, torch.from_numpy(q), torch.from_numpy(d.copy()))


def convert_tensor(tensor: TensorInfo, raw: np.ndarray) -> Weight:
    """One tensor's raw bytes -> a torch tensor or QuantizedTensor (see the module docstring)."""
    # GGUF lists dims fastest-first; torch wants (rows, cols).
    shape = tuple(reversed(tensor.shape))
    kind = tensor.ggml_type
    if kind == GGMLType.F32:
        return torch.from_numpy(raw.view(np.float32).copy()).reshape(shape)
    if kind == GGMLType.F16:
        return torch.from_numpy(raw.view(np.float16).copy()).reshape(shape)
    if kind == GGMLType.BF16:
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(shape)
    if len(shape) == 2 and kind in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0):
        n, k = shape
        if kind == GGMLType.Q8_0:
            return _q8_blocks(raw, n, k)
        return _q4_blocks(raw, n, k, has_min=kind == GGMLType.Q4_1)
    from gguf import GGMLQuantizationType, dequantize

    kind = GGMLQuantizationType(kind)
    log.warning("tensor %s has GGUF type %s: dequantized to fp32", tensor.name, kind.name)
    return torch.from_numpy(dequantize(raw.reshape(shape[0], -1), kind).astype(np.float32)).reshape(shape)


def unpermute_rope_rows(raw: np.ndarray, num_rows: int, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved -> rotate-half halves) on a 2-D
    tensor's raw bytes, before conversion: a row is a contiguous byte range in every GGUF type,
    and numpy's copy here spares torch's strided-copy kernels at load (~2 MB of code pages)."""
    rows = raw.reshape(num_heads, num_rows // num_heads // 2, 2, -1)
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(-1)


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
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                c = self.config
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
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            log.info("ignoring GGUF tensor %s", tensor.name)
        else:
            tensors[name] = tensor
    return GGUFSource(path, read_config(reader), read_tokenizer_metadata(reader), tensors)


# GGUF types whose rows convert on their own, bit for bit (the others dequantize with a warning).
_ROW_TYPES = {GGMLType.F32: None, GGMLType.F16: None, GGMLType.BF16: None,
              GGMLType.Q4_0: "int4", GGMLType.Q4_1: "int4", GGMLType.Q8_0: "int8"}


RowReader = Callable[[int, int, int, int, int, torch.Tensor], torch.Tensor]  # (fd, offset, n, k, type, ids)


class FileRows:
    """The rows of one 2-D GGUF tensor, read from the file when asked; only an open file is held.

    For the embedding, which a decode step touches a row per token of (plus the head's refined
    candidates when tied): the default model's 49152 x 576 Q8_0 table is 29 MB of resident
    memory when loaded. A row costs one pread and its decoding (kernels.cpu_ops.read_rows).
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

    def __del__(self) -> None:
        if hasattr(self, "_fd"):
            os.close(self._fd)

    def read(self, row_ids: torch.Tensor, reader: RowReader | None = None) -> torch.Tensor:
        """fp32 (len(row_ids), K): rows ``row_ids`` (1-D, any order, repeats allowed), decoded by
        ``reader`` (kernels.cpu_ops.read_rows, which sits above this file format), else by
        read_reference."""
        t = self._tensor
        try:
            if reader is not None:
                return reader(self._fd, t.offset, *self.shape, t.ggml_type, row_ids)
            return self.read_reference(row_ids)
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


def expected_weight_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{part}.weight" for part in _LAYER_NAMES.values()]
    return names


def check_weights(weights: dict[str, Weight], config: ModelConfig, source: str) -> None:
    missing = [n for n in expected_weight_names(config) if n not in weights]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(f"{source} is missing tensor(s) {', '.join(missing[:3])}{more}")
