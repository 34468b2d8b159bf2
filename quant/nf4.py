"""nf4: bitsandbytes' 4-bit NormalFloat weights, quantized by bitsandbytes, stored as it packs them.

Layout (bitsandbytes ``quantize_4bit(quant_type="nf4", compress_statistics=False)``): the (N, K)
weight is flattened row-major and cut into blocks of ``blocksize`` elements (our ``group_size``;
K is a multiple of it, so a block never spans two rows). Each block stores ``absmax`` (fp32) and
each element the index of the nearest of the 16 NF4 code values to ``w / absmax``. Indices are
packed two per byte with the *first* element in the high nibble: ``qweight`` is uint8
(N * K // 2, 1) and ``scales`` is fp32 (N * K // blocksize,). Dequantized: ``code[q] * absmax``.

``quantize_nf4`` calls bitsandbytes when it is importable and otherwise runs the same algorithm
in torch (bucketize against the code's midpoints); tests check the two agree byte for byte.
Dequantizing (quant.formats.dequantize_nf4) is plain torch: bitsandbytes computes the same
``code[q] * absmax`` in fp32.
"""

from __future__ import annotations

import torch

from quant.formats import NF4_CODE, QuantizedTensor

NF4_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def bitsandbytes_available() -> bool:
    try:
        import bitsandbytes.functional  # noqa: F401
    except Exception:  # an installed but broken bitsandbytes (no native library) counts as absent
        return False
    return True


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
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
    packed = ((q[0::2] << 4) | q[1::2]).unsqueeze(1)
    return QuantizedTensor("nf4", (n, k), blocksize, packed, absmax)
