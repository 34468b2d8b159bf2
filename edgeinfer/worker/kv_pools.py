"""The one constructor of a model's KV pools (kernels.kv_pool.KVPool): the serving pool, a draft
model's pool beside it, and the scratch pools of calibration and the worst-case step all take
their shape from the model's config here."""

from __future__ import annotations

import torch

from edgeinfer.config import ModelConfig
from kernels.kv_pool import KVPool, kv_bytes_per_token


def kv_pool(config: ModelConfig, num_blocks: int, block_size: int, key_dtype: str, value_dtype: str,
            device: torch.device | str = "cpu") -> KVPool:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens for every layer of this model."""
    return KVPool(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                  key_dtype, value_dtype, device)


def bytes_per_token(config: ModelConfig, key_dtype: str, value_dtype: str) -> int:
    """What one token takes in this model's pool, over all layers, K and V."""
    return kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, key_dtype, value_dtype)
