"""What `edgeinfer show` says about a model, read from headers alone (no weight is loaded).

GGUF: the metadata and tensor index (quant.gguf_reader); an HF folder: config.json and each
safetensors header; an edgeinfer checkpoint: config.json and the per-weight formats its
safetensors metadata records. A file that cannot be read raises ModelFileError naming it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.config import ModelConfig
from edgeinfer.models.store import model_format
from quant.checkpoint import WEIGHTS_FILE, read_header
from quant.gguf_import import ModelFileError, read_config
from quant.gguf_reader import GGUFFormatError, open_gguf
from quant.hf_import import read_hf_config


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    format: str  # "gguf", "hf" or "edgeinfer"
    architecture: str
    num_parameters: int
    tensor_types: dict[str, int]  # GGUF type, safetensors dtype or checkpoint format -> tensors
    context_length: int | None  # the model's own, as its metadata says
    chat_template: bool
    file_bytes: int  # on disk, every file of the model
    weight_bytes: int  # the tensors' bytes
    config: ModelConfig | None  # None when edgeinfer cannot run it ...
    unsupported: str | None = None  # ... and why


def _file_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _gguf_info(path: Path) -> ModelInfo:
    from gguf import GGMLQuantizationType

    try:
        reader = open_gguf(path)
    except (GGUFFormatError, OSError) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = str(reader.metadata.get("general.architecture", "unknown"))
    types = Counter(GGMLQuantizationType(t.ggml_type).name for t in reader.tensors)
    config, why = None, None
    try:
        config = read_config(reader)
    except (ModelFileError, ValueError) as exc:
        why = str(exc)
    context = reader.metadata.get(f"{arch}.context_length")
    return ModelInfo(path, "gguf", arch, sum(math.prod(t.shape) for t in reader.tensors), dict(types),
                     None if context is None else int(context), "tokenizer.chat_template" in reader.metadata,
                     _file_bytes(path), sum(t.nbytes for t in reader.tensors), config, why)


def _has_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    tokenizer_config = folder / "tokenizer_config.json"
    return tokenizer_config.is_file() and bool(_json(tokenizer_config).get("chat_template"))


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFileError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _hf_info(folder: Path) -> ModelInfo:
    raw = _json(folder / "config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder} has no .safetensors weights")
    types: Counter[str] = Counter()
    params = weight_bytes = 0
    for file in files:
        header, data_start = read_header(file)  # names the file when truncated or corrupt
        for name, entry in header.items():
            if name != "__metadata__":
                types[entry["dtype"]] += 1
                params += math.prod(entry["shape"])
        weight_bytes += file.stat().st_size - data_start
    config, why = None, None
    try:
        config = read_hf_config(folder)
    except (ModelFileError, KeyError, ValueError) as exc:
        why = str(exc) if not isinstance(exc, KeyError) else f"{folder}/config.json lacks {exc}"
    return ModelInfo(folder, "hf", str(raw.get("model_type", "unknown")), params, dict(types),
                     raw.get("max_position_embeddings"), _has_template(folder), _file_bytes(folder),
                     weight_bytes, config, why)


def _checkpoint_info(folder: Path) -> ModelInfo:
    raw = _json(folder / "config.json")
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise ModelFileError(f"{folder} has no {WEIGHTS_FILE}")
    header, data_start = read_header(file)
    types: Counter[str] = Counter()
    params = 0
    for name, value in header.get("__metadata__", {}).items():
        if name not in ("format", "format_version"):
            meta = json.loads(value)
            types[meta["format"]] += 1
            params += math.prod(meta["shape"])
    config, why = None, None
    try:
        config = ModelConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        why = f"{folder}/config.json: {exc}"
    context = config.max_position if config else raw.get("max_position")
    return ModelInfo(folder, "edgeinfer", str(raw.get("architecture", "llama")), params, dict(types), context,
                     _has_template(folder), _file_bytes(folder), file.stat().st_size - data_start, config, why)


def model_info(path: Path) -> ModelInfo:
    fmt = model_format(path)
    if fmt == "gguf":
        return _gguf_info(path)
    return _hf_info(path) if fmt == "hf" else _checkpoint_info(path)
