"""Test set-up: Triton runs under its interpreter when there is no GPU; the default model path."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere: kernels then run on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
