"""Other tools' model stores, laid out as those tools lay them out, for the store's tests.

- Hugging Face cache: ``models--acme--tiny-gguf`` and ``models--acme--tiny-hf``, each with
  ``blobs/<sha256>``, ``snapshots/<rev>/<file>`` symlinks into ``../../blobs/`` and ``refs/main``.
- ollama: ``manifests/registry.ollama.ai/library/tiny/latest`` (schemaVersion 2: a config layer,
  the model layer ``application/vnd.ollama.image.model``, a template layer), ``blobs/sha256-<hex>``.
- llama.cpp: ``tiny-llama.gguf`` in its cache folder.
Every GGUF is a tiny llama made with the gguf package's GGUFWriter.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REVISION = "0123456789abcdef0123456789abcdef01234567"


def write_tiny_gguf(path: Path, context: int = 64, template: bool = True, arch: str = "llama",
                    tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF with a one-layer model's metadata and ``tensors`` (default: two small ones)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(context)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    if template:
        writer.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    if tensors is None:
        tensors = {"token_embd.weight": np.zeros((3, 64), np.float32),
                   "blk.0.ffn_up.weight": np.zeros((128, 64), np.float16)}
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hf_repo(root: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A repo in the HF cache: blobs named by their sha256, the snapshot's files linked to them."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        os.symlink(f"../../blobs/{digest}", snapshot / name)
    return snapshot


def _hf_folder_files(scratch: Path) -> dict[str, bytes]:
    from safetensors.numpy import save_file

    config = {"model_type": "llama", "vocab_size": 3, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    weights = scratch / "model.safetensors"
    save_file({"model.embed_tokens.weight": np.zeros((3, 64), np.float16),
               "model.norm.weight": np.ones(64, np.float32)}, str(weights))
    return {"config.json": json.dumps(config).encode(), "model.safetensors": weights.read_bytes(),
            "tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"}).encode()}


def _ollama_model(root: Path, name: str, tag: str, gguf_bytes: bytes) -> tuple[Path, Path]:
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    layers = []
    for media_type, data in (("application/vnd.ollama.image.model", gguf_bytes),
                             ("application/vnd.ollama.image.template", b"{{ .Prompt }}")):
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        layers.append({"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)})
    config = json.dumps({"model_format": "gguf", "model_family": "llama"}).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    (root / "blobs" / f"sha256-{config_digest}").write_bytes(config)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": f"sha256:{config_digest}", "size": len(config)},
        "layers": layers}))
    return manifest, root / "blobs" / layers[0]["digest"].replace(":", "-")


@dataclass(frozen=True)
class Stores:
    env: dict[str, str]  # the variables that point every tool (and edgeinfer's cache) here
    hf_gguf: Path
    hf_folder: Path
    ollama_manifest: Path
    ollama_blob: Path
    llama_cpp_gguf: Path
    local_gguf: Path  # a GGUF in no store, to import


def make_stores(tmp: Path) -> Stores:
    scratch = tmp / "scratch"
    scratch.mkdir()
    gguf_bytes = write_tiny_gguf(scratch / "tiny.gguf").read_bytes()
    hf_root, ollama_root, llama_root = tmp / "hf" / "hub", tmp / "ollama" / "models", tmp / "llama.cpp"
    hf_gguf = _hf_repo(hf_root, "acme/tiny-gguf", {"tiny.Q8_0.gguf": gguf_bytes}) / "tiny.Q8_0.gguf"
    hf_folder = _hf_repo(hf_root, "acme/tiny-hf", _hf_folder_files(scratch))
    manifest, blob = _ollama_model(ollama_root, "tiny", "latest", gguf_bytes)
    llama_root.mkdir()
    llama_gguf = llama_root / "tiny-llama.gguf"
    llama_gguf.write_bytes(gguf_bytes)
    local = write_tiny_gguf(tmp / "My-Model.Q8_0.gguf", context=128)
    env = {"EDGEINFER_CACHE": str(tmp / "cache"), "HF_HUB_CACHE": str(hf_root), "OLLAMA_MODELS": str(ollama_root),
           "LLAMA_CACHE": str(llama_root), "HF_HUB_OFFLINE": "1"}
    return Stores(env, hf_gguf, hf_folder, manifest, blob, llama_gguf, local)
