"""The C++ AVX2 CPU ops (kernels/cpu/*.cpp): build, load, weight layout and the Python calls.

Owns the ops' life cycle: compiled once per source and torch version with the machine's C++
compiler (torch.utils.cpp_extension, ~40 s) into the cache folder (edgeinfer.models.pull.cache_dir,
under ``kernels/``), then loaded from there. ``available()`` says whether this machine can run
them (an x86 CPU that torch runs at AVX2 or better, a working compiler;
``EDGEINFER_CPU_KERNEL=torch`` turns them off); where not, callers use their torch path.

The ops and their references:
- ``int4_linear`` / ``int8_linear`` (quantized_gemm.cpp) / ``dequantize_into``
  (int4_dequantize.cpp): int4 x int16 and int8 x int16 GEMMs (int8 with or without mins, groups
  of 16 or multiples of 32) and the int4 dequantizer; activations are rounded to int16 with one scale per
  4 values (llama.cpp's int8 with one per 32 broke greedy parity with the fp32 reference on the
  default model), and kernels.reference.int16_activation_gemm_reference makes the same rounding,
  so tests compare the two tightly and each against the exact fp32 product.
- ``paged_decode_attention`` (attention.cpp, its AVX-512 loops in attention_avx512.cpp): one-token
  attention over plain, int8 or int4 KV caches; the torch path of kernels.paged_attention is its
  reference (for quantized caches, a brute-force oracle in the tests).
- ``rms_norm`` (rms_norm.cpp): torch.nn.functional.rms_norm is its reference.
- ``read_rows`` (file_rows.cpp): fp32 rows of a GGUF matrix read from its file, for
  quant.gguf_import.FileRows, whose Python path (raw rows, convert, dequantize) is its reference.
- ``row_topk`` and ``sample_rows`` (sampling.cpp): each row's k largest values (torch.topk is
  the reference), and a step's token draw from processed logits (edgeinfer.worker.sampler's
  torch path is the reference).
- ``refine_logits`` (refine_logits.cpp): an int4 head's best logits recomputed from their exact
  rows (torch's einsum and scatter_ are the reference).
- ``decode_layers`` (decode_layers.cpp): all transformer layers of a decode step in one call,
  through the ops above; edgeinfer.models.llama's per-op forward is its reference.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kernels.cpu_a8 import A8Weight
from quant.formats import QuantizedTensor

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
KERNEL_ENV = "EDGEINFER_CPU_KERNEL"  # "torch": use torch's int4 kernel even where this one builds
BLOCK = 32  # the kernel's weight block; an int4 weight's K and group size must be multiples of it
_LIBRARY = "edgeinfer_cpu"
# -fopenmp: at::parallel_for is OpenMP pragmas in a header, serial without it; the library then
# needs libgomp.so.1, which resolves to the copy torch has already loaded (one thread pool).
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


@dataclass(frozen=True)
class CpuInt4Weight:
    """An int4 weight in the kernel's layout: per 32-block, byte j holds element j (low nibble)
    and element j + 16 (high nibble), so one 16-byte load unpacks to the block in order."""

    packed: torch.Tensor  # uint8 (N, K // 2)
    scales: torch.Tensor  # fp16 or fp32 (N, K // group_size)
    mins: torch.Tensor  # same dtype and shape as scales
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))


def supports_int4(weight: QuantizedTensor) -> bool:
    return weight.format == "int4" and weight.shape[1] % BLOCK == 0 and weight.group_size % BLOCK == 0


def prepare_int4(weight: QuantizedTensor) -> CpuInt4Weight:
    """Re-order the nibbles of a quant.formats int4 weight (element 2j low, 2j + 1 high) into the
    kernel's block-half order; scales and mins stay as they are (bf16 becomes fp32, exactly)."""
    if not supports_int4(weight):
        raise ValueError(f"the AVX2 int4 kernel needs an int4 weight with K and group size multiples of {BLOCK}, "
                         f"got {weight.format} {weight.shape} group {weight.group_size}")
    assert weight.mins is not None
    n, k = weight.shape
    # Row chunks bound the staging copy of unpacked codes (1 byte per weight), written in place
    # (a concatenation would hold the packed weight twice: 14 MB more for the default head). In
    # numpy: the GGUF loader's uint8 ops are already resident there, while these torch ops would
    # bring ~2 MB of their kernels' code pages in for the load alone.
    qweight = weight.qweight.numpy()
    packed = np.empty((n, k // 2), dtype=np.uint8)
    for lo in range(0, n, 4096):
        rows = qweight[lo:lo + 4096]
        codes = np.stack((rows & 0x0F, rows >> 4), axis=-1).reshape(rows.shape[0], k // BLOCK, 2, BLOCK // 2)
        packed[lo:lo + 4096] = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(rows.shape[0], k // 2)
    packed = torch.from_numpy(packed)
    dtype = weight.scales.dtype if weight.scales.dtype in (torch.float16, torch.float32) else torch.float32
    scales = weight.scales.to(dtype).contiguous()
    mins = weight.mins.to(dtype).contiguous()
    return CpuInt4Weight(packed, scales, mins, weight.group_size)


def supports_int8(weight: QuantizedTensor) -> bool:
    """int8 with K a multiple of 32 and groups of 16 (GGUF Q6_K) or a multiple of 32, mins or not."""
    return weight.format == "int8" and weight.shape[1] % BLOCK == 0 and \
        (weight.group_size % BLOCK == 0 or weight.group_size == BLOCK // 2)


def prepare_int8(weight: QuantizedTensor) -> QuantizedTensor:
    """The kernel reads quant.formats int8 as it is (codes (N, K) in order); scales and mins of
    another dtype than fp16/fp32, or of two dtypes, become fp32 (exactly), so a Q8_0 or Q6_K
    weight is not copied."""
    if not supports_int8(weight):
        raise ValueError(f"the AVX2 int8 kernel needs an int8 weight with K a multiple of {BLOCK} and group 16 or "
                         f"a multiple of {BLOCK}, got {weight.format} {weight.shape} group {weight.group_size}")
    params = [weight.scales] if weight.mins is None else [weight.scales, weight.mins]
    if all(t.dtype == weight.scales.dtype and t.is_contiguous() for t in params) and \
            weight.scales.dtype in (torch.float16, torch.float32):
        return weight
    return QuantizedTensor("int8", weight.shape, weight.group_size, weight.qweight.contiguous(),
                           weight.scales.float().contiguous(), None if weight.mins is None else weight.mins.float())


def int8_linear(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """fp32 (M, N) = x (M, K), any float dtype, @ W.T for a prepare_int8 weight, x rounded to int16."""
    return torch.ops.edgeinfer_cpu.int8_gemm(x, weight.qweight, weight.scales, weight.mins, weight.group_size)


def int4_linear(x: torch.Tensor, weight: CpuInt4Weight) -> torch.Tensor:
    """fp32 (M, N) = x (M, K), any float dtype, @ W.T with x rounded to int16 (a scale per 4)."""
    return torch.ops.edgeinfer_cpu.int4_gemm(x, weight.packed, weight.scales, weight.mins, weight.group_size)


def dequantize_into(weight: CpuInt4Weight, out: torch.Tensor) -> torch.Tensor:
    """The fp32 (N, K) weight, written into the front of ``out`` (a reused buffer)."""
    n, k = weight.shape
    torch.ops.edgeinfer_cpu.int4_dequantize(weight.packed, weight.scales, weight.mins, weight.group_size, out)
    return out.view(-1)[: n * k].view(n, k)


def read_rows(fd: int, offset: int, num_rows: int, k: int, ggml_type: int, row_ids: torch.Tensor,
              cache: torch.Tensor | None = None, cache_ids: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 (len(row_ids), k) rows of a (num_rows, k) GGUF matrix (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1, Q4_K, Q5_K or Q6_K) stored at byte ``offset`` of the open file ``fd``; one pread
    per row, except rows found in ``cache`` (slots x row bytes, uint8) / ``cache_ids`` (slots,
    int64, -1 for empty): row r's bytes kept in slot r % slots, updated with the rows read.
    The caller keeps a cache to one thread at a time."""
    return torch.ops.edgeinfer_cpu.read_rows(fd, offset, num_rows, k, ggml_type, row_ids, cache, cache_ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm over the last dimension of x with an fp32 weight."""
    return torch.ops.edgeinfer_cpu.rms_norm(x, weight, eps)


def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values fp32, indices int64), each (B, k): the k (0 to V) largest values of each row of fp32
    x (B, V), largest first, the lower index first among equal values up to k = 128 (torch's order
    above), NaN above every number (as torch.topk)."""
    return torch.ops.edgeinfer_cpu.row_topk(x, k)


def refine_logits(logits: torch.Tensor, h: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[l, ids[l, r]] = h[l] . rows[l * R + r] for fp32 logits (L, V), fp32 h
    (L, hidden), int64 ids (L, R) and fp32 rows (L * R, hidden), each contiguous."""
    torch.ops.edgeinfer_cpu.refine_logits(logits, h, ids, rows)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, log_min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(B,) int64 token ids drawn from fp32 (B, V) processed logits with the per-row parameters of
    edgeinfer.worker.sampler.SamplingBatch (greedy rows: the first largest); a row holding a NaN or
    only -inf raises."""
    return torch.ops.edgeinfer_cpu.sample_rows(logits, temperature, greedy, top_k, top_p, log_min_p, uniforms)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           isa: str = "", k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, k_zero: torch.Tensor | None = None,
                           v_zero: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 (S, Hq, D): one query token per sequence over plain (blocks, block_size, Hkv, D)
    caches, int8 ones with fp16 ``k_scale`` / ``v_scale`` (blocks, block_size, Hkv) (a value is
    code x scale), or int4 ones (uint8 (blocks, block_size, Hkv, D / 2), channel 2i in byte i's
    low nibble) with fp16 scales and zeros (blocks, block_size, Hkv, D / 32) (a value is code x
    scale + zero per 32 channels); the fused step's rotation and key centring are its own. Read
    through int32 block tables up to int32 context lengths. ``isa``: "avx2", "avx512" or "" (the
    widest this CPU runs, as the fused step uses)."""
    return torch.ops.edgeinfer_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, isa,
                                                          k_scale, v_scale, k_zero, v_zero)


def attention_isa_supported(isa: str) -> bool:
    """Whether this CPU runs paged_decode_attention's ``isa`` loops ("avx2" or "avx512")."""
    return bool(torch.ops.edgeinfer_cpu.attention_isa_supported(isa))


# decode_layers' phases, in the order of its phase_ns (kernels/cpu/decode_layers.cpp kPhases).
DECODE_PHASES = ("input norm", "qkv", "rope + kv write", "attention", "o", "residual + norm", "gate/up", "act",
                 "down + residual")


def decode_setup(weights: list[torch.Tensor], k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 num_heads: int, scale: float, eps: float,
                 k_scales: Sequence[torch.Tensor] = (), v_scales: Sequence[torch.Tensor] = (),
                 k_zeros: Sequence[torch.Tensor] = (), v_zeros: Sequence[torch.Tensor] = (),
                 rotation: torch.Tensor | None = None, key_centres: torch.Tensor | None = None,
                 a8_wsums: Sequence[torch.Tensor] = (), a8_isa: str = "", a8_terms: Sequence[int] = (),
                 qkv_biases: Sequence[torch.Tensor] = (), qk_norms: Sequence[torch.Tensor] = (),
                 out_norms: Sequence[torch.Tensor] = (), window: int = 0, global_every: int = 0,
                 activation: str = "silu", attn_softcap: float = 0.0,
                 v_weights: Sequence[torch.Tensor] = ()) -> torch.ScriptObject:
    """What ``decode_layers`` keeps from step to step for a model over one KV pool, checked once
    here (a RuntimeError names what is wrong): its weights, the pool's caches and the architecture's
    constants. It holds the tensors; their contents may change (the caches are written by every
    step), not the tensors themselves. Why one object: passed per step, ~700 tensors cost ~220 us a
    one-row step to convert (decode_layers.cpp, DecodeSetup).
    ``weights``: 14 per layer (``decode_layer_weights``): the input norm, (codes, scales, mins) of
    QKV and of the output projection, the post-attention norm, then (codes, scales, mins) of gate/up
    and of down, each linear int4 or int8 with the group size its scales imply, or, with ``a8_isa``
    (kernels.cpu_a8.ISAS), every linear a cpu_a8 weight run with int8 activations on that kernel,
    its wsum in ``a8_wsums`` (``decode_layer_wsums``), its activations in as many int8 terms as
    ``a8_terms`` gives it (``decode_layer_terms``; kernels.cpu_a8.a8_linear); caches plain, or
    quantized (kernels.kv_pool's layouts: int8 with ``k_scales`` / ``v_scales``, int4 also with
    ``k_zeros`` / ``v_zeros``), K and V rotated by ``rotation`` and keys less ``key_centres``
    (layers, Hkv, D) first; ``qkv_biases`` (one fp32 ((Hq + 2 Hkv) * D,) per layer, added to QKV)
    and ``qk_norms`` (q's and k's fp32 (D,) RMSNorm weights per layer, over each head before RoPE)
    and ``out_norms`` (Gemma's sandwich norms: the attention's and the MLP's output norm weights
    per layer), where the architecture has them; ``window``: the sliding window of local layers (a
    query attends to itself and the window - 1 tokens before it; 0: none), every layer local
    unless ``global_every`` makes each global_every-th global; ``activation``: "silu" or
    "gelu_tanh"; ``attn_softcap``: scores -> cap * tanh(scores / cap) before the softmax (Gemma 2;
    0: none); ``v_weights``: none, or four per layer (``decode_layer_v``): V's own weight where it
    comes in another format than Q's and K's, the layer's QKV weight then holding Q and K only."""
    return torch.classes.edgeinfer_cpu.DecodeSetup(
        list(weights), list(k_caches), list(v_caches), num_heads, scale, eps, list(k_scales), list(v_scales),
        list(k_zeros), list(v_zeros), rotation, key_centres, list(a8_wsums), a8_isa, [int(t) for t in a8_terms],
        list(qkv_biases), list(qk_norms), list(out_norms), window, global_every, activation, attn_softcap,
        list(v_weights))


def decode_layers(h: torch.Tensor, setup: torch.ScriptObject, cos: torch.Tensor, signed_sin: torch.Tensor,
                  positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, a8_bf16_rows: torch.Tensor | None = None,
                  local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                  phase_ns: torch.Tensor | None = None) -> None:
    """Run every layer of ``setup`` (``decode_setup``) on h (M, hidden) fp32 in place, writing
    each layer's K/V into its caches: token t at ``positions[t]`` into pool slot
    ``slot_mapping[t]``, attending over the first ``context_lens[t]`` slots of its sequence through
    row t of ``block_tables``. ``cos`` / ``signed_sin``: (max_position, head_dim) RoPE tables, the
    sine's first half negated; ``local_rope``: local layers' own (cos, signed_sin) tables (Gemma 3);
    ``a8_bf16_rows``: (M,) bool, rows whose a8 linears run in bf16 on AMX-BF16; ``phase_ns``: None,
    or a (len(DECODE_PHASES),) int64 tensor each phase's wall time in nanoseconds is added into,
    summed over the layers."""
    torch.ops.edgeinfer_cpu.decode_layers(h, setup, cos, signed_sin, positions, slot_mapping, block_tables,
                                          context_lens, a8_bf16_rows, *(local_rope or (None, None)), phase_ns)


FusedLinear = CpuInt4Weight | QuantizedTensor | A8Weight  # a prepare_int4, prepare_int8 or cpu_a8 weight


def decode_layer_weights(input_norm: torch.Tensor, qkv: FusedLinear, o: FusedLinear, post_norm: torch.Tensor,
                         gate_up: FusedLinear, down: FusedLinear) -> list[torch.Tensor]:
    """One layer's 14 tensors in decode_layers' order (an int8 weight without mins: an empty one)."""
    return [input_norm.float().contiguous(), *_linear_tensors(qkv), *_linear_tensors(o), post_norm.float().contiguous(),
            *_linear_tensors(gate_up), *_linear_tensors(down)]


def _linear_tensors(w: FusedLinear) -> list[torch.Tensor]:
    """A linear's (codes, scales, mins) for decode_layers (no mins: an empty tensor)."""
    if isinstance(w, CpuInt4Weight):
        return [w.packed, w.scales, w.mins]
    if isinstance(w, A8Weight):
        return [w.codes, w.scales, w.scales.new_empty(0) if w.mins is None else w.mins]
    return [w.qweight, w.scales, w.scales.new_empty(0) if w.mins is None else w.mins]


def decode_layer_v(v: FusedLinear | None) -> list[torch.Tensor]:
    """decode_layers' ``v_weights`` for one layer: V's own (codes, scales, mins or empty, a8 wsum or
    empty), or four empty tensors where the layer's QKV weight holds V."""
    if v is None:
        return [torch.empty(0) for _ in range(4)]
    wsum = v.wsum if isinstance(v, A8Weight) and v.wsum is not None else torch.empty(0, dtype=torch.int16)
    return [*_linear_tensors(v), wsum]


def decode_layer_wsums(linears: Sequence[A8Weight]) -> list[torch.Tensor]:
    """decode_layers' ``a8_wsums`` for cpu_a8 linears in its order (qkv, o, gate_up, down per
    layer): each int8 weight's int16 code sums, an empty tensor for int4."""
    return [torch.empty(0, dtype=torch.int16) if w.wsum is None else w.wsum for w in linears]


def decode_layer_terms(linears: Sequence[A8Weight]) -> list[int]:
    """decode_layers' ``a8_terms`` for cpu_a8 linears in its order: each one's activation terms
    (a layer's V apart runs in its QKV's)."""
    return [w.terms for w in linears]


@functools.cache
def available() -> bool:
    """Build (first time only) and load the ops; False where this machine cannot run them."""
    if os.environ.get(KERNEL_ENV, "").lower() == "torch":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
        "AVX2", "AVX512"
    ):
        return False
    try:
        _load()
    except Exception as e:  # noqa: BLE001 - any build failure means "use the portable kernel"
        log.warning("AVX2 CPU ops unavailable, using the torch paths (%s)", str(e).splitlines()[0])
        return False
    return True


def _library_dir() -> Path:
    """Where compiled libraries are kept: kernels/ under edgeinfer's cache directory (the lookup
    of edgeinfer.models.pull.cache_dir, repeated here because kernels/ sits below edgeinfer/)."""
    if os.environ.get("EDGEINFER_CACHE"):
        return Path(os.environ["EDGEINFER_CACHE"]).expanduser() / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeinfer" / "kernels"


def _load() -> None:
    sources = sorted(SOURCE_DIR.glob("*.cpp"))
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(_FLAGS).encode())
    for path in sorted(SOURCE_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    library = _library_dir() / f"{_LIBRARY}-{digest.hexdigest()[:16]}.so"
    if library.is_file():
        torch.ops.load_library(str(library))
        return
    from torch.utils.cpp_extension import load

    # WARNING so that it shows by default: a first start otherwise sits silent for a minute.
    log.warning("compiling the C++ CPU kernels once (about a minute; later starts reuse them) into %s",
                library.parent)
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private folder and move the finished library into place, so an interrupted or
    # concurrent build never leaves a half-written library where the next start would load it.
    build = Path(tempfile.mkdtemp(prefix="build-", dir=library.parent))
    try:
        with _compile_progress(build, len(sources)):
            load(name=_LIBRARY, sources=[str(p) for p in sources], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                 build_directory=str(build), is_python_module=False, verbose=False)
        os.replace(build / f"{_LIBRARY}.so", library)
    finally:
        shutil.rmtree(build, ignore_errors=True)


@contextlib.contextmanager
def _compile_progress(build: Path, num_sources: int) -> Iterator[None]:
    """A progress bar (on a terminal) of the sources compiled so far: ninja writes one object file
    per source into ``build``, and torch's ``load`` gives no other sign of progress."""
    from tqdm import tqdm

    done = threading.Event()
    with tqdm(total=num_sources, desc="compiling CPU kernels", unit="file", disable=None, leave=False) as bar:
        def poll() -> None:
            while not done.wait(0.5):
                bar.update(len(list(build.glob("*.o"))) - bar.n)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()
