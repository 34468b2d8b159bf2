"""compressed-tensors export: an edgeinfer checkpoint as the HF folder vLLM and transformers load.

The folder holds config.json (the HF architecture's fields plus ``quantization_config``: format
``pack-quantized``, one config group per distinct (bits, group size, symmetry), its targets the
exact module names, so a ``--budget`` plan's mixed precisions are kept, and the plan itself as
``edgeinfer_plan``), model.safetensors and the tokenizer with its chat template (Tokenizer.save).
edgeinfer (quant.ctensors_import) and compressed-tensors' own decompressor read each layer with
its group. transformers 5.24 with compressed-tensors 0.20 cannot load a mixed folder: its
dequantizing load decompresses every layer with the first config group (``get_dense_scheme``)
and its compressed load, which does match groups per layer, sizes asymmetric zero points unpacked
(llm-compressor issue #1618); tests/quant/test_ctensors.py reproduces both. Each int4/int8 linear layer is packed by
compressed-tensors' own ``PackedQuantizationCompressor`` (weight_packed, weight_scale,
weight_shape, weight_zero_point when asymmetric) from the exact codes quant.ctensors_codes
derives; every other tensor is written as the checkpoint holds it (a quantized embedding, which
no loader reads as such, dequantized to fp32 with a note). A weight whose numbers the layout
cannot hold exactly (int4 with a real-valued min, nf4) is refused with the reason, before
anything is written. ``edgeinfer quantize --format compressed-tensors`` quantizes with integer
zero points and fp16 values throughout (ConvertOptions.ct_layout), so the folder loaded in fp16
or fp32 computes with the numbers edgeinfer computes with.

The whole folder is written into ``.DST.tmp-PID`` beside DST and renamed; a killed run leaves
no DST, and its leftovers are removed by the next export (quant.export_gguf.remove_stale).
The weights are held in memory while writing (one model, not streamed as the checkpoint is).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from edgeinfer.config import ModelConfig
from edgeinfer.models.tokenizer import Tokenizer
from quant.checkpoint import check_writable_folder, load_checkpoint
from quant.convert import ConvertOptions, ConvertReport
from quant.ctensors_codes import Codes, NotRepresentable, to_codes
from quant.export_gguf import convert_then_export, remove_stale
from quant.formats import QuantizedTensor
from quant.gguf_import import ModelFileError
from quant.weight_error import dense

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LINEAR_SKIP = ("model.embed_tokens.weight",)  # nn.Embedding: no pack-quantized loader reads it


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json of the HF architecture (transformers 5 and 4.x keys), or ModelFileError."""
    arch, spec = config.architecture, config.spec
    if arch not in HF_ARCHITECTURES:
        raise ModelFileError(f"compressed-tensors export writes {sorted(HF_ARCHITECTURES)}; not {arch!r}")
    if spec.rope_scaling != "none":
        raise ModelFileError(f"compressed-tensors export does not write RoPE scaling {spec.rope_scaling!r} yet")
    if spec.qkv_bias != (arch == "qwen2"):
        raise ModelFileError(f"{arch} with qkv_bias={spec.qkv_bias} has no HF config edgeinfer writes")
    eos = list(config.eos_token_ids)
    data: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position, "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "attention_bias": False, "sliding_window": spec.sliding_window,
    }
    if arch in ("qwen2", "qwen3"):
        data["use_sliding_window"] = spec.sliding_window is not None
    return data


def _scheme_key(codes: Codes) -> tuple[int, int | None, bool]:
    return codes.num_bits, None if codes.strategy == "channel" else codes.group_size, codes.zero_point is None


def quantization_config(schemes: dict[tuple[int, int | None, bool], list[str]]) -> dict[str, Any]:
    """config.json's ``quantization_config`` as compressed-tensors' ModelCompressor writes it."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    groups = {
        f"group_{i}": QuantizationScheme(targets=names, weights=QuantizationArgs(
            num_bits=bits, type="int", symmetric=symmetric, strategy="channel" if group is None else "group",
            group_size=group))
        for i, ((bits, group, symmetric), names) in enumerate(schemes.items())
    }
    qc = QuantizationConfig(config_groups=groups, format="pack-quantized", quantization_status="compressed",
                            ignore=["lm_head"] if not any("lm_head" in n for v in schemes.values() for n in v) else [])
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors", "sparsity_config": {},
            "transform_config": {}, **qc.model_dump(exclude=["quant_method"])}


def _compress(codes: Codes) -> dict[str, torch.Tensor]:
    """weight_packed, weight_scale, weight_shape (+ weight_zero_point) by the library's compressor,
    from weights that are exactly ``scale * (codes - zero)`` so its rounding gives back ``codes``.
    Scales are stored as fp32: compressed-tensors dequantizes in the scale's dtype, and an fp16
    product ``s * (q - z)`` would round where the engine's fp32 one does not (vLLM casts them to
    its dtype, exactly: they are fp16 values)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    n, k = codes.codes.shape
    bits, group, symmetric = _scheme_key(codes)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="channel" if group is None else "group", group_size=group)
    scale = codes.scale.float()
    zero = torch.zeros_like(scale) if codes.zero_point is None else codes.zero_point.float()
    weight = ((codes.codes.float().reshape(n, -1, codes.group_size) - zero[..., None]) * scale[..., None]).reshape(n, k)
    state = {"weight": weight, "weight_scale": scale}
    if codes.zero_point is not None:
        state["weight_zero_point"] = codes.zero_point
    out = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))
    return out


def export_ctensors(checkpoint: str | os.PathLike[str], dst: str | os.PathLike[str], *, force: bool = False,
                    log: Callable[[str], None] | None = None) -> Path:
    """Write the checkpoint folder ``checkpoint`` as the compressed-tensors folder ``dst`` (atomically)."""
    from safetensors.torch import save_file

    log = log or (lambda line: print(line, file=sys.stderr))
    dst = check_ct_destination(dst, force)
    config, weights = load_checkpoint(checkpoint)
    data = hf_config(config)
    plan = json.loads((Path(checkpoint) / "config.json").read_text()).get("edgeinfer_plan")
    if plan:  # the record of which precision each layer got, and the budget it was made for
        data["edgeinfer_plan"] = plan
    tensors: dict[str, torch.Tensor] = {}
    schemes: dict[tuple[int, int | None, bool], list[str]] = {}
    dequantized: list[str] = []
    for name, weight in weights.items():
        if not isinstance(weight, QuantizedTensor):
            tensors[name] = weight.contiguous()
            continue
        if name in _LINEAR_SKIP:
            dequantized.append(name)
            tensors[name] = dense(weight)
            continue
        try:
            codes = to_codes(weight)
        except NotRepresentable as exc:
            raise ModelFileError(f"{checkpoint}: {name} cannot be written as compressed-tensors: {exc}") from exc
        module = name.removesuffix(".weight")
        schemes.setdefault(_scheme_key(codes), []).append(module)
        for part, tensor in _compress(codes).items():
            tensors[f"{module}.{part}"] = tensor.contiguous()
    if dequantized:
        log(f"note: {', '.join(dequantized)} written dequantized as fp32 (no loader reads a quantized embedding)")
    plain = {t.dtype for n, t in tensors.items() if t.is_floating_point() and "weight_scale" not in n}
    data["torch_dtype"] = "float16" if plain <= {torch.float16} else "float32"
    data["quantization_config"] = quantization_config(schemes)
    remove_stale(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(data, indent=1))
        Tokenizer.from_folder(checkpoint).save(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        if dst.exists():
            os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def check_ct_destination(dst: str | os.PathLike[str], force: bool) -> Path:
    """Fail before any work if DST exists without force, is a file, or cannot be written."""
    dst = Path(dst).absolute()
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} already exists; pass --force to overwrite it")
    if dst.exists() and not (dst / "config.json").is_file():
        raise FileExistsError(f"{dst} exists and is not a model folder: refusing to replace it")
    check_writable_folder(dst, ModelFileError)
    return dst


def convert_to_ctensors(src: str | Path, dst: str | Path, opts: ConvertOptions,
                        progress: Callable[[int, int, str], None] | None = None,
                        log: Callable[[str], None] | None = None) -> ConvertReport:
    """``edgeinfer quantize --format compressed-tensors``: convert SRC in the exact layout
    (ConvertOptions.ct_layout) into a checkpoint beside DST, then export it as the folder DST."""
    dst_path = check_ct_destination(dst, opts.force)
    if opts.weights not in ("int4", "int8"):
        raise ValueError(f"--format compressed-tensors cannot hold --weights {opts.weights} (its pack-quantized "
                         "layout is integer codes with scales and zero points); use --weights int4 or int8")
    if opts.calibrate and opts.calibrate.endswith("gptq"):
        raise ValueError(f"--calibrate {opts.calibrate} with --format compressed-tensors is not supported (GPTQ "
                         "here rounds against a real-valued min); use --calibrate awq or none")
    return convert_then_export(src, dst_path, replace(opts, ct_layout=True), export_ctensors, progress, log)
