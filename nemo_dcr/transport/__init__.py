"""Transports between trainer ranks and engine ranks (in-process, torch.distributed over gloo, fsspec store)."""

from .base import Envelope, MessageKind, Transport, TransportError, TransportTimeout, TransportUnavailableError
from .dist import DistTransport
from .inproc import InProcHub, InProcTransport
from .store import StoreTransport

__all__ = ["DistTransport", "Envelope", "InProcHub", "InProcTransport", "MessageKind", "StoreTransport",
           "Transport", "TransportError", "TransportTimeout", "TransportUnavailableError"]
