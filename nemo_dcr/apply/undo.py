"""The undo log of a transaction: old bits of every element written, in memory up to a bound,
spilled to a temporary file beyond it.

A delta writes nnz elements (the log keeps 2 B per changed bf16 element, plus a reference to the
positions, which the decoded payload holds anyway; the transaction hands it the old bits its decode
read, so nothing is read twice); a resync overwrites whole tensors (the log
keeps the whole old tensor). Old bits beyond ``limit_bytes`` go to an unnamed-on-close temporary
file in pieces of ``SPILL_PIECE`` elements (copied to the host first for device tensors), so the
log's memory is at most ``limit_bytes`` plus one piece, whatever the transaction's size.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.kernels import read_bits, write_bits
from nemo_dcr.kernels.inplace import count_of, width_of
from nemo_dcr.kernels.traffic import to_device, to_host

UNDO_MEMORY_BYTES = 256 << 20
"""Default bound of old bits held in memory (the default ``dcr.bucket_size_mb`` of one part)."""
SPILL_PIECE = 1 << 20
"""Elements read, written to or read back from the spill file at a time."""


@dataclass
class _Entry:
    view: torch.Tensor | np.ndarray  # integer view written (a numpy bit array for host memory)
    pos: torch.Tensor | np.ndarray | None  # flat positions written; None: the whole view
    old: torch.Tensor | np.ndarray | None  # old bits in memory (host arrays stay on the host); None: spilled
    offset: int = 0  # byte offset of the spilled old bits
    count: int = 0


class UndoLog:
    """Old bits of every element a transaction wrote (see the module docstring).

    Args:
        limit_bytes: old bits held in memory at most; the rest is spilled.
        spill_dir: folder of the spill file (default: the system's temporary folder).
    """

    def __init__(self, limit_bytes: int = UNDO_MEMORY_BYTES, spill_dir: str | None = None):
        self.limit_bytes = limit_bytes
        self.spill_dir = spill_dir
        self._entries: list[_Entry] = []
        self._file = None
        self.held_bytes = 0
        self.spilled_bytes = 0

    def scatter(self, view: torch.Tensor | np.ndarray, pos: torch.Tensor | np.ndarray, new, old: np.ndarray | None = None) -> None:
        """``view[pos] = new`` after saving the bits ``view`` holds at ``pos``.

        Args:
            view: integer view written, or the numpy bits of a host tensor.
            pos: flat positions in it (numpy or torch).
            new: the bits to write (numpy or torch, the view's width).
            old: the bits ``view`` holds at ``pos`` when the caller read them already under the
                same write guard (the transaction's decode did): kept instead of read again.
        """
        self.save(view, pos, old)
        write_bits(view, pos, new)

    def save(self, view: torch.Tensor | np.ndarray, pos: torch.Tensor | np.ndarray, old: np.ndarray | None = None) -> None:
        """What :meth:`scatter` saves before it writes (the bits ``view`` holds at ``pos``, or
        ``old``); the caller writes ``pos`` after (worker threads do, for several tensors at once)."""
        count = count_of(pos)
        nbytes = count * width_of(view)
        if self.held_bytes + nbytes <= self.limit_bytes:
            self._entries.append(_Entry(view, pos, read_bits(view, pos) if old is None else np.ascontiguousarray(old)))
            self.held_bytes += nbytes
        else:
            pieces = (read_bits(view, pos[s : s + SPILL_PIECE]) if old is None else old[s : s + SPILL_PIECE]
                      for s in range(0, count, SPILL_PIECE))
            self._entries.append(self._spill(view, pos, pieces, count))

    def overwrite(self, view: torch.Tensor, new: torch.Tensor) -> None:
        """``view[:] = new`` (flat) after saving the whole tensor."""
        nbytes = view.numel() * view.element_size()
        if self.held_bytes + nbytes <= self.limit_bytes:
            self._entries.append(_Entry(view, None, view.clone()))
            self.held_bytes += nbytes
        else:
            flat = view.reshape(-1)
            pieces = (flat[s : s + SPILL_PIECE] for s in range(0, flat.numel(), SPILL_PIECE))
            self._entries.append(self._spill(view, None, pieces, flat.numel()))
        view.copy_(new.reshape(view.shape))

    def _spill(self, view: torch.Tensor, pos, pieces, count: int) -> _Entry:
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.spill_dir, prefix="nemo_dcr_undo_")
        offset = self._file.seek(0, os.SEEK_END)
        for piece in pieces:
            host = piece if isinstance(piece, np.ndarray) else to_host(piece).contiguous().numpy()
            self._file.write(np.ascontiguousarray(host).tobytes())
        self.spilled_bytes += count * width_of(view)
        return _Entry(view, pos, None, offset, count)

    def _spilled(self, e: _Entry, start: int, stop: int) -> torch.Tensor:
        width = width_of(e.view)
        self._file.seek(e.offset + start * width)
        raw = np.frombuffer(self._file.read((stop - start) * width), dtype=f"<i{width}" if width > 1 else "u1")
        if isinstance(e.view, np.ndarray):
            return raw.copy()
        return to_device(raw.copy(), e.view.device).view(e.view.dtype)

    def rollback(self) -> None:
        """Restore every saved element, newest first; then :meth:`close`."""
        for e in reversed(self._entries):
            if e.old is not None:
                (e.view.copy_(e.old) if e.pos is None else write_bits(e.view, e.pos, e.old))
                continue
            for s in range(0, e.count, SPILL_PIECE):
                old = self._spilled(e, s, min(s + SPILL_PIECE, e.count))
                if e.pos is None:
                    e.view.reshape(-1)[s : s + old.numel()].copy_(old)
                else:
                    write_bits(e.view, e.pos[s : s + count_of(old)], old)
        self.close()

    def close(self) -> None:
        """Forget the log (the transaction committed, or was rolled back); removes the spill file."""
        self._entries.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        self.held_bytes = self.spilled_bytes = 0

    @property
    def nbytes(self) -> int:
        """Old bits held in memory (positions are the arrays the writes used, referred to, not copied)."""
        return self.held_bytes
