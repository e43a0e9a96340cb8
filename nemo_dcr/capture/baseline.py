"""The trainer-side baseline: the bits the inference engine currently holds, per local param.

Capture compares live params against this store through integer views.  The store only moves
forward when the engine acknowledged a version (:meth:`BaselineStore.commit`), so a refit that
was skipped or failed leaves the baseline where it was and the next capture reports every
change since the last acknowledged version: changes accumulate, nothing is lost.

Backends (``backend=``):
    ``"device"``: a clone on the param's own device (GPU memory on a GPU trainer; fastest).
    ``"pinned"``: host memory, page-locked when CUDA is available (fast device<->host copies);
        on a machine without CUDA it is ordinary host memory (``pinned`` reports which).
    ``"file"``: numpy memmaps in ``directory`` (one ``.bits`` file per param); the OS pages
        them in while scanning, so the baseline costs no resident memory between steps.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.kernels.inplace import write_bits
from nemo_dcr.types import CARRIER_NP, SparseDelta, int_view

BACKENDS = ("device", "pinned", "file")


class BaselineError(RuntimeError):
    """Misuse of the baseline: unknown param, unknown version, shape or dtype change."""




@dataclass
class _Entry:
    bits: torch.Tensor  # flat integer tensor, same width as the param
    dtype: torch.dtype
    shape: tuple[int, ...]


class BaselineStore:
    """Per-param baseline bits with staged, version-tagged updates.

    Args:
        backend: one of :data:`BACKENDS`.
        directory: folder for the ``"file"`` backend (created if missing).
    """

    def __init__(self, backend: str = "device", directory: str | os.PathLike | None = None):
        if backend not in BACKENDS:
            raise BaselineError(f"unknown baseline backend {backend!r}; known {BACKENDS}")
        if backend == "file" and directory is None:
            raise BaselineError("the file backend needs a directory")
        self.backend = backend
        self.directory = None if directory is None else os.fspath(directory)
        self.pinned = backend == "pinned" and torch.cuda.is_available()
        self.version: int | None = None
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[int, list[SparseDelta]] = {}

    def register(self, name: str, param: torch.Tensor, version: int = 0) -> None:
        """Record ``param``'s current bits as what the engine holds (a full sync happened)."""
        src = int_view(param)
        bits = self._allocate(name, src)
        bits.copy_(src.to(bits.device))
        self._entries[name] = _Entry(bits, param.dtype, tuple(param.shape))
        self.version = version

    def _allocate(self, name: str, src: torch.Tensor) -> torch.Tensor:
        if self.backend == "device":
            return torch.empty_like(src)
        if self.backend == "pinned":
            return torch.empty(src.shape, dtype=src.dtype, pin_memory=self.pinned)
        os.makedirs(self.directory, exist_ok=True)
        fname = re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".bits"
        width = src.element_size()
        mm = np.memmap(os.path.join(self.directory, fname), dtype=CARRIER_NP[width], mode="w+",
                       shape=(src.numel(),))
        return torch.from_numpy(mm)

    def names(self) -> list[str]:
        """Registered param names, in registration order."""
        return list(self._entries)

    def bits(self, name: str) -> torch.Tensor:
        """Flat integer tensor of the committed baseline of ``name`` (do not write into it)."""
        entry = self._entries.get(name)
        if entry is None:
            raise BaselineError(f"no baseline for {name!r}; registered: {self.names()[:8]}...")
        return entry.bits

    def check(self, name: str, param: torch.Tensor) -> None:
        """Raise if ``param`` no longer matches the registered dtype/shape."""
        entry = self._entries.get(name)
        if entry is None:
            raise BaselineError(f"no baseline for {name!r}")
        if param.dtype != entry.dtype or tuple(param.shape) != entry.shape:
            raise BaselineError(
                f"{name}: registered {entry.dtype}{list(entry.shape)}, "
                f"now {param.dtype}{list(param.shape)}"
            )

    def stage(self, version: int, deltas: list[SparseDelta]) -> None:
        """Remember the deltas shipped as ``version`` until the engine acknowledges it."""
        self._pending[version] = list(deltas)

    def pending_versions(self) -> list[int]:
        """Versions captured but not yet acknowledged."""
        return sorted(self._pending)

    def commit(self, version: int) -> int:
        """The engine acknowledged ``version``: write its new bits into the baseline.

        Older pending versions are dropped (their changes are contained in ``version``, which
        was captured against the same or a later baseline).  Newer ones stay pending.

        Returns:
            Number of elements written.

        Raises:
            BaselineError: ``version`` was never staged.
        """
        deltas = self._pending.pop(version, None)
        if deltas is None:
            raise BaselineError(f"version {version} was not staged; pending {self.pending_versions()}")
        written = 0
        for d in deltas:
            base = self.bits(d.name)
            if d.nnz:
                write_bits(base, d.positions, d.new_bits)
            written += d.nnz
        for v in [v for v in self._pending if v < version]:
            del self._pending[v]
        self.version = version
        if self.backend == "file":
            self.flush()
        return written

    def flush(self) -> None:
        """Write file-backed baselines to disk (no-op for other backends)."""
        if self.backend != "file":
            return
        for entry in self._entries.values():
            arr = entry.bits.numpy()
            base = arr.base if isinstance(arr.base, np.memmap) else None
            if base is not None:
                base.flush()

    def nbytes(self) -> int:
        """Bytes held by the baseline."""
        return sum(e.bits.numel() * e.bits.element_size() for e in self._entries.values())
