"""Every GGUF block type with a decoder dequantizes, through the engine's format, to
gguf.quants.dequantize's values (the independent oracle): bit for bit where the file's scales are
kept, within the fp16 rounding of the scale products for K-quants (quant.gguf_blocks)."""

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_packing import random_blocks

from quant.gguf_blocks import DECODERS, requantize_int4
from quant.gguf_reader import GGMLType

EXACT = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8"}
PRODUCTS = {"Q4_K": ("int4", 32, 15), "Q5_K": ("int8", 32, 31), "Q6_K": ("int8", 16, 32)}  # format, group, max |code|


def _oracle(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(raw.reshape(n, -1), gguf.GGMLQuantizationType[kind])).float()


@pytest.mark.parametrize("kind", sorted(EXACT))
@pytest.mark.parametrize("shape", [(3, 64), (5, 576)])
def test_exact_types_are_bit_exact(kind: str, shape: tuple[int, int]) -> None:
    n, k = shape
    raw = random_blocks(kind, n, k, seed=n)
    qt = DECODERS[GGMLType[kind]](raw, n, k)
    assert qt.format == EXACT[kind] and qt.group_size == 32
    assert (qt.mins is not None) == (kind in ("Q4_0", "Q4_1", "Q5_1"))
    assert torch.equal(qt.dequantize(), _oracle(kind, raw, n, k))


@pytest.mark.parametrize("kind", sorted(PRODUCTS))
@pytest.mark.parametrize("shape", [(3, 256), (7, 1536)])
def test_k_quants_within_fp16_rounding_of_the_products(kind: str, shape: tuple[int, int]) -> None:
    n, k = shape
    raw = random_blocks(kind, n, k, seed=k + n)
    qt = DECODERS[GGMLType[kind]](raw, n, k)
    fmt, group, max_code = PRODUCTS[kind]
    assert (qt.format, qt.group_size, qt.scales.dtype) == (fmt, group, torch.float16)
    want = _oracle(kind, raw, n, k)
    got = qt.dequantize()
    # |error| <= 2^-11 (fp16's relative rounding) * (max |code| * |scale| + |min|) per group.
    scale = qt.scales.float().abs() * max_code + (0 if qt.mins is None else qt.mins.float().abs())
    bound = 2.0 ** -11 * scale.repeat_interleave(group, dim=1) * (1 + 2.0 ** -10)
    assert bool(((got - want).abs() <= bound).all())
    assert (got - want).abs().max() > 0  # the rounding is real: the bound is what is tested
    assert torch.allclose(got, want, rtol=0, atol=float(want.abs().max()) * 2.0 ** -9)


@pytest.mark.parametrize("shape", [(3, 256), (7, 1536)])
def test_q4_k_two_levels_are_the_file_exactly(shape: tuple[int, int]) -> None:
    n, k = shape
    raw = random_blocks("Q4_K", n, k, seed=k - n)
    qt = DECODERS[GGMLType.Q4_K](raw, n, k)
    levels = qt.super_scales
    assert levels is not None and levels.d.dtype == levels.neg_dmin.dtype == torch.float16
    assert levels.scale_codes.dtype == levels.min_codes.dtype == torch.uint8
    assert int(levels.scale_codes.max()) <= 63 and int(levels.min_codes.max()) <= 63
    scales, mins = levels.products()
    codes = torch.stack((qt.qweight & 0x0F, qt.qweight >> 4), dim=-1).reshape(n, k // 32, 32).float()
    exact = (codes * scales[..., None] + mins[..., None]).reshape(n, k)
    assert torch.equal(exact, _oracle("Q4_K", raw, n, k))  # the two levels: no rounding at all
    assert torch.equal(scales.half(), qt.scales) and torch.equal(mins.half(), qt.mins)


def test_requantized_types_report_their_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import gguf

    from quant.gguf_import import convert_tensor, open_gguf_model
    from quant.gguf_reader import read_tensor

    values = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    qt, error = requantize_int4(values)
    assert qt.format == "int4" and qt.group_size == 32 and 0.01 < error < 0.2
    assert torch.equal(qt.dequantize(), requantize_int4(qt.dequantize().numpy())[0].dequantize())
    # A file with a Q2_K tensor: one warning naming the type, the count and the error.
    path = tmp_path / "q2k.gguf"
    _write_tiny(path, gguf.GGMLQuantizationType.Q2_K)
    with caplog.at_level(logging.WARNING):
        source = open_gguf_model(path)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "Q2_K (1 tensors, +" in lines[0] and "RMS" in lines[0]
    tensor = source.tensors["model.layers.0.mlp.down_proj.weight"]
    assert convert_tensor(tensor, read_tensor(path, tensor)).format == "int4"


def test_a_type_nothing_can_read_is_refused_by_name(tmp_path: Path) -> None:
    import gguf

    from quant.gguf_import import ModelFileError, open_gguf_model

    path = tmp_path / "q8k.gguf"
    _write_tiny(path, gguf.GGMLQuantizationType.Q8_K)  # gguf.quants has no dequantizer for it
    with pytest.raises(ModelFileError, match=r"blk.0.ffn_down.weight has GGUF type Q8_K.*supported: F32"):
        open_gguf_model(path)


def _write_tiny(path: Path, down_type: int) -> None:
    """A one-layer llama GGUF (enough for open_gguf_model) whose ffn_down is random bytes of
    ``down_type`` (a 256-element block type), with Q2_K's d and dmin made finite."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 256),
                       ("feed_forward_length", 256), ("head_count", 2), ("layer_norm_rms_eps", 1e-5)):
        getattr(writer, f"add_{key}")(value)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.ones((3, 256), np.float32))
    raw = np.random.default_rng(1).integers(0, 256, (256, gguf.GGML_QUANT_SIZES[down_type][1]), dtype=np.uint8)
    raw[:, 80:84] = np.array([0.01, 0.001], np.float16).view(np.uint8)  # Q2_K's d, dmin: finite
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=down_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
