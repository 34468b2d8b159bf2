"""End to end: a tiny llama GGUF whose linears are Q4_K / Q5_K / Q6_K / Q5_0 (blocks packed from
random codes and scales) runs through the engine's int4/int8 kernels, fused C++ step and per-op
forward, with the logits of the same model dequantized to fp32 on the reference path."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_packing import random_blocks

from edgeinfer.models.llama import LlamaModel
from edgeinfer.worker.batch import SeqChunk, build_batch
from kernels import cpu_ops
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool
from quant.formats import QuantizedTensor
from quant.gguf_import import load_gguf

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 96
# GGUF name -> (type, rows, cols); Q4_K_M-like: V and down Q6_K, plus Q5_K and Q5_0 parts.
LINEARS = {
    "attn_q": ("Q4_K", HIDDEN, HIDDEN),
    "attn_k": ("Q4_K", KV_HEADS * 64, HIDDEN),
    "attn_v": ("Q6_K", KV_HEADS * 64, HIDDEN),
    "attn_output": ("Q5_K", HIDDEN, HIDDEN),
    "ffn_gate": ("Q4_K", INTER, HIDDEN),
    "ffn_up": ("Q5_0", INTER, HIDDEN),
    "ffn_down": ("Q6_K", HIDDEN, INTER),
}
# Super-block scale ranges that give weights of ~1 / sqrt(K) (random_blocks' defaults are larger).
SCALE = {"Q4_K": 0.01, "Q5_K": 0.005, "Q6_K": 0.01, "Q5_0": 1.0}


def _write(path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    rng = np.random.default_rng(0)
    norm = lambda: (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", norm())
    blocks = lambda kind, n, k, seed: random_blocks(kind, n, k, seed, SCALE[kind]).reshape(n, -1)  # noqa: E731
    writer.add_tensor("output.weight", blocks("Q6_K", VOCAB, HIDDEN, 99), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        for j, (name, (kind, n, k)) in enumerate(LINEARS.items()):
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(kind, n, k, 10 * i + j),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _logits(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    """Logits of a prompt's every position, then of two decode steps (fused where the model can)."""
    c = model.config
    pool = KVPool(c.num_layers, 8, 16, c.num_kv_heads, c.head_dim, "fp32", "fp32", model.device)
    table = (0, 1)
    token_ids, batch = build_batch([SeqChunk(tuple(prompt), 0, table, num_logits=len(prompt))], 16, model.device)
    out = [model.forward(token_ids, batch, pool)]
    for step, token in enumerate((5, 17)):
        token_ids, batch = build_batch([SeqChunk((token,), len(prompt) + step, table)], 16, model.device)
        out.append(model.forward(token_ids, batch, pool))
    return torch.cat(out)


@pytest.mark.skipif(not cpu_ops.available(), reason="the AVX2 CPU ops do not build here")
def test_kquant_model_matches_its_fp32_dequantization(tmp_path: Path) -> None:
    path = tmp_path / "kquant.gguf"
    _write(path)
    loaded = load_gguf(path)
    weights = {name: loaded.weights[name] for name in loaded.weights}
    formats = {name: (w.format, w.group_size, w.mins is not None) for name, w in weights.items()
               if isinstance(w, QuantizedTensor)}
    assert formats["model.layers.0.self_attn.q_proj.weight"] == ("int4", 32, True)  # Q4_K
    assert formats["model.layers.0.self_attn.v_proj.weight"] == ("int8", 16, False)  # Q6_K
    assert formats["model.layers.0.self_attn.o_proj.weight"] == ("int8", 32, True)  # Q5_K
    assert formats["model.layers.0.mlp.up_proj.weight"] == ("int8", 32, False)  # Q5_0
    dense = {name: w.dequantize() if isinstance(w, QuantizedTensor) else w.float() for name, w in weights.items()}
    reference = _logits(LlamaModel(loaded.config, dense, choose_backend("reference")), [3, 1, 4, 1, 5, 9, 2, 6])
    fast = LlamaModel(loaded.config, weights)
    assert fast.fused_steps  # int4 and int8 linears, mixed QKV included
    per_op = LlamaModel(loaded.config, weights, dataclasses.replace(fast.backend, fused_step_max_tokens=0))
    for model in (fast, per_op):
        got = _logits(model, [3, 1, 4, 1, 5, 9, 2, 6])
        assert got.shape == reference.shape
        rel = float((got - reference).norm() / reference.norm())
        assert rel < 1e-4, rel  # the int16 rounding of activations: ~1.5e-5 measured
        assert torch.equal(got.argmax(-1), reference.argmax(-1))
