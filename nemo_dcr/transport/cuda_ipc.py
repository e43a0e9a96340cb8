"""CUDA IPC for colocated training and generation (same node, same or different GPU).

The trainer process stages a payload in a GPU byte buffer and exports a CUDA IPC handle of it
(``torch.multiprocessing.reductions.reduce_tensor``); the handle, a few hundred bytes, travels
in an ordinary envelope (any transport), and the engine process maps the same device memory and
copies the payload out (or decodes it on the device).  No host copy and no socket carries the
payload itself.  The buffer must stay alive on the trainer until the engine acknowledged the
version, which the refit protocol guarantees (the sender keeps its parts until ACK/NACK).

This needs CUDA in both processes; on a CPU-only machine every entry point raises
:class:`TransportUnavailableError` with the reason.
"""

from __future__ import annotations

import pickle  # only for torch's own IPC handle tuple between two trusted local processes
from dataclasses import dataclass

import torch

from .base import TransportUnavailableError


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise TransportUnavailableError("CUDA IPC needs a CUDA device in both processes; none is visible")


@dataclass
class IpcExport:
    """A payload staged on the GPU: keep it alive until the engine acknowledged the version."""

    buffer: torch.Tensor
    handle: bytes


def export_payload(payload: bytes, device: int = 0) -> IpcExport:
    """Copy ``payload`` into device memory and export a CUDA IPC handle to it."""
    _require_cuda()
    from torch.multiprocessing.reductions import reduce_tensor

    host = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = host.to(f"cuda:{device}")
    rebuild, args = reduce_tensor(buf)
    return IpcExport(buf, pickle.dumps((rebuild, args)))


def import_payload(handle: bytes) -> bytes:
    """Map the exporter's device buffer and copy the payload out."""
    _require_cuda()
    rebuild, args = pickle.loads(handle)
    return rebuild(*args).cpu().numpy().tobytes()
