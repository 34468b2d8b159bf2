"""The conversion tool: formats, GGUF bit-exactness, greedy equality, GPTQ, kill -9, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_checkpoint import TINY, make_tiny_folder, tiny_weights

from edgeinfer.cli.quantize import eval_ppl_main, quantize_main
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.loader import load_model
from edgeinfer.models.pull import default_model_path
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool
from quant.calibrate import GPTQCalibrator, gptq_quantize, hessian
from quant.checkpoint import load_checkpoint
from quant.convert import ConvertOptions, convert, convert_weight, target_format
from quant.formats import QuantizedTensor, quantize_int4
from quant.gguf_import import ModelFileError
from quant.nf4 import bitsandbytes_available

REPO = Path(__file__).resolve().parents[2]
GGUF = default_model_path()  # `make test` pulls it first
needs_model = pytest.mark.skipif(not GGUF.is_file(), reason=f"default model not at {GGUF} (edgeinfer pull)")
QUIET = {"progress": None, "log": lambda line: None}


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_folder(tmp_path_factory.mktemp("src") / "tiny")


@pytest.mark.parametrize(
    ("weights", "group", "expected"),
    [
        ("int4", None, "int4 g32"),
        ("int4", 64, "int4 g64"),
        ("int8", None, "int8 g256"),
        ("nf4", None, "nf4 g64"),
        ("fp16", None, "float16"),
        ("bf16", None, "bfloat16"),
    ],
)
def test_convert_and_load_round_trip(
    tiny_src: Path, tmp_path: Path, weights: str, group: int | None, expected: str
) -> None:
    opts = ConvertOptions(weights=weights, group_size=group)
    report = convert(tiny_src, tmp_path / "out", opts, **QUIET)
    config, loaded = load_checkpoint(tmp_path / "out")
    assert config == TINY
    source = tiny_weights()
    q = "model.layers.1.mlp.down_proj.weight"
    assert report.formats[q] == expected
    assert report.formats["model.norm.weight"] == "float32"
    # What was loaded is exactly what the quantizer computed from the source.
    again = convert_weight(source[q], *target_format(q, 2, opts))
    got = loaded[q]
    assert torch.equal(
        got.dequantize() if isinstance(got, QuantizedTensor) else got.float(),
        again.dequantize() if isinstance(again, QuantizedTensor) else again.float(),
    )
    bound = {"int4": 0.2, "int8": 0.01, "nf4": 0.12, "fp16": 1e-3, "bf16": 5e-3}[weights]
    assert max(report.errors.values()) < bound


def test_skip_keeps_source_format(tiny_src: Path, tmp_path: Path) -> None:
    opts = ConvertOptions(weights="int4", skip=("*.down_proj.weight",))
    convert(tiny_src, tmp_path / "out", opts, **QUIET)
    _, loaded = load_checkpoint(tmp_path / "out")
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(loaded[name], tiny_weights()[name])
    assert isinstance(loaded["model.layers.0.mlp.up_proj.weight"], QuantizedTensor)


def _reference_logits(config, weights, token_ids: list[int]) -> torch.Tensor:
    model = LlamaModel(config, weights, choose_backend("reference"))
    pool = KVPool(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, "fp32")
    runner = ModelRunner(model, pool, 16)
    return runner.logits([SeqChunk(tuple(token_ids), 0, (0, 1, 2, 3), num_logits=len(token_ids))])


def test_calibrator_forward_matches_model() -> None:
    weights = tiny_weights()
    token_ids = list(range(5, 45))
    calibrator = GPTQCalibrator(TINY, torch.tensor([token_ids]))
    calibrator.set_embedding(weights["model.embed_tokens.weight"])
    for i in range(TINY.num_layers):
        layer = {name: w for name, w in weights.items() if name.startswith(f"model.layers.{i}.")}
        calibrator.run_layer(i, layer, lambda name, h: weights[name])
    h = torch.nn.functional.rms_norm(
        calibrator.hidden[0], (TINY.hidden_size,), weights["model.norm.weight"], TINY.rms_norm_eps
    )
    ours = h @ weights["model.embed_tokens.weight"].t()
    torch.testing.assert_close(ours, _reference_logits(TINY, weights, token_ids), atol=2e-4, rtol=1e-4)


def test_calibration_feeds_each_linear_the_quantized_ones_before_it() -> None:
    """True sequential, within a layer too: each linear's Hessian comes from inputs computed with
    what ``quantize`` returned for the linears before it. A zero v_proj makes attention, so
    o_proj's inputs, zero; a zero gate_proj makes SiLU(gate) * up, down_proj's inputs, zero."""
    weights = tiny_weights()
    calibrator = GPTQCalibrator(TINY, torch.tensor([list(range(5, 45)), list(range(50, 90))]))
    calibrator.set_embedding(weights["model.embed_tokens.weight"])
    prefix = "model.layers.0."
    hessians: dict[str, torch.Tensor] = {}

    def quantize(name: str, h: torch.Tensor) -> torch.Tensor:
        hessians[name.removeprefix(prefix).removesuffix(".weight")] = h
        zero = name.endswith(("v_proj.weight", "gate_proj.weight"))
        return torch.zeros_like(weights[name]) if zero else weights[name]

    calibrator.run_layer(0, {n: w for n, w in weights.items() if n.startswith(prefix)}, quantize)
    assert list(hessians) == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert hessians["self_attn.q_proj"] is hessians["self_attn.v_proj"]  # one input, one Hessian
    for name in ("self_attn.q_proj", "mlp.up_proj"):
        assert hessians[name].diagonal().min() > 0, name
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert torch.count_nonzero(hessians[name]) == 0, name


def test_gptq_beats_round_to_nearest() -> None:
    gen = torch.Generator().manual_seed(0)
    # Inputs near a 16-dim subspace, like real activations: GPTQ moves error where X cannot see it.
    x = torch.randn(2048, 16, generator=gen) @ torch.randn(16, 128, generator=gen)
    x = x + 0.1 * torch.randn(2048, 128, generator=gen)
    w = torch.randn(64, 128, generator=gen)
    identity = gptq_quantize(w, torch.eye(128), "int4", 32)  # no correlations: GPTQ is RTN
    assert torch.equal(identity.qweight, convert_weight(w, "int4", 32).qweight)
    for fmt, group in (("int4", 32), ("int4", 128), ("int8", 128)):
        gptq = gptq_quantize(w, hessian(x), fmt, group).dequantize()
        rtn = convert_weight(w, fmt, group).dequantize()
        err = lambda q: ((x @ (w - q).t()).norm() / (x @ w.t()).norm()).item()  # noqa: E731
        assert err(gptq) < 0.5 * err(rtn), (fmt, group, err(gptq), err(rtn))


def test_gptq_conversion_end_to_end(tiny_src: Path, tmp_path: Path) -> None:
    """Without --calib-data, calibration reads the excerpt that ships with edgeinfer (quant.corpus)."""
    opts = ConvertOptions(
        weights="int4",
        group_size=64,
        calibrate="gptq",
        calib_tokens=256,
        calib_seqlen=64,
    )
    report = convert(tiny_src, tmp_path / "out", opts, **QUIET)
    _, loaded = load_checkpoint(tmp_path / "out")
    assert report.formats["model.layers.1.self_attn.o_proj.weight"] == "int4 g64"
    assert isinstance(loaded["model.layers.1.self_attn.o_proj.weight"], QuantizedTensor)
    assert max(report.errors.values()) < 0.3


def test_calibration_sequences_longer_than_the_context_are_refused(tiny_src: Path, tmp_path: Path) -> None:
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    opts = ConvertOptions(weights="int4", calibrate="gptq", calib_data=str(text), calib_tokens=512, calib_seqlen=512)
    with pytest.raises(ValueError, match="512 tokens exceed the model's context of 256"):
        convert(tiny_src, tmp_path / "out", opts, **QUIET)
    assert not (tmp_path / "out").exists()


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"--calibrate must be one of \('gptq', 'awq', 'awq\+gptq'\), got 'smooth'"):
        ConvertOptions(weights="int4", calibrate="smooth", calib_data="x")
    with pytest.raises(ValueError, match="--group-size must be one of"):
        ConvertOptions(weights="int4", group_size=48)


def test_cli_refuses_overwrite_then_forces(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dst = str(tmp_path / "out")
    assert quantize_main([str(tiny_src), dst, "--weights", "int8", "-q"]) == 0
    assert quantize_main([str(tiny_src), dst, "--weights", "int4", "-q"]) == 2
    assert "--force" in capsys.readouterr().err
    assert quantize_main([str(tiny_src), dst, "--weights", "int4", "-q", "--force", "-v"]) == 0
    assert "rel_err" in capsys.readouterr().err
    assert load_checkpoint(dst)[1]["model.layers.0.mlp.up_proj.weight"].format == "int4"


def test_cli_eval_ppl(tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "out"
    convert(tiny_src, dst, ConvertOptions(weights="int4"), **QUIET)
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 10)
    assert (
        eval_ppl_main(
            [str(dst), "--text", str(text), "--tokens", "100", "--window", "64", "--kv-dtype", "int8"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "perplexity" in out and "98 tokens in 2 windows" in out
    text.write_text("to be or not to be, that is the question. " * 40)
    assert eval_ppl_main([str(dst), "--text", str(text), "--tokens", "300", "--window", "300"]) == 2
    assert "prompt_too_long" in capsys.readouterr().err  # the tiny model's context is 256 tokens
    monkeypatch.chdir(tmp_path)  # the default text ships with edgeinfer: found from any folder
    assert eval_ppl_main([str(dst), "--tokens", "100", "--window", "64"]) == 0
    captured = capsys.readouterr()
    assert "shakespeare_eval.txt" in captured.err and "98 tokens in 2 windows" in captured.out


_KILL_SCRIPT = """
import sys, time
from quant.convert import ConvertOptions, convert
def progress(done, total, name):
    print("tensor", done, flush=True)
    if done == 5:
        time.sleep(120)  # the test kills us here, mid-write
convert(sys.argv[1], sys.argv[2], ConvertOptions(weights="int4", force=True), progress=progress)
"""


def _convert_and_kill(src: Path, dst: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(src), str(dst)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        for line in proc.stdout:
            if line.strip() == "tensor 5":
                break
        else:
            pytest.fail(f"conversion never reached tensor 5 (exit {proc.wait()})")
        assert any(p.name.startswith(f".{dst.name}.tmp-") for p in dst.parent.iterdir())  # mid-write
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_kill_9_mid_conversion_leaves_no_partial_dst(tiny_src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    _convert_and_kill(tiny_src, dst)
    assert not dst.exists()
    # An existing checkpoint survives a killed --force conversion untouched.
    convert(tiny_src, dst, ConvertOptions(weights="int8"), **QUIET)
    before = (dst / "model.safetensors").read_bytes()
    _convert_and_kill(tiny_src, dst)
    assert (dst / "model.safetensors").read_bytes() == before
    assert load_checkpoint(dst)[1]["model.layers.0.mlp.up_proj.weight"].format == "int8"
    # The next run cleans the dead run's temporary folder.
    convert(tiny_src, dst, ConvertOptions(weights="int4", force=True), **QUIET)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_unknown_architecture(tmp_path: Path) -> None:
    src = make_tiny_folder(tmp_path / "gpt", model_type="gpt2")
    with pytest.raises(ModelFileError, match="unsupported architecture 'gpt2'"):
        convert(src, tmp_path / "out", ConvertOptions(weights="int4"), **QUIET)
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = make_tiny_folder(tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(
        torch.int32
    )
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ModelFileError, match="up_proj.weight has unsupported dtype torch.int32"):
        convert(src, tmp_path / "out", ConvertOptions(weights="int4"), **QUIET)
    assert not (tmp_path / "out").exists()


def test_corrupt_and_truncated_inputs(tmp_path: Path) -> None:
    src = make_tiny_folder(tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        convert(src, tmp_path / "out", ConvertOptions(weights="int4"), **QUIET)
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        convert(garbage, tmp_path / "out", ConvertOptions(weights="int4"), **QUIET)
    if GGUF.is_file():
        with open(GGUF, "rb") as f:
            garbage.write_bytes(f.read(3_000_000))  # header and tokenizer, no tensor data
        with pytest.raises(ModelFileError, match="truncated or corrupt"):
            convert(garbage, tmp_path / "out", ConvertOptions(weights="int4"), **QUIET)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not bitsandbytes_available(), reason="bitsandbytes not installed")
def test_bitsandbytes_4bit_source_is_dequantized(tmp_path: Path) -> None:
    import bitsandbytes.functional as bnbf
    from safetensors.torch import save_file

    src = make_tiny_folder(tmp_path / "bnb")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
    }
    (src / "config.json").write_text(json.dumps(cfg))
    tensors, expected = {}, {}
    for name, w in tiny_weights().items():
        if w.dim() == 2 and "embed" not in name:
            packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            tensors[name] = packed
            tensors.update({f"{name}.{k}": v for k, v in state.as_dict(packed=True).items()})
            expected[name] = bnbf.dequantize_4bit(packed, state).float()
        else:
            tensors[name] = w
    save_file(tensors, str(src / "model.safetensors"))
    convert(src, tmp_path / "out", ConvertOptions(weights="bf16"), **QUIET)
    _, loaded = load_checkpoint(tmp_path / "out")
    for name, w in expected.items():
        assert torch.equal(loaded[name], w.bfloat16()), name


@pytest.fixture(scope="module")
def gguf_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("gguf") / "int4"
    convert(GGUF, dst, ConvertOptions(weights="int4", group_size=32), **QUIET)
    return dst


@needs_model
def test_gguf_q4_1_to_int4_g32_is_bit_exact(gguf_int4: Path) -> None:
    gguf = load_model(GGUF)
    config, weights = load_checkpoint(gguf_int4)
    assert config == gguf.config
    assert weights.keys() == gguf.weights.keys()
    for name, w in gguf.weights.items():
        got = weights[name]
        if isinstance(w, QuantizedTensor):
            assert (got.format, got.group_size, got.scales.dtype) == (w.format, w.group_size, w.scales.dtype)
            assert torch.equal(got.qweight, w.qweight) and torch.equal(got.scales, w.scales), name
            assert w.mins is None or torch.equal(got.mins, w.mins), name
        else:
            assert got.dtype == w.dtype and torch.equal(got, w), name


def _greedy(path: Path, prompt: str, num_tokens: int) -> list[int]:
    loaded = load_model(path)
    c = loaded.config
    model = LlamaModel(c, loaded.weights, choose_backend("int4_cpu"))
    runner = ModelRunner(model, KVPool(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim, "fp32"), 16)
    ids = loaded.tokenizer.encode(prompt)
    out: list[int] = []
    chunk = SeqChunk(tuple(ids), 0, (0, 1, 2, 3))
    for _ in range(num_tokens):
        token = int(runner.logits([chunk]).argmax(-1)[0])
        out.append(token)
        chunk = SeqChunk((token,), chunk.start_pos + len(chunk.token_ids), (0, 1, 2, 3))
    return out


@needs_model
def test_converted_checkpoint_generates_like_the_gguf(gguf_int4: Path) -> None:
    prompt = "The capital of France is"
    assert _greedy(gguf_int4, prompt, 6) == _greedy(GGUF, prompt, 6)


def test_quantize_int4_reference_is_what_convert_uses() -> None:
    w = tiny_weights()["model.layers.0.mlp.up_proj.weight"]
    a, b = convert_weight(w, "int4", 32), quantize_int4(w, 32)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)


def test_group_size_falls_back_where_it_does_not_divide_k() -> None:
    from quant.convert import effective_group

    assert effective_group(128, 1536) == 128
    assert effective_group(128, 576) == 64  # the default model's hidden size
    assert effective_group(None, 576) == 576
    w = torch.randn(8, 576)
    assert convert_weight(w, "int4", 128).group_size == 64


@needs_model
def test_preflight_says_what_the_options_will_do() -> None:
    """Before the slow part: which weights a --group-size cannot take, and that a 4-bit source
    rounded again loses quality; nothing to say where the weights are kept bit for bit."""
    from quant.convert import open_source, preflight_notes

    source = open_source(GGUF)
    notes = preflight_notes(source, ConvertOptions(weights="int4", group_size=128))
    assert notes[0] == ("--group-size 128 does not divide K=576 of self_attn.q_proj, self_attn.k_proj, "
                        "self_attn.v_proj, self_attn.o_proj, mlp.gate_proj, mlp.up_proj: those use g64")
    assert notes[1].startswith(f"{GGUF.name} is already quantized (Q4_1): int4 g128 rounds those weights a second")
    assert len(notes) == 2
    assert preflight_notes(source, ConvertOptions(weights="int4", group_size=32)) == []
    assert preflight_notes(source, ConvertOptions(weights="int8"))[0].startswith(
        f"{GGUF.name} is already quantized (Q4_1): int8 rounds")
