"""HF-style folder import: config.json + *.safetensors (+ tokenizer.json) -> config and weights.

Weights stay in the folder's dtype (fp16/bf16/fp32); names are already the HF names the model
uses. Only safetensors are read: pickled .bin checkpoints are refused, never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from edgeinfer.config import ModelConfig
from quant.gguf_import import ModelFileError, check_weights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{folder} has no config.json")
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelFileError(
            f"{folder}: unsupported architecture {model_type!r}; edgeinfer runs {SUPPORTED_MODEL_TYPES}"
        )
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        architecture="llama",
    )


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        hint = ""
        if pickles:
            hint = f" (found {pickles}: pickle checkpoints are never loaded; convert them to safetensors)"
        raise ModelFileError(f"{folder} has no .safetensors weights{hint}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file} is not a readable safetensors file (truncated?): {exc}") from exc
    check_weights(weights, config, str(folder))
    return config, weights
