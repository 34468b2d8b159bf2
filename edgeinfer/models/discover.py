"""Models the user already has on disk, found where other tools keep them (read only, never moved).

- Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``):
  ``models--ORG--NAME/snapshots/REV/...`` whose files are symlinks into ``blobs/``; the revision
  ``refs/main`` names is preferred, else the newest snapshot. A snapshot with config.json and
  safetensors is an HF folder (named ``ORG/NAME``); each .gguf in it is a model of its own
  (named ``ORG/NAME/FILE.gguf``, as `edgeinfer pull` takes it).
- ollama (``$OLLAMA_MODELS``, ``~/.ollama/models``): ``manifests/HOST/NAMESPACE/NAME/TAG`` JSON
  whose layer of mediaType ``application/vnd.ollama.image.model`` names the GGUF blob
  ``blobs/sha256-HEX`` (named ``NAME:TAG`` for the default library, as ollama prints it).
- llama.cpp (``$LLAMA_CACHE``, ``~/.cache/llama.cpp``): every ``*.gguf`` below it, by file name.

huggingface_hub's scan_cache_dir is not used: it drops a repository with one missing blob as a
whole, and this listing must name the broken file instead. Each finding is plain data; a broken
one carries its ``problem`` so `list` can show it and `--model` can refuse it with the file named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"


@dataclass(frozen=True)
class FoundModel:
    name: str
    path: Path  # the GGUF file or the model folder
    where: str  # "store", "hf-cache", "ollama" or "llama.cpp"
    problem: str | None = None  # why it cannot be used, naming the file; None when it looks whole
    copied: bool = False  # a store entry whose files the store owns (rm deletes them)
    manifest: Path | None = None  # the file that names it (store or ollama manifest)


def _home() -> Path:
    return Path(os.path.expanduser("~"))


def hf_cache_root(env: Mapping[str, str]) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else _home() / ".cache"
    return base / "huggingface" / "hub"


def ollama_root(env: Mapping[str, str]) -> Path:
    return Path(env["OLLAMA_MODELS"]).expanduser() if env.get("OLLAMA_MODELS") else _home() / ".ollama" / "models"


def llama_cpp_root(env: Mapping[str, str]) -> Path:
    if env.get("LLAMA_CACHE"):
        return Path(env["LLAMA_CACHE"]).expanduser()
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else _home() / ".cache"
    return base / "llama.cpp"


def _missing_link(path: Path) -> str | None:
    """A problem sentence when ``path`` is a symlink whose target (an HF blob) is gone."""
    if path.is_symlink() and not path.exists():
        return f"{path} points at {os.readlink(path)}, which is missing (an incomplete download or a pruned cache)"
    return None


def _snapshot(repo: Path) -> Path | None:
    """The snapshot ``refs/main`` names, else the most recently written one."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = repo / "snapshots" / ref.read_text().strip()
        if candidate.is_dir():
            return candidate
    snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None


def scan_hf_cache(root: Path) -> list[FoundModel]:
    found: list[FoundModel] = []
    for repo in sorted(root.glob("models--*")):
        snapshot = _snapshot(repo)
        if snapshot is None:
            continue
        repo_id = repo.name.removeprefix("models--").replace("--", "/")
        for gguf in sorted(snapshot.rglob("*.gguf")):
            name = f"{repo_id}/{gguf.relative_to(snapshot).as_posix()}"
            found.append(FoundModel(name, gguf, "hf-cache", _missing_link(gguf)))
        if os.path.lexists(snapshot / "config.json"):
            files = [snapshot / "config.json", *sorted(snapshot.glob("*.safetensors"))]
            if len(files) > 1:
                problem = next((p for p in map(_missing_link, files) if p), None)
                found.append(FoundModel(repo_id, snapshot, "hf-cache", problem))
    return found


def _ollama_name(relative: Path) -> str:
    host, namespace, model, tag = relative.parts
    if host == OLLAMA_REGISTRY:
        return f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def read_ollama_manifest(root: Path, manifest: Path) -> tuple[Path | None, str | None]:
    """(the model blob's path, a problem naming the file) of one ollama manifest."""
    try:
        data = json.loads(manifest.read_text())
        layers = data["layers"]
        layer = next((x for x in layers if x.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"ollama manifest {manifest} is unreadable or corrupt ({type(exc).__name__}: {exc})"
    if layer is None:
        return None, f"ollama manifest {manifest} has no layer of type {OLLAMA_MODEL_LAYER}"
    digest = str(layer.get("digest", ""))
    if not digest.startswith("sha256:"):
        return None, f"ollama manifest {manifest} names the model blob {digest!r}, not sha256:HEX"
    blob = root / "blobs" / digest.replace(":", "-", 1)
    if not blob.is_file():
        return blob, f"ollama blob {blob} (named by {manifest}) is missing"
    size = blob.stat().st_size
    if isinstance(layer.get("size"), int) and size != layer["size"]:
        return blob, f"ollama blob {blob} has {size} bytes but {manifest} says {layer['size']} (truncated?)"
    return blob, None


def scan_ollama(root: Path) -> list[FoundModel]:
    manifests = root / "manifests"
    found = []
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
        relative = manifest.relative_to(manifests)
        if len(relative.parts) != 4:  # HOST/NAMESPACE/MODEL/TAG; anything else is not a manifest
            continue
        blob, problem = read_ollama_manifest(root, manifest)
        found.append(FoundModel(_ollama_name(relative), blob or manifest, "ollama", problem, manifest=manifest))
    return found


def scan_llama_cpp(root: Path) -> list[FoundModel]:
    return [FoundModel(p.name.removesuffix(".gguf"), p, "llama.cpp", _missing_link(p))
            for p in sorted(root.rglob("*.gguf")) if p.is_file() or p.is_symlink()]


def discover(env: Mapping[str, str]) -> list[FoundModel]:
    """Every model the other tools hold, in the order a name is looked up: HF cache, ollama, llama.cpp."""
    return [*scan_hf_cache(hf_cache_root(env)), *scan_ollama(ollama_root(env)), *scan_llama_cpp(llama_cpp_root(env))]
