"""One exception per rule of docs/wire_format.md.  All derive from :class:`DeltaFormatError`."""

from __future__ import annotations


class DeltaFormatError(ValueError):
    """A payload breaks a rule of the wire format; nothing was written.

    Attributes:
        record: name of the offending record, when the error is about one.
    """

    def __init__(self, message: str, record: str | None = None):
        self.record = record
        super().__init__(f"record {record!r}: {message}" if record else message)


class TruncatedPayloadError(DeltaFormatError):
    """Payload shorter than its preamble, header and records declare (rules 1, 4)."""


class TrailingBytesError(DeltaFormatError):
    """Payload longer than its preamble, header and records declare (rule 4)."""


class BadMagicError(DeltaFormatError):
    """Payload does not start with ``NDCR`` (rule 1)."""


class UnsupportedVersionError(DeltaFormatError):
    """Format version other than 1 (rule 2)."""


class UnknownFlagsError(DeltaFormatError):
    """Reserved flag bits set (rule 2)."""


class HeaderTooLargeError(DeltaFormatError):
    """Header JSON over the 64 MiB limit (rule 3)."""


class MalformedHeaderError(DeltaFormatError):
    """Header not decodable, or a key missing, mistyped or unknown (rules 3, 6, 7, 8)."""


class LimitExceededError(DeltaFormatError):
    """Too many records or dimensions (rule 6, section 3)."""


class AuthenticationError(DeltaFormatError):
    """MAC missing, unexpected or wrong (rule 5)."""


class MissingTensorError(DeltaFormatError):
    """A record names a tensor the receiver does not hold (rule 9)."""


class DtypeMismatchError(DeltaFormatError):
    """A record's dtype differs from the receiver's tensor (rule 9)."""


class ShapeMismatchError(DeltaFormatError):
    """A record's shape differs from the receiver's tensor (rule 9)."""


class BaseChecksumMismatchError(DeltaFormatError):
    """The receiver does not hold the base the payload was made against (rule 10)."""


class RecordChecksumError(DeltaFormatError):
    """A record body does not hash to its ``crc`` (rule 11)."""


class PositionOutOfBoundsError(DeltaFormatError):
    """Decoded positions not strictly increasing or beyond the tensor (rule 12)."""


class MalformedRecordError(DeltaFormatError):
    """A record body is inconsistent with its encoding (rules 12, section 4)."""


class TargetChecksumMismatchError(DeltaFormatError):
    """The decoded tensor would not have the declared target checksum (rule 12)."""


class UnknownEncodingError(DeltaFormatError):
    """A record names an encoding this decoder does not know (section 4)."""
