"""The model runs whatever formats a checkpoint mixes: nf4 and int8 projections (not fusable as
quantized tensors) next to int4 ones, on the exact path and on the CPU fast path."""

import pytest
import torch

from edgeinfer.config import ModelConfig
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.synthetic import synthetic_model
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool
from quant.formats import QuantizedTensor, quantize_int8
from quant.nf4 import quantize_nf4

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32, max_position=64)


def _logits(config: ModelConfig, weights: dict, path: str) -> torch.Tensor:
    model = LlamaModel(config, dict(weights), choose_backend(path))
    pool = KVPool(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, "fp32", "fp32")
    return ModelRunner(model, pool, 16).logits([SeqChunk(tuple(range(1, 20)), 0, (0, 1), num_logits=19)])


@pytest.mark.parametrize("path, tolerance", [("reference", 1e-5), ("int4_cpu", 3e-2)])
def test_nf4_and_int8_parts_match_their_dequantized_weights(path: str, tolerance: float) -> None:
    weights = dict(synthetic_model(TINY, "int4", group_size=32, seed=3).weights)
    nf4 = lambda name: quantize_nf4(weights[name].dequantize(), blocksize=64)  # noqa: E731
    # Layer 0 all nf4, as `edgeinfer quantize --weights nf4` writes; layer 1 mixed nf4/int8/int4.
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        weights[f"model.layers.0.self_attn.{name}.weight"] = nf4(f"model.layers.0.self_attn.{name}.weight")
    for name in ("gate_proj", "up_proj", "down_proj"):
        weights[f"model.layers.0.mlp.{name}.weight"] = nf4(f"model.layers.0.mlp.{name}.weight")
    for name in ("self_attn.q_proj", "mlp.up_proj"):
        weights[f"model.layers.1.{name}.weight"] = nf4(f"model.layers.1.{name}.weight")
    k1 = "model.layers.1.self_attn.k_proj.weight"
    weights[k1] = quantize_int8(weights[k1].dequantize())
    dense = {k: v.dequantize() if isinstance(v, QuantizedTensor) else v for k, v in weights.items()}
    got, want = _logits(TINY, weights, path), _logits(TINY, dense, "reference")
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < tolerance
