"""Make GGUF files of a 1.7B-shaped model with llama.cpp's own tools, for the format benchmarks.

SmolLM2-1.7B's shape (24 layers, hidden 2048, MLP 8192, 32 heads, tied 49152-token embedding)
with random weights (the hub cannot be reached here; speed and memory depend on the shape and the
tensor types, not on the values), the default model's tokenizer, saved as an HF folder, converted
by llama.cpp's `convert_hf_to_gguf.py` to F16 and quantized by `llama-quantize` to each type asked
for: files made the way users' files are made. Needs tools/build_llama_cpp.sh (run first, ~15 min).

    eval "$(tools/build_llama_cpp.sh)"
    python tools/make_bench_model.py [--types Q4_K_M Q8_0 Q4_1] [--out ~/.cache/edgeinfer/bench-models]

Prints the path of each file; files that exist are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from edgeinfer.models.loader import load_model  # noqa: E402
from edgeinfer.models.pull import cache_dir, default_model_path  # noqa: E402

SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
         "num_key_value_heads": 32, "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 130000.0,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
NAME = "smollm2-1.7b-shape"


def write_hf_folder(folder: Path, seed: int = 0) -> None:
    """config.json, tokenizer files and random bf16 weights under HF names."""
    folder.mkdir(parents=True, exist_ok=True)
    source = load_model(default_model_path())
    tok = source.tokenizer
    tok.backend.save(str(folder / "tokenizer.json"))
    vocab = tok.backend.id_to_token
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": vocab(tok.bos_token_id), "eos_token": vocab(tok.eos_token_id),
        "chat_template": tok.chat_template, "model_max_length": SHAPE["max_position_embeddings"]}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "hidden_act": "silu", **SHAPE}))
    gen = torch.Generator().manual_seed(seed)
    h, m, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"]
    kv_size = kv * h // SHAPE["num_attention_heads"]

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(SHAPE["vocab_size"], h), "model.norm.weight": 1 + rand(h, std=0.1)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": 1 + rand(h, std=0.1),
                    p + "post_attention_layernorm.weight": 1 + rand(h, std=0.1),
                    p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv_size, h),
                    p + "self_attn.v_proj.weight": rand(kv_size, h), p + "self_attn.o_proj.weight": rand(h, h),
                    p + "mlp.gate_proj.weight": rand(m, h), p + "mlp.up_proj.weight": rand(m, h),
                    p + "mlp.down_proj.weight": rand(h, m)}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def run(cmd: list[str], **env: str) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, env={**os.environ, **env})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0", "Q4_1"],
                        help="llama-quantize types (default: Q4_K_M Q8_0 Q4_1)")
    parser.add_argument("--out", type=Path, default=cache_dir() / "bench-models")
    args = parser.parse_args()
    missing = [v for v in ("LLAMA_CPP_BIN", "LLAMA_CPP_SRC") if v not in os.environ]
    if missing:
        parser.error(f"{' and '.join(missing)} not set: run `eval \"$(tools/build_llama_cpp.sh)\"` first")
    try:  # the converter tries a SentencePiece vocab first for llama models and dies without the module
        import sentencepiece  # noqa: F401
    except ImportError:
        parser.error("llama.cpp's convert_hf_to_gguf.py needs sentencepiece: pip install sentencepiece")
    bin_dir, src = Path(os.environ["LLAMA_CPP_BIN"]), Path(os.environ["LLAMA_CPP_SRC"])
    out = args.out / NAME
    f16 = out / f"{NAME}.F16.gguf"
    if not f16.is_file():
        folder = out / "hf"
        if not (folder / "model.safetensors").is_file():
            write_hf_folder(folder)
        partial = f16.with_suffix(".partial")
        run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16",
             "--outfile", str(partial)], PYTHONPATH=str(src / "gguf-py"))
        partial.replace(f16)
    for kind in args.types:
        target = out / f"{NAME}.{kind}.gguf"
        if not target.is_file():
            partial = target.with_suffix(".partial")
            run([str(bin_dir / "llama-quantize"), str(f16), str(partial), kind])
            partial.replace(target)
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
