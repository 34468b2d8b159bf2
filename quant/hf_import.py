"""HF-style folder import: config.json + *.safetensors (+ tokenizer.json) -> config and weights.

config.json is read as transformers 5 writes it (rope_parameters, layer_types) and as 4.x did
(rope_theta, rope_scaling at the top level); each architecture's differences from Llama become
the config's ArchSpec, and anything else it asks for (an unknown RoPE scaling, biases the
forward has no place for) is refused by name rather than approximated.

Weights stay in the folder's dtype (fp16/bf16/fp32); names are already the HF names the model
uses. A compressed-tensors folder's packed int4/int8 layers become QuantizedTensors
(quant.ctensors_import), exactly. Only safetensors are read: pickled .bin checkpoints are refused, never loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from edgeinfer.config import ArchSpec, ModelConfig
from quant.gguf_arch import ModelFileError, check_weights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    try:
        rope_theta, spec = _spec(cfg, model_type, head_dim)
    except ValueError as exc:  # ModelFileError, or ArchSpec's own check
        raise ModelFileError(f"{folder}: {exc}") from exc
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        architecture=model_type,
        spec=spec,
    )


def _spec(cfg: dict[str, Any], model_type: str, head_dim: int) -> tuple[float, ArchSpec]:
    """The global RoPE base and the ArchSpec of a config.json (transformers 4.x or 5 layout)."""
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window", "use_bidirectional_attention"):
        # Qwen 2's q/k/v biases are not a flag: its attention always has them.
        if cfg.get(flag):
            raise ModelFileError(f"{model_type} with {flag}=true is not supported")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if activation not in _ACTIVATIONS:
        raise ModelFileError(f"activation {activation!r} is not supported; edgeinfer runs {tuple(_ACTIVATIONS)}")
    spec: dict[str, Any] = {"activation": _ACTIVATIONS[activation]}
    # transformers 5 keeps the RoPE settings in rope_parameters (Gemma 3: one per layer type);
    # 4.x wrote rope_theta and rope_scaling at the top level.
    rope = cfg.get("rope_parameters") or {}
    if model_type == "gemma3_text":
        local = rope.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        if local.get("rope_type", "default") != "default":
            raise ModelFileError(f"RoPE scaling {local['rope_type']!r} on local layers is not supported")
        spec["local_rope_theta"] = float(local["rope_theta"])
        rope = rope.get("full_attention") or {}
    rope = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {}), **rope}
    theta = float(rope["rope_theta"])
    if {float(rope.get("partial_rotary_factor", 1.0)), float(cfg.get("partial_rotary_factor", 1.0))} != {1.0}:
        raise ModelFileError("partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
    spec |= _rope_scaling(rope, theta, head_dim)
    if model_type in ("mistral", "phi3"):  # every layer within the window, where one is set
        spec["sliding_window"] = cfg.get("sliding_window")
    spec |= {"qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True},
             "phi3": {"fused_qkv": True, "fused_gate_up": True}}.get(model_type, {})
    if model_type in ("gemma2", "gemma3_text"):
        spec |= {"norm_offset": 1.0, "sandwich_norms": True, "embed_scale": math.sqrt(cfg["hidden_size"]),
                 "attn_scale": float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                 "attn_softcap": cfg.get("attn_logit_softcapping"),
                 "final_softcap": cfg.get("final_logit_softcapping"),
                 "sliding_window": cfg["sliding_window"], "qk_norm": model_type == "gemma3_text",
                 "global_every": 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern", 6))}
    built = ArchSpec(**spec)
    layer_types = cfg.get("layer_types")
    if layer_types is not None:  # transformers 5 lists each layer's kind: it must be the spec's
        ours = ["sliding_attention" if built.is_local(i) else "full_attention" for i in range(len(layer_types))]
        if list(layer_types) != ours:
            raise ModelFileError(f"layer_types {layer_types} is not the {model_type} pattern edgeinfer runs ({ours})")
    return theta, built


def _rope_scaling(rope: dict[str, Any], theta: float, head_dim: int) -> dict[str, Any]:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rope_scaling": "linear", "rope_factor": float(rope["factor"])}
    if kind == "llama3":
        return {"rope_scaling": "llama3", "rope_freq_factors": llama3_freq_factors(
            theta, head_dim, float(rope["factor"]), float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))}
    raise ModelFileError(f"RoPE scaling {kind!r} is not supported; edgeinfer runs {SUPPORTED_ROPE_TYPES}")


def llama3_freq_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> tuple[float, ...]:
    """Llama 3's RoPE scaling as a divisor per frequency (what llama.cpp's converter writes as
    rope_freqs): high frequencies kept, low ones divided by ``factor``, a smooth blend between."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original_context / high_freq_factor:
            factors.append(1.0)
        elif wavelen > original_context / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
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
    qcfg = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    if qcfg:
        weights = _dequantized(folder, qcfg, weights)
    check_weights(weights, config, str(folder))
    return config, weights


def _dequantized(folder: Path, qcfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A compressed-tensors folder's packed layers as int4/int8 QuantizedTensors (exact); any
    other quantization_config is refused by name."""
    from quant.ctensors_import import ct_weight, is_ctensors, is_part, module_names

    if not is_ctensors(qcfg):
        raise ModelFileError(f"{folder}: quantization_config {qcfg.get('quant_method')!r} is served after "
                             "`edgeinfer quantize` converts it (compressed-tensors folders are served directly)")
    weights: dict[str, Any] = {k: v for k, v in tensors.items() if not is_part(k)}
    for module in module_names(list(tensors)):
        weights[f"{module}.weight"] = ct_weight(qcfg, module, tensors.__getitem__, tensors.__contains__, str(folder))
    return weights
