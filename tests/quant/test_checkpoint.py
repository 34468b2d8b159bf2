"""The edgeinfer checkpoint: round trips of every format, format/version checks, atomic writes, nf4."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from edgeinfer.config import ModelConfig
from edgeinfer.models.tokenizer import Tokenizer, _bytes_to_unicode
from quant.checkpoint import CheckpointError, load_checkpoint, read_header, save_checkpoint
from quant.formats import QuantizedTensor, dequantize_nf4, quantize_int4, quantize_int8
from quant.gguf_arch import expected_weight_names
from quant.nf4 import bitsandbytes_available, quantize_nf4

TINY = ModelConfig(
    vocab_size=257,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=256,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_ids=(256,),
)


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: 256 byte tokens + one special end token."""
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|end|>"])
    return Tokenizer(backend, bos_token_id=None, eos_token_id=256, add_bos=False, chat_template=None)


def tiny_weights(config: ModelConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in expected_weight_names(config):
        if "norm" in name:
            weights[name] = 1.0 + 0.1 * torch.randn(config.hidden_size, generator=gen)
        elif "embed" in name:
            weights[name] = torch.randn(config.vocab_size, config.hidden_size, generator=gen)
        else:
            weights[name] = torch.empty(0)
    shapes = {suffix.split(".")[-1]: nk for suffix, nk in config.linear_shapes().items()}
    for name, t in weights.items():
        if t.numel() == 0:
            n, k = shapes[name.split(".")[-2]]
            weights[name] = torch.randn(n, k, generator=gen) / k**0.5
    return weights


def make_tiny_folder(folder: Path, dtype: torch.dtype = torch.float32, model_type: str = "llama") -> Path:
    """An HF-style folder (config.json, model.safetensors, tokenizer) of a random tiny Llama."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    c = TINY
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": model_type,
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "rms_norm_eps": c.rms_norm_eps,
                "max_position_embeddings": c.max_position,
                "tie_word_embeddings": True,
                "eos_token_id": 256,
            }
        )
    )
    save_file(
        {k: v.to(dtype).contiguous() for k, v in tiny_weights().items()}, str(folder / "model.safetensors")
    )
    tiny_tokenizer().save(folder)
    return folder


def _all_formats() -> dict[str, QuantizedTensor | torch.Tensor]:
    w = tiny_weights()
    out: dict[str, QuantizedTensor | torch.Tensor] = dict(w)
    layer = "model.layers.0."
    out[layer + "self_attn.q_proj.weight"] = quantize_int4(w[layer + "self_attn.q_proj.weight"], 32)
    q = quantize_int4(w[layer + "self_attn.k_proj.weight"], 64)  # fp16 scales, as GGUF keeps them
    out[layer + "self_attn.k_proj.weight"] = QuantizedTensor(
        "int4", q.shape, 64, q.qweight, q.scales.half(), q.mins.half()
    )
    out[layer + "self_attn.v_proj.weight"] = quantize_int8(w[layer + "self_attn.v_proj.weight"])
    out[layer + "self_attn.o_proj.weight"] = quantize_int8(w[layer + "self_attn.o_proj.weight"], 32)
    out[layer + "mlp.gate_proj.weight"] = quantize_nf4(w[layer + "mlp.gate_proj.weight"], 64)
    out[layer + "mlp.up_proj.weight"] = w[layer + "mlp.up_proj.weight"].half()
    out[layer + "mlp.down_proj.weight"] = w[layer + "mlp.down_proj.weight"].bfloat16()
    g16 = quantize_int8(w["model.layers.1.self_attn.o_proj.weight"], 16)  # as from a GGUF Q6_K / Q5_K
    out["model.layers.1.self_attn.o_proj.weight"] = QuantizedTensor(
        "int8", g16.shape, 16, g16.qweight, g16.scales.half(), (-3 * g16.scales).half()
    )
    return out


def _same(a: QuantizedTensor | torch.Tensor, b: QuantizedTensor | torch.Tensor) -> bool:
    if isinstance(a, QuantizedTensor):
        parts = [(a.qweight, b.qweight), (a.scales, b.scales)] + (
            [(a.mins, b.mins)] if a.mins is not None else []
        )
        return (a.format, a.shape, a.group_size) == (b.format, b.shape, b.group_size) and all(
            x.dtype == y.dtype and torch.equal(x, y) for x, y in parts
        )
    return a.dtype == b.dtype and torch.equal(a, b)


def _save(dst: Path, weights: dict, force: bool = False) -> Path:
    return save_checkpoint(dst, TINY, tiny_tokenizer(), iter(weights.items()), list(weights), force=force)


def test_round_trip_every_format(tmp_path: Path) -> None:
    weights = _all_formats()
    dst = _save(tmp_path / "ckpt", weights)
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json",
        "generation_config.json",  # the stop ids and sampling defaults (Tokenizer.save)
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config, loaded = load_checkpoint(dst)
    assert config == TINY
    assert loaded.keys() == weights.keys()
    for name, w in weights.items():
        assert _same(w, loaded[name]), name
        if isinstance(w, QuantizedTensor):
            assert torch.equal(w.dequantize(), loaded[name].dequantize()), name
    meta = read_header(dst / "model.safetensors")[0]["__metadata__"]
    assert meta["format"] == "edgeinfer" and meta["format_version"] == "1"
    assert json.loads(meta["model.layers.0.self_attn.k_proj.weight"]) == {
        "format": "int4",
        "shape": [64, 128],
        "group_size": 64,
    }
    assert json.loads(meta["model.layers.0.mlp.up_proj.weight"])["format"] == "fp16"
    assert Tokenizer.from_folder(dst).encode("hello") == tiny_tokenizer().encode("hello")


def test_safetensors_library_reads_streamed_file(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    weights = _all_formats()
    dst = _save(tmp_path / "ckpt", weights)
    tensors = load_file(str(dst / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight.qweight"], q.qweight)
    assert torch.equal(tensors["model.norm.weight"], weights["model.norm.weight"])


def test_wrong_format_version_is_named(tmp_path: Path) -> None:
    dst = _save(tmp_path / "ckpt", tiny_weights())
    cfg = json.loads((dst / "config.json").read_text())
    cfg["edgeinfer_format"]["version"] = 2
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"expected format 'edgeinfer' version 1, found format 'edgeinfer' version 2"
    ):
        load_checkpoint(dst)


def test_wrong_weights_metadata_is_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    dst = _save(tmp_path / "ckpt", tiny_weights())
    save_file({"x": torch.zeros(2)}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"expected format 'edgeinfer' version 1, found format 'pt'"):
        load_checkpoint(dst)


def test_truncated_weights_are_reported(tmp_path: Path) -> None:
    dst = _save(tmp_path / "ckpt", tiny_weights())
    path = dst / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(dst)
    path.write_bytes(struct.pack("<Q", 10**9) + data[8:100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(dst)


def test_refuses_overwrite_without_force(tmp_path: Path) -> None:
    weights = tiny_weights()
    dst = _save(tmp_path / "ckpt", weights)
    with pytest.raises(FileExistsError, match="--force"):
        _save(dst, weights)
    weights2 = tiny_weights(seed=1)
    _save(dst, weights2, force=True)
    assert torch.equal(load_checkpoint(dst)[1]["model.norm.weight"], weights2["model.norm.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp or old folders left


def test_force_never_replaces_a_foreign_folder(tmp_path: Path) -> None:
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(FileExistsError, match="not an edgeinfer checkpoint"):
        _save(other, tiny_weights(), force=True)
    assert (other / "cat.jpg").read_bytes() == b"meow"


def test_read_only_destination(tmp_path: Path) -> None:
    # Tests run as root, which ignores permission bits: make the folder immutable instead.
    locked = tmp_path / "locked"
    locked.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(locked)]).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        with pytest.raises(CheckpointError, match="read-only|not writable"):
            _save(locked / "ckpt", tiny_weights())
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert not (locked / "ckpt").exists()


def test_missing_parent_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        _save(tmp_path / "no" / "ckpt", tiny_weights())


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    def broken():
        yield "model.norm.weight", torch.ones(128)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path / "ckpt", TINY, tiny_tokenizer(), broken(), list(tiny_weights()))
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_folder_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".ckpt.tmp-999999999"  # no such process
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    _save(tmp_path / "ckpt", tiny_weights())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_nf4_round_trip_and_layout() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    qt = quantize_nf4(w, 64, use_bitsandbytes=False)
    assert qt.qweight.shape == (64 * 256 // 2, 1) and qt.qweight.dtype == torch.uint8
    assert qt.scales.shape == (64 * 256 // 64,)
    d = dequantize_nf4(qt)
    assert (d - w).norm() / w.norm() < 0.12
    again = quantize_nf4(d, 64, use_bitsandbytes=False)  # dequantized values are fixed points
    assert torch.equal(again.qweight, qt.qweight) and torch.equal(again.scales, qt.scales)
    assert torch.equal(qt.dequantize(), d)


@pytest.mark.skipif(not bitsandbytes_available(), reason="bitsandbytes not installed")
def test_nf4_torch_mirror_matches_bitsandbytes() -> None:
    import bitsandbytes.functional as bnbf

    w = torch.randn(96, 192, generator=torch.Generator().manual_seed(1))
    for blocksize in (64, 32):
        ours = quantize_nf4(w, blocksize, use_bitsandbytes=False)
        theirs = quantize_nf4(w, blocksize, use_bitsandbytes=True)
        assert torch.equal(ours.qweight, theirs.qweight)
        assert torch.equal(ours.scales, theirs.scales)
        packed, state = bnbf.quantize_4bit(
            w, blocksize=blocksize, quant_type="nf4", compress_statistics=False
        )
        assert torch.equal(dequantize_nf4(theirs), bnbf.dequantize_4bit(packed, state).float())
