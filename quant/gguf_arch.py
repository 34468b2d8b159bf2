"""Per-architecture GGUF metadata: a file's `{arch}.*` keys -> ModelConfig and its ArchSpec, and
tensor names as llama.cpp's converter writes them (gguf.TENSOR_NAMES) -> the HF names the model
uses; what every checkpoint must hold (check_weights), whatever its source.

What the converter (convert_hf_to_gguf.py) does per architecture, and is undone or read here:
- llama (Llama 1-3, Mistral): Q/K rows (and biases) permuted for llama.cpp's interleaved RoPE
  (unpermute_rope_rows); Llama 3 RoPE scaling as a `rope_freqs` tensor of per-frequency
  divisors, linear scaling as `rope.scaling.type` / `.factor`.
- qwen2 (q/k/v biases), qwen3 (q/k norms), phi3 (fused attn_qkv, ffn_up = gate and up), gemma2,
  gemma3: NEOX-style RoPE, nothing permuted.
- gemma2/gemma3: norm weights stored as 1 + w (so applied as they are), the window pattern, the
  local layers' RoPE base and the attention scale are not in the file; llama.cpp fixes them per
  architecture (swa pattern 2 and 6, local base 10000, scale (hidden / heads) ** -0.5 for the 27B
  models, else head_dim ** -0.5), and so does this reader.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from edgeinfer.config import ArchSpec, ModelConfig
from quant.gguf_eog import end_of_generation_ids
from quant.gguf_reader import GGUFFile, read_tensor

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
SUPPORTED_ROPE_SCALING = ("none", "linear", "llama3 (rope_freqs)")

# GGUF block tensor -> HF name within a layer, shared by every architecture ...
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# ... and where one differs (Gemma's ffn_norm is the pre-MLP norm of its sandwich)
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's 27B Gemma models scale q by (hidden / heads) ** -0.5 (query_pre_attn_scalar), told
# apart by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class ModelFileError(ValueError):
    """A model file that cannot be used: wrong architecture, truncated, missing tensors."""


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """The HF name of a GGUF tensor of ``architecture``; None for one the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    names = _LAYER_NAMES | _ARCH_LAYER_NAMES.get(architecture, {})
    if len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias") and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def gguf_name(name: str, architecture: str) -> str:
    """The GGUF name llama.cpp's converter gives the HF tensor ``name`` (hf_name's inverse)."""
    inverse = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
    if name in inverse:
        return inverse[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    names = {hf: gguf for gguf, hf in (_LAYER_NAMES | _ARCH_LAYER_NAMES.get(architecture, {})).items()}
    if m is None or m.group(2) not in names:
        raise ModelFileError(f"tensor {name} has no GGUF name for architecture {architecture!r}")
    return f"blk.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def permutes_rope_rows(architecture: str, name: str) -> bool:
    """Whether llama.cpp's converter permuted this tensor's rows (llama's Q and K only)."""
    return architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                      "k_proj.bias"))


def unpermute_rope_rows(raw: np.ndarray, num_rows: int, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved -> rotate-half halves) on a
    tensor's raw bytes, before conversion: a row is a contiguous byte range in every GGUF type,
    and numpy's copy here spares torch's strided-copy kernels at load (~2 MB of code pages)."""
    rows = raw.reshape(num_heads, num_rows // num_heads // 2, 2, -1)
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(-1)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def tokenizer_fields(reader: GGUFFile) -> dict[str, Any]:
    """The file's tokenizer.* metadata, keys without the prefix, and under "sampling" its
    general.sampling.* keys without theirs (the sampling the model's publisher recommends, which
    llama.cpp's converter writes from generation_config.json and llama.cpp applies by default)."""
    fields = {k.removeprefix("tokenizer."): v for k, v in reader.metadata.items() if k.startswith("tokenizer.")}
    prefix = "general.sampling."
    fields["sampling"] = {k.removeprefix(prefix): v for k, v in reader.metadata.items() if k.startswith(prefix)}
    return fields


def read_config(reader: GGUFFile) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"unsupported architecture {arch!r}; edgeinfer runs {SUPPORTED_ARCHITECTURES}")
    names = {t.name for t in reader.tensors}

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelFileError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_layers = int(need("block_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFileError(f"{arch}: RoPE on {rope_dims} of {head_dim} head dimensions (partial rotary) "
                             f"is not supported")
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=end_of_generation_ids(tokenizer_fields(reader)),
        architecture=arch,
        spec=_spec(reader, arch, hidden, num_heads, head_dim, num_layers),
    )


def _spec(reader: GGUFFile, arch: str, hidden: int, num_heads: int, head_dim: int, num_layers: int) -> ArchSpec:
    window = _field(reader, f"{arch}.attention.sliding_window")
    spec: dict[str, Any] = {"sliding_window": int(window) if window else None, **_rope_scaling(reader, arch)}
    biases = {t.name.split(".")[2] for t in reader.tensors if t.name.startswith("blk.0.") and t.name.endswith(".bias")}
    if biases - {"attn_q", "attn_k", "attn_v", "attn_qkv"}:  # the forward adds q/k/v biases only
        raise ModelFileError(f"{arch}: biases on {sorted(biases)} are not supported (q/k/v biases are)")
    if arch == "qwen2" or biases:
        spec["qkv_bias"] = True
    elif arch == "qwen3":
        spec["qk_norm"] = True
    elif arch == "phi3":
        spec |= {"fused_qkv": True, "fused_gate_up": True}
    elif arch in ("gemma2", "gemma3"):
        scalar = hidden // num_heads if num_layers == _GEMMA_27B_LAYERS[arch] else head_dim
        spec |= {"sandwich_norms": True, "activation": "gelu_tanh", "embed_scale": math.sqrt(hidden),
                 "attn_scale": scalar ** -0.5}
        if arch == "gemma2":
            spec |= {"global_every": 2, "attn_softcap": _field(reader, f"{arch}.attn_logit_softcapping"),
                     "final_softcap": _field(reader, f"{arch}.final_logit_softcapping")}
        else:
            pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 6)
            if isinstance(pattern, list):  # one flag per layer (true: sliding window) -> its period
                flags = pattern
                pattern = next((i + 1 for i, local in enumerate(flags) if not local), 0)
                if flags != [ArchSpec(sliding_window=1, global_every=pattern).is_local(i) for i in range(num_layers)]:
                    raise ModelFileError(f"{arch}: sliding_window_pattern {flags} is not periodic; not supported")
            spec |= {"qk_norm": True, "global_every": int(pattern),
                     "local_rope_theta": float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0))}
    return ArchSpec(**spec)


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any]:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors:  # Phi-3's LongRoPE (su)
        kind = "longrope"
    if kind == "none" and "rope_freqs.weight" in tensors:
        tensor = tensors["rope_freqs.weight"]
        factors = read_tensor(reader.path, tensor).view(np.float32)
        return {"rope_scaling": "llama3", "rope_freq_factors": tuple(factors.tolist())}
    if kind == "none":
        return {}
    if kind == "linear":
        return {"rope_scaling": "linear", "rope_factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    raise ModelFileError(f"{arch}: RoPE scaling {kind!r} is not supported; edgeinfer runs {SUPPORTED_ROPE_SCALING}")


def expected_weight_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    parts = config.spec.layer_weight_names()
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{part}" for part in parts]
    return names


def check_weights(weights: dict[str, Any], config: ModelConfig, source: str) -> None:
    missing = [n for n in expected_weight_names(config) if n not in weights]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(f"{source} is missing tensor(s) {', '.join(missing[:3])}{more}")
