"""Safetensors checkpoints: files read and written by the ``safetensors`` package, folders by us.

A checkpoint is one ``.safetensors`` file or a Hugging Face folder with ``model.safetensors`` or
shards ``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (``weight_map``).
The ``safetensors`` package parses and validates every file (header, dtypes, offsets that tile
the buffer) and writes it (8-byte aligned header, wider element types first); this module adds the
folder layout, the index checks, atomic writes and errors: every failure raises a
:class:`CheckpointError` subclass naming the file (and the tensor, where known) at fault.
Loading memory-maps files copy-on-write: tensors share pages with the file, writes stay private.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.int64: "I64", torch.uint64: "U64", torch.float64: "F64",
}
"""torch dtype -> safetensors dtype string, for every dtype a checkpoint may hold."""


class CheckpointError(ValueError):
    """Base class of every checkpoint read/write failure."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file or directory (or a shard named by the index) does not exist."""


class MissingTensorError(CheckpointError, KeyError):
    """A requested tensor, or one the index names, is not where it should be."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class HeaderError(CheckpointError):
    """A file's header is truncated, too long, not JSON, or has a malformed entry; or the index is."""


class UnknownDtypeError(CheckpointError):
    """A tensor's dtype is not one a safetensors checkpoint holds (:data:`DTYPE_NAMES`)."""


class OffsetError(CheckpointError):
    """Data offsets are out of bounds, overlap, leave holes, or disagree with the shape."""


_ERROR_KINDS = ((UnknownDtypeError, ("unknown variant",)),
                (OffsetError, ("offset", "not fully covered")))
"""Words of the ``safetensors`` package's messages -> the error class they are raised as."""


def _file_error(path: Path, exc: Exception) -> CheckpointError:
    """The package's error about file ``path`` as a :class:`CheckpointError` naming the file."""
    text = str(exc).removeprefix("Error while deserializing header: ")
    kind = next((cls for cls, words in _ERROR_KINDS if any(w in text for w in words)), HeaderError)
    return kind(f"{path}: not a valid safetensors file: {text}")


def _open(path: Path):
    """``safetensors.safe_open`` of an existing file, its errors raised as :class:`CheckpointError`."""
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: safetensors file not found")
    try:
        return safetensors.safe_open(path, framework="pt")
    except safetensors.SafetensorError as exc:
        raise _file_error(path, exc) from None


def checkpoint_files(path: str | os.PathLike) -> dict[Path, list[str] | None]:
    """Map each file of a checkpoint to the names it holds (``None``: all of them)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return {path: None}
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: checkpoint directory (or .safetensors) not found")
    index = path / INDEX_FILE
    if index.is_file():
        return _read_index(index)
    if (path / SINGLE_FILE).is_file():
        return {path / SINGLE_FILE: None}
    raise CheckpointNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _read_index(index: Path) -> dict[Path, list[str]]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise HeaderError(f"{index}: not a valid index with a weight_map ({exc!r})") from None
    files: dict[Path, list[str]] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or Path(fname).name != fname:
            raise HeaderError(f"{index}: tensor {name!r} maps to invalid file name {fname!r}")
        files.setdefault(index.parent / fname, []).append(name)
    return dict(sorted(files.items()))


def _opened(file: Path, listed: list[str] | None):
    """The open file and its names in data-offset order; every name the index put there must be there."""
    if listed is not None and not file.is_file():
        raise CheckpointNotFoundError(f"{file}: shard not found (the index puts {len(listed)} tensor(s) there, "
                                      f"e.g. {listed[0]!r})")
    f = _open(file)
    names = list(f.offset_keys())
    if listed is not None:
        missing = sorted(set(listed) - set(names))
        if missing:
            raise MissingTensorError(f"{file}: tensor {missing[0]!r} is named by the index but not in this file")
        keep = set(listed)
        names = [n for n in names if n in keep]
    return f, names


def load_checkpoint(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Load tensors from a ``.safetensors`` file or an HF checkpoint directory.

    Args:
        path: a ``.safetensors`` file, or a directory with ``model.safetensors`` or an index.
        names: load only these tensors (default: all).

    Returns:
        ``{name: tensor}`` of contiguous CPU tensors, in file order (shards in file-name order,
        then data offset). Tensors share memory with the file copy-on-write.

    Raises:
        CheckpointError: a subclass naming the file and tensor at fault.
    """
    wanted = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    found: set[str] = set()
    for file, listed in checkpoint_files(path).items():
        if wanted is not None and listed is not None and wanted.isdisjoint(listed):
            found.update(listed)
            continue
        f, here = _opened(file, listed)
        found.update(here)
        with f:
            out.update({n: f.get_tensor(n) for n in here if wanted is None or n in wanted})
    if wanted is not None and wanted - found:
        raise MissingTensorError(f"{path}: no tensor(s) {sorted(wanted - found)}")
    return out


def list_tensors(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (safetensors dtype string, shape)}`` of a checkpoint, reading only headers."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file, listed in checkpoint_files(path).items():
        f, here = _opened(file, listed)
        with f:
            for n in here:
                part = f.get_slice(n)
                out[n] = (part.get_dtype(), tuple(part.get_shape()))
    return out


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """``__metadata__`` of a file (or of the first file of a directory checkpoint); ``{}`` if none."""
    with _open(next(iter(checkpoint_files(path)))) as f:
        return dict(f.metadata() or {})


def save_checkpoint(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, max_shard_bytes: int | None = None,
                    metadata: Mapping[str, str] | None = None) -> list[Path]:
    """Write tensors as safetensors, each file through :func:`atomic_write`.

    Args:
        tensors: ``{name: tensor}``; any device, made contiguous on CPU before writing.
        path: ``*.safetensors`` for one file; otherwise a directory (created) that gets
            ``model.safetensors``, or shards plus ``model.safetensors.index.json`` when
            ``max_shard_bytes`` is set.
        max_shard_bytes: shard size bound (a tensor larger than it gets a shard of its own).
        metadata: ``__metadata__`` strings; default ``{"format": "pt"}`` (what HF expects).

    Returns:
        The files written (safetensors files, then the index if any).

    Raises:
        UnknownDtypeError: a tensor of a dtype safetensors does not hold (nothing written).
    """
    path = Path(path)
    meta = {"format": "pt"} if metadata is None else dict(metadata)
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise UnknownDtypeError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, tensors, meta)
        return [path]
    path.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        write_file(path / SINGLE_FILE, tensors, meta)
        (path / INDEX_FILE).unlink(missing_ok=True)  # a stale index would take precedence
        return [path / SINGLE_FILE]
    return _write_shards(path, tensors, max_shard_bytes, meta)


def _write_shards(directory: Path, tensors: Mapping[str, torch.Tensor], max_bytes: int,
                  meta: dict[str, str]) -> list[Path]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += _nbytes(t)
    n = len(shards)
    written, weight_map = [], {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        write_file(directory / fname, shard, meta)
        weight_map.update(dict.fromkeys(shard, fname))
        written.append(directory / fname)
    total = sum(_nbytes(t) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write({directory / INDEX_FILE: lambda f: f.write(json.dumps(index, indent=2).encode())})
    return written + [directory / INDEX_FILE]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_file(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> None:
    """One safetensors file, written through :func:`atomic_write`."""
    atomic_write({Path(path): file_writer(tensors, meta)})


def file_writer(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> Callable:
    """``write(binary_file)`` of one safetensors file (``safetensors.torch.save``: wider element
    types first, so every tensor is aligned; tensors sharing memory are written as copies)."""
    held, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        held[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return lambda f: f.write(safetensors.torch.save(held, dict(meta) or None))


def atomic_write(writes: Mapping[Path, Callable]) -> None:
    """Write files through temp files of unique names in their folders, then rename them into place.

    Every file is written before the first rename, so a reader (or a crash) sees old files or
    new ones, never a partial one. On any failure every temp file is removed and no target is
    touched. Two writers of the same target never share a temp file (the last rename wins).

    Args:
        writes: target path -> ``write(binary_file)``.

    Raises:
        IsADirectoryError: a target is a folder (checked before anything is written).
    """
    for path in writes:
        if Path(path).is_dir():
            raise IsADirectoryError(21, "is a folder; a file path is needed", str(path))
    temps: dict[Path, str] = {}
    try:
        for path, write in writes.items():
            path = Path(path)
            fd, temps[path] = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.chmod(temps[path], 0o644)
        for path in list(temps):
            os.replace(temps[path], path)
            del temps[path]
    finally:
        for tmp in temps.values():
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
