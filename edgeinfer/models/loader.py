"""Open any supported model: a GGUF file, an HF-style folder, or an edgeinfer checkpoint.

The format is read from the file itself (GGUF magic, config.json's fields), never guessed from
a name. Returns plain data: the architecture, the weights by HF name, and the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgeinfer.config import ModelConfig
from edgeinfer.models.tokenizer import Tokenizer
from edgeinfer.models.tokenizer_gguf import gguf_file_tokenizer
from quant.formats import QuantizedTensor
from quant.gguf_import import ModelFileError, require_gguf_file


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor | QuantizedTensor]  # a GGUF's are read when first used
    tokenizer: Tokenizer | None  # None for synthetic models (edgeinfer.models.synthetic)
    source: str  # "gguf" | "hf" | "edgeinfer"
    # A checkpoint planned to a memory budget (quant.budget): its weight and KV bytes, context,
    # parallel sequences and KV dtype, which the server checks against the machine at start.
    budget_plan: tuple[tuple[str, Any], ...] = ()


def load_model(path: str | Path) -> LoadedModel:
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_file():
        require_gguf_file(path)
        from quant.gguf_import import load_gguf

        gguf = load_gguf(path)
        return LoadedModel(gguf.config, gguf.weights, gguf_file_tokenizer(path, gguf.tokenizer_metadata), "gguf")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelFileError(f"{path} is a folder without config.json: not a model")
    raw = json.loads(config_path.read_text())
    if "edgeinfer_format" in raw:
        from quant.checkpoint import load_checkpoint

        config, weights = load_checkpoint(path)
        loaded = _with_stop_ids(config, weights, Tokenizer.from_folder(path), "edgeinfer")
    else:
        from quant.hf_import import load_hf_folder

        config, weights = load_hf_folder(path)
        loaded = _with_stop_ids(config, weights, Tokenizer.from_folder(path), "hf")
    # A budget plan goes with its weights into an exported compressed-tensors folder as well.
    plan = raw.get("edgeinfer_plan") or {}
    return dataclasses.replace(loaded, budget_plan=tuple((k, v) for k, v in plan.items() if k != "layers"))


def _with_stop_ids(config: ModelConfig, weights: Mapping[str, torch.Tensor | QuantizedTensor], tokenizer: Tokenizer,
                   source: str) -> LoadedModel:
    """A folder's config.json names one EOS; its tokenizer (generation_config.json's eos list)
    names every id the model's own generation stops on. The engine stops on all of them."""
    stop_ids = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.stop_token_ids)))
    return LoadedModel(dataclasses.replace(config, eos_token_ids=stop_ids), weights, tokenizer, source)
