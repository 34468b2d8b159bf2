"""Synthetic-weights models for benchmarks: real architectures, random quantized weights.

``synthetic_model`` returns a LoadedModel (config + weights by HF name, no tokenizer) that
build_model / LlamaModel take exactly like a loaded checkpoint, so speed can be measured on a
Llama-3-8B-shaped model without downloading one. The quantized weights are made directly in
their stored form (random packed nibbles or int8 codes, random scales and mins) on the target
device: no fp32 weight is ever materialised, so the 8B int4 model (~4.5 GB) builds in seconds.

Value ranges are chosen so activations stay finite through every layer in fp16: codes are
uniform, so ``w = q * scale + min`` has mean 0 with ``min = -7.5 * scale`` (int4), and the scale
makes a row's standard deviation about ``1 / sqrt(K)`` (the usual init), so each linear layer
roughly preserves the RMS of its input. This module holds no state.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from edgeinfer.config import ModelConfig
from edgeinfer.models.loader import LoadedModel
from quant.formats import QuantizedTensor

WEIGHT_FORMATS = ("int4", "int8")

SHAPES: dict[str, ModelConfig] = {
    # SmolLM2-135M-Instruct, the default model (values read from its GGUF).
    "135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    # Meta-Llama-3-8B.
    "8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, max_position=8192,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
}

_INT4_CODE_STD = math.sqrt((16**2 - 1) / 12)  # std of a code uniform on 0..15
_INT8_CODE_STD = math.sqrt((255**2 - 1) / 12)  # std of a code uniform on -127..127


def effective_group(group_size: int, k: int) -> int:
    """``group_size`` if it divides K, else the largest of 128/64/32 below it that does (SmolLM2's
    576 is not a multiple of 128), as quant.convert falls back."""
    for g in (group_size, 128, 64, 32):
        if g <= group_size and k % g == 0:
            return g
    raise ValueError(f"no group size <= {group_size} among 128/64/32 divides K={k}")


def random_quantized(
    n: int, k: int, fmt: str, group_size: int, generator: torch.Generator, device: torch.device
) -> QuantizedTensor:
    """An (N, K) weight of random codes with per-group scales near ``1 / (sqrt(K) * code std)``."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    group = effective_group(group_size, k)
    code_std = _INT4_CODE_STD if fmt == "int4" else _INT8_CODE_STD
    # (N, K // group): a random factor in [0.5, 1.5) per group, so no two groups are alike.
    jitter = torch.rand((n, k // group), generator=generator, device=device) + 0.5
    scales = (jitter / (math.sqrt(k) * code_std)).to(torch.float16)
    if fmt == "int4":
        qweight = torch.randint(0, 256, (n, k // 2), generator=generator, device=device, dtype=torch.uint8)
        mins = (-7.5 * scales.float()).to(torch.float16)  # centres codes 0..15 on zero
        return QuantizedTensor("int4", (n, k), group, qweight, scales, mins)
    qweight = torch.randint(-127, 128, (n, k), generator=generator, device=device, dtype=torch.int8)
    return QuantizedTensor("int8", (n, k), group, qweight, scales)


def synthetic_model(
    shape: str | ModelConfig,
    weights: str = "int4",
    group_size: int = 128,
    seed: int = 0,
    device: str | torch.device = "cpu",
    max_position: int | None = None,
) -> LoadedModel:
    """A LoadedModel of ``shape`` ("135m", "8b" or any ModelConfig) with random ``weights``.

    Every linear layer, the embedding and (when untied) the head are ``weights``-quantized with
    ``group_size`` (falling back to a divisor of K); norms are fp32 ones. Tensors are made on
    ``device`` (make them on the GPU for the 8B shape: seconds instead of minutes). The same
    seed gives the same weights on the same device.
    """
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"shape must be one of {tuple(SHAPES)} or a ModelConfig, got {shape!r}")
        config = SHAPES[shape]
    else:
        config = shape
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    if max_position is not None:
        config = replace(config, max_position=max_position)
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    c = config
    linears = c.linear_shapes()

    def quantized(n: int, k: int) -> QuantizedTensor:
        return random_quantized(n, k, weights, group_size, generator, device)

    def ones() -> torch.Tensor:
        return torch.ones(c.hidden_size, dtype=torch.float32, device=device)

    tensors: dict[str, torch.Tensor | QuantizedTensor] = {
        "model.embed_tokens.weight": quantized(c.vocab_size, c.hidden_size),
        "model.norm.weight": ones(),
    }
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = quantized(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        prefix = f"model.layers.{i}."
        tensors[prefix + "input_layernorm.weight"] = ones()
        tensors[prefix + "post_attention_layernorm.weight"] = ones()
        for name, (n, k) in linears.items():
            tensors[prefix + name + ".weight"] = quantized(n, k)
    return LoadedModel(config, tensors, None, "synthetic")  # type: ignore[arg-type]  # no tokenizer


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of every weight as stored (codes, scales, mins, plain tensors)."""
    total = 0
    for w in loaded.weights.values():
        total += w.nbytes if isinstance(w, QuantizedTensor) else w.numel() * w.element_size()
    return total
