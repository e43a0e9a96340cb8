"""Safetensors checkpoints, read and written without the ``safetensors`` package.

File format (https://github.com/huggingface/safetensors, implemented here directly):

* 8 bytes: ``N``, the header length, unsigned little-endian 64-bit integer.
* ``N`` bytes: a UTF-8 JSON object ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``
  with an optional ``"__metadata__"`` entry (a ``str -> str`` object). Writers pad it with
  spaces so that the data starts 8-byte aligned.
* The byte buffer: raw little-endian tensor data; offsets are relative to its start. Every
  byte belongs to exactly one tensor (no overlaps, no holes).

A checkpoint is one ``.safetensors`` file or an HF directory with ``model.safetensors`` or
shards ``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (``weight_map``).
Loading memory-maps files copy-on-write: tensors share pages with the file, writes stay private.
Every failure raises a :class:`CheckpointError` subclass naming the file and tensor at fault.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nemo_dcr.types import CARRIER_NP, CARRIER_TORCH

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Headers longer than this are rejected (same limit as the reference implementation)."""

# safetensors dtype string -> (torch dtype, bytes per element)
DTYPE_TABLE: dict[str, tuple[torch.dtype, int]] = {
    **{"BOOL": (torch.bool, 1), "U8": (torch.uint8, 1), "I8": (torch.int8, 1)},
    **{"F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1)},
    **{"I16": (torch.int16, 2), "U16": (torch.uint16, 2), "F16": (torch.float16, 2)},
    **{"BF16": (torch.bfloat16, 2), "I32": (torch.int32, 4), "U32": (torch.uint32, 4)},
    **{"F32": (torch.float32, 4), "I64": (torch.int64, 8), "U64": (torch.uint64, 8)},
    "F64": (torch.float64, 8),
}
DTYPE_NAMES = {t: name for name, (t, _) in DTYPE_TABLE.items()}
"""torch dtype -> safetensors dtype string."""
# numpy carrier with the right width; torch reinterprets the bits with .view(dtype)

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("nemo_dcr.checkpoint supports little-endian hosts only")


class CheckpointError(ValueError):
    """Base class of every checkpoint read/write failure."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file or directory (or a shard named by the index) does not exist."""


class MissingTensorError(CheckpointError, KeyError):
    """A requested tensor, or one the index names, is not where it should be."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class HeaderError(CheckpointError):
    """The header is truncated, too long, not JSON, or has a malformed entry."""


class UnknownDtypeError(CheckpointError):
    """An entry's dtype is not one of :data:`DTYPE_TABLE`."""


class OffsetError(CheckpointError):
    """Data offsets are out of bounds, overlap, leave holes, or disagree with the shape."""


@dataclass(frozen=True)
class TensorEntry:
    """One validated header entry; ``[begin, end)`` is relative to the byte buffer."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class FileHeader:
    """Parsed header of one file: entries in data-offset order, ``__metadata__`` or ``{}``."""

    path: Path
    data_start: int  # absolute file offset of the byte buffer (8 + N)
    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str]


def read_header(path: str | os.PathLike) -> FileHeader:
    """Parse and validate the header of one ``.safetensors`` file (reads no tensor data)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: safetensors file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{path}: {size}-byte file is shorter than the header length field")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise HeaderError(f"{path}: header length {n} exceeds the file ({size} bytes) or limit")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"{path}: header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = _parse_metadata(path, header.pop("__metadata__", None))
    entries = [_parse_entry(path, name, value) for name, value in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    _check_coverage(path, entries, size - 8 - n)
    return FileHeader(path, 8 + n, tuple(entries), metadata)


def _parse_metadata(path: Path, meta) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise HeaderError(f"{path}: __metadata__ must be an object of string -> string")
    return dict(meta)


def _parse_entry(path: Path, name: str, value) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(value, dict) or not {"dtype", "shape", "data_offsets"} <= value.keys():
        raise HeaderError(f"{where}: entry needs dtype, shape and data_offsets, got {value!r}")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in DTYPE_TABLE:
        raise UnknownDtypeError(f"{where}: unknown dtype {dtype!r}; known: {sorted(DTYPE_TABLE)}")
    if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
        raise HeaderError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_uint, offsets)):
        raise HeaderError(f"{where}: data_offsets must be [begin, end], got {offsets!r}")
    begin, end = offsets
    numel = 1
    for s in shape:
        numel *= s
    if end < begin or end - begin != numel * DTYPE_TABLE[dtype][1]:
        raise OffsetError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes but "
            f"{dtype}{shape} needs {numel * DTYPE_TABLE[dtype][1]}"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _is_uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_coverage(path: Path, entries: list[TensorEntry], buffer_len: int) -> None:
    """Entries (sorted by offset) must tile ``[0, buffer_len)`` exactly."""
    cursor, prev = 0, None
    for e in entries:
        if e.begin < cursor:
            raise OffsetError(f"{path}: tensor {e.name!r} {[e.begin, e.end]} overlaps {prev!r}")
        if e.begin > cursor:
            raise OffsetError(f"{path}: hole of {e.begin - cursor} bytes before tensor {e.name!r}")
        if e.end > buffer_len:
            raise OffsetError(
                f"{path}: tensor {e.name!r} ends at {e.end}, past the {buffer_len}-byte buffer"
            )
        cursor, prev = e.end, e.name
    if cursor != buffer_len:
        raise OffsetError(f"{path}: {buffer_len - cursor} trailing bytes belong to no tensor")


def _load_file(header: FileHeader, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Tensors ``names`` (validated) of one file, in file order, sharing the file's pages."""
    wanted = set(names)
    size = header.entries[-1].end if header.entries else 0
    mm = np.memmap(header.path, np.uint8, "c", header.data_start, (size,)) if size else None
    return {e.name: _tensor_from_buffer(mm, e) for e in header.entries if e.name in wanted}


def _tensor_from_buffer(mm: np.ndarray | None, e: TensorEntry) -> torch.Tensor:
    dtype, width = DTYPE_TABLE[e.dtype]
    if e.end == e.begin:
        return torch.empty(e.shape, dtype=dtype)
    raw = mm[e.begin : e.end]
    if e.begin % width:  # misaligned (foreign writer): copy into an aligned buffer
        raw = np.array(raw)
    carrier = torch.from_numpy(raw.view(CARRIER_NP[width]))
    return carrier.view(dtype).reshape(e.shape)


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


def load_checkpoint(
    path: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
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
        header = _read_listed(file, listed)
        here = _names(header) if listed is None else listed
        found.update(here)
        take = here if wanted is None else [n for n in here if n in wanted]
        if take:
            out.update(_load_file(header, take))
    if wanted is not None and wanted - found:
        raise MissingTensorError(f"{path}: no tensor(s) {sorted(wanted - found)}")
    return out


def _names(header: FileHeader) -> list[str]:
    return [e.name for e in header.entries]


def _read_listed(file: Path, listed: list[str] | None) -> FileHeader:
    """Header of ``file``; every name the index assigned to it must be there."""
    if listed is not None and not file.is_file():
        raise CheckpointNotFoundError(
            f"{file}: shard not found (the index puts {len(listed)} tensor(s) there, "
            f"e.g. {listed[0]!r})"
        )
    header = read_header(file)
    if listed is not None:
        have = set(_names(header))
        for name in listed:
            if name not in have:
                raise MissingTensorError(
                    f"{file}: tensor {name!r} is named by the index but not in this file"
                )
    return header


def list_tensors(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (safetensors dtype string, shape)}`` of a checkpoint, reading only headers."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file, listed in checkpoint_files(path).items():
        header = _read_listed(file, listed)
        keep = None if listed is None else set(listed)
        for e in header.entries:
            if keep is None or e.name in keep:
                out[e.name] = (e.dtype, e.shape)
    return out


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """``__metadata__`` of a file (or of the first file of a directory checkpoint)."""
    return read_header(next(iter(checkpoint_files(path)))).metadata


def save_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write tensors as safetensors.

    Within a file wider element types come first (stable otherwise), so every tensor is
    aligned and loads zero-copy. Files are written under a temporary name, then renamed.

    Args:
        tensors: ``{name: tensor}``; any device, made contiguous on CPU before writing.
        path: ``*.safetensors`` for one file; otherwise a directory (created) that gets
            ``model.safetensors``, or shards plus ``model.safetensors.index.json`` when
            ``max_shard_bytes`` is set.
        max_shard_bytes: shard size bound (a tensor larger than it gets a shard of its own).
        metadata: ``__metadata__`` strings; default ``{"format": "pt"}`` (what HF expects).

    Returns:
        The files written (safetensors files, then the index if any).
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


def _write_shards(
    directory: Path, tensors: Mapping[str, torch.Tensor], max_bytes: int, meta: dict[str, str]
) -> list[Path]:
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


def _serialize_header(tensors: Mapping[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": meta} if meta else {}
    offset = 0
    for name, t in tensors.items():
        nbytes = _nbytes(t)
        where = [offset, offset + nbytes]
        header[name] = dict(dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), data_offsets=where)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> None:
    """One safetensors file, written through :func:`atomic_write`."""
    atomic_write({Path(path): file_writer(tensors, meta)})


def file_writer(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> Callable:
    """``write(binary_file)`` of one safetensors file (wider element types first, so all align)."""
    ordered = {n: tensors[n] for n in sorted(tensors, key=lambda n: -tensors[n].element_size())}

    def write(f) -> None:
        f.write(_serialize_header(ordered, dict(meta)))
        for t in ordered.values():
            if t.numel():
                f.write(_raw_bytes(t))

    return write


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


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(CARRIER_TORCH[flat.element_size()]).numpy()).cast("B")
