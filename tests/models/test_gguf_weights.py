"""A GGUF's weights are read when used: `[]` keeps a tensor, `pop` hands it over, and on the
CPU the embedding's rows are read from the file per step (FileRows)."""

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_runner import greedy_alone
from gguf_packing import K_TYPES, random_blocks

from edgeinfer.config import RuntimeConfig
from edgeinfer.models.loader import load_model
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.build import build_model, fixed_runner
from kernels import cpu_ops
from quant import gguf_import
from quant.formats import QuantizedTensor
from quant.gguf_import import FileRows, ModelFileError, convert_tensor
from quant.gguf_reader import open_gguf, read_tensor

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


def _one_tensor_gguf(path: Path, kind: str, n: int, k: int) -> None:
    import gguf

    t = gguf.GGMLQuantizationType[kind]
    values = np.random.default_rng(n * k + t).standard_normal((n, k)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    data = values if kind == "F32" else values.astype(np.float16) if kind == "F16" else \
        random_blocks(kind, n, k, seed=n).reshape(n, -1) if kind in K_TYPES else gguf.quants.quantize(values, t)
    writer.add_tensor("token_embd.weight", data, raw_dtype=None if kind in ("F32", "F16") else t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                  "Q6_K"])
def test_file_rows_equal_the_loaded_tensor(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "rows.gguf"
    n, k = 37, 512 if kind in K_TYPES else 96  # rows and blocks that fill no power-of-two tile
    _one_tensor_gguf(path, kind, n, k)
    (tensor,) = open_gguf(path).tensors
    whole = convert_tensor(tensor, read_tensor(path, tensor))
    whole = whole.dequantize(torch.float32) if isinstance(whole, QuantizedTensor) else whole.float()
    rows = FileRows(path, tensor)
    assert rows.shape == (n, k)
    ids = torch.tensor([36, 0, 5, 5, 17, 36, 1, 2, 3, 30])  # unsorted, repeats, both ends
    expected = whole[ids]
    assert torch.equal(rows.read_reference(ids), expected)
    if cpu_ops.available():  # the C++ op, bit for bit
        assert torch.equal(rows.read(ids, cpu_ops.read_rows), expected)
        assert rows.read(torch.tensor([], dtype=torch.long), cpu_ops.read_rows).shape == (0, k)
    for bad in ([n], [-1]):
        for reader in (None, cpu_ops.read_rows) if cpu_ops.available() else (None,):
            with pytest.raises(IndexError, match="outside"):
                rows.read(torch.tensor(bad), reader)
        with pytest.raises(IndexError, match="outside"):
            rows.read_reference(torch.tensor(bad))


def test_requantized_types_are_converted_whole(tmp_path: Path) -> None:
    """A Q2_K tensor (re-quantized to int4, tests/quant/test_gguf_blocks.py) has no row reader."""
    import gguf

    path = tmp_path / "q2k.gguf"
    raw = np.random.default_rng(0).integers(0, 256, (37, 2 * 84), dtype=np.uint8)
    raw.reshape(37, 2, 84)[..., 80:84] = np.array([0.01, 0.001], np.float16).view(np.uint8)  # d, dmin finite
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = open_gguf(path).tensors
    weight = convert_tensor(tensor, read_tensor(path, tensor))
    assert weight.format == "int4" and weight.shape == (37, 512)
    with pytest.raises(ValueError, match="token_embd.weight cannot be read by rows"):
        FileRows(path, tensor)


def test_unknown_ggml_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    _one_tensor_gguf(path, "Q8_0", 4, 32)
    data = bytearray(path.read_bytes())
    # Tensor info: name, n_dims (u32), dims (u64 each), then the type (u32).
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 2 * 8
    assert int.from_bytes(data[at:at + 4], "little") == 8
    data[at:at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="token_embd.weight has unknown GGML type 250"):
        open_gguf(path)


def test_file_rows_cut_short_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rows.gguf"
    _one_tensor_gguf(path, "Q8_0", 40, 64)
    (tensor,) = open_gguf(path).tensors
    rows = FileRows(path, tensor)
    os.truncate(path, tensor.offset + tensor.nbytes // 2)  # the file changes under a running model
    assert rows.read(torch.tensor([0, 1])).shape == (2, 64)  # rows still there read as before
    for read in (rows.read, lambda ids: rows.read_reference(ids)):
        with pytest.raises((ModelFileError, RuntimeError), match="file ends"):
            read(torch.tensor([39]))


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops do not build here")
def test_rows_read_are_kept_in_a_cache_of_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rows.gguf"
    n, k = 40, 64
    _one_tensor_gguf(path, "Q8_0", n, k)
    (tensor,) = open_gguf(path).tensors
    whole = convert_tensor(tensor, read_tensor(path, tensor)).dequantize(torch.float32)
    monkeypatch.setattr(gguf_import, "ROW_CACHE_BYTES", 5 * tensor.nbytes // n)  # 5 slots: row r in r % 5
    rows = FileRows(path, tensor)
    ids = torch.tensor([7, 2, 12, 7, 30, 39, 2])  # 2 / 7 / 12 share a slot, repeats, both rows missing
    for _ in range(2):  # the second call finds some rows in the cache
        assert torch.equal(rows.read(ids, cpu_ops.read_rows), whole[ids])
    slots = rows._cache_ids.tolist()
    assert all(r == -1 or r % 5 == slot for slot, r in enumerate(slots)) and {30, 39} <= set(slots)
    # A row in the cache is not read again: with the file cut short, the cached rows still come
    # back, uncached ones (and the same rows past the cache) name the file's end.
    os.truncate(path, tensor.offset)
    cached = torch.tensor([r for r in slots if r >= 0])
    assert torch.equal(rows.read(cached, cpu_ops.read_rows), whole[cached])
    for ids, flag in ((torch.tensor([next(r for r in range(n) if r not in slots)]), True), (cached, False)):
        with pytest.raises(ModelFileError, match="file ends"):
            rows.read(ids, cpu_ops.read_rows, cached=flag)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops do not build here")
def test_a_row_cache_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rows.gguf"
    _one_tensor_gguf(path, "Q8_0", 8, 64)
    (tensor,) = open_gguf(path).tensors
    ids, ok_ids = torch.tensor([1, 2]), torch.full((4,), -1)
    args = (os.open(path, os.O_RDONLY), tensor.offset, 8, 64, int(tensor.ggml_type), ids)
    try:
        wide, narrow = torch.empty(4, 68, dtype=torch.uint8), torch.empty(4, 64, dtype=torch.uint8)
        for cache, cache_ids, problem in ((wide, None, "both its bytes and its ids"),
                                          (narrow, ok_ids, r"\(slots, 68\)"),
                                          (wide, torch.full((3,), -1), r"\(4,\) contiguous int64")):
            with pytest.raises(RuntimeError, match=problem):
                cpu_ops.read_rows(*args, cache, cache_ids)
    finally:
        os.close(args[0])


def test_embedding_stays_in_the_file(default_model_path: Path) -> None:
    """The CPU model reads its embedding rows from the GGUF, with the same logits (prefill and
    greedy decode) as a model holding the loaded table."""
    runtime = RuntimeConfig(linear_path="int4_cpu")
    from_file = build_model(load_model(default_model_path), runtime, take_weights=True)
    assert isinstance(from_file.weights.embed, FileRows) and isinstance(from_file.weights.head_exact, FileRows)
    loaded = load_model(default_model_path)
    held = build_model(dataclasses.replace(loaded, weights=dict(loaded.weights)), runtime, take_weights=True)
    assert isinstance(held.weights.embed, QuantizedTensor)
    ids = list(range(300, 340))
    runs = []
    for model in (from_file, held):
        runner = fixed_runner(model, runtime, len(ids) + 9)
        prefill = runner.logits([SeqChunk(tuple(ids), 0, tuple(range(runner.pool.num_blocks)))])
        runner = fixed_runner(model, runtime, len(ids) + 9)
        tokens = greedy_alone(runner, ids, 8)
        runs.append((prefill, tokens))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
