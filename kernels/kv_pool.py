"""KVPool: the preallocated, paged K/V storage of every layer, in one KV format per K and per V.

Layout per layer and per K / V (``QuantizedKV``), ``N = num_blocks``, ``B = block_size``:

- plain (fp32/bf16/fp16): ``data`` (N, B, num_kv_heads, head_dim)
- int8: ``data`` int8 (N, B, num_kv_heads, head_dim), ``scale`` fp16 (N, B, num_kv_heads)
- int4: ``data`` uint8 (N, B, num_kv_heads, head_dim // 2), ``scale`` and ``zero`` fp16
  (N, B, num_kv_heads, head_dim // 32)

A token's slot is ``block_id * block_size + offset``. Which blocks a sequence owns is decided by
edgeinfer.core.block_manager (the only allocator); this class never allocates blocks, it only stores
bytes. Writer: the model actor, which owns the pool, through ``write`` and ``copy_blocks``;
attention kernels only read it.
"""

from __future__ import annotations

import math
import mmap

import torch

from kernels.kv_quant import (
    INT4_GROUP,
    PLAIN_DTYPES,
    SCALE_DTYPE,
    QuantizedKV,
    check_kv_dtype,
    dequantize_kv,
    kv_bytes_per_element,
    quantize_kv,
)


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, k_dtype: str, v_dtype: str
) -> int:
    """Bytes one token occupies in the pool over all layers, K and V, scales included."""
    per_head = (kv_bytes_per_element(k_dtype, head_dim) + kv_bytes_per_element(v_dtype, head_dim)) * head_dim
    return int(round(per_head * num_kv_heads * num_layers))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost no memory until written, on the CPU: an anonymous mapping of the OS's zero
    pages, committed a page at a time as blocks are first written (torch's zeros writes every byte,
    so a 6 GB pool was 6 GB resident at start; calloc does the same below glibc's mmap threshold).
    Blocks the scheduler has never handed out stay uncommitted: idle RSS is the weights plus what
    requests have used. Page-aligned, so cache-line aligned as torch's own allocator gives."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # frombuffer keeps the mapping alive as long as the tensor (and its views) live.
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def _empty_cache(kv_dtype: str, shape: tuple[int, int, int, int], device: torch.device) -> QuantizedKV:
    n, b, h, d = shape
    if kv_dtype in PLAIN_DTYPES:
        return QuantizedKV(kv_dtype, _zeros(shape, PLAIN_DTYPES[kv_dtype], device))
    if kv_dtype == "int8":
        return QuantizedKV(kv_dtype, _zeros(shape, torch.int8, device), _zeros((n, b, h), SCALE_DTYPE, device))
    groups = (n, b, h, d // INT4_GROUP)
    return QuantizedKV(kv_dtype, _zeros((n, b, h, d // 2), torch.uint8, device),
                       _zeros(groups, SCALE_DTYPE, device), _zeros(groups, SCALE_DTYPE, device))


def write_kv_cache_reference(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: QuantizedKV, v_cache: QuantizedKV
) -> None:
    """Torch: the same as write_kv_cache (the production path off CUDA)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    for x, cache in ((k, k_cache), (v, v_cache)):
        if cache.scale is None:  # plain dtype: one copy, no quantization (the CPU default)
            cache.data.view(-1, *cache.data.shape[2:]).index_copy_(0, slots, x.to(cache.data.dtype))
            continue
        q = quantize_kv(x, cache.kv_dtype)
        for dst, src in ((cache.data, q.data), (cache.scale, q.scale), (cache.zero, q.zero)):
            if dst is not None:
                    dst.view(-1, *dst.shape[2:])[slots] = src  # (num_blocks * block_size, Hkv, ...)


class KVPool:
    """Paged K/V storage for ``num_layers`` layers; see the module docstring for layouts."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        k_dtype: str = "fp16",
        v_dtype: str | None = None,
        device: str | torch.device = "cpu",
        transform: bool | None = None,
    ) -> None:
        """``transform``: whether the model stores keys centred and K and V rotated here
        (kernels.kv_quant.kv_rotation). None: K's and V's own formats decide, each when quantized,
        the only formats it helps; True on a plain pool changes nothing in exact arithmetic (the
        transform's test)."""
        v_dtype = v_dtype or k_dtype
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if value <= 0:
                raise ValueError(f"KVPool {name} must be positive, got {value}")
        check_kv_dtype(k_dtype, head_dim)
        check_kv_dtype(v_dtype, head_dim)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.k_dtype = k_dtype
        self.v_dtype = v_dtype
        self.transform_k = k_dtype not in PLAIN_DTYPES if transform is None else transform
        self.transform_v = v_dtype not in PLAIN_DTYPES if transform is None else transform
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = [_empty_cache(k_dtype, shape, torch.device(device)) for _ in range(num_layers)]
        self.v_caches = [_empty_cache(v_dtype, shape, torch.device(device)) for _ in range(num_layers)]
        # The tensors' own device: "cuda" resolves to "cuda:0", and callers compare with q.device.
        self.device = self.k_caches[0].data.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def bytes_per_token(self) -> int:
        """Bytes per token slot over all layers, K and V, scales included."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                  self.k_dtype, self.v_dtype)

    def nbytes(self) -> int:
        caches = self.k_caches + self.v_caches
        return sum(t.numel() * t.element_size() for c in caches for t in c.tensors())

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        use_triton: bool = False,
    ) -> None:
        """Quantize new keys and values (T, num_kv_heads, head_dim) into slots (T,) of ``layer``.

        A negative slot skips that token (padding). ``use_triton`` (kernels.dispatch.Backend.triton)
        runs the Triton kernel, else torch.
        """
        self._check_layer(layer)
        expected = (self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if x.dim() != 3 or tuple(x.shape[1:]) != expected:
                raise ValueError(f"write: {name} must be (T, {expected[0]}, {expected[1]}), "
                                 f"got {tuple(x.shape)}")
        if k.shape[0] != v.shape[0] or slot_mapping.shape != (k.shape[0],):
            raise ValueError(f"write: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
                             f"{tuple(slot_mapping.shape)} must agree on T")
        if use_triton:
            from kernels.paged_attention_triton import write_kv_cache

            write_kv_cache(k, v, slot_mapping, self.k_caches[layer], self.v_caches[layer])
        else:
            write_kv_cache_reference(k, v, slot_mapping, self.k_caches[layer], self.v_caches[layer])

    def gather(
        self, layer: int, block_ids: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of the given blocks: ``block_ids`` (...,) -> (..., B, Hkv, D) each.

        Pass rows of block tables (S, max_blocks) to get (S, max_blocks, B, Hkv, D); negative
        (padding) ids read block 0, which the caller must mask.
        """
        self._check_layer(layer)
        ids = block_ids.reshape(-1).long().clamp(min=0)
        out = []
        for cache in (self.k_caches[layer], self.v_caches[layer]):
            # index_select copies whole blocks; measured ~7x faster than advanced indexing on CPU.
            picked = [None if t is None else t.index_select(0, ids).unflatten(0, block_ids.shape)
                      for t in (cache.data, cache.scale, cache.zero)]
            out.append(dequantize_kv(QuantizedKV(cache.kv_dtype, *picked), dtype))
        return out[0], out[1]

    def copy_blocks(self, src_dst: list[tuple[int, int]]) -> None:
        """Copy whole blocks, all layers, K and V (the block manager's copy-on-write)."""
        if not src_dst:
            return
        src = torch.tensor([s for s, _ in src_dst], device=self.device)
        dst = torch.tensor([d for _, d in src_dst], device=self.device)
        for cache in self.k_caches + self.v_caches:
            for t in cache.tensors():
                t[dst] = t[src]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for a pool of {self.num_layers} layers")
