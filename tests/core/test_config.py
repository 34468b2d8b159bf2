"""RuntimeConfig's KV formats (what auto resolves to, overrides, errors that name the field) and
SchedulerConfig's step token budget per device."""

from __future__ import annotations

import pytest

from edgeinfer.config import RuntimeConfig, SchedulerConfig
from edgeinfer.core.scheduler import Scheduler
from edgeinfer.engine.actor import mailbox
from edgeinfer.engine.scheduler_actor import SchedulerActor
from kernels.dispatch import FUSED_STEP_MAX_TOKENS


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


def test_step_token_budget_is_settled_per_device() -> None:
    """Unset, a step's token budget is 128 on the CPU (within the fused C++ step's bound) and 512
    on a GPU, never below max_num_seqs; a given one is kept; the scheduler refuses an unsettled
    config rather than guess the device."""
    cpu, gpu = SchedulerConfig().for_device("cpu"), SchedulerConfig().for_device("cuda")
    assert cpu.max_num_batched_tokens == 128 <= FUSED_STEP_MAX_TOKENS
    assert gpu.max_num_batched_tokens == 512
    assert SchedulerConfig(max_num_seqs=200).for_device("cpu").max_num_batched_tokens == 200
    assert SchedulerConfig(max_num_batched_tokens=300).for_device("cpu").max_num_batched_tokens == 300
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_num_seqs \(64\)"):
        SchedulerConfig(max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="settle it for the device first"):
        Scheduler(SchedulerConfig(), num_blocks=8, block_size=4, max_model_len=64, vocab_size=10,
                  eos_token_ids=(), bytes_per_token=1, make_detokenizer=object)


def test_burst_window_is_settled_per_device() -> None:
    """Unset, an idle engine's burst window is 2 ms on the CPU (a small part of the ~50 ms first
    step it protects) and 0.5 ms on a GPU; a given one, 0 included, is kept; the scheduler actor
    refuses an unsettled one rather than wait none."""
    assert SchedulerConfig().for_device("cpu").burst_window_s == 0.002
    assert SchedulerConfig().for_device("cuda").burst_window_s == 0.0005
    assert SchedulerConfig(burst_window_s=0.0).for_device("cpu").burst_window_s == 0.0
    assert SchedulerConfig(burst_window_s=0.01).for_device("cuda").burst_window_s == 0.01
    settled_budget = SchedulerConfig(max_num_batched_tokens=128)
    scheduler = Scheduler(settled_budget, num_blocks=8, block_size=4, max_model_len=64, vocab_size=10,
                          eos_token_ids=(), bytes_per_token=1, make_detokenizer=object)
    with pytest.raises(ValueError, match="burst_window_s is None: settle it for the device first"):
        SchedulerActor(scheduler, mailbox("model", 1)[0])
