"""Tiny random-weight models of every supported architecture, made without a download.

Each is built with transformers' own config and model classes, then EVERY parameter is drawn at
random (transformers starts biases at 0 and norms at 1, which hid a missing-bias bug) and rounded
to fp16 so an F16 GGUF holds the very same values. A fixture is saved as an HF folder
(save_pretrained: config.json as transformers 5 writes it), optionally with config.json turned
into the 4.x layout, and written as a GGUF with the gguf package the way llama.cpp's
convert_hf_to_gguf.py names and lays out each architecture (Q/K rows permuted for arch llama,
Gemma norms stored as 1 + w, Llama 3 scaling as a rope_freqs tensor, Phi-3's fused tensors).

Small contexts make the features bite within a 300-token prompt: Llama 3 scaling from an
original context of 64, sliding windows of 48. Run as a script to write them all to a folder:
    python tests/models/arch_fixtures.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 320
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
WINDOW = 48

# name -> (transformers config class, its extra settings, GGUF architecture or None: no GGUF)
ARCHS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama3": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, "llama"),
    "llama_linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 50000.0,
                                                         "factor": 4.0}, "tie_word_embeddings": True}, "llama"),
    # llama.cpp's converter writes Mistral as arch llama with no sliding window: a windowed
    # Mistral has no faithful GGUF, so this one is HF only.
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}, None),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 1000000.0}}, "qwen2"),
    # head_dim 32 with 4 heads of a hidden 64, as Qwen3-0.6B and Gemma 2 have head_dim != hidden / heads
    "qwen3": ("Qwen3Config", {"head_dim": 32}, "qwen3"),
    "phi3": ("Phi3Config", {"sliding_window": WINDOW}, "phi3"),
    "gemma2": ("Gemma2Config", {"head_dim": 32, "sliding_window": WINDOW, "query_pre_attn_scalar": 32,
                                "attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0,
                                "hidden_activation": "gelu_pytorch_tanh"}, "gemma2"),
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 6, "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                                    "rope_parameters": {
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
               "gemma3"),
}


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The fixture ``name`` as a transformers model (fp32, eager attention, random parameters)."""
    import transformers

    class_name, extra, _ = ARCHS[name]
    config = getattr(transformers, class_name)(**(SHAPE | extra))
    config._attn_implementation = "eager"  # the plain softmax path: soft-capping and windows as written
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):  # Llama's norms scale by w, Gemma's by 1 + w
                values = torch.rand(param.shape, generator=generator) + (-0.5 if gemma else 0.5)
            else:  # weights and biases
                values = torch.randn(param.shape, generator=generator) * (0.5 if param.dim() == 1 else 0.15)
            param.copy_(values.half().float())  # fp16 values: an F16 GGUF holds them exactly
    return model


def save_hf(model: torch.nn.Module, folder: Path, v4_config: bool = False) -> Path:
    """The model as an HF folder; ``v4_config`` rewrites config.json as transformers 4.x wrote it
    (rope_theta / rope_scaling at the top level, no layer_types)."""
    model.save_pretrained(folder)
    if v4_config:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        path.write_text(json.dumps(_v4_layout(cfg), indent=1))
    return folder


def _v4_layout(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types", None)
    if cfg["model_type"] == "gemma3_text":
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        cfg["sliding_window_pattern"] = 6
        rope = rope["full_attention"]
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    return cfg


def write_gguf(name: str, model: torch.nn.Module, folder: Path, path: Path, dtype: str = "F16") -> Path:
    """Fixture ``name`` (``model``, saved in the HF ``folder``) as llama.cpp's converter writes it;
    2-D tensors in ``dtype`` (F32 or F16), 1-D ones in F32."""
    import gguf

    from quant.hf_import import read_hf_config

    config = read_hf_config(folder)  # the RoPE base and scaling as the folder states them
    cfg = model.config
    arch = ARCHS[name][2]
    assert arch is not None, f"{name} has no GGUF form"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    spec = config.spec
    if spec.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_factor)
    if arch in ("phi3", "gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if spec.rope_scaling == "llama3":
        writer.add_tensor("rope_freqs.weight", np.array(spec.rope_freq_factors, dtype=np.float32))
    for hf, tensor in model.state_dict().items():
        name = _gguf_name(hf, arch)
        if name is None:
            continue
        data = tensor.float()
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads
            data = _permute(data, heads)
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            data = data + 1  # the converter stores Gemma's 1 + w
        array = data.numpy()
        writer.add_tensor(name, array.astype(np.float16) if data.dim() == 2 and dtype == "F16" else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.LlamaModel.permute: rotate-half pairs -> interleaved, per head."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _gguf_name(hf: str, arch: str) -> str | None:
    """The GGUF name (gguf.TENSOR_NAMES) llama.cpp's converter gives the HF tensor ``hf``."""
    from gguf import MODEL_TENSOR as T
    from gguf import TENSOR_NAMES

    globals_ = {"model.embed_tokens": T.TOKEN_EMBD, "model.norm": T.OUTPUT_NORM, "lm_head": T.OUTPUT}
    layer = {"input_layernorm": T.ATTN_NORM, "post_attention_layernorm": T.FFN_NORM,
             "self_attn.q_proj": T.ATTN_Q, "self_attn.k_proj": T.ATTN_K, "self_attn.v_proj": T.ATTN_V,
             "self_attn.o_proj": T.ATTN_OUT, "self_attn.q_norm": T.ATTN_Q_NORM, "self_attn.k_norm": T.ATTN_K_NORM,
             "mlp.gate_proj": T.FFN_GATE, "mlp.up_proj": T.FFN_UP, "mlp.down_proj": T.FFN_DOWN,
             "self_attn.qkv_proj": T.ATTN_QKV, "mlp.gate_up_proj": T.FFN_UP}
    if arch.startswith("gemma"):
        layer |= {"post_attention_layernorm": T.ATTN_POST_NORM, "pre_feedforward_layernorm": T.FFN_NORM,
                  "post_feedforward_layernorm": T.FFN_POST_NORM}
    base, _, kind = hf.rpartition(".")
    if base in globals_:
        return f"{TENSOR_NAMES[globals_[base]]}.{kind}"
    parts = base.split(".", 3)  # model, layers, i, rest
    if parts[:2] != ["model", "layers"] or parts[3] not in layer:
        return None
    return f"{TENSOR_NAMES[layer[parts[3]]].format(bid=parts[2])}.{kind}"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (_, _, arch) in ARCHS.items():
        model = hf_model(name)
        folder = save_hf(model, out / name)
        if arch is not None:
            write_gguf(name, model, folder, out / f"{name}.gguf")
        print(name, "written")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
