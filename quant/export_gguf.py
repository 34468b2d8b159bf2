"""GGUF export: an edgeinfer checkpoint as the GGUF file llama.cpp (and ollama) load.

Each tensor is written in the one GGUF type that holds exactly the values the engine runs:
- int4 asymmetric with a group of 32 (or 64, 128: the group's scale and min repeated for each
  32-block) -> Q4_1 (``w = q * d + m``, d and m fp16): exact when the scales and mins are fp16
  values, which ``--format gguf`` makes the quantizers produce (quant.fp16_groups);
- int8 symmetric with a group that is a multiple of 32 (per-row included) -> Q8_0, same rule;
- norms (and biases, rope_freqs) F32, every other plain tensor F16.
A quantized tensor that has no exact type (int8 per row with K not a multiple of 32, fp32 scales
that fp16 cannot hold) is written as F16 with one note naming them and the size it costs; nf4,
which no GGUF type holds, is refused.

For GGUF arch llama the Q/K rows (and biases) are permuted into llama.cpp's interleaved RoPE
order (the inverse of quant.gguf_arch.unpermute_rope_rows); Gemma's ``w + 1`` norms are stored
with the 1 added, as llama.cpp's converter stores them. Metadata are the ``{arch}.*`` keys
quant.gguf_arch's reader reads (what convert_hf_to_gguf.py writes) and the tokenizer as
``tokenizer.ggml.*``. The file is written to a temporary name beside DST, fsynced and renamed.
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

import numpy as np
import torch

from edgeinfer.config import ModelConfig
from edgeinfer.models.tokenizer import Tokenizer
from quant.checkpoint import check_writable_folder, load_checkpoint
from quant.convert import ConvertOptions, ConvertReport, convert
from quant.formats import QuantizedTensor, unpack_int4
from quant.gguf_arch import gguf_name, permutes_rope_rows
from quant.gguf_import import ModelFileError
from quant.weight_error import dense

Weight = torch.Tensor | QuantizedTensor
BLOCK = 32  # Q4_1 / Q8_0 block length
# ModelConfig.architecture -> GGUF architecture (llama.cpp writes a Mistral as llama)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3"}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def _fp16_exact(t: torch.Tensor | None) -> bool:
    return t is not None and bool(torch.equal(t.half().float(), t.float()))


def gguf_type(weight: Weight) -> str:
    """"Q4_1", "Q8_0", "F16" or "F32" for a checkpoint tensor (see the module docstring)."""
    if not isinstance(weight, QuantizedTensor):
        return "F32" if weight.dim() == 1 else "F16"
    if weight.group_size % BLOCK == 0 and _fp16_exact(weight.scales):
        if weight.format == "int4" and _fp16_exact(weight.mins):
            return "Q4_1"
        if weight.format == "int8":
            return "Q8_0"
    return "F16"


def _why_not_exact(weight: QuantizedTensor) -> str:
    if weight.group_size % BLOCK:
        return f"{weight.format} group {weight.group_size} is no multiple of {BLOCK}"
    return f"{weight.format} scales are not fp16 values (quantize with --format gguf)"


def _permute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp's interleaved pairs, per head (convert_hf_to_gguf's permute)."""
    n = t.shape[0]
    return t.reshape(num_heads, 2, n // num_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _permute(weight: Weight, num_heads: int) -> Weight:
    if not isinstance(weight, QuantizedTensor):
        return _permute_rows(weight, num_heads)
    mins = None if weight.mins is None else _permute_rows(weight.mins, num_heads)
    return replace(weight, qweight=_permute_rows(weight.qweight, num_heads),
                   scales=_permute_rows(weight.scales, num_heads), mins=mins, super_scales=None)


def _fp16_bytes(t: torch.Tensor, n: int, num_blocks: int) -> torch.Tensor:
    return t.half().contiguous().view(torch.uint8).reshape(n, num_blocks, 2)


def encode(weight: Weight, ggml_type: str) -> np.ndarray:
    """The tensor's bytes in ``ggml_type``: uint8 (N, K // 32 * block bytes) for Q4_1 / Q8_0,
    else the values as float16 / float32 in their own shape."""
    if ggml_type in ("F16", "F32"):
        return dense(weight).numpy().astype(np.float16 if ggml_type == "F16" else np.float32)
    assert isinstance(weight, QuantizedTensor)
    n, k = weight.shape
    num_blocks = k // BLOCK
    repeat = weight.group_size // BLOCK  # larger groups: each 32-block repeats its group's scale
    d = _fp16_bytes(weight.scales.repeat_interleave(repeat, dim=1), n, num_blocks)
    if ggml_type == "Q8_0":  # block: d (fp16), 32 int8
        qs = weight.qweight.reshape(n, num_blocks, BLOCK).view(torch.uint8)
        return torch.cat([d, qs], dim=-1).reshape(n, -1).numpy()
    assert weight.mins is not None
    m = _fp16_bytes(weight.mins.repeat_interleave(repeat, dim=1), n, num_blocks)
    q = unpack_int4(weight.qweight).reshape(n, num_blocks, BLOCK)
    qs = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j (low nibble), element j + 16 (high)
    return torch.cat([d, m, qs], dim=-1).reshape(n, -1).numpy()


def _nbytes(shape: tuple[int, ...], ggml_type: str) -> int:
    numel = int(np.prod(shape))
    return {"F32": 4 * numel, "F16": 2 * numel, "Q4_1": numel // BLOCK * 20, "Q8_0": numel // BLOCK * 34}[ggml_type]


def _pre_tokenizer_name(pre_tokenizer: Any) -> str:
    """tokenizer.ggml.pre for a tokenizer.json pre_tokenizer, among those edgeinfer's tokenizer
    rebuilds (edgeinfer.models.tokenizer): single digits (SmolLM's), Llama 3's split, else GPT-2's."""
    text = json.dumps(pre_tokenizer)
    if '"Digits"' in text and '"individual_digits": true' in text:
        return "smollm"
    if "(?i:'s|'t|'re|'ve|'m|'ll|'d)" in text:
        return "llama-bpe"
    return "gpt2"


def tokenizer_fields(tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """tokenizer.ggml.* values (without the prefix) for a byte-level BPE tokenizer; the list is
    padded to the model's vocabulary with [PADi] tokens, as llama.cpp's converter pads it."""
    data = json.loads(tokenizer.backend.to_str())
    model = data["model"]
    if model.get("type") != "BPE":
        raise ModelFileError(f"GGUF export writes byte-level BPE tokenizers, not {model.get('type')!r}")
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        token = tokenizer.backend.id_to_token(i) if i < tokenizer.vocab_size else None
        tokens.append(token if token is not None else f"[PAD{i}]")
        kind = CONTROL if added.get(i, {}).get("special") else USER_DEFINED if i in added or token is None else NORMAL
        types.append(kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    fields = {"model": "gpt2", "pre": _pre_tokenizer_name(data.get("pre_tokenizer")), "tokens": tokens,
              "token_type": types, "merges": merges, "add_bos_token": tokenizer.add_bos}
    for key, value in (("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id),
                       ("chat_template", tokenizer.chat_template)):
        if value is not None:
            fields[key] = value
    return fields


def _write_metadata(writer: Any, config: ModelConfig, tokenizer: Tokenizer, file_type: int) -> None:
    """The keys quant.gguf_arch.read_config reads, as convert_hf_to_gguf.py writes them."""
    import gguf

    spec = config.spec
    writer.add_name(f"edgeinfer export ({config.architecture})")
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if spec.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_factor)
    arch = writer.arch
    if spec.sliding_window is not None and arch != "llama":
        writer.add_sliding_window(spec.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(spec.attn_softcap)
        writer.add_final_logit_softcapping(spec.final_softcap)
    if arch == "gemma3":
        writer.add_sliding_window_pattern(spec.global_every)
        if spec.local_rope_theta is not None:
            writer.add_rope_freq_base_swa(spec.local_rope_theta)
    fields = tokenizer_fields(tokenizer, config.vocab_size)
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_type"])
    writer.add_token_merges(fields["merges"])
    writer.add_add_bos_token(fields["add_bos_token"])
    if "bos_token_id" in fields:
        writer.add_bos_token_id(fields["bos_token_id"])
    if "eos_token_id" in fields:
        writer.add_eos_token_id(fields["eos_token_id"])
    if "chat_template" in fields:
        writer.add_chat_template(fields["chat_template"])
    # The model's sampling defaults as general.sampling.*, which llama.cpp applies; its repeat
    # penalty spans the last penalty_last_n tokens, not the whole context: not written.
    sampling = tokenizer.sampling_defaults
    for field, add in (("temperature", writer.add_sampling_temp), ("top_p", writer.add_sampling_top_p),
                       ("top_k", writer.add_sampling_top_k), ("min_p", writer.add_sampling_min_p)):
        if field in sampling:
            add(sampling[field])


def remove_stale(dst: Path) -> None:
    """Delete what an earlier export to DST killed midway left beside it: ``.DST.tmp-PID`` (the
    file) and ``.DST.ckpt-PID`` (the checkpoint stage, and its own ``..DST.ckpt-PID.tmp-PID``),
    where process PID is gone."""
    for path in [*dst.parent.glob(f".{dst.name}.*-*"), *dst.parent.glob(f"..{dst.name}.ckpt-*")]:
        pid = path.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def check_gguf_destination(dst: str | os.PathLike[str], force: bool) -> Path:
    """Fail before any work if DST exists without force, is a folder, or cannot be written."""
    dst = Path(dst).absolute()
    if dst.is_dir():
        raise FileExistsError(f"{dst} is a folder; --format gguf writes one file")
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} already exists; pass --force to overwrite it")
    check_writable_folder(dst, ModelFileError)
    return dst


def export_gguf(checkpoint: str | os.PathLike[str], dst: str | os.PathLike[str], *, force: bool = False,
                log: Callable[[str], None] | None = None) -> Path:
    """Write the checkpoint folder ``checkpoint`` as the GGUF file ``dst`` (atomically)."""
    import gguf

    log = log or (lambda line: print(line, file=sys.stderr))
    dst = check_gguf_destination(dst, force)
    config, weights = load_checkpoint(checkpoint)
    arch = GGUF_ARCH.get(config.architecture)
    if arch is None:
        raise ModelFileError(f"{checkpoint}: no GGUF architecture for {config.architecture!r}")
    nf4 = [name for name, w in weights.items() if isinstance(w, QuantizedTensor) and w.format == "nf4"]
    if nf4:
        raise ModelFileError(f"{checkpoint}: nf4 has no GGUF type llama.cpp reads ({nf4[0]} and "
                             f"{len(nf4) - 1} more); quantize with --weights int4 (Q4_1) or int8 (Q8_0)")
    if config.architecture == "mistral" and config.spec.sliding_window is not None:
        log(f"note: llama.cpp runs a Mistral as arch llama without its sliding window of "
            f"{config.spec.sliding_window} tokens (as its own converter writes it)")
    plan: list[tuple[str, str, str]] = []  # (checkpoint name, GGUF name, type)
    inexact: list[str] = []
    for name, weight in weights.items():
        kind = gguf_type(weight)
        if isinstance(weight, QuantizedTensor) and kind == "F16":
            inexact.append(name)
        plan.append((name, gguf_name(name, arch), kind))
    if inexact:
        extra = sum(_nbytes(weights[n].shape, "F16") - weights[n].nbytes for n in inexact)
        log(f"note: {len(inexact)} tensor(s) have no exact GGUF type ({_why_not_exact(weights[inexact[0]])}) and "
            f"are written as F16, {extra / 1e6:.1f} MB more: {', '.join(inexact)}")
    kinds = [kind for name, _, kind in plan if ".layers." in name and len(weights[name].shape) == 2]
    file_type = {"Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(
        max(set(kinds), key=kinds.count), gguf.LlamaFileType.MOSTLY_F16)

    def tensor(name: str, kind: str) -> np.ndarray:
        weight = weights[name]
        if len(weight.shape) == 1 and "norm" in name:  # Gemma's HF 1 + w norms: GGUF stores 1 + w
            weight = weight.float() + config.spec.norm_offset
        if arch == "llama" and permutes_rope_rows(arch, name):
            weight = _permute(weight, config.num_heads if "q_proj" in name else config.num_kv_heads)
        return encode(weight, kind)

    remove_stale(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        _write_metadata(writer, config, Tokenizer.from_folder(checkpoint), int(file_type))
        freqs = np.array(config.spec.rope_freq_factors, dtype=np.float32)
        if config.spec.rope_scaling == "llama3":
            writer.add_tensor_info("rope_freqs.weight", freqs.shape, freqs.dtype, freqs.nbytes)
        for name, gname, kind in plan:
            shape = tuple(weights[name].shape)
            raw = None if kind in ("F16", "F32") else gguf.GGMLQuantizationType[kind]
            byte_shape = shape if raw is None else (shape[0], _nbytes(shape, kind) // shape[0])
            dtype = np.dtype({"F16": np.float16, "F32": np.float32}.get(kind, np.uint8))
            writer.add_tensor_info(gname, byte_shape, dtype, _nbytes(shape, kind), raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if config.spec.rope_scaling == "llama3":
            writer.write_tensor_data(freqs)
        for name, _, kind in plan:  # one tensor in memory at a time
            writer.write_tensor_data(tensor(name, kind))
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst


def convert_to_gguf(src: str | Path, dst: str | Path, opts: ConvertOptions,
                    progress: Callable[[int, int, str], None] | None = None,
                    log: Callable[[str], None] | None = None) -> ConvertReport:
    """``edgeinfer quantize --format gguf``: convert SRC with fp16 scales into a checkpoint in a
    temporary folder beside DST, then export it as the GGUF file DST."""
    dst_path = check_gguf_destination(dst, opts.force)
    if opts.weights == "nf4":
        raise ValueError("--format gguf cannot hold --weights nf4 (no GGUF type llama.cpp reads is NF4); "
                         "use --weights int4 (written as Q4_1) or int8 (Q8_0)")
    return convert_then_export(src, dst_path, replace(opts, fp16_scales=True), export_gguf, progress, log)


def convert_then_export(src: str | Path, dst: Path, opts: ConvertOptions,
                        export: Callable[..., Path], progress: Callable[[int, int, str], None] | None,
                        log: Callable[[str], None] | None) -> ConvertReport:
    """Convert SRC with ``opts`` into a checkpoint in a temporary folder beside DST (what an
    earlier killed run left there removed first), then ``export(checkpoint, DST, force=, log=)``;
    the temporary checkpoint is gone however it ends."""
    remove_stale(dst)
    ckpt = dst.parent / f".{dst.name}.ckpt-{os.getpid()}"
    try:
        report = convert(src, ckpt, replace(opts, force=True), progress, log)
        export(ckpt, dst, force=opts.force, log=log)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    report.dst = dst
    return report
