"""kernels.dispatch.choose_backend: one Backend per model from the requested linear path, the
device and what this machine runs; Backend refuses combinations no kernel runs."""

import pytest
import torch

from kernels import cpu_ops
from kernels.dispatch import FUSED_STEP_MAX_TOKENS, Backend, choose_backend


def test_auto_resolves_by_device_and_the_machine_decides_the_cpu_ops() -> None:
    cuda = choose_backend("auto", "cuda")  # a choice, not an allocation: no GPU needed
    assert (cuda.linear_path, cuda.triton, cuda.cpu_ops, cuda.fused_step_max_tokens) == ("triton", True, False, 0)
    cpu = choose_backend()
    assert (cpu.device, cpu.linear_path, cpu.triton) == (torch.device("cpu"), "int4_cpu", False)
    assert cpu.cpu_ops == cpu_ops.available()
    assert cpu.fused_step_max_tokens == (FUSED_STEP_MAX_TOKENS if cpu.cpu_ops else 0)
    reference = choose_backend("reference")  # the exact linears; norms and attention as the machine allows
    assert (reference.linear_path, reference.cpu_ops) == ("reference", cpu.cpu_ops)


def test_backend_refuses_what_no_kernel_runs() -> None:
    with pytest.raises(ValueError, match="linear_path must be one of"):
        choose_backend("int3_cpu")
    with pytest.raises(ValueError, match="CPU only"):
        Backend(torch.device("cuda"), "triton", cpu_ops=True, triton=True, fused_step_max_tokens=0)
    with pytest.raises(ValueError, match="fused_step_max_tokens"):
        Backend(torch.device("cpu"), "int4_cpu", cpu_ops=False, triton=False, fused_step_max_tokens=128)
