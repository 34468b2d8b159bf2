"""nf4: bitsandbytes' 4-bit NormalFloat weights, quantized by bitsandbytes, stored as it packs them.

Layout (bitsandbytes ``quantize_4bit(quant_type="nf4", compress_statistics=False)``): the (N, K)
weight is flattened row-major and cut into blocks of ``blocksize`` elements (our ``group_size``;
K is a multiple of it, so a block never spans two rows). Each block stores ``absmax`` (fp32) and
each element the index of the nearest of the 16 NF4 code values to ``w / absmax``. Indices are
packed two per byte with the *first* element in the high nibble: ``qweight`` is uint8
(N * K // 2, 1) and ``scales`` is fp32 (N * K // blocksize,). Dequantized: ``code[q] * absmax``.

``quantize_nf4`` calls bitsandbytes when it is importable and otherwise runs the same algorithm
in torch (bucketize against the code's midpoints); tests check the two agree byte for byte.
``dequantize_nf4`` is plain torch: bitsandbytes computes the same ``code[q] * absmax`` in fp32.
"""

from __future__ import annotations

import torch

from quant.formats import QuantizedTensor

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
NF4_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def bitsandbytes_available() -> bool:
    try:
        import bitsandbytes.functional  # noqa: F401
    except Exception:  # an installed but broken bitsandbytes (no native library) counts as absent
        return False
    return True


def _code() -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32)


def _check(shape: tuple[int, int], blocksize: int) -> None:
    if blocksize not in NF4_BLOCK_SIZES:
        raise ValueError(f"nf4 block size must be one of {NF4_BLOCK_SIZES}, got {blocksize}")
    if shape[1] % blocksize:
        raise ValueError(f"nf4 block size {blocksize} does not divide K={shape[1]}")


def quantize_nf4(
    w: torch.Tensor, blocksize: int = 64, use_bitsandbytes: bool | None = None
) -> QuantizedTensor:
    """(N, K) weight -> nf4 QuantizedTensor (bitsandbytes when available, else the torch mirror)."""
    n, k = w.shape
    _check((n, k), blocksize)
    if use_bitsandbytes is None:
        use_bitsandbytes = bitsandbytes_available()
    if use_bitsandbytes:
        import bitsandbytes.functional as bnbf

        packed, state = bnbf.quantize_4bit(
            w.float().contiguous(), blocksize=blocksize, quant_type="nf4", compress_statistics=False
        )
        return QuantizedTensor("nf4", (n, k), blocksize, packed, state.absmax.float())
    blocks = w.float().reshape(-1, blocksize)  # (N * K // blocksize, blocksize)
    absmax = blocks.abs().amax(dim=-1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1).reshape(-1)
    code = _code()
    q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
    packed = ((q[0::2] << 4) | q[1::2]).unsqueeze(1)
    return QuantizedTensor("nf4", (n, k), blocksize, packed, absmax)


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
    values = _code().to(packed.device)[q].reshape(-1, qt.group_size)
    return (values * qt.scales.float().reshape(-1, 1)).reshape(n, k)
