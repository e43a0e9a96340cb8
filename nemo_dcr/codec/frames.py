"""Strict zstd frame decoding: exactly one frame, declared size checked before allocating.

:func:`decompress_exact` returns the whole content; :func:`iter_frame` yields it in pieces of
bounded size (the compressed input is fed 1 KiB at a time; a zstd block of at most 128 KiB needs
at least a few input bytes, so a piece is at most a few MiB), for decoders that turn the content
into something else as it comes and must not hold it whole.
"""

from __future__ import annotations

from collections.abc import Iterator

import zstandard

INPUT_PIECE = 1 << 10


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


def iter_frame(data, expected: int, error_cls, what: str, record: str | None = None) -> Iterator[bytes]:
    """The content of one zstd frame, in pieces, with the checks of :func:`decompress_exact`.

    The checks that need the whole frame (complete, nothing after it, ``expected`` bytes in all)
    run when the last piece has been taken: a caller validates everything it builds from the
    pieces only after the iterator is exhausted.
    """
    data = memoryview(data)
    try:
        declared = zstandard.get_frame_parameters(bytes(data[:18])).content_size
    except zstandard.ZstdError as exc:
        raise error_cls(f"{what} is not a zstd frame: {exc}", record) from None
    if declared != expected:
        raise error_cls(f"{what} frame declares {declared} bytes, expected {expected}", record)
    obj, total, end = zstandard.ZstdDecompressor().decompressobj(), 0, 0
    while end < len(data) and not obj.eof:
        start, end = end, min(end + INPUT_PIECE, len(data))
        try:
            out = obj.decompress(data[start:end])
        except zstandard.ZstdError as exc:
            raise error_cls(f"{what} is not a valid zstd frame: {exc}", record) from None
        total += len(out)
        if total > expected:
            raise error_cls(f"{what} holds more than the {expected} bytes it declares", record)
        if out:
            yield out
    if not obj.eof or obj.unused_data or end < len(data) or total != expected:
        raise error_cls(f"{what} must be exactly one complete zstd frame of {expected} bytes", record)
