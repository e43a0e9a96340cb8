"""The bytes a refit moves between the host and a device (PCIe), counted where they are copied.

Every crossing of the data path goes through :func:`to_host` (device -> host) or
:func:`to_device` (host -> device); each adds the bytes it copies to the :class:`HostDeviceBytes`
meter of the innermost :func:`measure` around it (in this thread; a meter started inside another
takes the copies alone, so an engine's apply measured inside a trainer's step is not counted
twice).  Host data is numpy; torch tensors live on their device.

:func:`device_path` makes host tensors take the device code path (torch ops on the tensor's
device, copies through these two functions), so the very code a GPU runs is exercised and
counted on a CPU: the counts are what would cross PCIe, whatever the device.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from ..types import int_view, spec_of


@dataclass
class HostDeviceBytes:
    """Bytes copied between the host and a device.

    Attributes:
        to_host: device -> host bytes.
        to_device: host -> device bytes.
    """

    to_host: int = 0
    to_device: int = 0

    @property
    def total(self) -> int:
        return self.to_host + self.to_device

    def per_element(self, elements: int) -> dict[str, float]:
        """Bytes per element (per changed element, given the change count) on each side."""
        n = max(elements, 1)
        return {"to_host": self.to_host / n, "to_device": self.to_device / n}


_METER: ContextVar[HostDeviceBytes | None] = ContextVar("nemo_dcr_host_device_meter", default=None)
_DEVICE_PATH: ContextVar[bool] = ContextVar("nemo_dcr_device_path", default=False)


@contextmanager
def measure() -> Iterator[HostDeviceBytes]:
    """Count the host <-> device copies made inside the block (this thread) into a new meter."""
    meter = HostDeviceBytes()
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)


@contextmanager
def device_path(on: bool = True) -> Iterator[None]:
    """Inside the block, host tensors take the device code path (tests and ``benchmarks/gpu.py``);
    ``on=False`` turns that off again where tensors are host memory by design (a resync's zeros)."""
    token = _DEVICE_PATH.set(on)
    try:
        yield
    finally:
        _DEVICE_PATH.reset(token)


def on_host(t: torch.Tensor) -> bool:
    """``t`` is host memory the host kernels may read through numpy (not under :func:`device_path`)."""
    return t.is_cpu and not _DEVICE_PATH.get()


def _count(to_host: int = 0, to_device: int = 0) -> None:
    meter = _METER.get()
    if meter is not None:
        meter.to_host += to_host
        meter.to_device += to_device


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of device tensor ``t`` (counted); ``t`` itself when it is host memory."""
    if on_host(t):
        return t
    _count(to_host=t.numel() * t.element_size())
    return t.detach().to("cpu", copy=True)


def to_device(a: "np.ndarray | torch.Tensor", device: torch.device) -> torch.Tensor:
    """Host data ``a`` (a numpy array or a host tensor) as a tensor on ``device``: a counted copy
    unless the tensors live on the host; numpy unsigned integers become the torch integer type of
    their width.  A pinned host tensor is copied without blocking."""
    if isinstance(a, torch.Tensor):
        host = a
    else:
        a = np.ascontiguousarray(a)
        host = torch.from_numpy(a.view(f"i{a.itemsize}") if a.dtype.kind == "u" and a.itemsize > 1 else a)
    if torch.device(device).type == "cpu" and not _DEVICE_PATH.get():
        return host
    _count(to_device=host.numel() * host.element_size())
    return host.to(device, copy=True, non_blocking=host.is_pinned())


def host_bits(t: torch.Tensor) -> np.ndarray:
    """Unsigned numpy bits of a contiguous tensor on any device: a view of host memory, else one
    counted copy of the whole tensor."""
    return to_host(int_view(t)).numpy().view(spec_of(t.dtype).uint)
