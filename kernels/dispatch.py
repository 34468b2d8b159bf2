"""The one dispatch point: the backend chosen once per model, and linear layers through it.

``choose_backend`` turns the requested linear path and the device, with what this machine can
run (the C++ CPU ops where they build), into a frozen ``Backend``; LlamaModel holds it and hands
its flags down by argument (the attention entry points, KVPool.write). Nothing below it asks the
machine again, and tests pick a backend by building one.

Linear layers: weight -> kernel-ready form (once, at load, ``prepare_linear``) -> matmul
(``linear``). Paths:
- ``int4_cpu``: int4 weights on the CPU. Up to ``CPU_KERNEL_MAX_M`` rows (decode, CPU prefill
  chunks) the AVX2 int4 x int16 kernel runs (kernels.cpu_ops: activations rounded to int16, a
  scale per 4 values; ~1.9-2.6x torch's int4 kernel at M = 1, 4 and 16,
  tools/bench_cpu_kernels.py) where the backend has the C++ ops; else torch's portable int4
  kernel (``_weight_int4pack_mm_for_cpu``, bf16 activations) below ``PREFILL_M``. Above, the
  weight is dequantized to fp32 per call into a reused scratch buffer and run through the fp32
  GEMM, which wins at prefill shapes. Either way only one copy of the weight is kept: the
  dequantizer reads the kernel's own layout (torch's packed bytes: layout probed once, see
  ``_packed_block_n``).
- ``int8_cpu``: int8 weights with the AVX2 ops (with mins and groups of 16 too: GGUF Q5_x, Q6_K):
  the int8 x int16 kernel (same activation
  rounding) up to ``CPU_KERNEL_MAX_M`` rows, dequantize into the scratch buffer + fp32 GEMM above; the
  weight is used as loaded (a Q8_0 tensor is not copied). Without the ops int8 (and nf4) weights
  run as bf16 copies (``bf16_cpu``).
- ``a8_cpu`` (a Backend with ``int8_activations``: RuntimeConfig.cpu_activations int8 or int8x2,
  or auto on a VNNI CPU, ``resolve_cpu_activations``; on the int4_cpu path): int4 and int8
  weights through the int8-activation GEMMs (kernels.cpu_a8: rows rounded to int8 with a scale
  per 32, in one or two terms; vpdpbusd on AVX512-VNNI / AVX-VNNI, vpmaddubsw on AVX2) at every
  M, prefill chunks included, and in the fused step: SmolLM2-135M's MLP shapes at M = 16-64 run
  3-10x the int16 kernel and 2-4x dequantize + fp32 GEMM (tools/bench_int8_gemm.py), M = 1 ~3x
  the int16 kernel (one term). On AMX-BF16 CPUs the same tiles run with bf16 activations for
  every row (``a8_bf16``) or for a step's prompt rows (``a8_bf16_prompts``; ``linear``'s
  ``bf16_rows``), generated rows staying int8x2.
- ``triton``: the Triton W4A16/W8A16 kernels (CUDA).
- ``reference``: dequantize to fp32 and matmul in fp32; exact, the oracle for the tests.

torch's int4 CPU kernel wants w = (q - 8) * scale + zero, so zero = min + 8 * scale, stored in
bf16: that rounding is its only difference from the reference. The AVX2 kernel keeps the
checkpoint's fp16 scales and mins; its difference is the int16 rounding of activations.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kernels import cpu_a8, cpu_ops
from quant.formats import QuantizedTensor, unpack_int4

# Crossovers against dequantize + fp32 GEMM. torch's int4 kernel (and a bf16 GEMM) lose from
# ~32 rows on. The AVX2 kernels, since their accumulators stay in registers and a tile's min
# terms are one FMA per group, win up to 64 (gate/up 2.71 vs 3.03 ms at 64, down 0.90 vs 1.00;
# qkv ties at 64 and the dequantized GEMM wins from 96). LlamaModel's fused decode step calls
# the kernels directly, for wider batches too (FUSED_STEP_MAX_TOKENS).
PREFILL_M = 32
CPU_KERNEL_MAX_M = 64
# CPU steps of up to this many tokens (decode rows, prompt chunks, verify steps) run as one
# decode_layers call. Its int4 kernel stays within ~10% of dequantize + fp32 GEMM per linear up
# to 128 rows (the measurement above); the per-op forward it replaces cost 2x at 48 decode rows
# (394 vs 191 ms per step) and, for 64-token prompt chunks, ran a 256-token prompt at 249-266
# tok/s against 338-414 (1024 tokens: 172-179 vs 219-286) with ~10 MB more peak RSS: its
# activations went through torch's allocator op by op; larger steps were not measured.
FUSED_STEP_MAX_TOKENS = 128
LINEAR_PATHS = ("int4_cpu", "triton", "reference")
_INNER_K_TILES = 8  # ignored by the CPU packer beyond validation; the CUDA one tiles by it
_PACK_CHUNK_ROWS = 4096  # a multiple of every packing block width


@dataclass(frozen=True)
class Backend:
    """What runs where for one model, decided once (``choose_backend``) and passed down."""

    device: torch.device
    linear_path: str  # one of LINEAR_PATHS ("auto" is resolved by choose_backend)
    # The C++ ops run: the int4/int8 linear kernels, RMSNorm, decode attention over plain
    # caches and a GGUF's rows read from its file; else every caller takes its torch path.
    cpu_ops: bool
    triton: bool  # attention and KV cache writes run the Triton kernels (CUDA, or the interpreter)
    # Steps of up to this many tokens run all layers as one C++ call (kernels.cpu_ops.decode_layers)
    # where the model's weights allow it; 0: never.
    fused_step_max_tokens: int
    # int4_cpu: quantized linears round activations to int8 per row (kernels.cpu_a8) instead of
    # int16 per 4 values; needs the C++ ops.
    int8_activations: bool = False
    a8_terms: int = 1  # with int8_activations: 1 int8 term per activation, or 2 (kernels.cpu_a8)
    # with int8_activations: the same GEMMs with bf16 activations on AMX-BF16 for every row
    # (cpu_activations bf16), or for the prompt rows only (bf16-prompts; generated rows int8x2)
    a8_bf16: bool = False
    a8_bf16_prompts: bool = False
    # with a8_terms 2: the linears (A8_LINEARS) whose activations stay one int8 term
    # (cpu_activations int8x2-lean: LEAN_ONE_TERM)
    a8_one_term: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.linear_path not in LINEAR_PATHS:
            raise ValueError(f"linear_path must be one of {LINEAR_PATHS}, got {self.linear_path!r}")
        if self.cpu_ops and self.device.type != "cpu":
            raise ValueError(f"the C++ CPU ops run on the CPU only, not on {self.device}")
        if self.fused_step_max_tokens < 0 or (self.fused_step_max_tokens and not self.cpu_ops):
            raise ValueError(f"fused_step_max_tokens must be 0, or positive with the C++ CPU ops, got "
                             f"{self.fused_step_max_tokens} (cpu_ops={self.cpu_ops})")
        if self.a8_terms not in (1, 2):
            raise ValueError(f"a8_terms must be 1 or 2, got {self.a8_terms}")
        if self.a8_bf16 and (self.a8_terms != 1 or not self.int8_activations):
            raise ValueError(f"a8_bf16 runs on the a8 path (int8_activations) with one term, got "
                             f"int8_activations={self.int8_activations} a8_terms={self.a8_terms}")
        unknown = set(self.a8_one_term) - set(A8_LINEARS)
        if unknown or (self.a8_one_term and self.a8_terms != 2):
            raise ValueError(f"a8_one_term names some of {A8_LINEARS} with a8_terms 2, got {self.a8_one_term} "
                             f"with a8_terms {self.a8_terms}")
        if self.a8_bf16_prompts and (self.a8_bf16 or not self.int8_activations):
            raise ValueError("a8_bf16_prompts runs on the a8 path (int8_activations), without a8_bf16")
        if self.int8_activations and not (self.cpu_ops and self.linear_path == "int4_cpu"):
            raise ValueError(f"int8 activations run on the int4_cpu linear path with the C++ CPU ops, not "
                             f"{self.linear_path} (cpu_ops={self.cpu_ops})")

    def for_linear(self, role: str) -> Backend:
        """The backend one linear (an A8_LINEARS role) is prepared with: one int8 term where
        ``a8_one_term`` names it."""
        if role not in A8_LINEARS:
            raise ValueError(f"linear role must be one of {A8_LINEARS}, got {role!r}")
        return dataclasses.replace(self, a8_terms=1, a8_one_term=()) if role in self.a8_one_term else self


A8_LINEARS = ("qkv", "o", "gate_up", "down", "head")  # a layer's linears (V apart runs as QKV) and the head
# int8x2-lean: the attention output projection and the head's coarse pass (whose best rows are
# recomputed exactly; a head stored in int4 stays on two) in one term: perplexity +0.09% over
# int16 and int8x2's greedy tokens on the default model, where one term on MLP down, gate/up or
# QKV as well broke greedy parity (docs/BENCHMARKS.md "int8x2-lean").
LEAN_ONE_TERM = ("o", "head")

# CPUs whose int8 dot products make two int8 terms pay: on AVX2 alone (vpmaddubsw) a 16-stream
# step of the default model ran 70-107 ms against int16's 62.
VNNI_ISAS = ("amx", "avx512vnni", "avxvnni")


def resolve_cpu_activations(requested: str, device: torch.device) -> str:
    """RuntimeConfig.cpu_activations as it runs: "auto" is bf16-prompts on a CPU with AMX-BF16,
    int8x2-lean on one with VNNI, else int16. int8x2 has int16's accuracy (default model: perplexity
    46.584 vs 46.583, 8 of 8 prompts x 32 greedy tokens identical) and, on an AVX512-VNNI Xeon
    (docs/BENCHMARKS.md, 2026-11-26), decodes the default model 1.25-1.47x (one stream) and 2.08x
    (16 streams) as fast, its prefill on a par; a 1.7B Q4_K_M, bound by memory, decodes 0.89x and
    prefills 1.10x as fast. bf16-prompts keeps int8x2 for every generated token (decode speed
    and a request's tokens whatever else runs beside it) and runs prompts in bf16 on the AMX tile
    unit (perplexity 46.61; 256-token prefill 1.3x int8x2's on the default model, 1.9x on a 1.7B
    Q4_K_M, 1.2x on its Q8_0; docs/BENCHMARKS.md). int8x2-lean runs two of int8x2's linears in
    one term (LEAN_ONE_TERM, with int8x2's measured accuracy): on an AVX512-VNNI EPYC a 16-row
    decode forward of the default model took 0.92x (0.89-0.97x) int8x2's time, one row the same
    (docs/BENCHMARKS.md, 2026-11-27).
    On AMX the fold makes both terms one tile multiply, so bf16-prompts keeps int8x2's."""
    if requested in ("bf16", "bf16-prompts") and not _has_amx_bf16(device):
        raise ValueError(f"cpu_activations {requested} needs a CPU with AMX-BF16 (a Sapphire Rapids or later Xeon) "
                         "and the C++ CPU ops; this machine has no such path: use int8x2 or int16")
    if requested != "auto":
        return requested
    if device.type != "cpu" or not cpu_ops.available():
        return "int16"
    if cpu_a8.default_isa() == "amx" and _has_amx_bf16(device):  # not where EDGEINFER_CPU_ISA names another
        return "bf16-prompts"
    return "int8x2-lean" if cpu_a8.default_isa() in VNNI_ISAS else "int16"


def _has_amx_bf16(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_ops.available() and cpu_a8.isa_supported(cpu_a8.BF16_ISA)


def choose_backend(linear_path: str = "auto", device: str | torch.device = "cpu",
                   int8_activations: bool = False, a8_terms: int = 1, a8_bf16: bool = False,
                   a8_bf16_prompts: bool = False, a8_one_term: tuple[str, ...] = ()) -> Backend:
    """The backend for a requested linear path (RuntimeConfig.linear_path; "auto": Triton on CUDA,
    int4_cpu elsewhere) on ``device``, with the C++ ops wherever this machine runs them (on every
    linear path: the reference path's norms and attention are theirs too). ``int8_activations``
    (RuntimeConfig.cpu_activations "int8", "int8x2" or "int8x2-lean", whose ``a8_terms`` is 2, the
    latter's ``a8_one_term`` LEAN_ONE_TERM; "bf16", ``a8_bf16``;
    "bf16-prompts", ``a8_bf16_prompts`` with two terms) applies where the int4_cpu path has the
    C++ ops and is ignored elsewhere."""
    device = torch.device(device)
    if linear_path == "auto":
        linear_path = "triton" if device.type == "cuda" else "int4_cpu"
    native = device.type == "cpu" and cpu_ops.available()
    a8 = int8_activations and native and linear_path == "int4_cpu"
    return Backend(device, linear_path, cpu_ops=native, triton=device.type == "cuda",
                   fused_step_max_tokens=FUSED_STEP_MAX_TOKENS if native else 0,
                   int8_activations=a8, a8_terms=a8_terms, a8_bf16=a8_bf16 and a8,
                   a8_bf16_prompts=a8_bf16_prompts and a8, a8_one_term=a8_one_term if a8 else ())


@dataclass(frozen=True)
class PreparedLinear:
    """A weight converted once into the form its path's kernel reads."""

    path: str
    shape: tuple[int, int]  # (N, K)
    source: QuantizedTensor | None  # the dequantize-then-GEMM prefill path's weight; int8_cpu's weight
    dense: torch.Tensor | None = None  # fp32 (N, K) for plain weights / the reference path
    packed: torch.Tensor | None = None  # int4_cpu: torch's packed layout
    scales_and_zeros: torch.Tensor | None = None  # int4_cpu: bf16 (K // group, N, 2)
    # triton: the kernel module's prepared weight; int4_cpu: CpuInt4Weight; a8_cpu: cpu_a8.A8Weight
    kernel: object | None = None
    group_size: int = 0  # int4_cpu, int8_cpu
    block_n: int | None = None  # int4_cpu: row-block width of the packed layout

    @property
    def nbytes(self) -> int:
        tensors = [self.dense, self.packed, self.scales_and_zeros]
        total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        if isinstance(self.kernel, (cpu_ops.CpuInt4Weight, cpu_a8.A8Weight)):
            total += self.kernel.nbytes
        if self.source is not None and self.dense is None:
            total += self.source.nbytes
        return total


def scratch_numel(weights: list[PreparedLinear]) -> int:
    """fp32 elements of the scratch buffer the CPU int4/int8 prefill paths reuse for these weights."""
    return max((w.shape[0] * w.shape[1] for w in weights if w.path in ("int4_cpu", "int8_cpu")), default=0)


def prepare_linear(weight: torch.Tensor | QuantizedTensor, backend: Backend) -> PreparedLinear:
    """Convert a weight for the backend's linear path; called once per weight at load time."""
    path, device = backend.linear_path, backend.device
    if not isinstance(weight, QuantizedTensor):
        if path == "int4_cpu" and weight.dtype == torch.bfloat16:
            return PreparedLinear("bf16_cpu", tuple(weight.shape), None, dense=weight.contiguous())
        dense = weight.to(device=device, dtype=torch.float32).contiguous()
        return PreparedLinear("dense", tuple(dense.shape), None, dense=dense)
    if path == "reference":
        dense = weight.dequantize(torch.float32).to(device)
        return PreparedLinear("reference", weight.shape, None, dense=dense)
    if path == "int4_cpu":
        if backend.int8_activations and cpu_a8.supports(weight):
            return PreparedLinear("a8_cpu", weight.shape, None,
                                  kernel=cpu_a8.prepare_a8(weight, backend.a8_terms, backend.a8_bf16),
                                  group_size=weight.group_size)
        if cpu_ops.supports_int8(weight) and backend.cpu_ops:
            return PreparedLinear("int8_cpu", weight.shape, cpu_ops.prepare_int8(weight), group_size=weight.group_size)
        if cpu_ops.supports_int4(weight) and backend.cpu_ops:
            return PreparedLinear("int4_cpu", weight.shape, None, kernel=cpu_ops.prepare_int4(weight),
                                  group_size=weight.group_size)
        if weight.format != "int4" or weight.shape[0] % 16:  # torch's packer needs N % 16 == 0
            # Only int4 has a fast CPU kernel. Dequantizing int8/nf4 per call cost 0.4 tok/s on the
            # default model; a bf16 copy (2 bytes per weight) runs as a bf16 GEMV instead.
            return PreparedLinear("bf16_cpu", weight.shape, None, dense=weight.dequantize(torch.bfloat16))
        return _prepare_int4_cpu(weight)
    assert path == "triton"  # Backend checked the name
    return _prepare_triton(weight, device)


def _prepare_int4_cpu(weight: QuantizedTensor) -> PreparedLinear:
    """torch's packed layout, for its portable int4 kernel."""
    assert weight.mins is not None
    block_n = _packed_block_n()
    # Row chunks (whole packing blocks) keep the int32 staging copy small: 113 MB for the
    # default model's head in one go.
    chunk = _PACK_CHUNK_ROWS if block_n else weight.shape[0]
    packed = torch.cat([
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(rows).to(torch.int32), _INNER_K_TILES)
        for rows in weight.qweight.split(chunk)
    ])
    scales = weight.scales.float()
    zeros = weight.mins.float() + 8 * scales
    scales_and_zeros = torch.stack((scales.t(), zeros.t()), dim=-1).contiguous().to(torch.bfloat16)
    # Keep the QuantizedTensor only where the packed bytes cannot be read back (unknown layout).
    source = weight if block_n is None or weight.shape[0] % block_n else None
    return PreparedLinear("int4_cpu", weight.shape, source, packed=packed, scales_and_zeros=scales_and_zeros,
                          group_size=weight.group_size, block_n=block_n)


@functools.cache
def _packed_block_n() -> int | None:
    """Row-block width of torch's CPU int4 packing, or None if it is not the layout we read.

    The packer stores rows in blocks of B (32 on AVX2, 64 with AVX-512): byte [b, k, i] holds
    q[b*B + i, k] in its low nibble and q[b*B + i + B/2, k] in its high nibble. Probed once on a
    random matrix rather than assumed, since it depends on how torch was built.
    """
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES).reshape(-1)
    for block_n in (32, 64, 16, 8):
        x = q.view(128 // block_n, block_n, 64).permute(0, 2, 1)
        if torch.equal((x[..., : block_n // 2] | (x[..., block_n // 2 :] << 4)).to(torch.uint8).reshape(-1), packed):
            return block_n
    return None


def _dequantize_packed_t(weight: PreparedLinear, scratch: torch.Tensor | None) -> torch.Tensor:
    """W.T (K, N) in fp32 from torch's packed bytes: w = (q - 8) * scale + zero per group.

    Written into ``scratch`` (any fp32 tensor of >= N * K elements) when given: a fresh 7 MB
    buffer per call costs more in page faults than the arithmetic (2.1 vs ~0.7 ms measured)."""
    n, k = weight.shape
    block_n, half, group = weight.block_n, weight.block_n // 2, weight.group_size
    packed = weight.packed.view(n // block_n, k, half)
    out = _scratch(weight, scratch).view(k, n // block_n, block_n)
    out[..., :half].copy_((packed & 0x0F).permute(1, 0, 2))  # copy_ converts uint8 -> fp32
    out[..., half:].copy_((packed >> 4).permute(1, 0, 2))
    sz = weight.scales_and_zeros.float()  # (K / group, N, 2)
    scales = sz[:, None, :, 0]
    offsets = sz[:, None, :, 1] - 8 * scales
    return out.view(k // group, group, n).mul_(scales).add_(offsets).view(k, n)


def _scratch(weight: PreparedLinear, scratch: torch.Tensor | None) -> torch.Tensor:
    """The first N * K elements of ``scratch``, or a fresh buffer where it is missing or short."""
    numel = weight.shape[0] * weight.shape[1]
    return torch.empty(numel) if scratch is None or scratch.numel() < numel else scratch[:numel]


def _dequantize_int8_into(weight: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """The fp32 (N, K) int8 weight, written into ``out`` (N * K elements)."""
    n, k = weight.shape
    g = weight.group_size
    dense = out.view(n, k // g, g)
    # fp32 scales: with fp16 ones the product would be computed, and rounded, in fp16.
    torch.mul(weight.qweight.view(n, k // g, g), weight.scales.view(n, k // g, 1).float(), out=dense)
    if weight.mins is not None:  # GGUF Q5_1/Q5_K
        dense.add_(weight.mins.view(n, k // g, 1).float())
    return dense.view(n, k)


def _prepare_triton(weight: QuantizedTensor, device: torch.device) -> PreparedLinear:
    if weight.format == "int4":
        from kernels.int4_gemm import prepare_int4

        kernel = prepare_int4(weight.to(device))
    elif weight.format == "int8":
        from kernels.int8_gemm import prepare_int8

        kernel = prepare_int8(weight.to(device))
    else:
        return PreparedLinear("dequantize", weight.shape, weight.to(device))
    return PreparedLinear("triton", weight.shape, None, kernel=kernel)


def linear(x: torch.Tensor, weight: PreparedLinear, scratch: torch.Tensor | None = None,
           bf16_rows: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T for x (..., K). Returns fp32 on the exact, prefill and AVX2 int4 paths, bf16
    from torch's int4/bf16 CPU kernels at thin M (left unconverted: the callers' next op, a
    residual add or RoPE against fp32 tensors, promotes it for free; a separate .float() costed
    ~2 us per call),
    x's dtype on Triton. ``scratch``: a reusable fp32 buffer for the int4_cpu prefill path (see
    scratch_numel). ``bf16_rows``: (M,) bool, the rows an a8_cpu weight runs with bf16 activations
    (Backend.a8_bf16_prompts: a step's prompt rows); the others run as the weight was prepared."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    path = weight.path
    if path in ("dense", "reference"):
        y = x2.float() @ weight.dense.t()
    elif path == "a8_cpu" and bf16_rows is not None and bool(bf16_rows.any()):
        if bool(bf16_rows.all()):  # a prompt-only step: no gather and scatter
            y = cpu_a8.a8_linear(x2, weight.kernel, bf16=True)
        else:
            y = torch.empty(m, weight.shape[0])
            y[bf16_rows] = cpu_a8.a8_linear(x2[bf16_rows], weight.kernel, bf16=True)
            y[~bf16_rows] = cpu_a8.a8_linear(x2[~bf16_rows], weight.kernel)
    elif path == "a8_cpu":
        y = cpu_a8.a8_linear(x2, weight.kernel)
    elif path == "int4_cpu" and weight.kernel is not None:
        if m <= CPU_KERNEL_MAX_M:
            y = cpu_ops.int4_linear(x2, weight.kernel)
        else:
            y = x2.float() @ cpu_ops.dequantize_into(weight.kernel, _scratch(weight, scratch)).t()
    elif path == "int8_cpu":
        if m <= CPU_KERNEL_MAX_M:
            y = cpu_ops.int8_linear(x2, weight.source)
        else:
            y = x2.float() @ _dequantize_int8_into(weight.source, _scratch(weight, scratch)).t()
    elif path == "int4_cpu" and (m < PREFILL_M or weight.source is not None):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.to(torch.bfloat16), weight.packed, weight.group_size, weight.scales_and_zeros
        )
    elif path == "int4_cpu":
        y = x2.float() @ _dequantize_packed_t(weight, scratch)
    elif path == "bf16_cpu":
        # bf16 GEMM is slow on AVX2 at prefill sizes (~7x fp32), so wide batches upcast.
        w = weight.dense
        y = x2.to(torch.bfloat16) @ w.t() if m < PREFILL_M else x2.float() @ w.float().t()
    elif path == "dequantize":
        y = x2.float() @ weight.source.dequantize(torch.float32).t()
    elif path == "triton":
        y = _triton_linear(x2, weight.kernel)
    else:
        raise ValueError(f"unknown prepared linear path {path!r}")
    return y.reshape(*lead, weight.shape[0])


def _triton_linear(x: torch.Tensor, kernel: object) -> torch.Tensor:
    from kernels.int4_gemm import Int4Weight, int4_gemm
    from kernels.int8_gemm import int8_gemm

    if x.dtype not in (torch.float16, torch.bfloat16):
        x = x.to(torch.float16)
    if isinstance(kernel, Int4Weight):
        return int4_gemm(x.contiguous(), kernel)
    return int8_gemm(x.contiguous(), kernel)
