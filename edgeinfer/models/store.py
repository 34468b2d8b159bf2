"""The model store: names for models, and where a name leads (`pull`, `list`, `rm`, `--model NAME`).

Layout under the cache (edgeinfer.models.pull.cache_dir)::

    models/SmolLM2-135M-Instruct.Q4_1.gguf   the bundled default, fetched by pull.py
    store/NAME.json                           one manifest per imported model:
                                              {"version": 1, "name", "path", "format", "copied", "source"}
    store/files/NAME/...                      the files of a model copied in (`pull --copy`)

A local model is imported by reference (only the manifest is written: a 4 GB GGUF is not
duplicated); `--copy` copies it under store/files, into a temporary folder renamed in place once
complete, so an interrupted copy leaves no entry. A Hugging Face pull downloads into the
Hugging Face cache through huggingface_hub (where other tools find it too) and references it.
Models found in other tools' stores (edgeinfer.models.discover) are used where they lie and
never removed. This module alone writes under store/.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from edgeinfer.models.discover import FoundModel, discover, hf_cache_root
from edgeinfer.models.pull import PullError, cache_dir, default_model_path, pull

MANIFEST_VERSION = 1
DEFAULT_NAMES = ("smollm2-135m-instruct", "smollm2")  # the bundled default, by name
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_HUB_PREFIXES = ("hf://", "https://huggingface.co/", "http://huggingface.co/")
_HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/.+)?")
# What an HF folder needs to run: config, tokenizer, chat template, safetensors (never pickles).
_HUB_FOLDER_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


class StoreError(ValueError):
    """A name that leads nowhere, a corrupt manifest or blob, a hub out of reach: one sentence."""


def store_dir() -> Path:
    return cache_dir() / "store"


def model_format(path: Path) -> str:
    """"gguf", "hf" or "edgeinfer", read from the file (magic, config.json), never from its name."""
    from quant.gguf_reader import GGUF_MAGIC  # here: it imports torch, which `list` and --help need not

    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise StoreError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        return "gguf"
    config = path / "config.json"
    if not config.is_file():
        raise StoreError(f"{path} is neither a GGUF file nor a model folder with config.json")
    try:
        return "edgeinfer" if "edgeinfer_format" in json.loads(config.read_text()) else "hf"
    except (OSError, ValueError) as exc:
        raise StoreError(f"{config} is not readable JSON: {exc}") from exc


def _default_entry() -> FoundModel | None:
    path = default_model_path()
    return FoundModel(DEFAULT_NAMES[0], path, "store", copied=True) if path.is_file() else None


def read_manifest(manifest: Path) -> FoundModel:
    """A store entry from its manifest; a corrupt manifest or a missing model is its ``problem``."""
    try:
        data = json.loads(manifest.read_text())
        name, path, copied = str(data["name"]), Path(data["path"]), bool(data["copied"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        problem = f"store manifest {manifest} is unreadable or corrupt ({type(exc).__name__}: {exc})"
        return FoundModel(manifest.stem, manifest, "store", problem, manifest=manifest)
    problem = None
    if not path.exists():
        problem = (f"{path} (named by the store manifest {manifest}) is missing: moved or deleted? "
                   f"`edgeinfer rm {name}` forgets it")
    return FoundModel(name, path, "store", problem, copied, manifest)


def store_models() -> list[FoundModel]:
    entries = [read_manifest(m) for m in sorted(store_dir().glob("*.json"))]
    default = _default_entry()
    return entries if default is None else [default, *entries]


def all_models(env: Mapping[str, str] = os.environ) -> list[FoundModel]:
    """The store, then what other tools hold (a model the store already references listed once)."""
    stored = store_models()
    known = {m.path.resolve() for m in stored}
    return stored + [m for m in discover(env) if m.path.resolve() not in known]


def _find(name: str, models: list[FoundModel]) -> FoundModel | None:
    by_name = {}
    for model in reversed(models):  # the first of equal names wins: the store, then the lookup order
        by_name[model.name] = model
        if model.where == "ollama" and model.name.endswith(":latest"):
            by_name.setdefault(model.name.removesuffix(":latest"), model)  # ollama's own shorthand
    return by_name.get(name)


def _unknown(name: str, models: list[FoundModel]) -> StoreError:
    names = [*DEFAULT_NAMES, *(m.name for m in models)]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return StoreError(f"no model named {name!r}: {hint}`edgeinfer list` shows the models found, "
                      "`edgeinfer pull` adds one")


def resolve_model(arg: str, env: Mapping[str, str] = os.environ) -> Path:
    """--model's value: a path as it was, else a store name, a discovered name, or the default's."""
    path = Path(arg).expanduser()
    if path.exists():
        return path
    if arg in DEFAULT_NAMES:
        default = default_model_path()
        return default if default.is_file() else pull()
    models = all_models(env)
    model = _find(arg, models)
    if model is None:
        error = _unknown(arg, models)
        # Meant as a path, with no name like it (ORG/REPO names have slashes too): say so, as the loader does.
        if arg.startswith(("/", ".", "~")) or (arg.endswith(".gguf") and "did you mean" not in str(error)):
            raise FileNotFoundError(f"model not found: {arg}")
        raise error
    if model.problem:
        raise StoreError(model.problem)
    return model.path


def _derived_name(path: Path) -> str:
    stem = path.name.removesuffix(".gguf") if path.is_file() else path.name
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"


def _check_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name in DEFAULT_NAMES:
        raise StoreError(f"{name!r} cannot name a model: use letters, digits and . _ : - (and not "
                         f"{' or '.join(DEFAULT_NAMES)}, the bundled default)")
    return name


def _write_manifest(entry: dict[str, object]) -> Path:
    manifest = store_dir() / f"{entry['name']}.json"
    tmp = manifest.with_name(f".{manifest.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"version": MANIFEST_VERSION, **entry}, indent=1) + "\n")
    os.replace(tmp, manifest)
    return manifest


def _copy_in(src: Path, name: str, progress: bool) -> Path:
    """Copy a file or folder to store/files/NAME through a temporary folder renamed at the end."""
    from tqdm import tqdm

    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    dest_root = store_dir() / "files" / name
    tmp = dest_root.with_name(f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True,
                  desc=f"copying {name}", disable=not progress) as bar:
            for file in files:
                target = tmp / (file.name if file is src else file.relative_to(src))
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(file, "rb") as fin, open(target, "wb") as fout:
                    while chunk := fin.read(1 << 22):
                        fout.write(chunk)
                        bar.update(len(chunk))
                    os.fsync(fout.fileno())
        shutil.rmtree(dest_root, ignore_errors=True)
        os.replace(tmp, dest_root)
    except BaseException:  # an error or Ctrl-C: leave no partial copy behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest_root / src.name if src.is_file() else dest_root


def _source_of(manifest: Path) -> object:
    try:
        return json.loads(manifest.read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def import_model(path: Path, name: str | None = None, copy: bool = False, source: str | None = None,
                 progress: bool = True) -> FoundModel:
    """Add a local GGUF, HF folder or edgeinfer checkpoint to the store (by reference, or copied)."""
    path = path.expanduser().absolute()  # not resolved: an HF snapshot's link, not its hash-named blob
    fmt = model_format(path)
    name = _check_name(name or _derived_name(path))
    manifest = store_dir() / f"{name}.json"
    if manifest.exists():
        existing = read_manifest(manifest)
        if existing.path == path or existing.copied and _source_of(manifest) == str(path):
            return existing  # pulling the same model again changes nothing
        raise StoreError(f"the store already has a model named {name!r} ({existing.path}); "
                         "choose another with --name, or `edgeinfer rm` it first")
    store_dir().mkdir(parents=True, exist_ok=True)
    target = _copy_in(path, name, progress) if copy else path
    _write_manifest({"name": name, "path": str(target), "format": fmt, "copied": copy,
                     "source": source or str(path)})
    return read_manifest(manifest)


def hub_spec(spec: str) -> tuple[str, str | None] | None:
    """(repo id, file in it or None) of a Hugging Face reference; None if ``spec`` is not one."""
    for prefix in _HUB_PREFIXES:
        if spec.startswith(prefix):
            spec = re.sub(r"/(?:resolve|blob)/[^/]+/", "/", spec.removeprefix(prefix), count=1)
            break
    else:
        if not _HUB_REPO.fullmatch(spec):
            return None
    parts = spec.strip("/").split("/", 2)
    if len(parts) < 2:
        return None
    return f"{parts[0]}/{parts[1]}", parts[2] if len(parts) == 3 else None


def pull_hub(repo_id: str, filename: str | None, name: str | None, progress: bool,
             env: Mapping[str, str] = os.environ) -> FoundModel:
    """Download a GGUF (or an HF folder's config, tokenizer and safetensors) into the HF cache."""
    import huggingface_hub
    from huggingface_hub.utils import disable_progress_bars

    if not progress:
        disable_progress_bars()
    asked = f"{repo_id}/{filename}" if filename else repo_id
    cache = hf_cache_root(env)  # the folder `list` searches (huggingface_hub reads it once, at import)
    try:
        if filename:
            local = Path(huggingface_hub.hf_hub_download(repo_id, filename, cache_dir=cache))
        else:
            local = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=_HUB_FOLDER_FILES, cache_dir=cache))
    except (OSError, ValueError) as exc:  # every huggingface_hub error is one of these
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"could not fetch {asked} from the Hugging Face hub: {reason}") from None
    derived = _derived_name(local) if filename else repo_id.split("/")[-1].lower()
    return import_model(local, name or derived, source=f"hf://{asked}", progress=progress)


def pull_model(spec: str | None, name: str | None = None, copy: bool = False, progress: bool = True) -> FoundModel:
    """`edgeinfer pull`: the default (no spec or its name), a local path, or a Hugging Face reference."""
    if spec is None or spec in DEFAULT_NAMES:
        try:
            return FoundModel(DEFAULT_NAMES[0], pull(quiet=not progress), "store", copied=True)
        except PullError as exc:
            raise StoreError(str(exc)) from None
    path = Path(spec).expanduser()
    if path.exists():
        return import_model(path, name, copy, progress=progress)
    hub = hub_spec(spec)
    if hub is not None:
        return pull_hub(*hub, name, progress)
    raise _unknown(spec, all_models())


def remove_model(name: str, env: Mapping[str, str] = os.environ) -> FoundModel:
    """Forget a store entry; delete its files only when the store owns them (a copy, the default)."""
    entry = _find(name, store_models()) if name not in DEFAULT_NAMES else _default_entry()
    if entry is None and name in DEFAULT_NAMES:
        raise StoreError(f"the default model is not in the store ({default_model_path()}): nothing to remove")
    if entry is None:
        elsewhere = _find(name, discover(env))
        if elsewhere is not None:
            raise StoreError(f"{name} is not in edgeinfer's store: it lives in {elsewhere.where} at "
                             f"{elsewhere.path}; remove it with that tool")
        raise _unknown(name, all_models(env))
    if entry.copied:
        owned = entry.path if entry.manifest is None else store_dir() / "files" / entry.name
        if owned.is_dir():
            shutil.rmtree(owned)
        else:
            owned.unlink(missing_ok=True)
    if entry.manifest is not None:
        entry.manifest.unlink()
    return entry
