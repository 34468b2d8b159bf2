"""Weight formats: the QuantizedTensor every loader produces and every kernel consumes.

Formats (all group-wise along the input dimension K of an (N, K) weight):

- ``int8``: ``w = q * scale`` (+ ``min`` where ``mins`` is given); ``q`` int8 (N, K), ``scales``
  (and ``mins``) (N, K // group). Per-output-channel int8 is simply ``group_size == K``. GGUF
  Q8_0 is this with group 32; Q5_0/Q5_1/Q5_K and Q6_K (group 16) are its codes with the
  type's scales and offsets (quant.gguf_blocks).
- ``int4``: asymmetric, ``w = q * scale + min``; ``q`` in 0..15 packed two per byte along K
  (element ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high nibble), so
  ``qweight`` is uint8 (N, K // 2); ``scales`` and ``mins`` are (N, K // group).
  GGUF Q4_1 is exactly this with group 32 (``d`` and ``m`` per block); Q4_0 is ``min = -8 * d``.
- ``nf4``: bitsandbytes' 4-bit NormalFloat, stored as bitsandbytes packs it (see quant.nf4).

Scales and mins keep the dtype they were made in (fp16 from GGUF) so nothing is lost; kernels
accumulate in fp32. This module owns packing and the quantize/dequantize pairs; it never
touches files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FORMATS = ("int8", "int4", "nf4")
GROUP_SIZES = (32, 64, 128)  # what the conversion tool quantizes to; GGUF files also bring 16


@dataclass(frozen=True)
class SuperScales:
    """An int4 weight's scales and mins as a K-quant file holds them (GGUF Q4_K): per super-block of
    ``block`` values of K an fp16 scale of scales ``d`` and of mins ``neg_dmin`` (the file's dmin,
    negated), per group an unsigned code. The weight's ``scales`` are d * scale_codes and its
    ``mins`` neg_dmin * min_codes rounded to fp16; these products are exact in fp32. Kernels that
    read the two levels (kernels.cpu_a8) hold 18.5 bytes per 32 weights against the file's 18,
    where the fp16 products take 20."""

    d: torch.Tensor  # fp16 (N, K // block)
    scale_codes: torch.Tensor  # uint8 (N, K // group)
    neg_dmin: torch.Tensor  # fp16 (N, K // block)
    min_codes: torch.Tensor  # uint8 (N, K // group)
    block: int = 256

    def products(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, mins) in fp32, exact: (N, K // group) each."""
        per_block = self.scale_codes.shape[1] // self.d.shape[1]
        expand = lambda t: t.float().repeat_interleave(per_block, dim=1)  # noqa: E731
        return expand(self.d) * self.scale_codes.float(), expand(self.neg_dmin) * self.min_codes.float()


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized (N, K) weight. ``shape`` is the logical (dequantized) shape."""

    format: str
    shape: tuple[int, int]
    group_size: int
    qweight: torch.Tensor  # int8 (N, K) | uint8 (N, K // 2) | nf4: bitsandbytes packed bytes
    scales: torch.Tensor  # (N, K // group_size); nf4: absmax as bitsandbytes stores it
    mins: torch.Tensor | None = None  # (N, K // group_size): int4 always, int8 optionally
    # int4 from a K-quant: the two levels the scales and mins are made of (kernels.cpu_a8 reads them)
    super_scales: SuperScales | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown weight format {self.format!r}; expected one of {FORMATS}")
        n, k = self.shape
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(
                f"group_size {self.group_size} does not divide K={k} of a {self.format} weight"
            )
        if self.format == "nf4":
            return
        num_groups = k // self.group_size
        if tuple(self.scales.shape) != (n, num_groups):
            raise ValueError(f"scales have shape {tuple(self.scales.shape)}, expected {(n, num_groups)}")
        if self.format == "int8":
            if self.qweight.dtype != torch.int8 or tuple(self.qweight.shape) != (n, k):
                raise ValueError(
                    f"int8 qweight must be int8 {(n, k)}, got {self.qweight.dtype} {tuple(self.qweight.shape)}"
                )
        else:
            if k % 2:
                raise ValueError(f"int4 needs an even K, got {k}")
            if self.qweight.dtype != torch.uint8 or tuple(self.qweight.shape) != (n, k // 2):
                raise ValueError(
                    f"int4 qweight must be uint8 {(n, k // 2)}, got {self.qweight.dtype} "
                    f"{tuple(self.qweight.shape)}"
                )
            if self.mins is None:
                raise ValueError(f"int4 needs mins of shape {(n, num_groups)}")
        if self.mins is not None and tuple(self.mins.shape) != (n, num_groups):
            raise ValueError(f"mins have shape {tuple(self.mins.shape)}, expected {(n, num_groups)}")

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """The same weight with its tensors on ``device`` (off the CPU without super_scales: only
        the CPU kernels read them)."""
        levels = self.super_scales if torch.device(device).type == "cpu" else None
        return replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device),
                       mins=None if self.mins is None else self.mins.to(device), super_scales=levels)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads to use this weight once."""
        extra = 0 if self.mins is None else self.mins.numel() * self.mins.element_size()
        return (
            self.qweight.numel() * self.qweight.element_size()
            + self.scales.numel() * self.scales.element_size()
            + extra
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight in ``dtype``; computed in fp32 so every path agrees."""
        if self.format == "int8":
            return dequantize_int8(self.qweight, self.scales, self.group_size, self.mins).to(dtype)
        if self.format == "int4":
            assert self.mins is not None
            return dequantize_int4(self.qweight, self.scales, self.mins, self.group_size).to(dtype)
        return dequantize_nf4(self).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in 0..15 -> uint8 (N, K // 2), element 2j low nibble, 2j+1 high."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dimension, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (N, K // 2) -> uint8 (N, K) in 0..15; inverse of pack_int4."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    return w.reshape(n, k // group_size, group_size)


def quantize_int4(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Round-to-nearest asymmetric int4: each group maps [min, max] onto 0..15."""
    n, k = w.shape
    g = _grouped(w.float(), group_size)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(n, k)
    return QuantizedTensor("int4", (n, k), group_size, pack_int4(q), scale, lo)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    q = unpack_int4(qweight).float()
    n, k = q.shape
    g = q.reshape(n, k // group_size, group_size)
    return (g * scales.float()[..., None] + mins.float()[..., None]).reshape(n, k)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> QuantizedTensor:
    """Round-to-nearest symmetric int8; ``group_size=None`` means one scale per output row."""
    n, k = w.shape
    group_size = group_size or k
    g = _grouped(w.float(), group_size)
    scale = (g.abs().amax(dim=-1) / 127).clamp(min=1e-8)
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedTensor("int8", (n, k), group_size, q, scale)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                    mins: torch.Tensor | None = None) -> torch.Tensor:
    n, k = qweight.shape
    g = qweight.float().reshape(n, k // group_size, group_size) * scales.float()[..., None]
    if mins is not None:
        g = g + mins.float()[..., None]
    return g.reshape(n, k)


def as_int8(weight: QuantizedTensor, group_size: int, dtype: torch.dtype) -> QuantizedTensor:
    """The same int4 or int8 weight as int8 with mins, in groups of ``group_size`` (dividing its
    own) and ``dtype`` scales and mins: exact (an int4 code 0..15 is an int8 code; a group's scale
    and min repeat over its parts; a missing min is 0), so that parts of mixed formats can be
    fused (a GGUF Q4_K_M's Q6_K V beside its Q4_K Q and K)."""
    if weight.format not in ("int4", "int8") or weight.group_size % group_size:
        raise ValueError(f"as_int8 takes int4/int8 with a group that {group_size} divides, got {weight.format} "
                         f"group {weight.group_size}")
    codes = unpack_int4(weight.qweight).to(torch.int8) if weight.format == "int4" else weight.qweight
    repeat = weight.group_size // group_size
    scales = weight.scales.to(dtype).repeat_interleave(repeat, dim=1)
    mins = torch.zeros_like(scales) if weight.mins is None else weight.mins.to(dtype).repeat_interleave(repeat, dim=1)
    return QuantizedTensor("int8", weight.shape, group_size, codes, scales, mins)


def concat_rows(weights: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack weights along N (QKV, gate/up fusion): same format, K, group size and dtypes required."""
    if not weights:
        raise ValueError("concat_rows needs at least one weight")
    first = weights[0]
    if first.format == "nf4":
        raise ValueError("concat_rows does not support nf4 (bitsandbytes packs it flat)")
    for i, w in enumerate(weights[1:], start=1):
        mismatch = [
            f"{name} {got} vs {want}"
            for name, got, want in (
                ("format", w.format, first.format),
                ("K", w.shape[1], first.shape[1]),
                ("group size", w.group_size, first.group_size),
                ("scales dtype", w.scales.dtype, first.scales.dtype),
                ("mins", w.mins is None, first.mins is None),
                ("device", w.qweight.device, first.qweight.device),
            )
            if got != want
        ]
        if mismatch:
            raise ValueError(f"concat_rows: weight {i} does not match weight 0: {', '.join(mismatch)}")
    mins = None if first.mins is None else torch.cat([w.mins for w in weights])
    levels = [w.super_scales for w in weights]
    super_scales = None
    if all(s is not None for s in levels) and len({s.block for s in levels}) == 1:  # type: ignore[union-attr]
        super_scales = SuperScales(*(torch.cat([getattr(s, name) for s in levels])
                                     for name in ("d", "scale_codes", "neg_dmin", "min_codes")), block=levels[0].block)
    return QuantizedTensor(
        first.format,
        (sum(w.shape[0] for w in weights), first.shape[1]),
        first.group_size,
        torch.cat([w.qweight for w in weights]),
        torch.cat([w.scales for w in weights]),
        mins,
        super_scales,
    )


# bitsandbytes.functional.get_4bit_type("nf4"): quantiles of N(0, 1), normalised to [-1, 1].
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def dequantize_nf4(qt: QuantizedTensor) -> torch.Tensor:
    """nf4 QuantizedTensor -> fp32 (N, K)."""
    if qt.format != "nf4":
        raise ValueError(f"dequantize_nf4 needs an nf4 weight, got {qt.format}")
    n, k = qt.shape
    packed = qt.qweight.reshape(-1)
    if packed.numel() * 2 != n * k or qt.scales.numel() * qt.group_size != n * k:
        raise ValueError(
            f"nf4 weight {qt.shape} with block size {qt.group_size} needs {n * k // 2} packed bytes and "
            f"{n * k // qt.group_size} absmax values, got {packed.numel()} and {qt.scales.numel()}"
        )
    q = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(-1).long()  # first element high
    values = torch.tensor(NF4_CODE, dtype=torch.float32, device=packed.device)[q].reshape(-1, qt.group_size)
    return (values * qt.scales.float().reshape(-1, 1)).reshape(n, k)
