"""A GGUF's weights are read when used: `[]` keeps a tensor, `pop` hands it over."""

from pathlib import Path

import pytest
import torch

from edgeinfer.config import RuntimeConfig
from edgeinfer.llm import build_model
from edgeinfer.loader import load_model

NAME = "model.layers.3.mlp.down_proj.weight"


def test_getitem_keeps_and_pop_hands_over(default_model_path: Path) -> None:
    weights = load_model(default_model_path).weights
    count = len(weights)
    assert NAME in weights and count == 3 + 9 * 30 - 1  # tied embeddings: no lm_head
    kept = weights[NAME]
    assert weights[NAME] is kept  # read once
    taken = weights.pop(NAME)
    assert torch.equal(taken.qweight, kept.qweight) and torch.equal(taken.scales, kept.scales)
    assert NAME not in weights and len(weights) == count - 1 and NAME not in list(weights)
    with pytest.raises(KeyError, match="down_proj"):
        weights[NAME]
    with pytest.raises(KeyError, match="down_proj"):
        weights.pop(NAME)
    fresh = weights.pop("model.layers.4.mlp.down_proj.weight")  # never read before: read now
    assert fresh.shape == kept.shape and not torch.equal(fresh.qweight, kept.qweight)


def test_take_weights_leaves_nothing_behind(default_model_path: Path) -> None:
    loaded = load_model(default_model_path)
    build_model(loaded, RuntimeConfig(linear_path="int4_cpu"), take_weights=True)
    assert len(loaded.weights) == 0
