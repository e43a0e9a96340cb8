"""Capture stage: changed elements of each rank's own param shard, against the baseline."""

from nemo_dcr.capture.baseline import BACKENDS, BaselineError, BaselineStore, int_view
from nemo_dcr.capture.delta import SparseDelta
from nemo_dcr.capture.ranges import intersect, split_range
from nemo_dcr.capture.scan import apply_deltas, capture, scan_param

__all__ = [
    "BACKENDS", "BaselineError", "BaselineStore", "SparseDelta", "apply_deltas", "capture",
    "int_view", "intersect", "scan_param", "split_range",
]
