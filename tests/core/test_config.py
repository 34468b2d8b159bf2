"""RuntimeConfig's KV formats: what auto resolves to, overrides, and errors that name the field."""

from __future__ import annotations

import pytest

from edgeinfer.config import RuntimeConfig


def test_auto_kv_is_fp16_except_on_the_exact_reference_path() -> None:
    for path in ("auto", "int4_cpu", "triton"):
        runtime = RuntimeConfig(linear_path=path)
        assert (runtime.key_dtype, runtime.value_dtype) == ("fp16", "fp16")
    reference = RuntimeConfig(linear_path="reference")
    assert (reference.key_dtype, reference.value_dtype) == ("fp32", "fp32")
    mixed = RuntimeConfig(linear_path="reference", v_dtype="int4")
    assert (mixed.key_dtype, mixed.value_dtype) == ("fp32", "int4")
    explicit = RuntimeConfig(kv_dtype="int8", k_dtype="bf16")
    assert (explicit.key_dtype, explicit.value_dtype) == ("bf16", "int8")


@pytest.mark.parametrize("field,value", [("kv_dtype", "fp8"), ("k_dtype", "auto"), ("v_dtype", "int3")])
def test_bad_kv_formats_name_the_field(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be .*got '{value}'"):
        RuntimeConfig(**{field: value})


def test_context_length_and_the_pool_options() -> None:
    """--ctx defaults to the model's context capped at 8192, may shorten it, may not lengthen it;
    every size must be positive and is named when it is not."""
    assert RuntimeConfig().context_length(2048) == 2048
    assert RuntimeConfig().context_length(131072) == 8192
    assert RuntimeConfig(max_model_len=512).context_length(131072) == 512
    with pytest.raises(ValueError, match=r"a context of 4096 tokens \(--ctx\) is longer than the model's own \(2048"):
        RuntimeConfig(max_model_len=4096).context_length(2048)
    for field in ("max_model_len", "parallel", "kv_memory_bytes"):
        with pytest.raises(ValueError, match=f"{field} must be positive, got 0"):
            RuntimeConfig(**{field: 0})
    with pytest.raises(ValueError, match=r"kv_memory_fraction must be in \(0, 1\], got 1.5"):
        RuntimeConfig(kv_memory_fraction=1.5)
