"""The edgeinfer checkpoint: a folder written atomically, read back fast (mmap).

Layout of a checkpoint folder::

    config.json            ModelConfig fields + "edgeinfer_format": {"name": "edgeinfer", "version": 1}
                           (+ "edgeinfer_plan": a budget plan, quant.budget)
    tokenizer.json         (+ tokenizer_config.json, generation_config.json, chat_template.jinja)
                           via Tokenizer.save
    model.safetensors      every tensor; its __metadata__ holds "format": "edgeinfer",
                           "format_version": "1" and, per weight NAME, a JSON string
                           {"format": "int4"|"int8"|"nf4"|"fp32"|"fp16"|"bf16", "shape": [...],
                            "group_size": g (quantized only)}

A QuantizedTensor NAME is stored as NAME.qweight, NAME.scales (and NAME.mins for int4 and int8 with offsets); a plain
tensor as NAME. The safetensors file is written by ``_SafetensorsWriter`` tensor by tensor (the
header space is reserved up front from the weight names and padded with spaces, which the
format allows), so peak memory is one tensor, not the model.

Atomicity: everything is written into a hidden temporary folder beside DST, fsynced, its
header re-read and checked, then renamed onto DST. A run killed at any point leaves the old DST
(or none) plus at worst a stale ``.NAME.tmp-PID`` folder, which the next save removes. With
``force`` an existing checkpoint is moved aside, the new one renamed in, the old one deleted.
This module is the only writer of checkpoint folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from edgeinfer.config import ModelConfig
from quant.formats import QuantizedTensor
from quant.gguf_import import ModelFileError, check_weights

FORMAT_NAME = "edgeinfer"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
_RESERVED_KEYS = ("format", "format_version")


class TokenizerFiles(Protocol):
    """What a checkpoint needs of a tokenizer (edgeinfer.models.tokenizer.Tokenizer, which sits
    above this file format and is loaded from the folder by the model loader)."""

    def save(self, folder: str | Path) -> None: ...
_DTYPES = {  # torch dtype <-> safetensors dtype name <-> our plain format name
    torch.float32: ("F32", "fp32"),
    torch.float16: ("F16", "fp16"),
    torch.bfloat16: ("BF16", "bf16"),
    torch.int8: ("I8", None),
    torch.uint8: ("U8", None),
    torch.int32: ("I32", None),
}
_PLAIN_FORMATS = {fmt: dtype for dtype, (_, fmt) in _DTYPES.items() if fmt}

Weight = torch.Tensor | QuantizedTensor


class CheckpointError(ModelFileError):
    """A checkpoint that cannot be written or read: wrong format/version, corrupt, unwritable DST."""


def _parts(name: str, weight: Weight) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """Per-weight metadata and the stored tensors it becomes."""
    if isinstance(weight, QuantizedTensor):
        meta = {"format": weight.format, "shape": list(weight.shape), "group_size": weight.group_size}
        parts = [(f"{name}.qweight", weight.qweight), (f"{name}.scales", weight.scales)]
        if weight.mins is not None:
            parts.append((f"{name}.mins", weight.mins))
        return meta, parts
    if weight.dtype not in _PLAIN_FORMATS.values():
        raise CheckpointError(f"tensor {name} has dtype {weight.dtype}; plain weights must be fp32/fp16/bf16")
    return {"format": _DTYPES[weight.dtype][1], "shape": list(weight.shape)}, [(name, weight)]


def _header_reserve(names: Iterable[str]) -> int:
    # Per weight: up to three tensor entries (~110 bytes + name each) and one metadata entry.
    return 4096 + sum(600 + 5 * len(n) for n in names)


class _SafetensorsWriter:
    """Writes a safetensors file tensor by tensor: [u64 header length][JSON header][raw bytes]."""

    def __init__(self, f: BinaryIO, weight_names: list[str]) -> None:
        self.f = f
        self.header_len = _header_reserve(weight_names)
        self.entries: dict[str, dict[str, Any]] = {}
        self.metadata: dict[str, str] = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}
        self.offset = 0
        f.seek(8 + self.header_len)

    def add(self, name: str, weight: Weight) -> None:
        if name in _RESERVED_KEYS or name in self.metadata:
            raise CheckpointError(f"weight name {name!r} is reserved or already written")
        meta, parts = _parts(name, weight)
        for part_name, tensor in parts:
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.dtype not in _DTYPES:
                raise CheckpointError(f"tensor {part_name} has unsupported dtype {tensor.dtype}")
            data = tensor.reshape(-1).view(torch.uint8).numpy()  # no copy: written from the buffer
            self.f.write(data.data)
            self.entries[part_name] = {
                "dtype": _DTYPES[tensor.dtype][0],
                "shape": list(tensor.shape),
                "data_offsets": [self.offset, self.offset + data.nbytes],
            }
            self.offset += data.nbytes
        self.metadata[name] = json.dumps(meta)

    def finish(self) -> None:
        header = json.dumps({"__metadata__": self.metadata, **self.entries}, separators=(",", ":")).encode()
        assert len(header) <= self.header_len, (
            f"header {len(header)} B overflows its reserve {self.header_len} B"
        )
        self.f.seek(0)
        self.f.write(struct.pack("<Q", self.header_len) + header + b" " * (self.header_len - len(header)))
        self.f.flush()
        os.fsync(self.f.fileno())


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """(header dict, data start) of a safetensors file, checking every offset lies inside it."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, no safetensors header")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise CheckpointError(f"{path} is truncated: header of {header_len} B but file of {size} B")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {exc}") from exc
    data_start = 8 + header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        end = entry["data_offsets"][1]
        if data_start + end > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name} ends at byte {data_start + end}, file has {size}"
            )
    return header, data_start


def _check_format(source: str, found: Any, version: Any) -> None:
    if found != FORMAT_NAME or str(version) != str(FORMAT_VERSION):
        raise CheckpointError(
            f"{source}: expected format {FORMAT_NAME!r} version {FORMAT_VERSION}, "
            f"found format {found!r} version {version!r}"
        )


def _verify(path: Path, names: list[str]) -> None:
    header, _ = read_header(path)
    meta = header.get("__metadata__", {})
    _check_format(str(path), meta.get("format"), meta.get("format_version"))
    missing = [n for n in names if n not in meta]
    if missing:
        raise CheckpointError(f"{path}: written header lacks {missing[:3]}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(dst: Path) -> None:
    """Delete temporary folders of earlier saves to DST whose process is gone."""
    for tmp in dst.parent.glob(f".{dst.name}.tmp-*"):
        with contextlib.suppress(ValueError):
            pid = int(tmp.name.rsplit("-", 1)[1])
            try:
                os.kill(pid, 0)
                alive = pid != os.getpid()
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
            if not alive:
                shutil.rmtree(tmp, ignore_errors=True)


def is_checkpoint(path: Path) -> bool:
    try:
        return "edgeinfer_format" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def check_destination(dst: str | os.PathLike[str], force: bool) -> Path:
    """Fail early (before any work) if DST exists without force, is not ours, or is unwritable."""
    dst = Path(dst).absolute()
    if dst.exists():
        if not force:
            raise FileExistsError(f"{dst} already exists; pass --force to overwrite it")
        if not dst.is_dir() or (any(dst.iterdir()) and not is_checkpoint(dst)):
            raise FileExistsError(f"{dst} exists and is not an edgeinfer checkpoint: refusing to replace it")
    check_writable_folder(dst, CheckpointError)
    return dst


def check_writable_folder(dst: Path, error: type[Exception]) -> None:
    """Raise ``error`` naming DST unless its folder exists and can be written."""
    if not dst.parent.is_dir():
        raise error(f"cannot write {dst}: folder {dst.parent} does not exist")
    if not os.access(dst.parent, os.W_OK):
        raise error(f"cannot write {dst}: folder {dst.parent} is read-only")


def save_checkpoint(
    dst: str | os.PathLike[str],
    config: ModelConfig,
    tokenizer: TokenizerFiles,
    weights: Iterable[tuple[str, Weight]],
    weight_names: list[str],
    *,
    force: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically. ``weights`` may be a generator (consumed once, streamed);
    ``weight_names`` lists every name it will yield (used to reserve the header); ``extra_config``
    adds keys to config.json (a budget plan: "edgeinfer_plan")."""
    dst = check_destination(dst, force)
    _remove_stale(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    try:
        try:
            tmp.mkdir()
        except OSError as exc:
            raise CheckpointError(
                f"cannot write {dst}: {dst.parent} is not writable ({exc.strerror})"
            ) from exc
        config_data = {
            **config.to_dict(),
            "edgeinfer_format": {"name": FORMAT_NAME, "version": FORMAT_VERSION},
            **(extra_config or {}),
        }
        (tmp / "config.json").write_text(json.dumps(config_data, indent=1))
        tokenizer.save(tmp)
        written: list[str] = []
        with open(tmp / WEIGHTS_FILE, "wb") as f:
            writer = _SafetensorsWriter(f, weight_names)
            for name, weight in weights:
                writer.add(name, weight)
                written.append(name)
            writer.finish()
        if sorted(written) != sorted(weight_names):
            raise CheckpointError(f"wrote {len(written)} weights but {len(weight_names)} were announced")
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        _verify(tmp / WEIGHTS_FILE, written)
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        if dst.exists():
            os.rename(dst, old)
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Weight]]:
    """Read a checkpoint folder (weights through safetensors' mmap); checks format and version."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        config_data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable config.json: {exc}") from exc
    fmt = config_data.get("edgeinfer_format") or {}
    _check_format(f"{path}/config.json", fmt.get("name"), fmt.get("version"))
    config = ModelConfig.from_dict(config_data)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise CheckpointError(f"{path} has no {WEIGHTS_FILE}")
    read_header(file)  # names truncation precisely before safetensors does
    weights: dict[str, Weight] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            _check_format(str(file), meta.get("format"), meta.get("format_version"))
            for name, value in meta.items():
                if name in _RESERVED_KEYS:
                    continue
                weights[name] = _read_weight(f, name, json.loads(value), str(file))
    except SafetensorError as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
    check_weights(weights, config, str(path))
    return config, weights


def _read_weight(f: Any, name: str, meta: dict[str, Any], source: str) -> Weight:
    fmt = meta.get("format")
    shape = tuple(meta.get("shape", ()))
    if fmt in _PLAIN_FORMATS:
        t = f.get_tensor(name)
        if t.dtype != _PLAIN_FORMATS[fmt] or tuple(t.shape) != shape:
            raise CheckpointError(
                f"{source}: tensor {name} is recorded as {fmt} {list(shape)} but stored as "
                f"{t.dtype} {list(t.shape)}"
            )
        return t
    if fmt not in ("int8", "int4", "nf4"):
        raise CheckpointError(f"{source}: tensor {name} has unknown format {fmt!r}")
    # int4 always has mins; int8 from a GGUF Q5_1/Q5_K does (a key only safetensors can answer for).
    mins = f.get_tensor(f"{name}.mins") if fmt == "int4" or f"{name}.mins" in f.keys() else None
    try:
        return QuantizedTensor(
            fmt,
            shape,
            int(meta["group_size"]),
            f.get_tensor(f"{name}.qweight"),
            f.get_tensor(f"{name}.scales"),
            mins,
        )
    except ValueError as exc:
        raise CheckpointError(f"{source}: tensor {name} ({fmt}): {exc}") from exc
