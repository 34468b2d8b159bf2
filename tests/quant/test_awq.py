"""AWQ: folding is exact, the search beats round-to-nearest where activations have outlier
channels (layer output error and the model's perplexity), and awq / awq+gptq run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoint import TINY, make_tiny_folder, tiny_weights

from edgeinfer.cli.quantize import quantize_main
from edgeinfer.models.llama import LlamaModel
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool
from quant.awq import fold_scale, search_scale
from quant.checkpoint import load_checkpoint
from quant.convert import ConvertOptions, convert, convert_weight
from quant.hf_import import load_hf_folder
from quant.weight_error import dense

QUIET = {"progress": None, "log": lambda line: None}
OUTLIERS = (3, 17, 50, 90, 111)  # hidden channels whose activations are made 40x larger
TEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"


def _logits(config, weights, token_ids: list[int]) -> torch.Tensor:
    model = LlamaModel(config, weights, choose_backend("reference"))
    num_blocks = -(-len(token_ids) // 16)
    pool = KVPool(config.num_layers, num_blocks, 16, config.num_kv_heads, config.head_dim, "fp32")
    runner = ModelRunner(model, pool, 16)
    return runner.logits([SeqChunk(tuple(token_ids), 0, tuple(range(num_blocks)), num_logits=len(token_ids))])


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "phi3", "gemma2"])
def test_folding_is_exact_in_fp32(arch: str, tmp_path: Path) -> None:
    """Random scales folded into every group of every layer leave the logits unchanged: GQA
    (o's scale per V channel), q/k/v biases (qwen2), fused qkv and gate_up (phi3), 1 + w norms
    and sandwich norms (gemma2)."""
    pytest.importorskip("transformers")
    from models.arch_fixtures import hf_model, save_hf

    config, weights = load_hf_folder(save_hf(hf_model(arch), tmp_path / arch))
    weights = {name: w.float() for name, w in weights.items()}
    scaled = dict(weights)
    gen = torch.Generator().manual_seed(1)
    o_channels = config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        for linear, k in (("qkv", config.hidden_size), ("o", o_channels), ("gate_up", config.hidden_size),
                          ("down", config.intermediate_size)):
            fold_scale(scaled, config, i, linear, torch.exp(torch.randn(k, generator=gen)))
    assert not torch.equal(scaled["model.layers.0.input_layernorm.weight"],
                           weights["model.layers.0.input_layernorm.weight"])
    token_ids = list(range(3, 103))
    want, got = _logits(config, weights, token_ids), _logits(config, scaled, token_ids)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_search_beats_round_to_nearest_on_outlier_channels() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 256, generator=gen)
    x[:, [5, 77, 130, 200]] *= 40.0
    w = torch.randn(96, 256, generator=gen) / 16
    fake_quant = lambda t: convert_weight(t, "int4", 128).dequantize()  # noqa: E731
    s, err, rtn = search_scale(w, x, x.abs().mean(0), fake_quant)
    assert err < 0.6 * rtn, (err, rtn)
    assert s[[5, 77, 130, 200]].min() > s.median()  # the outlier channels got the larger scales


def _outlier_folder(folder: Path) -> dict[str, torch.Tensor]:
    """TINY with a few hidden channels 40x larger going into every norm'd linear, and a few MLP
    channels 40x larger going into down (AWQ's case: weights ordinary, activations not)."""
    make_tiny_folder(folder)
    weights = tiny_weights()
    for i in range(TINY.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"][list(OUTLIERS)] *= 40.0
        weights[f"model.layers.{i}.mlp.up_proj.weight"][list(OUTLIERS)] *= 40.0
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return weights


def _perplexity(weights, targets: torch.Tensor, prefix: list[int]) -> float:
    logits = _logits(TINY, {n: w for n, w in weights.items()}, prefix)
    nll = -torch.log_softmax(logits.double(), dim=-1).gather(1, targets[:, None]).mean()
    return float(nll.exp())


@pytest.mark.skipif(not TEXT.is_file(), reason=f"calibration text not at {TEXT}")
def test_awq_beats_round_to_nearest_on_held_out_text(tmp_path: Path) -> None:
    """Perplexity of tokens drawn from the original model's own next-token distributions (after a
    held-out prefix: the last 200 bytes of the text, which calibration never sees): the original
    model scores best in expectation (cross-entropy = entropy + KL), and AWQ is closer to it than
    round-to-nearest at the same group size."""
    original = _outlier_folder(tmp_path / "src")
    calib = tmp_path / "calib.txt"
    text = TEXT.read_text()
    calib.write_text(text[:20000])
    prefix = list(text[-200:].encode())
    probs = torch.softmax(_logits(TINY, original, prefix).double(), dim=-1)
    targets = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0)).squeeze(1)
    ppl = {"fp32": _perplexity(original, targets, prefix)}
    for method in (None, "awq", "awq+gptq"):
        opts = ConvertOptions(weights="int4", group_size=64, calibrate=method, calib_data=str(calib),
                              calib_tokens=2048, calib_seqlen=128)
        convert(tmp_path / "src", tmp_path / str(method), opts, **QUIET)
        _, loaded = load_checkpoint(tmp_path / str(method))
        ppl[str(method)] = _perplexity({n: dense(w) for n, w in loaded.items()}, targets, prefix)
    assert ppl["fp32"] < ppl["awq"] < ppl["None"], ppl
    assert ppl["awq+gptq"] < ppl["None"], ppl


def test_awq_gptq_through_the_command_line(tmp_path: Path) -> None:
    src = make_tiny_folder(tmp_path / "src")
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    code = quantize_main([str(src), str(tmp_path / "out"), "--weights", "int4", "--group-size", "64",
                          "--calibrate", "awq+gptq", "--calib-data", str(calib), "--calib-tokens", "256",
                          "--calib-seqlen", "64", "-q"])
    assert code == 0
    config, loaded = load_checkpoint(tmp_path / "out")
    down = loaded["model.layers.1.mlp.down_proj.weight"]
    assert (down.format, down.group_size) == ("int4", 64)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["edgeinfer_format"]["name"] == "edgeinfer"
    # The norms carry the folded scales: no longer the source's.
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(loaded[norm], tiny_weights()[norm])


def test_awq_needs_int4() -> None:
    with pytest.raises(ValueError, match="--calibrate awq scales for int4 groups; got --weights int8"):
        ConvertOptions(weights="int8", calibrate="awq", calib_data="x.txt")
