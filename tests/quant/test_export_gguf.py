"""GGUF export: read back bit-exactly by our loader and by the gguf package, same logits, every
architecture the reader has; inexact tensors noted, nf4 refused, the command line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_awq import _logits
from test_checkpoint import make_tiny_folder, tiny_tokenizer

from edgeinfer.cli.quantize import quantize_main
from edgeinfer.models.pull import default_model_path
from edgeinfer.models.tokenizer_gguf import tokenizer_from_gguf
from quant.checkpoint import load_checkpoint
from quant.convert import ConvertOptions, convert
from quant.export_gguf import _permute_rows, export_gguf
from quant.formats import QuantizedTensor
from quant.gguf_arch import gguf_name
from quant.gguf_import import ModelFileError, load_gguf
from quant.gguf_reader import open_gguf, read_tensor
from quant.weight_error import dense

QUIET = {"progress": None, "log": lambda line: None}
GGUF = default_model_path()


def _export(src: Path, tmp_path: Path, weights: str, group: int | None, fp16: bool = True,
            log: list[str] | None = None) -> tuple[Path, Path]:
    ckpt = tmp_path / "ckpt"
    convert(src, ckpt, ConvertOptions(weights=weights, group_size=group, fp16_scales=fp16), **QUIET)
    out = export_gguf(ckpt, tmp_path / "out.gguf", log=(log.append if log is not None else lambda line: None))
    return ckpt, out


@pytest.mark.parametrize(("weights", "group", "ggml"), [("int4", 32, "Q4_1"), ("int4", 128, "Q4_1"),
                                                        ("int8", None, "Q8_0")])
def test_export_reads_back_bit_exactly(tmp_path: Path, weights: str, group: int | None, ggml: str) -> None:
    import gguf

    ckpt, out = _export(make_tiny_folder(tmp_path / "src"), tmp_path, weights, group)
    config, ours = load_checkpoint(ckpt)
    back = load_gguf(out)
    for name, weight in ours.items():
        got = back.weights[name]
        if isinstance(weight, QuantizedTensor):  # larger groups come back as g32 with repeated scales
            repeat = weight.group_size // 32
            assert got.group_size == 32 and got.format == weight.format, name
            assert torch.equal(got.qweight, weight.qweight), name
            assert torch.equal(got.scales, weight.scales.repeat_interleave(repeat, dim=1)), name
            if weight.mins is not None:
                assert torch.equal(got.mins, weight.mins.repeat_interleave(repeat, dim=1)), name
        else:
            assert torch.equal(got, weight), name
    token_ids = list(range(3, 83))
    torch.testing.assert_close(_logits(back.config, back.weights, token_ids), _logits(config, ours, token_ids),
                               atol=1e-6, rtol=0)
    # The gguf package reads the same file and dequantizes every tensor to the same values (Q/K
    # rows in llama.cpp's order).
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types[gguf_name("model.layers.0.mlp.down_proj.weight", "llama")] == ggml
    for t in reader.tensors:
        name = next(n for n in ours if gguf_name(n, "llama") == t.name)
        want = dense(ours[name])
        if "q_proj" in name or "k_proj" in name:
            want = _permute_rows(want, config.num_heads if "q_proj" in name else config.num_kv_heads)
        values = gguf.dequantize(t.data, t.tensor_type).reshape(want.shape)
        assert np.array_equal(values.astype(np.float32), want.numpy()), name
    tokenizer = tokenizer_from_gguf(back.tokenizer_metadata)
    assert tokenizer.encode("to be, or not") == tiny_tokenizer().encode("to be, or not")
    assert tokenizer.eos_token_id == tiny_tokenizer().eos_token_id


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_every_architecture_exports_with_the_same_logits(arch: str, tmp_path: Path) -> None:
    """Metadata as the reader reads them (RoPE scaling, windows, soft-caps, Gemma's 1 + w norms,
    fused tensors, biases, q/k norms): the exported file runs as the checkpoint does."""
    pytest.importorskip("transformers")
    from models.arch_fixtures import hf_model, save_hf

    folder = save_hf(hf_model(arch), tmp_path / arch)
    tiny_tokenizer().save(folder)
    ckpt, out = _export(folder, tmp_path, "int4", 32)
    config, ours = load_checkpoint(ckpt)
    back = load_gguf(out)
    assert back.config.spec.sliding_window == config.spec.sliding_window
    token_ids = list(range(3, 103))
    want = _logits(config, ours, token_ids)
    torch.testing.assert_close(_logits(back.config, back.weights, token_ids), want,
                               atol=1e-5 * want.abs().max().item(), rtol=0)


def test_inexact_tensors_are_f16_with_a_note_and_nf4_is_refused(tmp_path: Path) -> None:
    src = make_tiny_folder(tmp_path / "src")
    notes: list[str] = []
    ckpt, out = _export(src, tmp_path, "int4", 32, fp16=False, log=notes)  # fp32 scales: no exact Q4_1
    assert len(notes) == 1 and "written as F16" in notes[0] and "model.layers.0.mlp.down_proj.weight" in notes[0]
    assert "scales are not fp16 values" in notes[0]
    _, ours = load_checkpoint(ckpt)
    back = load_gguf(out).weights["model.layers.0.mlp.down_proj.weight"]
    assert back.dtype == torch.float16
    assert torch.equal(back, dense(ours["model.layers.0.mlp.down_proj.weight"]).half())
    convert(src, tmp_path / "nf4", ConvertOptions(weights="nf4"), **QUIET)
    with pytest.raises(ModelFileError, match="nf4 has no GGUF type"):
        export_gguf(tmp_path / "nf4", tmp_path / "nf4.gguf")
    assert not (tmp_path / "nf4.gguf").exists()


def test_quantize_format_gguf_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = make_tiny_folder(tmp_path / "src")
    dst = tmp_path / "model.gguf"
    dead = _dead_pid()
    (tmp_path / f".model.gguf.tmp-{dead}").write_bytes(b"GGUF partial")  # what kill -9 leaves
    (tmp_path / f".model.gguf.ckpt-{dead}").mkdir()
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = [str(src), str(dst), "--weights", "int4", "--format", "gguf", "-q", "--calibrate", "awq",
            "--calib-data", str(calib), "--calib-tokens", "256", "--calib-seqlen", "64"]
    assert quantize_main(args) == 0
    assert load_gguf(dst).config.num_layers == 2
    assert quantize_main(args) == 2
    assert f"{dst} already exists; pass --force" in capsys.readouterr().err
    assert quantize_main([*args[:3], "nf4", *args[4:7], "--force"]) == 2
    assert "--format gguf cannot hold --weights nf4" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "model.gguf", "src"]  # no temporary left


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.skipif(not GGUF.is_file(), reason=f"default model not at {GGUF} (edgeinfer pull)")
def test_default_model_round_trips_to_the_same_tensor_bytes(tmp_path: Path) -> None:
    """Q4_1 -> int4 g32 -> Q4_1 (and the Q8_0 embedding): every tensor's bytes as in the source,
    the Q/K rows permuted back exactly."""
    dst = tmp_path / "rt.gguf"
    assert quantize_main([str(GGUF), str(dst), "--weights", "int4", "--format", "gguf", "-q"]) == 0
    source, exported = open_gguf(GGUF), open_gguf(dst)
    theirs = {t.name: t for t in exported.tensors}
    assert sorted(theirs) == sorted(t.name for t in source.tensors)
    for t in source.tensors:
        assert theirs[t.name].ggml_type == t.ggml_type, t.name
        assert np.array_equal(read_tensor(dst, theirs[t.name]), read_tensor(GGUF, t)), t.name
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.pre", "tokenizer.chat_template", "llama.rope.freq_base"):
        assert exported.metadata[key] == source.metadata[key], key
    # The source sets no sampling; its model card's defaults (edgeinfer.models.pull) go with the
    # export as general.sampling.*, which llama.cpp applies.
    assert not any(k.startswith("general.sampling.") for k in source.metadata)
    assert (exported.metadata["general.sampling.temp"], exported.metadata["general.sampling.top_p"]) == \
        (pytest.approx(0.2), pytest.approx(0.9))
