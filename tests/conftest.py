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


@pytest.fixture(scope="session")
def default_model_path():  # noqa: ANN201
    """The default GGUF, pulled into the cache if missing ($EDGEINFER_TEST_MODEL overrides)."""
    from pathlib import Path

    from edgeinfer.models.pull import PullError, pull
    from edgeinfer.models.pull import default_model_path as cached

    override = os.environ.get("EDGEINFER_TEST_MODEL")
    if override:
        return Path(override)
    path = cached()
    if path.is_file():
        return path
    try:
        return pull(quiet=True)
    except PullError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def loaded_model(default_model_path):  # noqa: ANN001, ANN201
    from edgeinfer.models.loader import load_model

    return load_model(default_model_path)


@pytest.fixture(scope="session")
def hf_reference(default_model_path):  # noqa: ANN001, ANN201
    """transformers' model and tokenizer read from the same GGUF: the numerical reference."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    folder, name = str(default_model_path.parent), default_model_path.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model, tok
