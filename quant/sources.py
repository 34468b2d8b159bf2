"""Model sources for the conversion tool: a GGUF file or HF-style folder, opened without reading
its tensors, then read one tensor at a time (GGUF memory-mapped, safetensors through safe_open).

HF folders may be plain (fp32/fp16/bf16), bitsandbytes 4-bit (dequantized through bitsandbytes)
or compressed-tensors pack-quantized (int4/int8 layers as QuantizedTensors, exactly:
quant.ctensors_import); any other ``quantization_config`` is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgeinfer.config import ModelConfig
from edgeinfer.models.tokenizer import Tokenizer
from edgeinfer.models.tokenizer_gguf import gguf_file_tokenizer
from quant.formats import QuantizedTensor
from quant.gguf_import import ModelFileError, check_weights, require_gguf_file

Weight = torch.Tensor | QuantizedTensor


@dataclass
class Source:
    """A model to convert, read one tensor at a time."""

    kind: str  # "gguf" | "hf" | "bnb4" | "ct" (compressed-tensors pack-quantized)
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    names: list[str]
    load: Callable[[str], Weight]
    four_bit: tuple[str, ...] = ()  # the 4-bit types the source's weights are stored in, if any


def open_source(path: str | Path) -> Source:
    """Open SRC (GGUF file or HF folder) without reading its tensors."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"source model not found: {path}")
    if path.is_file():
        require_gguf_file(path)
        source = _open_gguf(path)
    else:
        source = _open_hf(path)
    check_weights(dict.fromkeys(source.names), source.config, str(path))
    return source


def _open_gguf(path: Path) -> Source:
    from gguf import GGMLQuantizationType

    from quant.gguf_import import open_gguf_model

    gguf = open_gguf_model(path)
    tokenizer = gguf_file_tokenizer(path, gguf.tokenizer_metadata)
    types = {GGMLQuantizationType(t.ggml_type).name for t in gguf.tensors.values()}
    four_bit = tuple(sorted(t for t in types if t.startswith(("Q4", "IQ4", "Q3", "Q2", "IQ3", "IQ2", "IQ1"))))
    return Source("gguf", path, gguf.config, tokenizer, list(gguf.tensors), gguf.load, four_bit)


_BNB_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state")


def _open_hf(folder: Path) -> Source:
    from safetensors import SafetensorError, safe_open

    from quant.ctensors_import import ct_weight, is_ctensors, module_names
    from quant.ctensors_import import is_part as ct_part
    from quant.hf_import import read_hf_config

    config = read_hf_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    qcfg = raw.get("quantization_config") or {}
    kind = "hf"
    if qcfg and is_ctensors(qcfg):
        kind = "ct"
    elif qcfg:
        if qcfg.get("quant_method") != "bitsandbytes" or not qcfg.get("load_in_4bit"):
            raise ModelFileError(
                f"{folder}: quantization_config {qcfg.get('quant_method')!r} "
                f"(load_in_4bit={qcfg.get('load_in_4bit')}) is not supported; "
                "edgeinfer converts plain, bitsandbytes 4-bit and compressed-tensors checkpoints"
            )
        kind = "bnb4"
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder} has no .safetensors weights (pickle checkpoints are never loaded)")
    handles: dict[str, Any] = {}
    try:
        for file in files:
            handle = safe_open(str(file), framework="pt")
            handles.update(dict.fromkeys(handle.keys(), handle))
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{folder}: {exc} (truncated or corrupt safetensors?)") from exc
    is_part = lambda key: any(f".weight.{p}" in key for p in _BNB_PARTS) or ct_part(key)  # noqa: E731
    packed = set(module_names(list(handles))) if kind == "ct" else set()
    names = [key for key in handles if not is_part(key)] + [f"{m}.weight" for m in sorted(packed)]

    def get(key: str) -> torch.Tensor:
        try:
            return handles[key].get_tensor(key)
        except SafetensorError as exc:
            raise ModelFileError(f"{folder}: tensor {key} cannot be read (truncated?): {exc}") from exc

    def load(name: str) -> Weight:
        if name.removesuffix(".weight") in packed:
            return ct_weight(qcfg, name.removesuffix(".weight"), get, handles.__contains__, str(folder))
        if f"{name}.absmax" in handles:
            return _dequantize_bnb4(
                folder,
                name,
                {k[len(name) + 1 :]: get(k) for k in handles if k.startswith(f"{name}.")},
                get(name),
            )
        t = get(name)
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ModelFileError(f"{folder}: tensor {name} has unsupported dtype {t.dtype}")
        return t

    return Source(kind, folder, config, Tokenizer.from_folder(folder), names, load, ("nf4",) if kind == "bnb4" else ())


def _dequantize_bnb4(
    folder: Path, name: str, parts: dict[str, torch.Tensor], packed: torch.Tensor
) -> torch.Tensor:
    from quant.nf4 import bitsandbytes_available

    if not bitsandbytes_available():
        raise ModelFileError(
            f"{folder} is a bitsandbytes 4-bit checkpoint; install bitsandbytes "
            "(pip install 'edgeinfer[nf4]') to convert it"
        )
    import bitsandbytes.functional as bnbf

    state = bnbf.QuantState.from_dict(parts, device=torch.device("cpu"))
    return bnbf.dequantize_4bit(packed, state).float()
