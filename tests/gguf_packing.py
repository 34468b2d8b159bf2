"""Random GGUF blocks in the exact byte layout of each type (ggml-quants.c), from random codes and
scales, for tests that check quant.gguf_blocks against gguf.quants.dequantize (the oracle).

Every packer returns the raw bytes of an (n, k) tensor; K-quant scales are drawn so the fp16
products d * sc stay fp16 normals (the bound tests state holds for normals)."""

from __future__ import annotations

import numpy as np

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _f16(rng: np.random.Generator, shape: tuple[int, ...], lo: float = 1e-3, hi: float = 2e-2) -> np.ndarray:
    """Positive fp16 values as 2 bytes each (..., 2)."""
    return rng.uniform(lo, hi, shape).astype(np.float16)[..., None].view(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block (..., 8) -> ggml's 12 bytes (get_scale_min_k4)."""
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return out


def _k_nibbles(codes: np.ndarray) -> np.ndarray:
    """(..., 8, 32) 4-bit codes -> 128 bytes: chunk j's byte l = sub-block 2j's l | 2j + 1's l << 4."""
    low, high = codes[..., 0::2, :], codes[..., 1::2, :]
    return (low | (high << 4)).reshape(*codes.shape[:-2], 128).astype(np.uint8)


def q4_k(rng: np.random.Generator, n: int, k: int, scale: float = 1.0) -> np.ndarray:
    s = (n, k // 256)
    sc, mn = rng.integers(1, 64, (*s, 8), dtype=np.uint8), rng.integers(0, 64, (*s, 8), dtype=np.uint8)
    codes = rng.integers(0, 16, (*s, 8, 32), dtype=np.uint8)
    d = _f16(rng, s, 1e-3 * scale, 2e-2 * scale)
    dmin = _f16(rng, s, 1e-3 * scale, 2e-2 * scale)
    return np.concatenate((d, dmin, _pack_k_scales(sc, mn), _k_nibbles(codes)), axis=-1)


def q5_k(rng: np.random.Generator, n: int, k: int, scale: float = 1.0) -> np.ndarray:
    s = (n, k // 256)
    sc, mn = rng.integers(1, 64, (*s, 8), dtype=np.uint8), rng.integers(0, 64, (*s, 8), dtype=np.uint8)
    codes = rng.integers(0, 32, (*s, 8, 32), dtype=np.uint8)
    qh = ((codes >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2).astype(np.uint8)  # (.., 32)
    d = _f16(rng, s, 1e-3 * scale, 2e-2 * scale)
    dmin = _f16(rng, s, 1e-3 * scale, 2e-2 * scale)
    return np.concatenate((d, dmin, _pack_k_scales(sc, mn), qh, _k_nibbles(codes & 0x0F)), axis=-1)


def q6_k(rng: np.random.Generator, n: int, k: int, scale: float = 1.0) -> np.ndarray:
    s = (n, k // 256)
    codes = rng.integers(0, 64, (*s, 2, 4, 32), dtype=np.uint8)  # (half, c, l): element 128h + 32c + l
    ql = np.concatenate(((codes[..., 0, :] & 0x0F) | ((codes[..., 2, :] & 0x0F) << 4),
                         (codes[..., 1, :] & 0x0F) | ((codes[..., 3, :] & 0x0F) << 4)), axis=-1)  # (.., 2, 64)
    qh = sum((codes[..., c, :] >> 4) << (2 * c) for c in range(4)).astype(np.uint8)  # (.., 2, 32)
    scales = rng.integers(-128, 128, (*s, 16), dtype=np.int8).view(np.uint8)
    scales[scales == 0] = 1
    return np.concatenate((ql.reshape(*s, 128), qh.reshape(*s, 64), scales, _f16(rng, s, 1e-4 * scale, 2e-3 * scale)),
                          axis=-1)


def random_blocks(kind: str, n: int, k: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Raw bytes (flat uint8) of an (n, k) tensor of GGUF type ``kind``: K-quants packed from random
    codes and scales, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 by gguf.quants.quantize of random values;
    ``scale`` multiplies the super-block scales' range (the others' values: 0.05 * scale)."""
    rng = np.random.default_rng(seed)
    if kind in K_TYPES:
        return {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}[kind](rng, n, k, scale).reshape(-1)
    import gguf

    values = rng.standard_normal((n, k)).astype(np.float32) * 0.05 * scale
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind]).reshape(-1)
