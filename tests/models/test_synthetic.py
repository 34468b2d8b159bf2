"""Synthetic-weights models: right shapes and formats, deterministic, built without fp32 weights,
and they run through the ordinary build_model / LlamaModel path to finite logits."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.config import ModelConfig, RuntimeConfig
from edgeinfer.models.synthetic import SHAPES, effective_group, synthetic_model, weight_bytes
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.build import build_model, fixed_runner
from quant.formats import QuantizedTensor

TINY = ModelConfig(vocab_size=320, hidden_size=96, intermediate_size=160, num_layers=3, num_heads=6,
                   num_kv_heads=2, head_dim=16, max_position=128)


def test_shapes_match_the_real_architectures() -> None:
    s, b = SHAPES["135m"], SHAPES["8b"]
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
            s.vocab_size, s.tie_word_embeddings) == (576, 30, 9, 3, 64, 1536, 49152, True)
    assert (b.hidden_size, b.num_layers, b.num_heads, b.num_kv_heads, b.head_dim, b.intermediate_size,
            b.vocab_size, b.tie_word_embeddings) == (4096, 32, 32, 8, 128, 14336, 128256, False)


def test_group_fallback() -> None:
    assert effective_group(128, 4096) == 128
    assert effective_group(128, 576) == 64  # 576 = 4.5 * 128
    assert effective_group(32, 576) == 32
    with pytest.raises(ValueError, match="divides"):
        effective_group(128, 100)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_tiny_weights_formats_and_determinism(fmt: str) -> None:
    a = synthetic_model(TINY, fmt, group_size=32, seed=3)
    b = synthetic_model(TINY, fmt, group_size=32, seed=3)
    c = synthetic_model(TINY, fmt, group_size=32, seed=4)
    assert a.source == "synthetic" and a.tokenizer is None
    assert "lm_head.weight" in a.weights and len(a.weights) == 3 + 9 * TINY.num_layers
    q = a.weights["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(q, QuantizedTensor) and q.format == fmt and q.shape == (96, 160) and q.group_size == 32
    assert torch.equal(q.qweight, b.weights["model.layers.1.mlp.down_proj.weight"].qweight)
    assert not torch.equal(q.qweight, c.weights["model.layers.1.mlp.down_proj.weight"].qweight)
    w = q.dequantize()
    # Zero-centred, row std near 1 / sqrt(K): each layer roughly keeps its input's RMS.
    assert abs(float(w.mean())) < 0.01
    assert 0.5 < float(w.std()) * 160**0.5 < 1.5


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="shape must be one of"):
        synthetic_model("70b")
    with pytest.raises(ValueError, match="weights must be one of"):
        synthetic_model(TINY, "nf4")
    with pytest.raises(ValueError, match="group_size"):
        synthetic_model(TINY, "int4", group_size=16)


@pytest.mark.parametrize(("fmt", "path"), [("int4", "int4_cpu"), ("int8", "reference")])
def test_tiny_forward_finite_and_deterministic(fmt: str, path: str) -> None:
    loaded = synthetic_model(TINY, fmt, group_size=32)
    runtime = RuntimeConfig(linear_path=path)
    logits = []
    for _ in range(2):
        runner = fixed_runner(build_model(loaded, runtime), runtime, 32)
        table = tuple(range(runner.pool.num_blocks))
        first = runner.logits([SeqChunk((1, 5, 7, 9, 11), 0, table)])
        logits.append(torch.cat([first, runner.logits([SeqChunk((4,), 5, table)])]))
    assert logits[0].shape == (2, TINY.vocab_size)
    assert torch.isfinite(logits[0]).all() and float(logits[0].std()) > 0.1
    assert torch.equal(logits[0], logits[1])


def test_135m_shape_builds_small_and_runs_on_the_cpu() -> None:
    loaded = synthetic_model("135m", "int4")
    assert loaded.config == SHAPES["135m"]
    assert loaded.weights["model.layers.0.self_attn.q_proj.weight"].group_size == 64  # K = 576
    assert loaded.weights["model.layers.0.mlp.down_proj.weight"].group_size == 128  # K = 1536
    # int4 with fp16 scales and mins: ~0.53 bytes per weight, no fp32 copy anywhere.
    assert 60e6 < weight_bytes(loaded) < 90e6
    runtime = RuntimeConfig(linear_path="int4_cpu")
    runner = fixed_runner(build_model(loaded, runtime), runtime, 32)
    logits = runner.logits([SeqChunk(tuple(range(1, 9)), 0, tuple(range(runner.pool.num_blocks)))])
    assert logits.shape == (1, 49152) and torch.isfinite(logits).all()
