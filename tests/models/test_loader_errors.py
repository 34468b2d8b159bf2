"""Bad model files get errors that name the problem."""

from pathlib import Path

import numpy as np
import pytest
from model_stores import write_tiny_gguf

from edgeinfer.models.loader import load_model
from quant.gguf_import import ModelFileError


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    write_tiny_gguf(path, template=False, arch=arch, tensors=tensors)


def test_missing_file() -> None:
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_model("/nonexistent/model.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_model(bad)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, "mamba", {"token_embd.weight": np.ones((3, 64), np.float32)})
    with pytest.raises(ModelFileError, match="unsupported architecture 'mamba'"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", {"token_embd.weight": np.ones((3, 64), np.float32),
                                "output_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(ModelFileError, match=r"missing tensor\(s\) model.layers.0"):
        load_model(path)


def test_truncated_file(default_model_path: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as src:
        cut.write_bytes(src.read(20_000_000))
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        load_model(cut)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="without config.json"):
        load_model(tmp_path)
