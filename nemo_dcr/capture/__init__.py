"""Capture stage: changed elements of each rank's own param shard, against the baseline."""

from nemo_dcr.capture.baseline import BACKENDS, BaselineError, BaselineStore
from nemo_dcr.capture.ranges import intersect, split_range
from nemo_dcr.capture.scan import capture, scan_param

__all__ = ["BACKENDS", "BaselineError", "BaselineStore", "capture", "intersect", "scan_param", "split_range"]
