"""tools/make_slice.py: the few-layer slice of the default model that travels to a GPU machine.
It fits the carry limit, keeps every tensor bit for bit, loads through the ordinary loader, and
its CPU fp32 greedy tokens are deterministic and the same as a slice cut in memory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from fake_runner import greedy_alone

from edgeinfer.config import RuntimeConfig
from edgeinfer.models.loader import load_model
from edgeinfer.worker.build import build_model, fixed_runner
from quant.formats import QuantizedTensor

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 4
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CARRY_LIMIT = 64 * 2**20


def _tool():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("make_slice", ROOT / "tools" / "make_slice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def slice_dir(tmp_path_factory, default_model_path) -> Path:  # noqa: ANN001
    out = tmp_path_factory.mktemp("slice") / "slice"
    assert _tool().main(["--model", str(default_model_path), "--layers", str(LAYERS), "--out", str(out)]) == 0
    return out


RUNTIME = RuntimeConfig(linear_path="reference", kv_dtype="fp32")  # the CPU fp32 oracle


def greedy(model, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:  # noqa: ANN001
    return greedy_alone(fixed_runner(model, RUNTIME, len(prompt_ids) + max_tokens), prompt_ids, max_tokens)


def test_slice_fits_and_is_bit_exact(slice_dir: Path, loaded_model) -> None:  # noqa: ANN001
    assert _tool().folder_bytes(slice_dir) < CARRY_LIMIT
    sliced = load_model(slice_dir)
    assert sliced.source == "edgeinfer"
    assert sliced.config.num_layers == LAYERS
    assert sliced.config.hidden_size == loaded_model.config.hidden_size
    expected = _tool().slice_model(loaded_model, LAYERS).weights
    assert sorted(sliced.weights) == sorted(expected)
    assert "model.layers.3.mlp.down_proj.weight" in sliced.weights
    assert not any(name.startswith("model.layers.4.") for name in sliced.weights)
    for name, want in expected.items():
        got = sliced.weights[name]
        if isinstance(want, QuantizedTensor):
            assert (got.format, got.shape, got.group_size) == (want.format, want.shape, want.group_size), name
            for a, b in ((got.qweight, want.qweight), (got.scales, want.scales), (got.mins, want.mins)):
                assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name
    assert sliced.tokenizer.encode(PROMPTS[0]) == loaded_model.tokenizer.encode(PROMPTS[0])


def test_slice_greedy_deterministic_and_same_as_in_memory(slice_dir: Path, loaded_model) -> None:  # noqa: ANN001
    sliced = load_model(slice_dir)
    model = build_model(sliced, RUNTIME)
    in_memory = build_model(_tool().slice_model(loaded_model, LAYERS), RUNTIME)
    for text in PROMPTS:
        ids = sliced.tokenizer.encode(text)
        first = greedy(model, ids)
        assert len(first) == 16
        assert greedy(model, ids) == first
        assert greedy(in_memory, ids) == first


def test_slice_rejects_bad_layer_count(loaded_model) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="num_layers must be in"):
        _tool().slice_model(loaded_model, 0)
