"""`edgeinfer pull`, `list`, `show`, `rm` and `--model NAME` as a user runs them: subprocesses over
other tools' stores laid out as those tools lay them out (tests/model_stores.py), every error one
line on stderr naming the file or the name asked for, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_stores import Stores, make_stores


@pytest.fixture()
def stores(tmp_path: Path) -> Stores:
    return make_stores(tmp_path)


def _edgeinfer(stores: Stores, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "XDG_CACHE_HOME")}
    return subprocess.run([sys.executable, "-m", "edgeinfer.cli", *args], capture_output=True, text=True,
                          env={**env, **stores.env}, timeout=timeout)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def test_pull_list_show_rm(stores: Stores) -> None:
    pulled = _edgeinfer(stores, "pull", str(stores.local_gguf), "--name", "mine")
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip() == str(stores.local_gguf) and "stored by reference" in pulled.stderr

    listed = _edgeinfer(stores, "list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
    assert rows == {"mine": "store", "acme/tiny-gguf/tiny.Q8_0.gguf": "hf-cache", "acme/tiny-hf": "hf-cache",
                    "tiny:latest": "ollama", "tiny-llama": "llama.cpp"}

    shown = _edgeinfer(stores, "show", "mine")
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(":", 1) for line in shown.stdout.splitlines())
    assert fields["model"].strip() == "mine (store)" and fields["architecture"].strip() == "llama"
    assert fields["tensor types"].strip() == "F32 x1, F16 x1" and fields["context"].strip() == "128 tokens"
    assert fields["chat template"].strip() == "yes" and str(stores.local_gguf) in fields["file"]
    assert fields["runs here"].strip().startswith("yes (CPU)") and "4 x 128-token sequences" in fields["runs here"]

    removed = _edgeinfer(stores, "rm", "mine")
    assert removed.returncode == 0 and "its files stay" in removed.stdout
    assert stores.local_gguf.is_file()
    assert "mine" not in _edgeinfer(stores, "list").stdout


def test_show_a_discovered_hf_folder(stores: Stores) -> None:
    shown = _edgeinfer(stores, "show", "acme/tiny-hf", "--ctx", "100", "--parallel", "2", "--kv-dtype", "int8")
    assert shown.returncode == 0, shown.stderr
    assert "acme/tiny-hf (hf-cache)" in shown.stdout and "format:        hf" in shown.stdout
    assert "KV cache int8" in shown.stdout and "2 x 100-token sequences" in shown.stdout


def test_pull_copy_and_rm_deletes_the_copy(stores: Stores) -> None:
    pulled = _edgeinfer(stores, "pull", str(stores.llama_cpp_gguf), "--copy")
    assert pulled.returncode == 0, pulled.stderr
    copy = Path(pulled.stdout.strip())
    assert copy.read_bytes() == stores.llama_cpp_gguf.read_bytes() and copy.parent.name == "tiny-llama"
    assert "copying tiny-llama" in pulled.stderr  # tqdm's bar
    # The store's entry shadows the llama.cpp file it was copied from, which stays listed as its own.
    assert _edgeinfer(stores, "rm", "tiny-llama").returncode == 0
    assert not copy.exists() and stores.llama_cpp_gguf.is_file()


def test_rm_of_another_tools_model_is_refused(stores: Stores) -> None:
    error = _one_line_error(_edgeinfer(stores, "rm", "tiny:latest"))
    assert f"lives in ollama at {stores.ollama_blob}" in error


def test_missing_and_corrupt_files_are_named(stores: Stores) -> None:
    stores.ollama_blob.unlink()
    assert str(stores.ollama_blob) in _one_line_error(_edgeinfer(stores, "show", "tiny:latest"))
    listed = _edgeinfer(stores, "list")
    assert listed.returncode == 0 and f"! ollama blob {stores.ollama_blob}" in listed.stdout
    stores.ollama_manifest.write_text("{")
    assert str(stores.ollama_manifest) in _one_line_error(_edgeinfer(stores, "show", "tiny"))
    stores.llama_cpp_gguf.write_bytes(stores.llama_cpp_gguf.read_bytes()[:300])  # truncated in the metadata
    assert str(stores.llama_cpp_gguf) in _one_line_error(_edgeinfer(stores, "show", "tiny-llama"))


def test_unknown_name_and_unreachable_hub(stores: Stores) -> None:
    error = _one_line_error(_edgeinfer(stores, "show", "tiny-lama"))
    assert "did you mean tiny-llama" in error and "edgeinfer list" in error
    error = _one_line_error(_edgeinfer(stores, "pull", "hf://acme/absent/x.gguf"))
    assert "could not fetch acme/absent/x.gguf from the Hugging Face hub" in error


def test_generate_with_a_store_name(stores: Stores, default_model_path: Path) -> None:
    # The compiled CPU kernels live in edgeinfer's cache: share the real one (no minute-long build).
    from edgeinfer.models.pull import cache_dir

    Path(stores.env["EDGEINFER_CACHE"]).mkdir()
    (Path(stores.env["EDGEINFER_CACHE"]) / "kernels").symlink_to(cache_dir() / "kernels")
    assert _edgeinfer(stores, "pull", str(default_model_path), "--name", "smol").returncode == 0
    result = _edgeinfer(stores, "generate", "Say hi", "--model", "smol", "--max-tokens", "4", timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    error = _one_line_error(_edgeinfer(stores, "generate", "Say hi", "--model", "smoll"))
    assert "no model named 'smoll': did you mean smol" in error
