"""Why an engine refused or undid a refit.  Codec rule violations stay :class:`DeltaFormatError`."""

from __future__ import annotations


class RefitRefusedError(RuntimeError):
    """The engine did not move to the target version; it still holds its old version bit for bit."""


class VersionMismatchError(RefitRefusedError):
    """The payload's base version is not the version the engine holds.

    Attributes:
        engine_version: version the engine holds.
        base_version: base version the payload was made against.
    """

    def __init__(self, engine_version: int, base_version: int, target_version: int):
        self.engine_version = engine_version
        self.base_version = base_version
        self.target_version = target_version
        kind = "gap" if base_version > engine_version else "stale or duplicate"
        super().__init__(f"version {kind}: engine holds v{engine_version}, payload is "
                         f"v{base_version} -> v{target_version}")

    @property
    def is_gap(self) -> bool:
        """The payload skips versions the engine never received."""
        return self.base_version > self.engine_version


class IncompletePartsError(RefitRefusedError):
    """The parts of one version disagree on their versions or name a tensor twice."""


class PendingVersionError(RefitRefusedError):
    """A prepared version is waiting for commit or rollback (or none is, when one was expected)."""


class ApplyVerificationError(RefitRefusedError):
    """After writing, a tensor's checksum is not the payload's target checksum (rolled back)."""


class InjectedFault(RuntimeError):
    """Raised by a test or chaos hook in the middle of an apply (the apply must roll back)."""
