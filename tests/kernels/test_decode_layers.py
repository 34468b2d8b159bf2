"""The fused C++ step (kernels/cpu/decode_layers.cpp) against the model's per-op forward: same
logits and the same K/V written, for decode rows, prompt chunks and mixed steps of several
sequences with scattered blocks, every KV format; bad arguments get errors that name them."""

from __future__ import annotations

import copy
import dataclasses
import gc
import time

import pytest
import torch

from edgeinfer.config import ArchSpec, ModelConfig, RuntimeConfig
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.loader import LoadedModel
from edgeinfer.models.synthetic import synthetic_model
from edgeinfer.worker.batch import SeqChunk, build_batch
from edgeinfer.worker.build import build_model
from kernels import cpu_a8, cpu_ops
from kernels.dispatch import LEAN_ONE_TERM, Backend, choose_backend
from kernels.kv_pool import KVPool
from quant.formats import QuantizedTensor, unpack_int4

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the AVX2 CPU ops do not build here")

# q_size (3 heads x 32 = 96) differs from hidden (64), and 3 query heads share 1 KV head.
CONFIG = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=3,
                     num_kv_heads=1, head_dim=32, max_position=128)
BLOCK = 4
# int8x2 activations against the per-op forward: bounded on the whole (see
# test_fused_step_runs_int8_activation_linears); on a multi-threaded CPU a step of a few rows then
# runs as a team.
A8X2_BOUND = 5e-3


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return synthetic_model(CONFIG, "int4", group_size=32, seed=3)


@pytest.fixture(scope="module")
def model(loaded: LoadedModel) -> LlamaModel:
    model = LlamaModel(loaded.config, loaded.weights)
    assert model.fused_steps, "an int4 g32 model on the CPU takes the fused step"
    return model


def bounded(loaded: LoadedModel, model: LlamaModel, max_tokens: int) -> LlamaModel:
    """The same weights on the same backend, with fused steps only up to ``max_tokens`` tokens
    (0: the per-op forward, the fused step's reference)."""
    backend = dataclasses.replace(model.backend, fused_step_max_tokens=max_tokens)
    return LlamaModel(loaded.config, loaded.weights, backend)


@pytest.fixture(scope="module")
def per_op(loaded: LoadedModel, model: LlamaModel) -> LlamaModel:
    return bounded(loaded, model, 0)


def a8_backend() -> Backend:
    """int8 activations in two terms (kernels.cpu_a8), the engine's choice on a VNNI CPU: steps of a
    few rows then run as a team (decode_layers' use_team), more rows op by op."""
    return choose_backend(int8_activations=True, a8_terms=2)


def assert_near(actual: torch.Tensor, expected: torch.Tensor, tol: float, activations: str) -> None:
    """Element by element within ``tol`` of the largest (int16 activations); with int8 ones a value
    at a rounding boundary of a GEMM's input moves a residual code step, so the bound is on the
    whole, as test_fused_step_runs_int8_activation_linears sets it (a wiring mistake moves every
    value by its own size)."""
    actual, expected = actual.float(), expected.float()
    if activations == "int16":
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * expected.abs().max().item())
    else:
        assert float((actual - expected).norm() / expected.norm()) < max(tol, A8X2_BOUND)


def with_activations(loaded: LoadedModel, model: LlamaModel, per_op: LlamaModel,
                     activations: str) -> tuple[LlamaModel, LlamaModel]:
    """The fused and per-op models on int16 activations (the fixtures) or int8 ones ("int8x2")."""
    if activations == "int16":
        return model, per_op
    fused = LlamaModel(loaded.config, loaded.weights, a8_backend())
    return fused, bounded(loaded, fused, 0)


def _prefilled(model: LlamaModel, kv_dtype: str, prompts: list[list[int]],
               tables: list[tuple[int, ...]]) -> KVPool:
    c = model.config
    pool = KVPool(c.num_layers, 24, BLOCK, c.num_kv_heads, c.head_dim, kv_dtype, kv_dtype, model.device)
    for ids, table in zip(prompts, tables, strict=True):
        token_ids, batch = build_batch([SeqChunk(tuple(ids), 0, table)], BLOCK, model.device)
        model.forward(token_ids, batch, pool)
    return pool


def _decode_step(fused: LlamaModel, per_op: LlamaModel, fused_pool: KVPool, reference_pool: KVPool,
                 lengths: tuple[int, ...], tables: list[tuple[int, ...]], g: torch.Generator,
                 step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One random token (from ``g``) per sequence after its ``length + step`` tokens: the logits
    of the fused step and of the per-op forward, each on its own pool."""
    chunks = [SeqChunk((int(torch.randint(0, CONFIG.vocab_size, (), generator=g)),), n + step, t)
              for n, t in zip(lengths, tables, strict=True)]
    token_ids, batch = build_batch(chunks, BLOCK, fused.device)
    assert batch.is_decode
    assert fused.runs_fused(len(token_ids), fused_pool) and not per_op.runs_fused(len(token_ids), reference_pool)
    return fused.forward(token_ids, batch, fused_pool), per_op.forward(token_ids, batch, reference_pool)


@pytest.mark.parametrize("activations", ["int16", "int8x2"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "int8", "int4"])
def test_fused_decode_matches_the_per_op_forward(loaded: LoadedModel, model: LlamaModel, per_op: LlamaModel,
                                                 kv_dtype: str, activations: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model, per_op = with_activations(loaded, model, per_op, activations)
    g = torch.Generator().manual_seed(0)
    if kv_dtype in ("int8", "int4"):  # keys centred as after calibration (then rotated and quantized)
        c = model.config
        centres = torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, generator=g)
        for m in (model, per_op):
            monkeypatch.setattr(m, "key_centres", centres)
    lengths = (1, 6, 13)  # contexts that end mid-block, one a single token
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    tables = [(7, 2), (11, 0, 5), (3, 9, 1, 20, 14)]  # scattered, out of order, room for decode
    # Where the two paths differ in the last bits (below), a bf16 / fp16 cache may round a value
    # one step apart: tolerances are the cache dtype's resolution, 1e-4 for fp32.
    # Quantized: a value within a rounding step of a code boundary may take the neighbouring code.
    tol = {"int8": 1 / 127, "int4": 1 / 15}.get(kv_dtype) or \
        max(1e-4, torch.finfo({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kv_dtype]).eps)
    fused_pool = _prefilled(model, kv_dtype, prompts, tables)
    reference_pool = copy.deepcopy(fused_pool)
    for step in range(3):
        fused, reference = _decode_step(model, per_op, fused_pool, reference_pool, lengths, tables, g, step)
        assert fused.shape == reference.shape == (3, CONFIG.vocab_size)
        assert_near(fused, reference, tol, activations)
    # Not bit-exact from layer 1 on: SiLU's exp differs from torch's in the last bits, and the
    # int16 rounding of the next GEMM's input can turn that into one code step (~3e-5 relative).
    for fused_cache, reference_cache in zip(fused_pool.k_caches + fused_pool.v_caches,
                                            reference_pool.k_caches + reference_pool.v_caches, strict=True):
        expected = reference_cache.data.float()
        if kv_dtype in ("int8", "int4"):  # codes within one step, nearly all equal; scales to fp16 rounding
            codes = [unpack_int4(c.data) if kv_dtype == "int4" else c.data for c in (fused_cache, reference_cache)]
            assert (codes[0].int() - codes[1].int()).abs().max() <= 1
            assert (codes[0] != codes[1]).float().mean() < 0.01
            for name in ("scale", "zero") if kv_dtype == "int4" else ("scale",):
                torch.testing.assert_close(getattr(fused_cache, name).float(), getattr(reference_cache, name).float(),
                                           rtol=1e-3, atol=1e-3 * getattr(reference_cache, name).abs().max().item())
            continue
        assert_near(fused_cache.data, expected, tol, activations)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "int8", "int4"])
def test_fused_prompt_and_mixed_steps_match_the_per_op_forward(model: LlamaModel, per_op: LlamaModel, kv_dtype: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of one step that belong to one sequence attend causally: a prompt from position 0, a
    prompt chunk continuing a cached context, a decode row and a verify-style chunk with logits
    for each of its tokens, in one step, against the per-op forward from the same pool."""
    c = model.config
    g = torch.Generator().manual_seed(4)
    if kv_dtype in ("int8", "int4"):
        centres = torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, generator=g)
        for m in (model, per_op):
            monkeypatch.setattr(m, "key_centres", centres)
    tokens = lambda n: tuple(torch.randint(0, c.vocab_size, (n,), generator=g).tolist())  # noqa: E731
    tables = [(5, 1, 12, 3), (8, 0, 19), (2, 14), (7, 10, 4)]
    cached = {1: 6, 2: 5, 3: 3}  # tokens already in the cache per sequence (written by the per-op path)
    pool = KVPool(c.num_layers, 24, BLOCK, c.num_kv_heads, c.head_dim, kv_dtype, kv_dtype, model.device)
    for seq, n in cached.items():
        token_ids, batch = build_batch([SeqChunk(tokens(n), 0, tables[seq])], BLOCK, model.device)
        per_op.forward(token_ids, batch, pool)
    chunks = [SeqChunk(tokens(13), 0, tables[0]),  # ends mid-block, spans 4 blocks
              SeqChunk(tokens(5), 6, tables[1]),  # continues a cached context across a block edge
              SeqChunk(tokens(1), 5, tables[2]),  # a decode row
              SeqChunk(tokens(4), 3, tables[3], num_logits=4)]  # verify-style: every row's logits
    token_ids, batch = build_batch(chunks, BLOCK, model.device)
    assert not batch.is_decode
    reference_pool = copy.deepcopy(pool)
    assert model.runs_fused(len(token_ids), pool)
    fused = model.forward(token_ids, batch, pool)
    reference = per_op.forward(token_ids, batch, reference_pool)
    assert fused.shape == reference.shape == (1 + 1 + 1 + 4, c.vocab_size)
    # fp32 / bf16: 2e-4, not 1e-4: the two paths sum in other orders, so an activation at an int16
    # code boundary can round either way, and 1 of these 700 logits moved 1.03x 1e-4 of the
    # largest on an AVX-512 EPYC; a wiring mistake moves every logit by its own size.
    tol = {"int8": 1 / 127, "int4": 1 / 15, "fp16": torch.finfo(torch.float16).eps}.get(kv_dtype, 2e-4)
    torch.testing.assert_close(fused, reference, rtol=tol, atol=tol * reference.abs().max().item())
    for cache, expected in zip(pool.k_caches + pool.v_caches, reference_pool.k_caches + reference_pool.v_caches,
                               strict=True):
        if kv_dtype in ("int8", "int4"):  # codes within one step, nearly all equal
            codes = [unpack_int4(x.data) if kv_dtype == "int4" else x.data for x in (cache, expected)]
            assert (codes[0].int() - codes[1].int()).abs().max() <= 1
            assert (codes[0] != codes[1]).float().mean() < 0.01
        else:
            ref = expected.data.float()
            torch.testing.assert_close(cache.data.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_wide_decode_batches_are_fused_up_to_the_bound(loaded: LoadedModel, model: LlamaModel) -> None:
    c, num_seqs = model.config, 37  # rows split over threads in every phase of the fused step
    g = torch.Generator().manual_seed(1)
    pool = KVPool(c.num_layers, 2 * num_seqs, BLOCK, c.num_kv_heads, c.head_dim, "fp32", "fp32", model.device)
    tables = [(2 * i + 1, 2 * i) for i in range(num_seqs)]
    lengths = [1 + i % BLOCK for i in range(num_seqs)]
    for n, table in zip(lengths, tables, strict=True):
        token_ids, batch = build_batch([SeqChunk(tuple(torch.randint(0, c.vocab_size, (n,), generator=g).tolist()),
                                                 0, table)], BLOCK, model.device)
        model.forward(token_ids, batch, pool)
    reference_pool = copy.deepcopy(pool)
    chunks = [SeqChunk((int(torch.randint(0, c.vocab_size, (), generator=g)),), n, t)
              for n, t in zip(lengths, tables, strict=True)]
    token_ids, batch = build_batch(chunks, BLOCK, model.device)
    assert model.runs_fused(num_seqs, pool)
    fused = model.forward(token_ids, batch, pool)
    narrow = bounded(loaded, model, num_seqs - 1)
    assert not narrow.runs_fused(num_seqs, reference_pool)
    reference = narrow.forward(token_ids, batch, reference_pool)  # above the bound: the per-op forward
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


def test_fused_decode_is_off_where_the_weights_do_not_allow_it(caplog: pytest.LogCaptureFixture) -> None:
    loaded = synthetic_model(CONFIG, "int4", group_size=32, seed=3)
    weights = dict(loaded.weights)
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"].dequantize(
        torch.bfloat16)  # a bf16 GEMV: no C++ quantized kernel
    with caplog.at_level("INFO", logger="edgeinfer.models.weights"):
        assert not LlamaModel(loaded.config, weights).fused_steps
    assert [r.getMessage() for r in caplog.records if "per-op forward" in r.getMessage()]
    assert not LlamaModel(loaded.config, loaded.weights, choose_backend("reference")).fused_steps


def _gguf_like_int8(weight: QuantizedTensor, group: int, mins: bool, seed: int) -> QuantizedTensor:
    """An int8 weight of the weight's shape as GGUF Q6_K (group 16) or Q5_K (mins) bring it."""
    g = torch.Generator().manual_seed(seed)
    n, k = weight.shape
    codes = torch.randint(-32 if group == 16 else 0, 32, (n, k), generator=g, dtype=torch.int8)
    scales = ((torch.rand(n, k // group, generator=g) + 0.5) / (k ** 0.5 * 18)).half()
    offsets = (-15.5 * scales.float() * (torch.rand(n, k // group, generator=g) + 0.5)).half() if mins else None
    return QuantizedTensor("int8", (n, k), group, codes, scales, offsets)


def test_fused_step_runs_mixed_int4_and_int8_linears(loaded: LoadedModel) -> None:
    """A Q4_K_M-like model: int4 g32 linears, V and down int8 g16 (Q6_K) in some layers, o int8
    g32 with mins (Q5_K): the fused step runs it and matches the per-op forward."""
    weights = dict(loaded.weights)
    for i in range(CONFIG.num_layers):
        p = f"model.layers.{i}."
        if i != 1:  # like Q4_K_M: only some layers' V and down are Q6_K
            for name in ("self_attn.v_proj", "mlp.down_proj"):
                weights[p + name + ".weight"] = _gguf_like_int8(weights[p + name + ".weight"], 16, False, i)
        weights[p + "self_attn.o_proj.weight"] = _gguf_like_int8(weights[p + "self_attn.o_proj.weight"], 32, True, i)
    mixed = LlamaModel(loaded.config, weights)
    assert mixed.fused_steps
    # V apart where it is int8 beside int4 Q and K (not widened with them to int8 with mins)
    assert [layer.v is not None for layer in mixed.weights.layers] == [i != 1 for i in range(CONFIG.num_layers)]
    assert all(layer.qkv.kernel is not None for layer in mixed.weights.layers)  # Q and K stay int4
    assert len(mixed.weights.fused_v) == 4 * CONFIG.num_layers
    per_op = LlamaModel(loaded.config, weights, dataclasses.replace(mixed.backend, fused_step_max_tokens=0))
    g = torch.Generator().manual_seed(5)
    lengths, tables = (1, 6, 13), [(7, 2), (11, 0, 5), (3, 9, 1, 20, 14)]
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    fused_pool = _prefilled(per_op, "fp32", prompts, tables)
    reference_pool = copy.deepcopy(fused_pool)
    fused, reference = _decode_step(mixed, per_op, fused_pool, reference_pool, lengths, tables, g)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


def test_decode_layers_errors_name_the_problem(model: LlamaModel) -> None:
    c = model.config
    pool = KVPool(c.num_layers, 4, BLOCK, c.num_kv_heads, c.head_dim, "fp32", "fp32", model.device)
    token_ids, batch = build_batch([SeqChunk((1,), 0, (0,))], BLOCK, model.device)
    h = model.embed_tokens(token_ids).contiguous()
    k = [cache.data for cache in pool.k_caches]
    v = [cache.data for cache in pool.v_caches]

    def setup(weights=model.weights.fused, k_caches=k, v_caches=v, **int8):
        return cpu_ops.decode_setup(weights, k_caches, v_caches, c.num_heads, 0.1, 1e-5, **int8)

    def run(positions=batch.positions, slots=batch.slot_mapping, x=h, **kwargs):
        cpu_ops.decode_layers(x, setup(), model._cos, model._sin, positions, slots, batch.block_tables,
                              batch.context_lens, **kwargs)

    # The setup's checks, once when it is made
    with pytest.raises(RuntimeError, match="14 weights"):
        setup(weights=model.weights.fused[:-1])
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        setup(k_caches=[k[0].half()] + k[1:])
    codes = [t.to(torch.int8) for t in k]
    with pytest.raises(RuntimeError, match="one K and one V scale tensor per layer"):
        setup(k_caches=codes, v_caches=codes)
    scales = [torch.ones(t.shape[:3], dtype=torch.float16) for t in k]
    with pytest.raises(RuntimeError, match="KV rotation"):
        setup(k_caches=codes, v_caches=codes, k_scales=scales, v_scales=scales)
    with pytest.raises(RuntimeError, match="plain caches take no scales"):
        setup(k_scales=scales, v_scales=scales)
    with pytest.raises(RuntimeError, match="activation must be silu or gelu_tanh, got relu"):
        setup(activation="relu")
    # and a step's, every call
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        run(slots=torch.tensor([4 * BLOCK]))
    assert model._cos.shape[0] == c.max_position  # (the tables never pass the context)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        run(positions=torch.tensor([c.max_position]))
    with pytest.raises(RuntimeError, match=rf"h must be contiguous fp32 \(M, {c.hidden_size}\)"):
        run(x=h[:, :-1].contiguous())
    with pytest.raises(RuntimeError, match="local RoPE tables"):
        run(local_rope=(model._cos, model._sin[:-1]))
    with pytest.raises(RuntimeError, match="phase_ns must be a contiguous int64 tensor of 9"):
        run(phase_ns=torch.zeros(len(cpu_ops.DECODE_PHASES) - 1, dtype=torch.int64))
    run()  # the same call with good arguments goes through


def test_phase_clocks_add_each_phase_and_change_nothing(model: LlamaModel) -> None:
    """LlamaModel.phase_ns: each fused step adds its phases' wall times (kernels.cpu_ops.DECODE_PHASES)
    into it, together at most the step's own time, and the logits and cache are what they are without."""
    c = model.config
    g = torch.Generator().manual_seed(5)
    prompt = [int(t) for t in torch.randint(0, c.vocab_size, (6,), generator=g)]
    token_ids, batch = build_batch([SeqChunk((7,), len(prompt), (0, 1))], BLOCK, model.device)
    outputs = []
    for timed in (False, True):
        pool = _prefilled(model, "fp16", [prompt], [(0, 1)])
        model.phase_ns = torch.zeros(len(cpu_ops.DECODE_PHASES), dtype=torch.int64) if timed else None
        try:
            start = time.perf_counter_ns()
            outputs.append((model.forward(token_ids, batch, pool), pool.k_caches[0].data.clone()))
            wall = time.perf_counter_ns() - start
            if timed:
                first = model.phase_ns.clone()
                model.forward(token_ids, batch, pool)
                second = model.phase_ns.clone()
        finally:
            model.phase_ns = None
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    names = cpu_ops.DECODE_PHASES
    assert all(first[names.index(gemm)] > 0 for gemm in ("qkv", "o", "gate/up", "down + residual"))
    assert (first >= 0).all() and 0 < first.sum() <= wall
    assert (second >= first).all() and second.sum() > first.sum()  # added into, not overwritten


def test_rope_tables_grow_with_the_contexts_seen_and_stop_at_the_model_context() -> None:
    config = ModelConfig(**{**CONFIG.to_dict(), "max_position": 700})
    loaded = synthetic_model(config, "int4", group_size=32, seed=5)
    grown, full = LlamaModel(config, loaded.weights), LlamaModel(config, loaded.weights)
    assert grown._cos.shape[0] == 256  # the CPU starts small
    full._cos, full._sin = full._rope_tables(config.max_position, full._inv_freq)
    ids = torch.randint(0, config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    table = tuple(range(80))  # 320 slots: room for the prompt and 20 decode steps
    logits = {}
    for name, model in (("grown", grown), ("full", full)):
        pool = KVPool(config.num_layers, 80, BLOCK, config.num_kv_heads, config.head_dim, "fp32", "fp32", model.device)
        token_ids, batch = build_batch([SeqChunk(tuple(ids), 0, table)], BLOCK, model.device)
        out = [model.forward(token_ids, batch, pool)]
        token_ids, batch = build_batch([SeqChunk((7,), 300, table)], BLOCK, model.device)
        out.append(model.forward(token_ids, batch, pool))  # the fused step reads positions past 256
        logits[name] = out
    assert grown._cos.shape[0] == 512  # doubled: covers the 320 slots of the block table
    torch.testing.assert_close(grown._cos, full._cos[:512], rtol=0, atol=0)
    for a, b in zip(logits["grown"], logits["full"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    grown._cover_positions(5000)
    assert grown._cos.shape[0] == grown._sin.shape[0] == config.max_position


def test_a_plain_pool_that_asks_for_the_kv_transform_takes_the_per_op_forward(model: LlamaModel) -> None:
    c = model.config
    pools = [KVPool(c.num_layers, 4, BLOCK, c.num_kv_heads, c.head_dim, "fp32", "fp32", transform=transform)
             for transform in (None, True)]
    assert model.runs_fused(1, pools[0])
    assert not model.runs_fused(1, pools[1])  # the C++ step rotates quantized caches only


def test_a_pool_keeps_its_decode_setup_until_the_key_centres_change(model: LlamaModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The setup (weights, caches, constants, checked once) is made on a pool's first fused step,
    reused by the next ones, made again when calibration replaces the key centres it holds, and
    let go with the pool."""
    c = model.config
    pools = [KVPool(c.num_layers, 4, BLOCK, c.num_kv_heads, c.head_dim, "int8", "int8") for _ in range(2)]
    before = len(model._decode_setups)  # other tests' pools, where still alive
    first = model._decode_setup(pools[0])
    assert model._decode_setup(pools[0]) is first
    assert model._decode_setup(pools[1]) is not first
    monkeypatch.setattr(model, "key_centres", torch.zeros(c.num_layers, c.num_kv_heads, c.head_dim))
    assert model._decode_setup(pools[0]) is not first
    assert len(model._decode_setups) == before + 2
    del pools
    gc.collect()
    assert len(model._decode_setups) == before

def test_an_observer_takes_the_per_op_forward(model: LlamaModel, per_op: LlamaModel) -> None:
    """The fused step has nowhere to show activations: a forward with an observer (calibration)
    runs per op, as the per-op model does, and shows each layer's linear inputs and keys in order."""
    c = model.config
    token_ids, batch = build_batch([SeqChunk(tuple(range(1, 12)), 0, (0, 1, 2))], BLOCK, model.device)

    def run(m: LlamaModel, observe=None) -> torch.Tensor:
        pool = KVPool(c.num_layers, 3, BLOCK, c.num_kv_heads, c.head_dim, "fp32", "fp32", m.device)
        return m.forward(token_ids, batch, pool, observe=observe)

    assert model.runs_fused(11, KVPool(c.num_layers, 3, BLOCK, c.num_kv_heads, c.head_dim, "fp32", "fp32"))
    seen: list[tuple[int, str, tuple[int, ...]]] = []
    observed = run(model, lambda layer, name, x: seen.append((layer, name, tuple(x.shape))))
    torch.testing.assert_close(observed, run(per_op), rtol=0, atol=0)
    q_size, inner = c.num_heads * c.head_dim, c.intermediate_size
    shapes = {"qkv": (11, c.hidden_size), "keys": (11, c.num_kv_heads, c.head_dim), "o": (11, q_size),
              "gate_up": (11, c.hidden_size), "down": (11, inner)}
    assert seen == [(layer, name, shape) for layer in range(c.num_layers) for name, shape in shapes.items()]


def test_rope_tables_stop_at_the_planned_context() -> None:
    """The memory plan's --ctx bounds the tables (on CUDA they are built whole at start)."""
    config = ModelConfig(**{**CONFIG.to_dict(), "max_position": 700})
    loaded = synthetic_model(config, "int4", group_size=32, seed=5)
    model = build_model(loaded, RuntimeConfig(max_model_len=300))
    assert model.max_positions == 300
    model._cover_positions(290)
    assert model._cos.shape[0] == 300  # doubling 256 would pass the plan: stops at it
    model._cover_positions(650)
    assert model._cos.shape[0] == 300
    assert LlamaModel(config, loaded.weights).max_positions == 700  # no plan: the model's context


BF16 = pytest.param("bf16", marks=pytest.mark.skipif(not cpu_ops.available() or not cpu_a8.isa_supported("amx_bf16"),
                                                    reason="this CPU has no AMX-BF16"))


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("terms", [1, 2, BF16])
def test_fused_step_runs_int8_activation_linears(loaded: LoadedModel, mixed: bool, terms: int | str) -> None:
    """With int8 activations (kernels.cpu_a8, in one term or two) or bf16 ones (AMX-BF16) the
    fused step runs the a8 kernels for int4 and int8 linears (g16, g32 with mins) and matches
    the per-op forward on the same kernels."""
    weights = dict(loaded.weights)
    if mixed:
        for i in range(CONFIG.num_layers):
            p = f"model.layers.{i}."
            weights[p + "mlp.down_proj.weight"] = _gguf_like_int8(weights[p + "mlp.down_proj.weight"], 16, False, i)
            weights[p + "self_attn.o_proj.weight"] = _gguf_like_int8(weights[p + "self_attn.o_proj.weight"], 32, True,
                                                                     i)
            if i != 1:  # V apart (Q6_K beside Q4_K Q and K) in some layers
                weights[p + "self_attn.v_proj.weight"] = _gguf_like_int8(weights[p + "self_attn.v_proj.weight"], 16,
                                                                         False, i)
    bf16 = terms == "bf16"
    backend = choose_backend("int4_cpu", "cpu", int8_activations=True, a8_terms=1 if bf16 else terms, a8_bf16=bf16)
    a8 = LlamaModel(loaded.config, weights, backend)
    assert a8._a8_isa == ("amx_bf16" if bf16 else cpu_a8.default_isa())
    assert a8.fused_steps and len(a8.weights.fused_wsums) == 4 * CONFIG.num_layers
    assert len(a8.weights.fused_v) == (4 * CONFIG.num_layers if mixed else 0)
    per_op = LlamaModel(loaded.config, weights, dataclasses.replace(backend, fused_step_max_tokens=0))
    g = torch.Generator().manual_seed(6)
    lengths, tables = (1, 6, 13), [(7, 2), (11, 0, 5), (3, 9, 1, 20, 14)]
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    fused_pool = _prefilled(a8, "fp32", prompts, tables)  # prompt chunks: fused too
    reference_pool = _prefilled(per_op, "fp32", prompts, tables)
    fused, reference = _decode_step(a8, per_op, fused_pool, reference_pool, lengths, tables, g)
    # SiLU's exp differs from torch's in the last bits; a value at an int8 rounding boundary of
    # the next GEMM's input then moves a whole code step (1/127 of its block's largest value), so
    # single logits may differ by a few percent: the bound is on the whole. A wiring mistake (a
    # linear's weights, wsum or group) moves every logit by its own size.
    # Two terms leave boundary flips a code step of the residual (a sixteenth of the codes'
    # step): 0.0018 seen; bf16 a last-bit flip of one value (2^-8 of it).
    bound = {1: 0.03, 2: A8X2_BOUND}.get(terms, 1e-3)
    assert float((fused - reference).norm() / reference.norm()) < bound


def test_lean_activations_run_their_one_term_linears_in_one_term(loaded: LoadedModel) -> None:
    """int8x2-lean (Backend.a8_one_term): the attention output projection, and the head's coarse
    pass where an exact head refines it, are prepared with one term, the other linears with two;
    the fused step runs each linear in its own terms (its logits differ from int8x2's, so the
    terms reach the kernel) and matches the per-op forward, which runs each weight as prepared."""
    lean_backend = choose_backend("int4_cpu", "cpu", int8_activations=True, a8_terms=2, a8_one_term=LEAN_ONE_TERM)
    weights = dict(loaded.weights)
    weights["lm_head.weight"] = loaded.weights["lm_head.weight"].dequantize(torch.float32)  # exact rows to refine from

    def build(backend: Backend, with_weights: dict = weights) -> LlamaModel:
        return LlamaModel(loaded.config, with_weights, backend, head_format="int4")

    lean = build(lean_backend)
    int8x2 = build(dataclasses.replace(lean_backend, a8_one_term=()))
    head_only = build(dataclasses.replace(lean_backend, a8_one_term=("head",)))  # lean but o on two terms
    per_op = build(dataclasses.replace(lean_backend, fused_step_max_tokens=0))
    assert lean.weights.fused_terms == [2, 1, 2, 2] * CONFIG.num_layers
    assert int8x2.weights.fused_terms == head_only.weights.fused_terms == [2] * (4 * CONFIG.num_layers)
    assert lean.weights.head_exact is not None
    assert lean.weights.head.kernel.terms == head_only.weights.head.kernel.terms == 1
    assert int8x2.weights.head.kernel.terms == 2
    assert all(layer.o.kernel.terms == 1 and layer.down.kernel.terms == 2 for layer in per_op.weights.layers)
    stored_int4 = build(lean_backend, loaded.weights)  # a head stored in int4: no exact copy, two terms
    assert stored_int4.weights.head_exact is None and stored_int4.weights.head.kernel.terms == 2
    g = torch.Generator().manual_seed(9)
    lengths, tables = (4, 11), [(1, 2), (3, 4, 5)]
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    pools = [_prefilled(model, "fp32", prompts, tables) for model in (lean, per_op)]
    shared, state = copy.deepcopy(pools[0]), g.get_state()
    fused, reference = _decode_step(lean, per_op, *pools, lengths, tables, g)
    assert float((fused - reference).norm() / reference.norm()) < 0.03  # one-term linears: as terms=1 above
    g.set_state(state)  # the same token into the same caches and the same head: only o's terms differ
    two = _decode_step(head_only, per_op, shared, pools[1], lengths, tables, g)[0]
    assert not torch.equal(fused, two)
    with pytest.raises(ValueError, match="a8_one_term"):
        dataclasses.replace(lean_backend, a8_one_term=("proj",))
    with pytest.raises(ValueError, match="a8_one_term"):
        dataclasses.replace(lean_backend, a8_terms=1)


@pytest.mark.skipif(not cpu_ops.available() or not cpu_a8.isa_supported("amx_bf16"), reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize("fused", [True, False])
def test_prompt_rows_run_bf16_and_generated_rows_int8x2(loaded: LoadedModel, fused: bool) -> None:
    """cpu_activations bf16-prompts: in one step, the rows marked as prompt tokens get exactly the
    logits of an all-bf16 model and the others exactly those of an int8x2 model (each row its own
    sequence, so rows meet only in the GEMMs), in the fused step and the per-op forward alike."""
    def model_for(**flags) -> LlamaModel:
        backend = choose_backend("int4_cpu", "cpu", int8_activations=True, **flags)
        if not fused:
            backend = dataclasses.replace(backend, fused_step_max_tokens=0)
        return LlamaModel(loaded.config, loaded.weights, backend)

    int8x2, bf16 = model_for(a8_terms=2), model_for(a8_bf16=True)
    hybrid = model_for(a8_terms=2, a8_bf16_prompts=True)
    g = torch.Generator().manual_seed(8)
    lengths, tables = (5, 9, 3, 7), [(1, 2, 3), (4, 5, 6), (7, 8), (9, 10, 11)]
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    marks = (1, 0, 1, 0)
    chunks = [SeqChunk((int(torch.randint(0, CONFIG.vocab_size, (), generator=g)),), n, t, prompt_tokens=p)
              for n, t, p in zip(lengths, tables, marks, strict=True)]
    token_ids, batch = build_batch(chunks, BLOCK, hybrid.device)
    assert batch.prompt_rows.tolist() == [True, False, True, False]
    out = {}
    for name, model in (("int8x2", int8x2), ("bf16", bf16), ("hybrid", hybrid)):
        pool = _prefilled(int8x2, "fp32", prompts, tables)  # the same caches for all three
        assert model.runs_fused(len(token_ids), pool) == fused
        out[name] = model.forward(token_ids, batch, pool)
    assert torch.equal(out["hybrid"][0::2], out["bf16"][0::2])
    assert torch.equal(out["hybrid"][1::2], out["int8x2"][1::2])
    assert not torch.equal(out["bf16"], out["int8x2"])  # the two arithmetics differ: the check can fail


def test_batches_mark_prompt_rows() -> None:
    chunks = [SeqChunk((1, 2, 3, 4), 0, (0, 1), prompt_tokens=3), SeqChunk((5,), 7, (2, 3))]
    _, batch = build_batch(chunks, BLOCK, torch.device("cpu"))
    assert batch.prompt_rows.tolist() == [True, True, True, False, False]
    _, batch = build_batch([SeqChunk((5,), 7, (2, 3))], BLOCK, torch.device("cpu"))
    assert batch.prompt_rows is None


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8", "int4"])
def test_fused_decode_with_kv_heads_and_long_contexts_matches_the_per_op_forward(kv_dtype: str) -> None:
    """Two KV heads of three query heads each and contexts long enough to be cut into parts
    (one sequence of 300 tokens beside one of 9): the C++ decode attention runs each sequence's
    KV heads in one work unit, reading each head's rows, scales and zeros at its own offset."""
    config = ModelConfig(**{**CONFIG.to_dict(), "num_heads": 6, "num_kv_heads": 2, "max_position": 400})
    loaded = synthetic_model(config, "int4", group_size=32, seed=9)
    fused = LlamaModel(config, loaded.weights)
    per_op = LlamaModel(config, loaded.weights, dataclasses.replace(fused.backend, fused_step_max_tokens=0))
    g = torch.Generator().manual_seed(3)
    lengths, tables = (300, 9), [tuple(range(80, 4, -1)), (90, 81, 95)]
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    pools = []
    for model in (fused, per_op):
        pool = KVPool(config.num_layers, 96, BLOCK, config.num_kv_heads, config.head_dim, kv_dtype, kv_dtype,
                      model.device)
        for ids, table in zip(prompts, tables, strict=True):
            model.forward(*build_batch([SeqChunk(tuple(ids), 0, table)], BLOCK, model.device), pool)
        pools.append(pool)
    if kv_dtype in ("int8", "int4"):
        pools[1] = copy.deepcopy(pools[0])  # the same codes: only the attention differs
    tol = {"int8": 1 / 127, "int4": 1 / 15}.get(kv_dtype, 1e-3)
    for step in range(2):
        chunks = [SeqChunk((int(torch.randint(0, config.vocab_size, (), generator=g)),), n + step, t)
                  for n, t in zip(lengths, tables, strict=True)]
        token_ids, batch = build_batch(chunks, BLOCK, fused.device)
        assert fused.runs_fused(2, pools[0]) and not per_op.runs_fused(2, pools[1])
        a, b = fused.forward(token_ids, batch, pools[0]), per_op.forward(token_ids, batch, pools[1])
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


GEMMA3 = ArchSpec(qk_norm=True, norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh", sliding_window=5,
                  global_every=2, local_rope_theta=1000.0)


GEMMA2 = ArchSpec(norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh", sliding_window=5, global_every=2,
                  attn_softcap=2.0)


@pytest.mark.parametrize("spec", [ArchSpec(qkv_bias=True), ArchSpec(qk_norm=True),
                                  ArchSpec(qkv_bias=True, qk_norm=True), ArchSpec(sliding_window=5),
                                  ArchSpec(sandwich_norms=True, activation="gelu_tanh"), GEMMA3,
                                  ArchSpec(attn_softcap=2.0), GEMMA2],
                         ids=["qwen2-biases", "qwen3-qk-norms", "both", "window", "sandwich-gelu", "gemma3",
                              "softcap", "gemma2"])
@pytest.mark.parametrize("activations", ["int16", "int8x2"])
@pytest.mark.parametrize("kv_dtype", ["fp16", "int8"])
def test_architecture_features_run_fused_as_the_per_op_forward(spec: ArchSpec, kv_dtype: str, activations: str) -> None:
    """Qwen 2's q/k/v biases and the per-head q/k RMSNorms (random, far from zero and one), a
    sliding window on every layer (Mistral, Phi-3; 5 tokens, shorter than the contexts), Gemma's
    sandwich norms and GELU, Gemma 3's local layers (window, own RoPE base) between global ones,
    and Gemma 2's soft-capped attention scores (a cap of 2, low enough to bite), in the fused
    step: prompt, then decode, as the per-op forward computes them."""
    config = dataclasses.replace(CONFIG, spec=spec)
    loaded = synthetic_model(config, "int4", group_size=32, seed=5)
    g = torch.Generator().manual_seed(5)
    weights = dict(loaded.weights)
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}.self_attn."
        for part, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            weights[f"{prefix}{part}.bias"] = torch.randn(size, generator=g)
        for norm in ("q_norm", "k_norm"):
            weights[f"{prefix}{norm}.weight"] = 0.5 + torch.rand(config.head_dim, generator=g)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = 0.5 + torch.rand(config.hidden_size, generator=g)
    fused = LlamaModel(config, weights, a8_backend() if activations != "int16" else None)
    assert fused.fused_steps, "biases and q/k norms no longer keep a model off the fused step"
    per_op = LlamaModel(config, weights, dataclasses.replace(fused.backend, fused_step_max_tokens=0))
    lengths, tables = (7, 11), [(4, 9, 2), (1, 6, 13, 3)]
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    pools = [KVPool(config.num_layers, 24, BLOCK, config.num_kv_heads, config.head_dim, kv_dtype, kv_dtype, "cpu")
             for _ in range(2)]
    tol = {"int8": 1 / 127}.get(kv_dtype, 1e-3)
    chunks = [SeqChunk(tuple(ids), 0, t) for ids, t in zip(prompts, tables, strict=True)]
    token_ids, batch = build_batch(chunks, BLOCK, fused.device)
    assert fused.runs_fused(len(token_ids), pools[0])
    a, b = fused.forward(token_ids, batch, pools[0]), per_op.forward(token_ids, batch, pools[1])
    assert_near(a, b, tol, activations)
    for step in range(2):
        chunks = [SeqChunk((int(torch.randint(0, config.vocab_size, (), generator=g)),), n + step, t)
                  for n, t in zip(lengths, tables, strict=True)]
        token_ids, batch = build_batch(chunks, BLOCK, fused.device)
        a, b = fused.forward(token_ids, batch, pools[0]), per_op.forward(token_ids, batch, pools[1])
        assert_near(a, b, tol, activations)
