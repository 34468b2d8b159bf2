"""tools/int8_peak.py, the yardstick every a8 GEMM figure is a fraction of: its loop must keep one
multiply per accumulator once compiled. With two accumulators on the same operand pair the
compiler kept one of them, and the AVX512-VNNI peak read 1.5x too high (docs/BENCHMARKS.md,
2026-11-27). Compiled to assembly only, so it runs on any CPU with the C compiler the kernels use."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "int8_peak.py"
STEPS = {"avx512vnni": "vpdpbusd", "avxvnni": "vpdpbusd", "avx2": "vpmaddubsw"}


def _tool():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("int8_peak", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("isa", sorted(STEPS))
def test_every_accumulator_keeps_its_own_multiply(isa: str) -> None:
    peak = _tool()
    flags = peak._ISAS[isa][0].split()
    asm = subprocess.run(["cc", "-O2", "-S", *flags, "-x", "c", "-", "-o", "-"], input=peak._source(isa),
                         capture_output=True, text=True, check=True).stdout
    assert asm.count(STEPS[isa]) == peak._accumulators(isa)
