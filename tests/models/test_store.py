"""The model store and discovery, in process: names found in each tool's layout, import by
reference and by copy, removal, and every corrupt or missing file named in its error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from model_stores import Stores, make_stores

from edgeinfer.models.discover import FoundModel
from edgeinfer.models.model_info import model_info
from edgeinfer.models.store import (
    StoreError,
    all_models,
    hub_spec,
    import_model,
    pull_model,
    remove_model,
    resolve_model,
    store_dir,
)


@pytest.fixture()
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Stores:
    for name in ("HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    made = make_stores(tmp_path)
    for name, value in made.env.items():
        monkeypatch.setenv(name, value)
    return made


def _by_name(models: list[FoundModel]) -> dict[str, FoundModel]:
    return {m.name: m for m in models}


def test_each_tools_layout_is_found_and_marked(stores: Stores) -> None:
    found = _by_name(all_models())
    assert {name: (m.where, m.path, m.problem) for name, m in found.items()} == {
        "acme/tiny-gguf/tiny.Q8_0.gguf": ("hf-cache", stores.hf_gguf, None),
        "acme/tiny-hf": ("hf-cache", stores.hf_folder, None),
        "tiny:latest": ("ollama", stores.ollama_blob, None),
        "tiny-llama": ("llama.cpp", stores.llama_cpp_gguf, None),
    }


def test_names_resolve_to_paths(stores: Stores) -> None:
    assert resolve_model("acme/tiny-hf") == stores.hf_folder
    assert resolve_model("tiny:latest") == stores.ollama_blob
    assert resolve_model("tiny") == stores.ollama_blob  # ollama's shorthand for :latest
    assert resolve_model("tiny-llama") == stores.llama_cpp_gguf
    assert resolve_model(str(stores.local_gguf)) == stores.local_gguf  # a path stays a path


def test_unknown_name_lists_close_matches(stores: Stores) -> None:
    with pytest.raises(StoreError, match=r"no model named 'tiny-lama': did you mean tiny-llama.*edgeinfer list"):
        resolve_model("tiny-lama")
    with pytest.raises(FileNotFoundError, match="model not found: nowhere/x.gguf"):
        resolve_model("nowhere/x.gguf")
    with pytest.raises(StoreError, match="did you mean acme/tiny-hf"):
        resolve_model("acme/tiny-hff")


def test_import_by_reference_then_rm_keeps_the_file(stores: Stores) -> None:
    entry = import_model(stores.local_gguf, progress=False)
    assert (entry.name, entry.path, entry.copied, entry.where) == ("my-model.q8_0", stores.local_gguf, False, "store")
    assert import_model(stores.local_gguf, progress=False) == entry  # the same pull again changes nothing
    assert resolve_model("my-model.q8_0") == stores.local_gguf
    manifest = json.loads((store_dir() / "my-model.q8_0.json").read_text())
    assert manifest["format"] == "gguf" and manifest["path"] == str(stores.local_gguf)
    remove_model("my-model.q8_0")
    assert stores.local_gguf.is_file() and not list(store_dir().glob("*.json"))


def test_copy_then_rm_deletes_the_copy(stores: Stores) -> None:
    entry = import_model(stores.hf_folder, name="tiny-copy", copy=True, progress=False)
    assert entry.copied and entry.path == store_dir() / "files" / "tiny-copy"
    assert sorted(p.name for p in entry.path.iterdir()) == ["config.json", "model.safetensors",
                                                            "tokenizer_config.json"]
    assert not any(p.is_symlink() for p in entry.path.iterdir())  # the blobs' bytes, not the links
    remove_model("tiny-copy")
    assert not entry.path.exists() and stores.hf_folder.is_dir()


def test_an_interrupted_copy_leaves_nothing(stores: Stores, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(KeyboardInterrupt):
        import_model(stores.local_gguf, copy=True, progress=False)
    assert not list(store_dir().rglob("*"))[1:]  # the files folder at most, empty


def test_a_taken_name_is_refused(stores: Stores) -> None:
    import_model(stores.local_gguf, name="mine", progress=False)
    with pytest.raises(StoreError, match="already has a model named 'mine'"):
        import_model(stores.llama_cpp_gguf, name="mine", progress=False)
    with pytest.raises(StoreError, match="cannot name a model"):
        import_model(stores.llama_cpp_gguf, name="a/b", progress=False)


def test_rm_refuses_a_model_of_another_tool(stores: Stores) -> None:
    with pytest.raises(StoreError, match=f"lives in ollama at {stores.ollama_blob}"):
        remove_model("tiny:latest")


def test_missing_ollama_blob_is_named(stores: Stores) -> None:
    stores.ollama_blob.unlink()
    with pytest.raises(StoreError, match=f"ollama blob {stores.ollama_blob} .*is missing"):
        resolve_model("tiny:latest")


def test_truncated_ollama_blob_is_named(stores: Stores) -> None:
    stores.ollama_blob.write_bytes(stores.ollama_blob.read_bytes()[:100])
    with pytest.raises(StoreError, match=f"ollama blob {stores.ollama_blob} has 100 bytes"):
        resolve_model("tiny:latest")


def test_corrupt_ollama_manifest_is_named(stores: Stores) -> None:
    stores.ollama_manifest.write_text("{not json")
    assert _by_name(all_models())["tiny:latest"].problem.startswith(f"ollama manifest {stores.ollama_manifest}")
    with pytest.raises(StoreError, match="is unreadable or corrupt"):
        resolve_model("tiny:latest")


def test_pruned_hf_blob_is_named(stores: Stores) -> None:
    stores.hf_gguf.resolve().unlink()
    with pytest.raises(StoreError, match=f"{stores.hf_gguf} points at .*blobs.*which is missing"):
        resolve_model("acme/tiny-gguf/tiny.Q8_0.gguf")


def test_store_entry_whose_file_went_is_named(stores: Stores) -> None:
    import_model(stores.local_gguf, name="gone", progress=False)
    stores.local_gguf.unlink()
    with pytest.raises(StoreError, match=f"{stores.local_gguf} .*gone.json\\) is missing"):
        resolve_model("gone")
    remove_model("gone")  # a broken entry can still be forgotten


def test_corrupt_store_manifest_is_named(stores: Stores) -> None:
    store_dir().mkdir(parents=True)
    (store_dir() / "bad.json").write_text("[1, 2")
    with pytest.raises(StoreError, match=f"store manifest {store_dir() / 'bad.json'} is unreadable"):
        resolve_model("bad")


@pytest.mark.parametrize("spec, parsed", [
    ("hf://acme/tiny-gguf/tiny.Q8_0.gguf", ("acme/tiny-gguf", "tiny.Q8_0.gguf")),
    ("acme/tiny-hf", ("acme/tiny-hf", None)),
    ("https://huggingface.co/acme/tiny-gguf/resolve/main/sub/t.gguf", ("acme/tiny-gguf", "sub/t.gguf")),
    ("tiny-llama", None),
])
def test_hub_references(spec: str, parsed: tuple[str, str | None] | None) -> None:
    assert hub_spec(spec) == parsed


def test_unreachable_hub_is_one_clear_error(stores: Stores) -> None:
    with pytest.raises(StoreError, match="could not fetch acme/absent/x.gguf from the Hugging Face hub"):
        pull_model("hf://acme/absent/x.gguf", progress=False)


def test_hub_pull_of_a_cached_file_references_the_cache(stores: Stores) -> None:
    """Offline, huggingface_hub answers from its cache: the store then names that file."""
    entry = pull_model("acme/tiny-gguf/tiny.Q8_0.gguf", progress=False)
    assert entry.path == stores.hf_gguf and not entry.copied
    assert [m.where for m in all_models()].count("hf-cache") == 1  # listed once, as the store's


def test_show_reads_headers_only(stores: Stores) -> None:
    gguf = model_info(stores.local_gguf)
    assert (gguf.architecture, gguf.num_parameters, gguf.context_length, gguf.chat_template) == (
        "llama", 3 * 64 + 128 * 64, 128, True)
    assert gguf.tensor_types == {"F32": 1, "F16": 1} and gguf.config is not None
    folder = model_info(stores.hf_folder)
    assert (folder.format, folder.architecture, folder.context_length, folder.chat_template) == (
        "hf", "llama", 256, True)
    assert folder.tensor_types == {"F16": 1, "F32": 1} and folder.num_parameters == 3 * 64 + 64


def test_show_reads_a_checkpoints_formats(tmp_path: Path) -> None:
    import torch

    from edgeinfer.config import ModelConfig
    from quant.checkpoint import save_checkpoint
    from quant.formats import quantize_int4

    class Template:
        def save(self, folder: str | Path) -> None:
            (Path(folder) / "chat_template.jinja").write_text("{{ messages }}")

    config = ModelConfig(vocab_size=3, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=32, max_position=512)
    weights = [("model.embed_tokens.weight", torch.zeros(3, 64, dtype=torch.float16)),
               ("model.layers.0.mlp.up_proj.weight", quantize_int4(torch.randn(128, 64), 32))]
    folder = save_checkpoint(tmp_path / "ckpt", config, Template(), weights, [n for n, _ in weights])
    info = model_info(folder)
    assert (info.format, info.context_length, info.chat_template, info.config) == ("edgeinfer", 512, True, config)
    assert info.tensor_types == {"fp16": 1, "int4": 1} and info.num_parameters == 3 * 64 + 128 * 64


def test_quantize_and_eval_ppl_take_names(stores: Stores, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """quantize and eval-ppl resolve names through the store too."""
    from edgeinfer.cli.quantize import eval_ppl_main, quantize_main

    assert quantize_main(["tiny-lama", str(tmp_path / "out"), "--weights", "int8", "-q"]) == 2
    assert "no model named 'tiny-lama': did you mean tiny-llama" in capsys.readouterr().err
    stores.ollama_blob.unlink()
    assert eval_ppl_main(["tiny:latest"]) == 2
    assert f"ollama blob {stores.ollama_blob}" in capsys.readouterr().err


def test_rm_of_the_absent_default_says_so(stores: Stores) -> None:
    with pytest.raises(StoreError, match="the default model is not in the store"):
        remove_model("smollm2")
