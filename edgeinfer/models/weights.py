"""Weight preparation: a checkpoint's tensors -> the forms LlamaModel's forward reads, once at load.

Owns the conversion for the model's kernels.dispatch.Backend: Q/K/V and gate/up fused into one
weight each, every linear converted by kernels.dispatch.prepare_linear, norms made dense fp32,
the head re-quantized to int4 for a coarse pass where asked, a GGUF's embedding left in its file
on the CPU, and kernels.cpu_ops.decode_layers' weight list where the fused step can run (every
linear on the C++ int4 or int8 kernel). What it
returns is read-only from then on; the forward (edgeinfer.models.llama) reads rows through
``weight_rows``.

``head_format`` 'same' runs the output head in the checkpoint's format. 'int4' is the CPU fast
path: the head (49152 x 576 for the default model, a quarter of all weight bytes) is re-quantized
to int4 g32 for a coarse pass (2.6 ms instead of 5.3 ms as a bf16 GEMV), and the forward
recomputes its best rows exactly from ``head_exact`` (llama.HEAD_REFINE_ROWS). Measured on the
default model's Q8_0 head: the int8 kernel (1.65-2.0 ms per token, 30 MB read) loses to int4 +
refinement (1.2-1.3 ms, 18 MB read) by more than the 17 MB it saves.

On the CPU a GGUF's embedding is not loaded: each step reads the rows it needs (its tokens, and
the refined head rows when tied) from the file (quant.gguf_import.FileRows).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from edgeinfer.config import ArchSpec, ModelConfig
from edgeinfer.models.host_memory import trim_heap
from kernels import cpu_ops
from kernels.cpu_a8 import A8Weight
from kernels.dispatch import Backend, PreparedLinear, prepare_linear
from quant.formats import QuantizedTensor, as_int8, concat_rows, quantize_int4
from quant.gguf_import import FileRows, LazyWeights, RowReader

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedTensor


def spec_features(spec: ArchSpec, names: Sequence[str]) -> list[str]:
    """Which of the ArchSpec fields ``names`` differ from Llama's."""
    return [name for name in names if getattr(spec, name) != getattr(ArchSpec(), name)]


@dataclass(frozen=True)
class PreparedLayer:
    """One layer's weights as the forward reads them; the optional ones per the ArchSpec.
    Norm weights include the spec's norm offset."""

    input_norm: torch.Tensor
    qkv: PreparedLinear  # the checkpoint's q, k, v rows, one linear (ArchSpec.linear_parts); see v
    o: PreparedLinear
    post_norm: torch.Tensor  # before the MLP
    gate_up: PreparedLinear
    down: PreparedLinear
    qkv_bias: torch.Tensor | None = None  # ((Hq + 2 Hkv) * D,)
    q_norm: torch.Tensor | None = None  # (D,), over each head
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms on the blocks' outputs
    mlp_out_norm: torch.Tensor | None = None
    # V's rows apart where they come in another format than Q's and K's (a GGUF Q4_K_M's Q6_K V
    # beside Q4_K Q and K); qkv then holds Q and K. Fused as one int8 weight with mins, Q and K
    # took 1.375 bytes per weight instead of 0.58 (a 1.7B model's decode step read 82 MB more).
    v: PreparedLinear | None = None

    def linears(self) -> list[PreparedLinear]:
        return [w for w in (self.qkv, self.v, self.o, self.gate_up, self.down) if w is not None]


@dataclass(frozen=True)
class PreparedWeights:
    embed: Weight | FileRows  # read by weight_rows() per step
    head: PreparedLinear
    head_exact: Weight | FileRows | None  # the exact rows an int4 head's best logits are recomputed from
    layers: tuple[PreparedLayer, ...]
    norm: torch.Tensor
    fused: list[torch.Tensor] | None  # decode_layers' weights, 14 per layer; None: no fused step
    # decode_layers' a8_wsums where every fused linear is a kernels.cpu_a8 weight (int8 activations)
    fused_wsums: list[torch.Tensor] = field(default_factory=list)
    fused_terms: list[int] = field(default_factory=list)  # and their activation terms (decode_layer_terms)
    fused_v: list[torch.Tensor] = field(default_factory=list)  # decode_layers' v_weights, where a layer has v

    def linears(self) -> list[PreparedLinear]:
        return [w for layer in self.layers for w in layer.linears()]


def row_reader(backend: Backend) -> RowReader | None:
    """The C++ reader of a file's rows where the backend has the C++ ops (None: FileRows' Python path)."""
    return cpu_ops.read_rows if backend.cpu_ops else None


def prepare_weights(config: ModelConfig, weights: dict[str, Weight], backend: Backend, head_format: str = "same",
                    take_weights: bool = False) -> PreparedWeights:
    """``take_weights`` pops each tensor from ``weights`` once converted, so the caller's dict does
    not hold a second copy of the model while the prepared one is built."""
    if head_format not in ("same", "int4"):
        raise ValueError(f"head_format must be 'same' or 'int4', got {head_format!r}")
    device = backend.device
    get = weights.pop if take_weights else weights.__getitem__
    # The head first: its int4 copy's build transient (~20 MB) then lands before the layers'
    # weights do, below the model's final size.
    embed_name = "model.embed_tokens.weight"
    embed: Weight | FileRows | None = None
    if device.type == "cpu" and isinstance(weights, LazyWeights):
        embed = weights.file_rows(embed_name, take=take_weights)  # rows read per step
    if embed is None:
        embed = get(embed_name).to(device)
    head = embed if config.tie_word_embeddings else get("lm_head.weight")
    head_exact: Weight | FileRows | None = None
    if head_format == "int4" and _format(head) != "int4":
        head_exact = head.to(device, torch.float32) if isinstance(head, torch.Tensor) else head
        head = _quantize_head_int4(head, row_reader(backend))
    elif isinstance(head, FileRows):
        head = head.load()
    # One int8 term where the backend asks it for the head (int8x2-lean) only when its best rows
    # are recomputed exactly: a head stored in int4 has no exact copy, and is the logits themselves.
    prepared_head = prepare_linear(head, backend.for_linear("head") if head_exact is not None else backend)
    del head  # the int4 copy's codes (14 MB) were repacked for the kernel
    trim_heap()
    spec = config.spec
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layers.append(prepare_layer(lambda name: get(p + name), backend, spec))  # noqa: B023
        trim_heap()  # the layer's staging copies, before the next layer's land between them
    norm = _dense(get("model.norm.weight"), device) + spec.norm_offset
    # Every ArchSpec runs in the fused C++ step (kernels/cpu/decode_layers.cpp: Llama's layer with
    # q/k/v biases, q/k norms, windows on every layer or on Gemma's local ones with their own RoPE,
    # sandwich norms, GELU and soft-capped attention; RoPE scaling, norm offsets, fused checkpoint
    # weights, the attention scale, the embedding scale and the final soft-cap live outside it).
    fused = _fused_step_weights(layers, backend)
    fused_weights, fused_wsums, fused_terms, fused_v = fused if fused is not None else (None, [], [], [])
    return PreparedWeights(embed, prepared_head, head_exact, tuple(layers), norm, fused_weights, fused_wsums,
                           fused_terms, fused_v)


def prepare_layer(get: Callable[[str], Weight], backend: Backend, spec: ArchSpec) -> PreparedLayer:
    """One decoder layer's weights, ``get(name)`` giving the checkpoint tensor named
    "model.layers.{i}.{name}" (ArchSpec.layer_weight_names), read in the forward's order."""
    device = backend.device
    parts = spec.linear_parts()
    norm_names = spec.norm_names()
    prep = lambda linear: prepare_linear(  # noqa: E731
        _fuse([get(f"{part}.weight") for part in parts[linear]], backend), backend.for_linear(linear))
    qkv_parts = [get(f"{part}.weight") for part in parts["qkv"]]
    v = None
    if _v_apart(qkv_parts):
        *qkv_parts, v_weight = qkv_parts
        v = prepare_linear(v_weight, backend.for_linear("qkv"))  # decode_layers runs V in QKV's terms
    norm = lambda role: (  # noqa: E731
        _dense(get(f"{norm_names[role]}.weight"), device) + spec.norm_offset if role in norm_names else None)
    return PreparedLayer(
        input_norm=norm("input_norm"),
        qkv=prepare_linear(_fuse(qkv_parts, backend), backend.for_linear("qkv")),
        o=prep("o"),
        post_norm=norm("post_norm"),
        gate_up=prep("gate_up"),
        down=prep("down"),
        qkv_bias=torch.cat([_dense(get(f"{part}.bias"), device) for part in parts["qkv"]]) if spec.qkv_bias else None,
        q_norm=norm("q_norm"),
        k_norm=norm("k_norm"),
        attn_out_norm=norm("attn_out_norm"),
        mlp_out_norm=norm("mlp_out_norm"),
        v=v,
    )


def weight_rows(weight: Weight | FileRows, row_ids: torch.Tensor, read_rows: RowReader | None,
                cached: bool = True) -> torch.Tensor:
    """fp32 rows of a (possibly quantized) matrix: embedding lookup and head refinement;
    ``read_rows``: row_reader's choice for a file's rows; ``cached``: see FileRows.read."""
    if isinstance(weight, FileRows):
        return weight.read(row_ids, read_rows, cached)
    if not isinstance(weight, QuantizedTensor):
        return weight[row_ids].float()
    picked = QuantizedTensor(
        weight.format, (row_ids.numel(), weight.shape[1]), weight.group_size, weight.qweight[row_ids],
        weight.scales[row_ids], None if weight.mins is None else weight.mins[row_ids],
    )
    return picked.dequantize(torch.float32)


def _fused_step_weights(layers: list[PreparedLayer], backend: Backend
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[torch.Tensor]] | None:
    """decode_layers' weight list, a8_wsums, a8_terms and v_weights when the backend runs fused steps and
    every linear runs the AVX2 int4 or int8 kernel (each with its own group size: a Q4_K_M GGUF
    mixes int4 g32 and int8 g16), or every one the int8-activation kernels (then the wsums and terms;
    else none), else None; a model that could have fused steps but cannot use them says so at load."""
    if not backend.fused_step_max_tokens:
        return None

    def kernel(w: PreparedLinear) -> object:
        return w.kernel if w.path in ("int4_cpu", "a8_cpu") else w.source if w.path == "int8_cpu" else None

    linears = [w for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    kernels = [kernel(w) for w in linears]
    v_kernels = [None if layer.v is None else kernel(layer.v) for layer in layers]
    every = kernels + [k for k, layer in zip(v_kernels, layers, strict=True) if layer.v is not None]
    a8 = all(isinstance(k, A8Weight) for k in every)
    if not a8 and not all(isinstance(k, (cpu_ops.CpuInt4Weight, QuantizedTensor)) for k in every):
        log.info("the fused C++ step runs int4/int8 linears; this model's run as %s, so steps take the per-op "
                 "forward", sorted({w.path for layer in layers for w in layer.linears()}))
        return None
    weights = [t for i, layer in enumerate(layers) for t in cpu_ops.decode_layer_weights(
        layer.input_norm, kernels[4 * i], kernels[4 * i + 1], layer.post_norm, kernels[4 * i + 2], kernels[4 * i + 3])]
    v_apart = any(k is not None for k in v_kernels)
    v_weights = [t for k in v_kernels for t in cpu_ops.decode_layer_v(k)] if v_apart else []
    if not a8:
        return weights, [], [], v_weights
    return weights, cpu_ops.decode_layer_wsums(kernels), cpu_ops.decode_layer_terms(kernels), v_weights


def _fusing_key(weight: QuantizedTensor) -> tuple[object, ...]:
    """What quantized weights must share to be concatenated as they are (formats.concat_rows)."""
    return weight.format, weight.group_size, weight.mins is None, weight.scales.dtype


def _v_apart(parts: list[Weight]) -> bool:
    """Whether q, k, v come as q and k of one quantized format and v of another (GGUF Q4_K_M,
    Q5_K_M: V one type up), so that V is better its own linear than all three widened to int8."""
    if len(parts) != 3 or not all(isinstance(w, QuantizedTensor) and w.format in ("int4", "int8") for w in parts):
        return False
    q, k, v = (_fusing_key(w) for w in parts)  # type: ignore[arg-type]
    return q == k != v


def _fuse(weights: list[Weight], backend: Backend) -> Weight:
    """One weight for several projections of the same input (QKV, gate/up; a single part as it
    is); parts that cannot be concatenated quantized become one dense tensor."""
    if len(weights) == 1:
        return weights[0]
    if all(isinstance(w, QuantizedTensor) and w.format in ("int4", "int8") for w in weights):
        if len({_fusing_key(w) for w in weights}) == 1:  # type: ignore[arg-type]
            return concat_rows(weights)  # type: ignore[arg-type]
        # Other mixes of formats (V apart is prepare_layer's): all int8 with mins in the common
        # group, exact; int4 parts then take twice their bytes, still a quarter of a bf16 copy's.
        group = math.gcd(*(w.group_size for w in weights))  # type: ignore[union-attr]
        dtypes = {t.dtype for w in weights for t in (w.scales, w.mins) if t is not None}  # type: ignore[union-attr]
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        return concat_rows([as_int8(w, group, dtype) for w in weights])  # type: ignore[arg-type]
    # The CPU fast path runs unfusable (nf4, mixed) parts as a bf16 GEMV; other paths stay exact.
    dense_dtype = torch.bfloat16 if backend.linear_path == "int4_cpu" else torch.float32
    return torch.cat([w.dequantize(dense_dtype) if isinstance(w, QuantizedTensor) else w.to(dense_dtype)
                      for w in weights])


def _dense(t: Weight, device: torch.device) -> torch.Tensor:
    if isinstance(t, QuantizedTensor):
        t = t.dequantize()
    return t.to(device, torch.float32)


def _format(weight: Weight | FileRows) -> str | None:
    """The QuantizedTensor format of a weight, None for a dense one."""
    return None if isinstance(weight, torch.Tensor) else weight.format


def _quantize_head_int4(head: Weight | FileRows, read_rows: RowReader | None, chunk: int = 1024) -> QuantizedTensor:
    """int4 group-32 round-to-nearest copy of the head for the coarse pass, fp16 scales and mins
    (20 instead of 24 bytes per 32 weights read per token). Row blocks go straight into the
    final buffers: quantizing the whole fp32 head at once would spike RSS by ~0.5 GB, and
    concatenating quantized blocks held the head twice (build peak 387 -> 370 MB with the
    kernel packing below, default model)."""
    n, k = head.shape
    out = QuantizedTensor("int4", (n, k), 32, torch.empty(n, k // 2, dtype=torch.uint8),
                          torch.empty(n, k // 32, dtype=torch.float16), torch.empty(n, k // 32, dtype=torch.float16))
    for lo in range(0, n, chunk):
        part = quantize_int4(weight_rows(head, torch.arange(lo, min(lo + chunk, n)), read_rows, cached=False), 32)
        out.qweight[lo:lo + chunk] = part.qweight
        out.scales[lo:lo + chunk] = part.scales
        out.mins[lo:lo + chunk] = part.mins
    return out
