"""Transactional engine-side apply: validate every part, write with an undo log, verify, commit.

Usage::

    from nemo_dcr.apply import TensorEngine
    engine = TensorEngine(named_tensors, version=0, key=key)
    result = engine.apply([payload])      # ApplyResult(touched={name: count}, ...)
"""

from .engine import TensorEngine
from .errors import ApplyVerificationError, IncompletePartsError, InjectedFault, RefitRefusedError, VersionMismatchError
from .guard import VersionGuard
from .transaction import ApplyResult, UndoSettings, apply_parts, resync_parts
from .undo import UNDO_MEMORY_BYTES, UndoLog

__all__ = ["ApplyResult", "ApplyVerificationError", "IncompletePartsError", "InjectedFault",
           "RefitRefusedError", "TensorEngine", "UNDO_MEMORY_BYTES", "UndoLog", "UndoSettings", "VersionGuard",
           "VersionMismatchError", "apply_parts", "resync_parts"]
