"""compressed-tensors export and import: transformers (through the compressed-tensors package)
decompresses the exported folder to exactly the engine's weights and generates the same greedy
tokens; a folder the library packs from random codes imports exactly; unrepresentable formats
are refused with the reason and a killed export leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_awq import _logits
from test_checkpoint import make_tiny_folder, tiny_tokenizer

from edgeinfer.cli.quantize import quantize_main
from edgeinfer.models.loader import load_model
from quant.checkpoint import load_checkpoint
from quant.convert import ConvertOptions, convert
from quant.export_ctensors import convert_to_ctensors, export_ctensors
from quant.formats import QuantizedTensor
from quant.gguf_import import ModelFileError
from quant.hf_import import load_hf_folder
from quant.weight_error import dense

pytest.importorskip("compressed_tensors")
QUIET = {"progress": None, "log": lambda line: None}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_load(folder: Path, dequantize: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    # Asymmetric pack-quantized folders load only with dequantize=True in transformers 5 with
    # compressed-tensors 0.20: the compressed path sizes weight_zero_point unpacked while the
    # library's own compressor (and vLLM's loader) pack it (llm-compressor issue #1618).
    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **extra).eval()


def _greedy_ours(config, weights, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_logits(config, weights, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize(("weights", "group"), [("int4", 32), pytest.param("int4", 128, marks=pytest.mark.slow),
                                                ("int8", None)])
def test_export_is_the_engines_weights_in_transformers(tmp_path: Path, weights: str, group: int | None) -> None:
    pytest.importorskip("transformers")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    convert(make_tiny_folder(tmp_path / "src"), ckpt, ConvertOptions(weights=weights, group_size=group,
                                                                     ct_layout=True), **QUIET)
    export_ctensors(ckpt, out, log=lambda line: None)
    config, ours = load_checkpoint(ckpt)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    (scheme,) = [group["weights"] for group in qcfg["config_groups"].values()]
    assert qcfg["format"] == "pack-quantized" and scheme["symmetric"] == (weights == "int8")
    assert scheme["strategy"] == ("channel" if group is None else "group")
    model = _hf_load(out, dequantize=weights == "int4")  # symmetric: the compressed load
    prompt = [5, 77, 140, 9, 33, 201, 18]
    with torch.no_grad():  # (whose first forward decompresses the weights)
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert theirs[0, len(prompt):].tolist() == _greedy_ours(config, ours, prompt, 12)
    state = model.state_dict()
    for name, weight in ours.items():
        assert torch.equal(state[name].float(), dense(weight)), name
    assert isinstance(ours["model.layers.1.mlp.down_proj.weight"], QuantizedTensor)
    # and back: the folder imports onto the same codes, scales and mins
    back_config, back = load_hf_folder(out)
    torch.testing.assert_close(_logits(back_config, back, prompt), _logits(config, ours, prompt), atol=1e-5, rtol=0)
    for name, weight in ours.items():
        if isinstance(weight, QuantizedTensor):
            assert back[name].format == weight.format and back[name].group_size == weight.group_size, name
            assert torch.equal(back[name].qweight, weight.qweight), name
        assert torch.equal(dense(back[name]), dense(weight)), name
    assert tiny_tokenizer().encode("to be, or not") == tiny_tokenizer().__class__.from_folder(out).encode(
        "to be, or not")


SCHEMES = {"int4 asymmetric g32": dict(num_bits=4, symmetric=False, strategy="group", group_size=32),
           "int4 symmetric g64": dict(num_bits=4, symmetric=True, strategy="group", group_size=64),
           "int8 per channel": dict(num_bits=8, symmetric=True, strategy="channel")}


def _library_folder(tmp_path: Path, scheme: dict, q_proj_scheme: dict | None = None) -> Path:
    """A folder packed by compressed-tensors itself from random codes, bf16 scales and zero points;
    with ``q_proj_scheme``, the q_proj layers are packed with it and named exactly in a second
    config group after the first's class target "Linear" (the most specific target wins)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    src = make_tiny_folder(tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    exceptions: list[str] = []
    for name in [n for n in tensors if n.endswith(tuple(f"{p}.weight" for p in LINEARS))]:
        if q_proj_scheme is not None and name.endswith("q_proj.weight"):
            args = QuantizationArgs(**q_proj_scheme)
            exceptions.append(name.removesuffix(".weight"))
        else:
            args = QuantizationArgs(**scheme)
        lo, hi = (-8, 7) if args.num_bits == 4 else (-128, 127)
        n, k = tensors[name].shape
        num_groups = 1 if args.strategy == "channel" else k // args.group_size
        scale = (torch.rand(n, num_groups, generator=gen) * 0.02 + 0.001).bfloat16()
        zero = torch.randint(lo, hi + 1, (n, num_groups), generator=gen, dtype=torch.int8)
        if args.symmetric:
            zero = torch.zeros_like(zero)
        codes = torch.randint(lo, hi + 1, (n, k), generator=gen).float()
        w = ((codes.reshape(n, num_groups, -1) - zero.float()[..., None]) * scale.float()[..., None]).reshape(n, k)
        state = {"weight": w, "weight_scale": scale.float(), "weight_zero_point": zero}
        packed = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))
        packed["weight_scale"] = scale
        del tensors[name]
        tensors.update({f"{name.removesuffix('.weight')}.{part}": t.contiguous() for part, t in packed.items()})
    save_file(tensors, str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"],
                                                             "weights": QuantizationArgs(**scheme).model_dump()}}}
    if exceptions:
        cfg["quantization_config"]["config_groups"]["group_1"] = {
            "targets": exceptions, "weights": QuantizationArgs(**q_proj_scheme).model_dump()}
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("scheme", [s if "asymmetric" in s else pytest.param(s, marks=pytest.mark.slow)
                                    for s in SCHEMES])
def test_a_folder_the_library_packed_imports_exactly(tmp_path: Path, scheme: str) -> None:
    pytest.importorskip("transformers")
    src = _library_folder(tmp_path, SCHEMES[scheme])
    state = _hf_load(src, dequantize=True).state_dict()
    _, ours = load_hf_folder(src)
    fmt = scheme.split()[0]
    for name, weight in ours.items():
        # The library multiplies in the scales' dtype (bf16 here), one correctly rounded product:
        # ours, exact in fp32, rounded once to it is the same number.
        want = dense(weight).bfloat16().float() if isinstance(weight, QuantizedTensor) else weight
        assert torch.equal(want, state[name]), name
        if name.endswith("proj.weight"):
            assert weight.format == fmt and weight.group_size == SCHEMES[scheme].get("group_size", weight.shape[1])
    # edgeinfer quantize keeps the layers already in the asked format bit for bit
    group = SCHEMES[scheme].get("group_size")
    convert(src, tmp_path / "ckpt", ConvertOptions(weights=fmt, group_size=group), **QUIET)
    _, converted = load_checkpoint(tmp_path / "ckpt")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(converted[q].qweight, ours[q].qweight) and torch.equal(dense(converted[q]), dense(ours[q]))


# transformers 5.24 + compressed-tensors 0.20: the dequantizing load decompresses every dense layer
# with the first config group (transformers.integrations.compressed_tensors.get_dense_scheme): a
# layer of another group fails to load (RuntimeError: its scales do not fit) or, where its packed
# shapes happen to fit, loads wrong values (AssertionError below). The compressed load matches groups
# per layer but sizes asymmetric zero points unpacked (llm-compressor issue #1618), so no load of
# transformers reads an asymmetric mixed folder. Strict: a fixed library turns these into failures.
FIRST_GROUP_ONLY = pytest.mark.xfail(strict=True, raises=(RuntimeError, AssertionError), reason=(
    "transformers' dequantizing load applies the first config group to every layer"))


@pytest.mark.parametrize("dequantize", [False, pytest.param(True, marks=FIRST_GROUP_ONLY)])
def test_mixed_groups_the_library_packed(tmp_path: Path, dequantize: bool) -> None:
    """The minimal reproduction: two symmetric groups packed by compressed-tensors alone (q_proj int8
    per channel, named exactly, after int4 g64 for "Linear"). The compressed load reads each layer
    with its group; the dequantizing one does not. edgeinfer imports each layer with its group (the
    exact name wins over "Linear", as in the library)."""
    pytest.importorskip("transformers")
    src = _library_folder(tmp_path, SCHEMES["int4 symmetric g64"], q_proj_scheme=SCHEMES["int8 per channel"])
    _, ours = load_hf_folder(src)
    for name, weight in ours.items():
        if name.endswith("proj.weight"):
            assert (weight.format, weight.group_size) == (("int8", 128) if "q_proj" in name else ("int4", 64)), name
    model = _hf_load(src, dequantize=dequantize)
    with torch.no_grad():
        model(torch.tensor([[5, 77, 140]]))  # the compressed load decompresses on the first forward
    state = model.state_dict()
    for name, weight in ours.items():
        # The compressed load multiplies in fp32 (the model's dtype), exactly as edgeinfer does;
        # the dequantizing one in the scales' bf16, one correctly rounded product.
        want = dense(weight) if not dequantize or not isinstance(weight, QuantizedTensor) else dense(
            weight).bfloat16().float()
        assert torch.equal(state[name].float(), want), name


def _precision(args: dict) -> str:
    return "int8" if args["num_bits"] == 8 else f"int4 g{args['group_size']}"


def _mixed_plan(tmp_path: Path) -> tuple[Path, dict[str, str], dict]:
    """The tiny model through ``edgeinfer quantize --budget --format compressed-tensors`` at a budget
    halfway between its all-int8 and its smallest plan (measured as the command measures it): the
    folder, its plan's precision per module, and the weights edgeinfer computes for that plan
    (converted directly in the compressed-tensors layout)."""
    from quant.budget import Budget, choose, measure, sizes
    from quant.sources import open_source

    src = make_tiny_folder(tmp_path / "src")
    source, opts = open_source(src), ConvertOptions(weights="int4", ct_layout=True)
    smallest, fixed = sizes(source, opts)
    budget = Budget(10**9, 64, 1, "fp16").for_model(source.config)
    options = measure(source, opts)
    for name, choices in options.items():  # shapes alone give this layout's bytes too
        assert smallest[name].nbytes == choices[-1].nbytes, name
    largest = choose(options, fixed, budget, source.config)
    middle = (largest.total_bytes + fixed + sum(c.nbytes for c in smallest.values()) + largest.kv_bytes) // 2
    out = tmp_path / "out"
    assert quantize_main([str(src), str(out), "--weights", "int4", "--budget", str(middle), "--ctx", "64",
                          "--parallel", "1", "--format", "compressed-tensors", "-q"]) == 0
    plan = json.loads((out / "config.json").read_text())["edgeinfer_plan"]
    planned = {name.removesuffix(".weight"): precision for name, precision, _, _ in plan["layers"]}
    assert len(set(planned.values())) >= 3, planned  # halfway: int8 and several int4 groups
    precisions = tuple((f"{m}.weight", p.split()[0], int(p.split()[1][1:]) if " " in p else None)
                       for m, p in planned.items())
    convert(src, tmp_path / "ckpt", replace(opts, precisions=precisions), **QUIET)
    _, ours = load_checkpoint(tmp_path / "ckpt")
    for name, _, nbytes, _ in plan["layers"]:
        assert ours[name].nbytes == nbytes, name  # the plan's bytes are these weights'
    return out, planned, ours


def test_a_mixed_budget_plan_exports_and_imports_exactly(tmp_path: Path) -> None:
    out, planned, ours = _mixed_plan(tmp_path)
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    # every planned layer is named by exactly one group, the group of its precision
    named = [(module, group["weights"]) for group in groups.values() for module in group["targets"]]
    assert sorted(module for module, _ in named) == sorted(planned)
    for module, args in named:
        assert _precision(args) == planned[module], module
        assert args["symmetric"] == (args["num_bits"] == 8) and args["strategy"] == (
            "channel" if args["num_bits"] == 8 else "group"), module
    assert len(groups) == len(set(planned.values()))
    loaded = load_model(out)
    plan = json.loads((out / "config.json").read_text())["edgeinfer_plan"]
    # the server checks the exported plan against its machine, as it does a checkpoint's
    assert dict(loaded.budget_plan) == {k: v for k, v in plan.items() if k != "layers"} and loaded.budget_plan
    back = loaded.weights
    assert back.keys() == ours.keys()
    for name, weight in ours.items():
        if name.removesuffix(".weight") in planned:
            got = back[name]
            assert (got.format, got.group_size) == (weight.format, weight.group_size), name
            assert torch.equal(got.qweight, weight.qweight), name
            assert torch.equal(got.scales.float(), weight.scales.float()), name
            assert (got.mins is None) == (weight.mins is None), name
            if weight.mins is not None:
                assert torch.equal(got.mins.float(), weight.mins.float()), name
        assert torch.equal(dense(back[name]), dense(weight)), name


def test_a_mixed_budget_plan_in_compressed_tensors(tmp_path: Path) -> None:
    """compressed-tensors' own decompressor, given each layer's group as its own match_targets picks
    it from the folder's config, gives back exactly edgeinfer's weights, layer by layer."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_targets
    from safetensors.torch import load_file

    out, _, ours = _mixed_plan(tmp_path)
    qcfg = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    target_to_scheme = {t: scheme for scheme in qcfg.config_groups.values() for t in scheme.targets}
    tensors = load_file(str(out / "model.safetensors"))
    modules = sorted(key.removesuffix(".weight_packed") for key in tensors if key.endswith(".weight_packed"))
    assert modules and len({id(target_to_scheme[match_targets(m, torch.nn.Linear(1, 1), target_to_scheme)[0]])
                            for m in modules}) >= 3
    for module in modules:
        scheme = target_to_scheme[match_targets(module, torch.nn.Linear(1, 1), target_to_scheme)[0]]
        state = {k.removeprefix(f"{module}."): v for k, v in tensors.items() if k.startswith(f"{module}.weight_")}
        weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        assert torch.equal(weight.float(), dense(ours[f"{module}.weight"])), module


@FIRST_GROUP_ONLY
def test_a_mixed_budget_plan_in_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out, _, ours = _mixed_plan(tmp_path)
    state = _hf_load(out, dequantize=True).state_dict()
    for name, weight in ours.items():
        assert torch.equal(state[name].float(), dense(weight)), name


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_refusals_and_no_partial_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = make_tiny_folder(tmp_path / "src")
    with pytest.raises(ValueError, match="cannot hold --weights nf4"):
        convert_to_ctensors(src, tmp_path / "nf4", ConvertOptions(weights="nf4"), **QUIET)
    with pytest.raises(ValueError, match="--calibrate gptq with --format compressed-tensors"):
        convert_to_ctensors(src, tmp_path / "g", ConvertOptions(weights="int4", calibrate="gptq"), **QUIET)
    convert(src, tmp_path / "ckpt", ConvertOptions(weights="int4"), **QUIET)  # real-valued mins
    with pytest.raises(ModelFileError, match="not -scale x an integer zero point"):
        export_ctensors(tmp_path / "ckpt", tmp_path / "rtn")
    dst = tmp_path / "out"
    dead = _dead_pid()
    (tmp_path / f".out.tmp-{dead}").mkdir()  # what kill -9 leaves
    (tmp_path / f".out.ckpt-{dead}").mkdir()
    args = [str(src), str(dst), "--weights", "int4", "--group-size", "64", "--format", "compressed-tensors", "-q"]
    assert quantize_main(args) == 0
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["group_size"] == 64
    assert quantize_main(args) == 2
    assert f"{dst} already exists; pass --force" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out", "src"]
