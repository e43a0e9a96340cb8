"""Strict zstd frame decoding: exactly one frame, declared size checked before allocating."""

from __future__ import annotations

import zstandard


def decompress_exact(data, expected: int, error_cls, what: str, record: str | None = None) -> bytes:
    """Decompress one zstd frame that MUST hold exactly ``expected`` bytes and nothing after it.

    The frame's declared content size is checked before any output is allocated, so a frame
    claiming a huge size cannot exhaust memory.
    """
    data = bytes(data)
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as exc:
        raise error_cls(f"{what} is not a zstd frame: {exc}", record) from None
    if declared != expected:
        raise error_cls(f"{what} frame declares {declared} bytes, expected {expected}", record)
    obj = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = obj.decompress(data)
    except zstandard.ZstdError as exc:
        raise error_cls(f"{what} is not a valid zstd frame: {exc}", record) from None
    if not obj.eof or obj.unused_data or len(out) != expected:
        raise error_cls(f"{what} must be exactly one complete zstd frame of {expected} bytes", record)
    return out
