"""Engine side: the engine contract and the transactional in-place apply behind it.

Usage::

    from nemo_dcr.apply import TensorEngine, apply_version
    engine = TensorEngine(named_tensors, version=0, key=key)
    result = apply_version(engine, {0: [payload]})   # ApplyResult(touched={name: count}, ...)
"""

from .contract import Engine, EngineChecksums, ForwardingEngine, Parts, apply_version
from .engine import TensorEngine
from .errors import (ApplyVerificationError, EngineRefusedError, IncompletePartsError, InjectedFault, PendingVersionError,
                     PreflightError, RefitRefusedError, VersionMismatchError)
from .guard import VersionGuard
from .transaction import ApplyResult, UndoSettings, apply_parts, resync_parts
from .undo import UNDO_MEMORY_BYTES, UndoLog

__all__ = ["ApplyResult", "ApplyVerificationError", "Engine", "EngineChecksums", "EngineRefusedError", "ForwardingEngine",
           "IncompletePartsError", "InjectedFault", "Parts", "PendingVersionError", "PreflightError", "RefitRefusedError",
           "TensorEngine", "UNDO_MEMORY_BYTES", "UndoLog", "UndoSettings", "VersionGuard", "VersionMismatchError", "apply_parts", "apply_version", "resync_parts"]
