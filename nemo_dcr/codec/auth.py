"""The one rule for HMAC key files (docs/wire_format.md, rule 5), used by every entry point.

A key file holds the key as raw bytes: nothing is stripped or decoded (a trailing newline is part
of the key), so the command line, the refit hook, the NeMo-RL plugin and the store transport all
derive the same key from the same file.  A key shorter than :data:`MIN_KEY_BYTES` is refused.
"""

from __future__ import annotations

import os

MIN_KEY_BYTES = 16


class KeyFileError(ValueError):
    """A key file is missing, unreadable or too short (the message names the file)."""


def read_key_file(path: str | os.PathLike) -> bytes:
    """The raw bytes of a key file.

    Raises:
        KeyFileError: the file cannot be read or holds fewer than :data:`MIN_KEY_BYTES` bytes.
    """
    try:
        with open(path, "rb") as f:
            key = f.read()
    except OSError as exc:
        raise KeyFileError(f"key file {os.fspath(path)!r}: {exc.strerror or exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise KeyFileError(f"key file {os.fspath(path)!r} holds {len(key)} bytes; an HMAC key needs at least "
                           f"{MIN_KEY_BYTES} (raw bytes, nothing is stripped)")
    return key
