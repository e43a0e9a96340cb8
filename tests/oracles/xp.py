"""A small array-op shim so one vectorized algorithm runs on numpy arrays or torch tensors.

Every integer the ``dcr`` kernels compute fits in int64 (gaps < 2**62, steps < 2**32), so both
backends work in int64 and never need unsigned 64-bit arithmetic.  ``TorchOps`` keeps every
array on the device of the tensors it was built for; only small per-group tables and the final
byte buffer cross to the host.
"""

from __future__ import annotations

import numpy as np
import torch

_PACK = np.array([128, 64, 32, 16, 8, 4, 2, 1], dtype=np.int64)


class NumpyOps:
    """Backend over numpy arrays (host)."""

    name = "numpy"

    def i64(self, x):
        return np.asarray(x).astype(np.int64, copy=False)

    def unsigned(self, x, bits: int):
        return x.astype(np.int64)  # numpy bit arrays are already unsigned

    def host(self, x) -> np.ndarray:
        return np.asarray(x)

    def u8(self, x):
        return x.astype(np.uint8)

    def clamp0(self, x):
        return np.maximum(x, 0)

    def dev(self, x: np.ndarray):
        return np.asarray(x)

    def arange(self, n: int):
        return np.arange(n, dtype=np.int64)

    def zeros(self, n: int, kind: str = "i64"):
        return np.zeros(n, dtype={"i64": np.int64, "u8": np.uint8, "bool": bool}[kind])

    def ones_bool(self, n: int):
        return np.ones(n, dtype=bool)

    def cumsum(self, x):
        return np.cumsum(x, dtype=np.int64)

    def nonzero(self, mask):
        return np.flatnonzero(mask)

    def searchsorted(self, a, v, right: bool = False):
        return np.searchsorted(a, v, side="right" if right else "left")

    def bincount(self, x, n: int):
        return np.bincount(x, minlength=n)[:n].astype(np.int64, copy=False) if x.size else np.zeros(n, np.int64)

    def argsort_stable(self, x):
        return np.argsort(x, kind="stable")

    def repeat(self, x, counts, total: int):
        return np.repeat(x, counts)

    def cat(self, parts):
        return np.concatenate(parts)

    def seg_min(self, values, seg_ids, starts, n_seg: int):
        """Minimum per segment of ``values`` grouped contiguously by sorted ``seg_ids``."""
        counts = np.bincount(seg_ids, minlength=n_seg)
        out = np.full(n_seg, np.iinfo(np.int64).max, dtype=np.int64)
        ne = counts > 0
        if values.size:
            out[ne] = np.minimum.reduceat(values, (np.cumsum(counts) - counts)[ne])
        return out

    def any(self, mask) -> bool:
        return bool(mask.any())

    def pack(self, bits) -> bytes:
        return np.packbits(bits.astype(np.uint8, copy=False)).tobytes()

    def unpack(self, data: bytes):
        return np.unpackbits(np.frombuffer(data, dtype=np.uint8))


class TorchOps:
    """Backend over torch tensors on ``device`` (any device torch supports)."""

    name = "torch"

    def __init__(self, device):
        self.device = torch.device(device)

    def i64(self, x):
        return x.to(torch.int64)

    def unsigned(self, x, bits: int):
        return x.to(torch.int64) & ((1 << bits) - 1)

    def host(self, x) -> np.ndarray:
        return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

    def u8(self, x):
        return x.to(torch.uint8)

    def clamp0(self, x):
        return x.clamp_min(0)

    def dev(self, x: np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def arange(self, n: int):
        return torch.arange(n, dtype=torch.int64, device=self.device)

    def zeros(self, n: int, kind: str = "i64"):
        dt = {"i64": torch.int64, "u8": torch.uint8, "bool": torch.bool}[kind]
        return torch.zeros(n, dtype=dt, device=self.device)

    def ones_bool(self, n: int):
        return torch.ones(n, dtype=torch.bool, device=self.device)

    def cumsum(self, x):
        return torch.cumsum(x, 0, dtype=torch.int64)

    def nonzero(self, mask):
        return torch.nonzero(mask).reshape(-1)

    def searchsorted(self, a, v, right: bool = False):
        return torch.searchsorted(a, v, right=right)

    def bincount(self, x, n: int):
        return torch.bincount(x.to(torch.int64), minlength=n)[:n]

    def argsort_stable(self, x):
        return torch.sort(x, stable=True).indices

    def repeat(self, x, counts, total: int):
        return torch.repeat_interleave(x, counts, output_size=total)

    def cat(self, parts):
        return torch.cat(parts)

    def seg_min(self, values, seg_ids, starts, n_seg: int):
        out = torch.full((n_seg,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=values.device)
        return out.scatter_reduce_(0, seg_ids, values, "amin", include_self=True)

    def any(self, mask) -> bool:
        return bool(mask.any())

    def pack(self, bits) -> bytes:
        pad = (-bits.numel()) % 8
        if pad:
            bits = torch.cat([bits, bits.new_zeros(pad)])
        w = torch.as_tensor(_PACK, device=bits.device)
        packed = (bits.to(torch.int64).reshape(-1, 8) * w).sum(1).to(torch.uint8)
        return packed.cpu().numpy().tobytes()

    def unpack(self, data: bytes):
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if data else self.zeros(0, "u8")
        shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=self.device)
        return ((t[:, None] >> shifts) & 1).reshape(-1)
