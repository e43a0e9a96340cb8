"""Where each nanosecond per change of one ``dcr`` refit goes (used by :mod:`peer`).

:class:`Probe` wraps named library functions with CPU-time accumulators for the length of one
refit (module attributes, looked up by the callers at call time), so the figures are the real
path's own calls, not a re-enactment.  Sub-phases of a phase are reported inside it; ``rest``
is the phase's time outside its probed calls (Python bookkeeping, headers, small copies).
"""

from __future__ import annotations

import importlib
import sys
import time
from contextlib import contextmanager
from pathlib import Path

PROBES = {
    "scan": "nemo_dcr.capture.scan.changes_np",
    "trainer checksums": "peer.checksums_after",
    "mirror changes": "nemo_dcr.refit.mirror.changes_at",
    "index get": "nemo_dcr.codec.dcr.class_index.DcrIndexes.get",
    "ranks": "nemo_dcr.codec.dcr.jit_codec.class_ranks",
    "coder": "nemo_dcr.codec.dcr.jit_codec.encode_kernel",
    "parse": "nemo_dcr.codec.dcr.jit_codec.parse",
    "places (select, finish)": "nemo_dcr.codec.dcr.jit_codec.places",
    "sort by position": "nemo_dcr.codec.dcr.jit_codec.in_position_order",
    "checksum": "nemo_dcr.codec.payload.updated_checksum",
    "crc": "nemo_dcr.codec.payload._crc",
    "undo + write": "nemo_dcr.apply.transaction.write_deltas",
    "read-back check": "nemo_dcr.apply.transaction.verify_written",
    "index update": "nemo_dcr.codec.dcr.class_index.DcrIndexes.update",
}
"""Probed calls: label -> the function's dotted path (absent ones are skipped)."""


def _module(name: str):
    """The module ``name``; the script run as ``__main__`` when its file is ``name`` (its own globals,
    which its calls look up: importing its file again would make a second module nobody calls)."""
    main = sys.modules.get("__main__")
    if "." not in name and Path(getattr(main, "__file__", None) or "").stem == name:
        return main
    return importlib.import_module(name)


def _resolve(dotted: str):
    """(owner object, attribute name) of a dotted module path (a class attribute allowed)."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = _module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(dotted)


class Probe:
    """CPU seconds spent inside each probed function while active (nested probes count once each)."""

    def __init__(self, probes: dict[str, str]):
        self.targets = {label: _resolve(path) for label, path in probes.items()}
        self.seconds = {label: 0.0 for label in probes}

    def reset(self) -> None:
        self.seconds = {label: 0.0 for label in self.seconds}

    @contextmanager
    def active(self):
        saved = []
        for label, (owner, name) in self.targets.items():
            fn = getattr(owner, name, None)
            if fn is None:
                continue
            saved.append((owner, name, owner.__dict__[name] if name in vars(owner) else fn))
            setattr(owner, name, self._timed(label, fn))
        try:
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)

    def _timed(self, label: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.process_time() - t0
        return wrapper


def breakdown(refit, changed: int) -> dict:
    """ns per change of every phase of one ``refit(probe=...)`` (a :class:`peer.DcrPath` bound
    method) and of the probed calls inside each phase; ``rest`` is the phase outside them."""
    probe = Probe(PROBES)
    with probe.active():
        res = refit(probe=probe)
    out = {}
    for phase, probed in res["probed"].items():
        subs = {k: v / changed * 1e9 for k, v in probed.items()}
        total = res[phase] / changed * 1e9
        out[phase] = {"total": total, **subs, "rest": total - sum(subs.values())}
    return out
