"""End-to-end decode benchmark of synthetic 135M- and 8B-shaped models against the roofline.

For each shape (``135m``, ``8b``), weight format (``int4``, ``int8``) and batch size it prints
decode tok/s, the step time, the time to first token of a ``--prompt-len`` (2k) prompt at batch
1, the peak GPU memory and the roofline fraction:

    roofline = (weight bytes + KV bytes read per step) / step time / copy bandwidth

where weight bytes are every linear layer and the head as stored (codes, scales, mins), KV
bytes are each sequence's context in the pool's format, and the copy bandwidth is a measured
device-to-device copy (read + write bytes per second, as tools/bench_gemm.py). The same
workload then runs through transformers (fp16 LlamaForCausalLM of the same config with random
weights, and bitsandbytes nf4 where it imports) in the same call; ``x_hf`` is our tok/s over
transformers fp16's at the same shape and batch.

Our path: ModelRunner over a KVPool (fp16 KV), Triton GEMMs, decode steps replayed as CUDA
graphs (``--no-graphs`` for eager); each step's greedy tokens go back to the host, as in the
engine. Sequences decode after a ``--context``-token prompt each.

``--device cpu`` is the proof-of-life fallback: the 135M shape, int4, batch 1, a short prompt,
torch's int4 CPU kernel and transformers in fp32; same table. Targets (GPU), checked at the end:
8B int4 batch 1 >= 85% of the roofline, >= 3x transformers fp16 at batch 1, 135M batch 1
>= 1000 tok/s.

    python tools/bench_e2e_gpu.py [--json] [--json-out FILE] [--shapes 135m,8b] [--weights int4,int8]
        [--batch 1,8,32] [--prompt-len 2048] [--context 512] [--steps 32] [--no-graphs] [--no-peers]
    python tools/bench_e2e_gpu.py --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from edgeinfer.config import ModelConfig  # noqa: E402
from edgeinfer.models.llama import LlamaModel  # noqa: E402
from edgeinfer.models.loader import LoadedModel  # noqa: E402
from edgeinfer.models.synthetic import synthetic_model  # noqa: E402
from edgeinfer.worker.batch import SeqChunk  # noqa: E402
from edgeinfer.worker.kv_pools import kv_pool  # noqa: E402
from edgeinfer.worker.model_runner import ModelRunner  # noqa: E402
from kernels.dispatch import choose_backend  # noqa: E402
from quant.formats import QuantizedTensor  # noqa: E402
from tools.bench_common import copy_bandwidth, int_list, table_cell  # noqa: E402

BLOCK_SIZE = 16
TARGET_ROOFLINE = 0.85
TARGET_X_HF = 3.0
TARGET_135M_TOKS = 1000.0
COLUMNS = ("model", "weights", "engine", "batch", "tok/s", "step_ms", "ttft_ms", "peak_GiB", "roofline%", "x_hf")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB: process peak RSS


def step_weight_bytes(loaded: LoadedModel) -> int:
    """Bytes one decode step reads of the weights: every layer and the head, not the embedding
    (a lookup reads a few rows) unless it is the head."""
    total = 0
    for name, w in loaded.weights.items():
        if name == "model.embed_tokens.weight" and not loaded.config.tie_word_embeddings:
            continue
        total += w.nbytes if isinstance(w, QuantizedTensor) else w.numel() * w.element_size()
    return total


def kv_bytes_per_token(config: ModelConfig, element_bytes: float) -> float:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element_bytes


def _timed_decode(step: Callable[[int], None], warmup: int, steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` steps after ``warmup``; ``step(i)`` runs step i."""
    for i in range(warmup):
        step(i)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    _sync(device)
    return (time.perf_counter() - t0) / steps


def _median_time(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    fn()  # compile / tune
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- edgeinfer --------------------------------------------------------------------------------


def bench_ours(loaded: LoadedModel, args: argparse.Namespace, device: torch.device, copy_bw: float) -> list[dict]:
    c = loaded.config
    backend = choose_backend("auto", device)
    model = LlamaModel(c, loaded.weights, backend,
                       head_format="int4" if backend.linear_path == "int4_cpu" else "same")
    weight_bytes = step_weight_bytes(loaded)
    gen = torch.Generator().manual_seed(0)
    rows = []
    ttft_ms = None
    for batch in args.batch:
        _reset_peak(device)
        per_seq = -(-(args.context + args.warmup + args.steps + 1) // BLOCK_SIZE)
        ttft_blocks = -(-(args.prompt_len + 1) // BLOCK_SIZE)
        pool = kv_pool(c, max(batch * per_seq, ttft_blocks), BLOCK_SIZE, args.kv_dtype, args.kv_dtype, device)
        sizes = (batch,) if device.type == "cuda" and not args.no_graphs else ()
        runner = ModelRunner(model, pool, BLOCK_SIZE, graph_batch_sizes=sizes, max_blocks_per_seq=per_seq)
        if ttft_ms is None:  # batch 1, the whole prompt in one prefill chunk, until its token is on the host
            ttft_ms = 1e3 * _ttft(runner, args, gen, ttft_blocks, device)
        step_s = _decode_step_time(runner, args, gen, batch, per_seq, device)
        mean_context = args.context + args.warmup + (args.steps + 1) / 2
        kv_bytes = batch * mean_context * pool.bytes_per_token()
        rows.append(_row(args, "edgeinfer" + ("" if sizes else "-eager"), batch, step_s, ttft_ms,
                         _peak_gib(device), (weight_bytes + kv_bytes) / step_s / copy_bw))
        del runner, pool
    return rows


def _ttft(runner: ModelRunner, args: argparse.Namespace, gen: torch.Generator, num_blocks: int,
          device: torch.device) -> float:
    prompt = tuple(torch.randint(0, runner.model.config.vocab_size, (args.prompt_len,), generator=gen).tolist())
    table = tuple(range(num_blocks))
    return _median_time(lambda: runner.logits([SeqChunk(prompt, 0, table)]).argmax(-1).tolist(), args.reps, device)


def _decode_step_time(runner: ModelRunner, args: argparse.Namespace, gen: torch.Generator, batch: int,
                      per_seq: int, device: torch.device) -> float:
    """Prefill ``batch`` sequences of ``args.context`` tokens, then time greedy decode steps."""
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = torch.randint(0, runner.model.config.vocab_size, (batch, args.context), generator=gen).tolist()
    tokens: list[int] = []
    for start in range(0, batch, 8):  # prefill 8 sequences per step: bounded activations
        chunks = [SeqChunk(tuple(prompts[i]), 0, tables[i]) for i in range(start, min(batch, start + 8))]
        tokens += runner.logits(chunks).argmax(-1).tolist()
    runner.capture_graphs()

    def step(i: int) -> None:
        chunks = [SeqChunk((tokens[s],), args.context + i, tables[s]) for s in range(batch)]
        tokens[:] = runner.logits(chunks).argmax(-1).tolist()

    return _timed_decode(step, args.warmup, args.steps, device)


def _row(args: argparse.Namespace, engine: str, batch: int, step_s: float, ttft_ms: float | None,
         peak: float, roofline: float) -> dict:
    return {"model": args.current_shape, "weights": args.current_weights, "engine": engine, "batch": batch,
            "tok/s": batch / step_s, "step_ms": 1e3 * step_s, "ttft_ms": ttft_ms, "peak_GiB": peak,
            "roofline%": 100 * roofline, "x_hf": None}


# ---- transformers -----------------------------------------------------------------------------


def hf_model(c: ModelConfig, dtype: torch.dtype, device: torch.device, bnb4: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position, tie_word_embeddings=c.tie_word_embeddings,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init straight in fp16 on the device: no fp32 8B copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.to(dtype)  # a no-op unless this transformers version initialises in its own dtype
    if bnb4:
        _to_bnb4(model, device)
    return model.eval()


def _to_bnb4(model: torch.nn.Module, device: torch.device) -> None:
    """Swap every decoder linear layer for bitsandbytes nf4 (the head stays fp16, as HF does)."""
    import bitsandbytes as bnb

    for module in list(model.model.layers.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                        compute_dtype=torch.float16, quant_type="nf4", device="meta")
                new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                setattr(module, name, new.to(device))  # quantizes on the move


def _hf_weight_bytes(model: torch.nn.Module, tied: bool) -> int:
    total = 0
    for name, p in model.named_parameters():  # tied weights are listed once
        if "embed_tokens" in name and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def bench_hf(c: ModelConfig, args: argparse.Namespace, device: torch.device, copy_bw: float,
             dtype: torch.dtype, bnb4: bool, engine: str) -> list[dict]:
    _reset_peak(device)
    model = hf_model(c, dtype, device, bnb4)
    weight_bytes = _hf_weight_bytes(model, c.tie_word_embeddings)
    gen = torch.Generator().manual_seed(0)

    def forward(ids: torch.Tensor, past: object = None, model: torch.nn.Module = model) -> tuple[torch.Tensor, object]:
        out = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values

    rows = []
    with torch.inference_mode():
        prompt = torch.randint(0, c.vocab_size, (1, args.prompt_len), generator=gen).to(device)
        ttft_ms = 1e3 * _median_time(lambda: forward(prompt)[0].tolist(), args.reps, device)
        for batch in args.batch:
            _reset_peak(device)
            ids = torch.randint(0, c.vocab_size, (batch, args.context), generator=gen).to(device)
            state = list(forward(ids))

            def step(i: int, state: list = state) -> None:
                nxt, past = forward(state[0], state[1])
                nxt.tolist()  # tokens to the host each step, as our engine does
                state[0], state[1] = nxt, past

            step_s = _timed_decode(step, args.warmup, args.steps, device)
            mean_context = args.context + args.warmup + (args.steps + 1) / 2
            kv_bytes = batch * mean_context * kv_bytes_per_token(c, torch.finfo(dtype).bits / 8)
            rows.append(_row(args, engine, batch, step_s, ttft_ms, _peak_gib(device),
                             (weight_bytes + kv_bytes) / step_s / copy_bw))
            del state
    del model
    return rows


def peer_engines(device: torch.device) -> list[tuple[str, torch.dtype, bool]]:
    if device.type != "cuda":
        return [("hf-fp32", torch.float32, False)]  # fp16 matmuls on the CPU are not a fair peer
    peers = [("hf-fp16", torch.float16, False)]
    try:
        import bitsandbytes  # noqa: F401

        peers.append(("hf-bnb4", torch.float16, True))
    except ImportError:
        print("bitsandbytes not importable: no hf-bnb4 rows", file=sys.stderr)
    return peers


# ---- driver -----------------------------------------------------------------------------------


def _dump_partial(args: argparse.Namespace, name: str, copy_bw: float, rows: list[dict]) -> None:
    if args.json_out:
        partial = {"device": name, "copy_GB/s": copy_bw / 1e9, "partial": True, "rows": rows}
        Path(args.json_out).write_text(json.dumps(partial, indent=1))


def check_targets(rows: list[dict], device: torch.device) -> list[dict]:
    """The issue's three targets, from the rows measured (absent rows: not checked)."""
    if device.type != "cuda":
        return []

    def find(model: str, weights: str, engine: str, batch: int) -> dict | None:
        return next((r for r in rows if (r["model"], r["weights"], r["engine"], r["batch"])
                     == (model, weights, engine, batch)), None)

    ours = next((e for e in ("edgeinfer", "edgeinfer-eager") if find("8b", "int4", e, 1)), "edgeinfer")
    out = []
    r8 = find("8b", "int4", ours, 1)
    if r8:
        out.append({"target": "8b int4 batch 1 roofline >= 85%", "value": r8["roofline%"],
                    "ok": r8["roofline%"] >= 100 * TARGET_ROOFLINE})
        if r8["x_hf"] is not None:
            out.append({"target": "8b int4 batch 1 >= 3x transformers fp16", "value": r8["x_hf"],
                        "ok": r8["x_hf"] >= TARGET_X_HF})
    r135 = find("135m", "int4", ours, 1)
    if r135:
        out.append({"target": "135m int4 batch 1 >= 1000 tok/s", "value": r135["tok/s"],
                    "ok": r135["tok/s"] >= TARGET_135M_TOKS})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shapes", default=None, help="comma-separated: 135m,8b (cpu: 135m)")
    parser.add_argument("--weights", default=None, help="comma-separated: int4,int8 (cpu: int4)")
    parser.add_argument("--batch", type=int_list, default=None, help="batch sizes (cuda: 1,8,32; cpu: 1)")
    parser.add_argument("--prompt-len", type=int, default=None, help="TTFT prompt (cuda: 2048; cpu: 64)")
    parser.add_argument("--context", type=int, default=None, help="prompt per decoding sequence (cuda: 512)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (cuda: 32; cpu: 8)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    parser.add_argument("--reps", type=int, default=3, help="TTFT repetitions (median)")
    parser.add_argument("--group", type=int, default=128, help="weight group size (falls back to a divisor of K)")
    parser.add_argument("--kv-dtype", default=None, help="KV cache format (cuda: fp16; cpu: fp32)")
    parser.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    parser.add_argument("--no-peers", action="store_true", help="skip transformers")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--json-out", default=None, help="also write the JSON object to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run with --device cpu for the CPU fallback", file=sys.stderr)
        return 0
    gpu = device.type == "cuda"
    shapes = (args.shapes or ("135m,8b" if gpu else "135m")).split(",")
    formats = (args.weights or ("int4,int8" if gpu else "int4")).split(",")
    args.batch = args.batch or ([1, 8, 32] if gpu else [1])
    args.prompt_len = args.prompt_len or (2048 if gpu else 64)
    args.context = args.context or (512 if gpu else 32)
    args.steps = args.steps or (32 if gpu else 8)
    args.kv_dtype = args.kv_dtype or ("fp16" if gpu else "fp32")
    max_position = max(args.prompt_len, args.context + args.warmup + args.steps) + 64

    copy_bw = copy_bandwidth(device, (1 << 30) if gpu else (1 << 28))
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"{name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)", file=sys.stderr)
    rows: list[dict] = []
    for shape in shapes:
        args.current_shape = shape
        for fmt in formats:
            args.current_weights = fmt
            t0 = time.perf_counter()
            loaded = synthetic_model(shape, fmt, group_size=args.group, device=device, max_position=max_position)
            print(f"{shape} {fmt}: synthetic weights in {time.perf_counter() - t0:.1f}s, "
                  f"{step_weight_bytes(loaded) / 2**30:.2f} GiB read per step", file=sys.stderr)
            rows += bench_ours(loaded, args, device, copy_bw)
            config = loaded.config
            del loaded
            _reset_peak(device)
            _dump_partial(args, name, copy_bw, rows)  # a run cut short by a time limit keeps what it had
        if not args.no_peers:
            args.current_weights = "-"
            for engine, dtype, bnb4 in peer_engines(device):
                try:
                    rows += bench_hf(config, args, device, copy_bw, dtype, bnb4, engine)
                except Exception as exc:  # a peer that cannot run is reported, not fatal
                    print(f"{engine} on {shape} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                _reset_peak(device)
                _dump_partial(args, name, copy_bw, rows)
    for r in rows:
        peer = next((p for p in rows if p["model"] == r["model"] and p["batch"] == r["batch"]
                     and p["engine"] in ("hf-fp16", "hf-fp32")), None)
        if r["engine"].startswith("edgeinfer") and peer is not None:
            r["x_hf"] = r["tok/s"] / peer["tok/s"]
    targets = check_targets(rows, device)
    result = {"device": name, "copy_GB/s": copy_bw / 1e9, "kv_dtype": args.kv_dtype, "prompt_len": args.prompt_len,
              "context": args.context, "steps": args.steps, "graphs": gpu and not args.no_graphs,
              "rows": rows, "targets": targets}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{name}: copy {copy_bw / 1e9:.0f} GB/s; KV {args.kv_dtype}; TTFT prompt {args.prompt_len}; "
          f"decode after {args.context} tokens, {args.steps} steps; graphs {result['graphs']}")
    widths = [15 if c == "engine" else max(len(c), 10) for c in COLUMNS]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for r in rows:
        print("  ".join(table_cell(r[c]).rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for t in targets:
        print(f"{'PASS' if t['ok'] else 'FAIL'}  {t['target']}: {t['value']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
