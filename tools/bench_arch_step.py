"""The fused C++ step against the per-op forward for an architecture's features, on a synthetic
model of the default model's shape (int4 g32, random q/k/v biases and norm weights), fp16 cache.

Per round, each path in turn: a decode step of 1 row and of 16 rows (64-token contexts) and a
128-token prompt chunk, ms (median of the step's repeats), timed through LlamaModel.forward.
The per-op forward runs what the fused step does not take (steps over 128 tokens, observers);
before the fused step covered these architectures it ran every step of theirs.

    python tools/bench_arch_step.py [--spec qwen|gemma3|gemma2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from edgeinfer.config import ArchSpec, ModelConfig, RuntimeConfig  # noqa: E402
from edgeinfer.models.llama import LlamaModel  # noqa: E402
from edgeinfer.models.loader import LoadedModel  # noqa: E402
from edgeinfer.models.synthetic import SHAPES, synthetic_model  # noqa: E402
from edgeinfer.worker.batch import SeqChunk, build_batch  # noqa: E402
from edgeinfer.worker.build import build_model  # noqa: E402
from kernels.kv_pool import KVPool  # noqa: E402

SPECS = {
    "qwen": ArchSpec(qkv_bias=True, qk_norm=True),
    "gemma3": ArchSpec(qk_norm=True, norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh",
                       sliding_window=512, global_every=6, local_rope_theta=10000.0),
    "gemma2": ArchSpec(norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh", sliding_window=512,
                       global_every=2, attn_softcap=50.0),
}
BLOCK = 16


def model_pair(spec: ArchSpec) -> tuple[ModelConfig, LlamaModel, LlamaModel]:
    """The same random weights as the engine builds them (fused) and on the per-op forward."""
    config = dataclasses.replace(SHAPES["135m"], spec=spec, max_position=2048)
    weights = dict(synthetic_model(config, "int4", group_size=32, seed=1).weights)
    g = torch.Generator().manual_seed(0)
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        attn = f"model.layers.{i}.self_attn."
        for part, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            weights[f"{attn}{part}.bias"] = torch.randn(size, generator=g) * 0.1
        for norm in ("q_norm", "k_norm"):
            weights[f"{attn}{norm}.weight"] = 0.5 + torch.rand(config.head_dim, generator=g)
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = torch.rand(config.hidden_size, generator=g)
    fused = build_model(LoadedModel(config, dict(weights), None, "hf"), RuntimeConfig())
    per_op = LlamaModel(config, dict(weights), dataclasses.replace(fused.backend, fused_step_max_tokens=0))
    return config, fused, per_op


def decode_times(model: LlamaModel, config: ModelConfig, rows: int, context: int, repeats: int,
                 phase_ns: torch.Tensor | None = None) -> list[float]:
    """Seconds of each of ``repeats`` decode steps of ``rows`` rows after ``context`` cached tokens
    (fp16 cache, each context prefilled in 128-token chunks, as the fused step takes them),
    fastest first; ``phase_ns``: the timed steps' fused phases are added into it (LlamaModel.phase_ns)."""
    blocks = (context + repeats) // BLOCK + 2
    pool = KVPool(config.num_layers, blocks * rows + 16, BLOCK, config.num_kv_heads, config.head_dim, "fp16", "fp16",
                  "cpu")
    tables = [tuple(range(i * blocks, (i + 1) * blocks)) for i in range(rows)]
    for table in tables:
        for start in range(0, context, 128):
            chunk = tuple(range(1 + start, 1 + min(context, start + 128)))
            model.forward(*build_batch([SeqChunk(chunk, start, table)], BLOCK, "cpu"), pool)
    times = []
    model.phase_ns = phase_ns
    try:
        for step in range(repeats):
            ids, batch = build_batch([SeqChunk((5,), context + step, t) for t in tables], BLOCK, "cpu")
            start = time.perf_counter()
            model.forward(ids, batch, pool)
            times.append(time.perf_counter() - start)
    finally:
        model.phase_ns = None
    return sorted(times)


def decode_ms(model: LlamaModel, config: ModelConfig, rows: int, context: int, repeats: int) -> float:
    return statistics.median(decode_times(model, config, rows, context, repeats)) * 1e3


def prompt_ms(model: LlamaModel, config: ModelConfig, tokens: int, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        pool = KVPool(config.num_layers, 16, BLOCK, config.num_kv_heads, config.head_dim, "fp16", "fp16", "cpu")
        ids, batch = build_batch([SeqChunk(tuple(range(1, tokens + 1)), 0, tuple(range(16)))], BLOCK, "cpu")
        start = time.perf_counter()
        model.forward(ids, batch, pool)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", choices=sorted(SPECS), default="qwen", help="the architecture features (default: qwen)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (default: 3)")
    args = p.parse_args()
    config, fused, per_op = model_pair(SPECS[args.spec])
    assert fused.fused_steps, "the fused step should take this spec"
    print(f"{args.spec}: ms per step, {torch.get_num_threads()} threads")
    print("round  path    decode 1 row  decode 16 rows  128-token chunk")
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, model in (("per-op", per_op), ("fused", fused)):
                print(f"{r:5d}  {name:6s}  {decode_ms(model, config, 1, 64, 30):12.2f}  "
                      f"{decode_ms(model, config, 16, 64, 10):14.2f}  {prompt_ms(model, config, 128):15.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
