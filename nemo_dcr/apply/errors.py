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


class EngineRefusedError(RuntimeError):
    """An engine cannot be refit exactly (a kernel backend that rearranges weights, quantized
    layers, an element that lands twice, ...): refused before the first sync, nothing sent.

    Attributes:
        reasons: what (an engine param, a canonical tensor, an engine feature) -> why.
    """

    def __init__(self, reasons: dict[str, str], where: str = "the engine"):
        self.reasons = dict(reasons)
        lines = "; ".join(f"{what}: {why}" for what, why in sorted(self.reasons.items())[:12])
        more = f" (and {len(self.reasons) - 12} more)" if len(self.reasons) > 12 else ""
        super().__init__(f"{where} cannot be refit in place: {lines}{more}")


class PreflightError(RuntimeError):
    """The engine after the first sync differs from its own dense load of the same weights.

    Attributes:
        differences: one line per differing tensor (which engine rank, which tensor).
    """

    def __init__(self, differences: list[str]):
        self.differences = list(differences)
        head = "; ".join(self.differences[:12])
        more = f" (and {len(self.differences) - 12} more)" if len(self.differences) > 12 else ""
        super().__init__(f"preflight: the engine differs from its own load of the attach weights: {head}{more}")
