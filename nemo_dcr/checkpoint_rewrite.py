"""Write tensors back in the shape of the checkpoint they came from (what ``nemo-dcr apply`` writes).

Only the checkpoint's own files are written, each through a temp file of a unique name renamed
into place (:func:`nemo_dcr.checkpoint.atomic_write`); nothing else in the destination is read,
changed or removed. An in-place rewrite of a Hugging Face folder therefore keeps its config,
tokenizer and any other files, and every file keeps its ``__metadata__``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from nemo_dcr.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    atomic_write,
    checkpoint_files,
    file_writer,
    read_metadata,
    write_file,
)


def rewrite_checkpoint(tensors: Mapping[str, torch.Tensor], like: str | os.PathLike,
                       out: str | os.PathLike) -> list[Path]:
    """Write ``tensors`` to ``out`` with the file layout and ``__metadata__`` of checkpoint ``like``.

    Args:
        tensors: every tensor of ``like`` (same names).
        like: the checkpoint the tensors came from (file or Hugging Face folder).
        out: ``*.safetensors``: one file with the metadata of ``like``'s first file; otherwise a
            folder (created) that gets ``like``'s files: ``model.safetensors``, or the same shards
            and the same index. ``out`` may be ``like`` itself.

    Returns:
        The files written.

    Raises:
        CheckpointError: ``out`` holds an index that would take precedence over the written file
            (checked before anything is written).
    """
    files = checkpoint_files(like)
    first = read_metadata(next(iter(files)))
    out = Path(out)
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, tensors, first)
        return [out]
    index = Path(like) / INDEX_FILE
    if not (Path(like).is_dir() and index.is_file()):
        if (out / INDEX_FILE).exists():
            raise CheckpointError(f"{out}: holds {INDEX_FILE}, which would take precedence over the "
                                  f"{SINGLE_FILE} this writes; choose another output or remove the index")
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / SINGLE_FILE, tensors, first)
        return [out / SINGLE_FILE]
    out.mkdir(parents=True, exist_ok=True)
    writes = {out / f.name: file_writer({n: tensors[n] for n in names}, read_metadata(f))
              for f, names in files.items()}
    if index.resolve() != (out / INDEX_FILE).resolve():
        data = index.read_bytes()
        writes[out / INDEX_FILE] = lambda f: f.write(data)
    atomic_write(writes)  # every shard is written before the first one is renamed into place
    return list(writes)
