"""Typed bodies of the refit protocol's control messages (JSON; docs/wire_format.md section 7).

* :class:`Query`: the body of a ``QUERY`` envelope, what a trainer rank asks an engine rank
  (:class:`Ask`) and a number that pairs it with its answer.
* :class:`EngineReply`: the body of ``ACK``, ``NACK`` and ``STATE`` envelopes; a ``STATE`` reply
  names the query it answers.

Decoding is strict: every key present with its type, no unknown key, checksums as 16 lowercase hex
digits; each violation raises :class:`MessageFormatError` naming the message and what is wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

from nemo_dcr.verify.sample import Sample

_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SHARD = re.compile(r"0|[1-9][0-9]{0,8}")


class MessageFormatError(ValueError):
    """A query or engine reply that breaks docs/wire_format.md section 7 (the message names what)."""


class Ask(str, Enum):
    """What a query asks an engine rank for (every answer carries its version)."""

    STATE = "state"
    """The incremental checksums (kept from each verified apply)."""
    FULL = "full"
    """Checksums by a full scan (which also replaces the incremental values)."""
    DIGESTS = "digests"
    """A full scan and sha256 digests of everything the engine holds (tests and chaos: an equality
    check independent of the checksums)."""
    PLACEMENT = "placement"
    """The engine's placement per shard (empty: it holds canonical tensors whole)."""
    SAMPLED = "sampled"
    """Checksums of one slice of every tensor recomputed from the live tensors (the query's
    ``sample``, :class:`~nemo_dcr.verify.sample.Sample`); the kept values are not changed."""
    PREFLIGHT = "preflight"
    """Compare everything the engine holds with its own dense load of the same weights; the reply
    is ``ok`` when they are bit-identical, else names the differences (``reason``)."""

def _object(data: bytes, what: str, keys: tuple[str, ...]) -> dict:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MessageFormatError(f"{what} is not UTF-8 JSON: {exc}") from None
    return _keys(obj, what, keys)


def _keys(obj: Any, what: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(obj, dict):
        raise MessageFormatError(f"{what} is a JSON {type(obj).__name__}, not an object")
    missing, unknown = [k for k in keys if k not in obj], sorted(set(obj) - set(keys))
    if missing or unknown:
        raise MessageFormatError(f"{what}: missing keys {missing}, unknown keys {unknown}")
    return obj


def _int(value: Any, what: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value < 1 << 63:
        raise MessageFormatError(f"{what} must be an integer in [{low}, 2**63), got {value!r}")
    return value


def _seconds(value: Any, what: str) -> float:
    if type(value) not in (int, float) or not 0 <= value < 1e9:
        raise MessageFormatError(f"{what} must be a number of seconds in [0, 1e9), got {value!r}")
    return float(value)


def _map(value: Any, what: str, parse: Callable[[Any, str], Any], key: re.Pattern | None = None) -> dict:
    if not isinstance(value, dict):
        raise MessageFormatError(f"{what} must be an object, got {type(value).__name__}")
    if key is not None:
        bad = [k for k in value if not key.fullmatch(k)]
        if bad:
            raise MessageFormatError(f"{what}: key {bad[0]!r} is not a shard number")
    return {k: parse(v, f"{what}[{k!r}]") for k, v in value.items()}


def _hex(pattern: re.Pattern, digits: int) -> Callable[[Any, str], str]:
    def parse(value: Any, what: str) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise MessageFormatError(f"{what} must be {digits} lowercase hex digits, got {value!r}")
        return value
    return parse


_checksum = _hex(_HEX16, 16)
_digest = _hex(_HEX64, 64)


@dataclass(frozen=True)
class Query:
    """What a trainer rank asks an engine rank (body of a ``QUERY`` envelope).

    Attributes:
        ask: what is asked.
        id: the asker's number for this query; the answer carries it back.
        sample: the slice a :attr:`Ask.SAMPLED` query asks for (None for every other ask).
    """

    ask: Ask
    id: int = 0
    sample: Sample | None = None

    def __post_init__(self) -> None:
        if (self.ask == Ask.SAMPLED) != (self.sample is not None):
            raise ValueError(f"a {Ask(self.ask).value!r} query {'needs' if self.sample is None else 'takes no'} sample")

    def to_json(self) -> dict[str, Any]:
        """``{"ask": ..., "id": ...}``, with ``"sample"`` for a sampled query."""
        out: dict[str, Any] = {"ask": Ask(self.ask).value, "id": self.id}
        if self.sample is not None:
            out["sample"] = self.sample.to_json()
        return out

    def to_bytes(self) -> bytes:
        """:meth:`to_json` as UTF-8 JSON."""
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Query":
        """Inverse of :meth:`to_bytes`.

        Raises:
            MessageFormatError: not such an object, an unknown ``ask``, a bad ``id`` or ``sample``.
        """
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise MessageFormatError(f"query is not UTF-8 JSON: {exc}") from None
        return cls.from_json(obj)

    @classmethod
    def from_json(cls, obj: Any, what: str = "query") -> "Query":
        """From the decoded JSON value (a query body, or the ``query`` of a reply)."""
        sampled = isinstance(obj, dict) and obj.get("ask") == Ask.SAMPLED.value
        obj = _keys(obj, what, ("ask", "id", "sample") if sampled else ("ask", "id"))
        if obj["ask"] not in {a.value for a in Ask}:
            raise MessageFormatError(f"{what} asks {obj['ask']!r}; known: {[a.value for a in Ask]}")
        try:
            sample = Sample.from_json(obj["sample"]) if sampled else None
        except ValueError as exc:
            raise MessageFormatError(f"{what} sample: {exc}") from None
        return cls(Ask(obj["ask"]), _int(obj["id"], f"{what} id"), sample)


_REPLY_KEYS = ("ok", "version", "query", "reason", "checksums", "views", "digests", "touched", "placement",
               "seconds")
ENGINE_SECONDS = ("parts", "apply", "checksums")
"""Keys of an ACK's or NACK's ``seconds``: from the version's first part arriving to its last,
the decode and transactional apply, the checksums after it (wall seconds on the engine rank)."""


@dataclass(frozen=True)
class EngineReply:
    """ACK, NACK or STATE from an engine rank.

    Attributes:
        ok: committed (ACK) or answered (STATE); False for a NACK or a refused query.
        version: the engine's version after handling the message.
        reason: why it refused, with the exception type.
        checksums: the engine's canonical partial checksums (incremental, or full when asked).
        digests: sha256 of everything it holds (answer to :attr:`Ask.DIGESTS` only).
        touched: elements written per tensor (ACK).
        placement: the engine's placement per shard (answer to :attr:`Ask.PLACEMENT`).
        views: shard -> per-tensor checksums of the elements that shard holds, in its view index
            space (engines holding shards; replicas included, unlike ``checksums``).
        query: the query a STATE reply answers (None for ACK and NACK).
        seconds: the engine rank's wall seconds of the version (ACK, NACK; keys of
            :data:`ENGINE_SECONDS`), empty for a STATE.
    """

    ok: bool
    version: int
    reason: str = ""
    checksums: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    touched: dict[str, int] = field(default_factory=dict)
    placement: list[dict] = field(default_factory=list)
    views: dict[int, dict[str, int]] = field(default_factory=dict)
    query: Query | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """UTF-8 JSON, keys in the order of docs/wire_format.md (checksums as 16 hex digits)."""
        return json.dumps(dict(
            ok=self.ok, version=self.version,
            query=None if self.query is None else self.query.to_json(),
            reason=self.reason, checksums=_hexes(self.checksums),
            views={str(s): _hexes(v) for s, v in sorted(self.views.items())},
            digests=self.digests, touched=self.touched, placement=self.placement,
            seconds={k: round(v, 6) for k, v in self.seconds.items()})).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "EngineReply":
        """Inverse of :meth:`to_bytes`.

        Raises:
            MessageFormatError: naming the key that is missing, unknown or of the wrong form.
        """
        o = _object(data, "engine reply", _REPLY_KEYS)
        if type(o["ok"]) is not bool or not isinstance(o["reason"], str):
            raise MessageFormatError(f"engine reply: ok must be a boolean and reason a string, got {o['ok']!r}, "
                                     f"{type(o['reason']).__name__}")
        if not isinstance(o["placement"], list) or not all(isinstance(p, dict) for p in o["placement"]):
            raise MessageFormatError("engine reply: placement must be a list of objects (one per shard)")
        query = None if o["query"] is None else Query.from_json(o["query"], "engine reply query")
        views = _map(o["views"], "engine reply views", lambda v, w: _map(v, w, _checksum), _SHARD)
        seconds = _map(o["seconds"], "engine reply seconds", _seconds)
        odd = sorted(set(seconds) - set(ENGINE_SECONDS))
        if odd:
            raise MessageFormatError(f"engine reply seconds: unknown keys {odd} (keys: {list(ENGINE_SECONDS)})")
        return cls(o["ok"], _int(o["version"], "engine reply version"), o["reason"],
                   _ints(_map(o["checksums"], "engine reply checksums", _checksum)),
                   _map(o["digests"], "engine reply digests", _digest),
                   _map(o["touched"], "engine reply touched", _int), o["placement"],
                   {int(s): _ints(v) for s, v in views.items()}, query, seconds)


def _hexes(values: Mapping[str, int]) -> dict[str, str]:
    return {k: f"{v:016x}" for k, v in values.items()}


def _ints(values: Mapping[str, str]) -> dict[str, int]:
    return {k: int(v, 16) for k, v in values.items()}
