"""Quantized KV caches store keys centred and K/V rotated (kernels.kv_quant.kv_rotation,
edgeinfer.worker.kv_calibration): exact in exact arithmetic, and smaller int4 error on the real model."""

import pytest
import torch

from edgeinfer.config import ModelConfig
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.synthetic import synthetic_model
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.kv_calibration import prepare_quantized_kv
from edgeinfer.worker.model_runner import ModelRunner
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool
from kernels.kv_quant import dequantize_kv, kv_rotation, quantize_kv

TINY = ModelConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=24, max_position=128)  # head_dim 24: not a power of two


@pytest.mark.parametrize("head_dim", [64, 24, 1])
def test_rotation_is_orthonormal(head_dim: int) -> None:
    r = kv_rotation(head_dim).double()
    assert torch.allclose(r @ r.t(), torch.eye(head_dim, dtype=torch.float64), atol=1e-6)


def logits(model: LlamaModel, kv_dtype: str, tokens: list[int], config: ModelConfig,
           transform: bool | None = None) -> torch.Tensor:
    blocks = -(-len(tokens) // 16)
    pool = KVPool(config.num_layers, blocks, 16, config.num_kv_heads, config.head_dim, kv_dtype, kv_dtype,
                  transform=transform)
    runner = ModelRunner(model, pool, 16)
    prefix, rest = tokens[:-5], tokens[-5:]
    out = [runner.logits([SeqChunk(tuple(prefix), 0, tuple(range(blocks)))])]
    for j, token in enumerate(rest):  # decode steps read the transformed cache too
        out.append(runner.logits([SeqChunk((token,), len(prefix) + j, tuple(range(blocks)))]))
    return torch.cat(out)


def test_centring_and_rotation_leave_attention_unchanged() -> None:
    weights = synthetic_model(TINY, "int8", group_size=32, seed=4).weights
    tokens = [int(t) for t in torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(1))]
    plain = LlamaModel(TINY, dict(weights), choose_backend("reference"))
    want = logits(plain, "fp32", tokens, TINY)
    transformed = LlamaModel(TINY, dict(weights), choose_backend("reference"), kv_calibration_ids=tokens[::-1])
    # An fp32 cache that asks for the transform: centring and rotation run, storage adds no error.
    prepare_quantized_kv(transformed)
    assert transformed.key_centres is not None and transformed.key_centres.abs().max() > 0.1
    got = logits(transformed, "fp32", tokens, TINY, transform=True)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_int4_keys_with_a_shared_offset_lose_less_once_centred() -> None:
    """Why the model centres keys, on any CPU: an int4 group's 16 levels span each token's range
    over 32 channels, a per-channel offset shared by every token (real keys carry one on the slow
    RoPE channels) widens that range, and subtracting the mean removes it exactly. With offsets
    of 8 on a seventh of the channels the error shrinks ~5-10x; the bound leaves 2x of margin.
    On the real model the gain is smaller and measured, not asserted: tools/kv_quality.py."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(300, 2, 64, generator=g)  # (tokens, KV heads, head_dim)
    offset = torch.zeros(64)
    offset[::7] = 8.0
    keys = keys + offset

    def error(x: torch.Tensor) -> float:
        return float((dequantize_kv(quantize_kv(x, "int4")) - x).pow(2).mean())

    assert error(keys - keys.mean(dim=0)) < 0.4 * error(keys)
