"""The plugin's settings: the keys of ``policy.generation.refit_cfg["<selector>"]`` in NeMo-RL's config.

NeMo-RL builds the engine as ``DcrCheckpointEngine(bucket_size=..., **engine_kwargs)`` where
``engine_kwargs`` are every key of ``refit_cfg[<selector>]`` except
``update_weights_bucket_memory_ratio`` (NeMo-RL sizes ``bucket_size`` from it), plus
``release_after_refit`` (NeMo-RL's own flag, always passed).  An unknown key is refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from nemo_dcr.config.schema import DcrConfig

SELECTOR = "nemo_dcr.integrations.nemo_rl:DcrCheckpointEngine"
"""The ``policy.generation.refit_transport`` value that selects this plugin."""


@dataclass(frozen=True)
class PluginOptions:
    """Settings of :class:`~nemo_dcr.integrations.nemo_rl.plugin.DcrCheckpointEngine`."""

    url: str
    """Folder (or fsspec URL) every policy and vLLM worker can read and write; one job per url."""
    key_file: str
    """HMAC key file (>= 16 raw bytes), the same on every worker: authenticates every message."""
    bucket_size: int = 1 << 30
    """Bytes per payload part (NeMo-RL's ``bucket_size``): bounds what one message carries."""
    encoding: str = "dcr"
    """Payload encoding: ``dcr``, ``reference`` or ``raw``."""
    timeout_s: float = 600.0
    """Longest wait for a peer's message (policy: an engine's reply or another policy worker's
    part of a collective; rollout: the next message of a sync), then a timeout error."""
    verify_interval: int = 1
    """Compare trainer and engine checksums every N syncs (0: never)."""
    full_verify_interval: int = 10
    """Full checksum scans on both sides every N syncs (0: never)."""
    full_resync_interval: int = 0
    """Send every tensor whole every N syncs (0: only when a check fails)."""
    baseline: str = "device"
    """Where each policy worker keeps the capture baseline of the tensors it owns: ``device``
    (next to its CPU copy of them), ``pinned``, or ``file`` (``baseline_dir``)."""
    baseline_dir: str | None = None
    """Folder of the ``file`` baseline (local to each policy worker)."""
    rollout_index: bool = True
    """vLLM workers keep a ``dcr`` class index of the tensors they hold (host memory, about 2.3
    bytes per element: decoding then costs in proportion to the changes); false: no such memory,
    each refit ranks the touched tensors again."""
    telemetry: bool = True
    """Policy rank 0 appends one row per sync to ``<url>/telemetry.jsonl`` (the row schema of
    :mod:`nemo_dcr.telemetry.jsonl`, with ``session``, ``sync_s`` and ``time``)."""
    release_after_refit: bool = False
    """NeMo-RL's flag: it calls ``finalize()`` after every sync (nothing to release here)."""

    @classmethod
    def parse(cls, bucket_size: int, kwargs: dict) -> "PluginOptions":
        """From NeMo-RL's constructor arguments.

        Raises:
            ValueError: an unknown or missing key, or a value out of range (named).
        """
        known = {f.name for f in fields(cls)} - {"bucket_size"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown refit_cfg keys for {SELECTOR}: {unknown}; known: {sorted(known)} "
                             "(and NeMo-RL's update_weights_bucket_memory_ratio)")
        for k in ("url", "key_file"):
            if not kwargs.get(k):
                raise ValueError(f"refit_cfg['{SELECTOR}'].{k} is required")
        opts = cls(bucket_size=int(bucket_size), **kwargs)
        opts.dcr_config("check")  # value checks, with DcrConfig's messages
        return opts

    def dcr_config(self, folder: str) -> DcrConfig:
        """The ``dcr`` settings of one session's refit (store transport in ``folder``)."""
        if self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 byte, got {self.bucket_size}")
        cfg = DcrConfig(encoding=self.encoding, transport="store", url=folder, baseline=self.baseline,
                        baseline_dir=self.baseline_dir, verify_interval=self.verify_interval,
                        full_verify_interval=self.full_verify_interval, full_resync_interval=self.full_resync_interval,
                        bucket_size_mb=self.bucket_size / 2**20, reply_timeout_s=self.timeout_s,
                        key_file=self.key_file, telemetry_encodings=[])
        cfg.validate(prefix=f"refit_cfg['{SELECTOR}']")
        return cfg
