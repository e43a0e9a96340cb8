"""The one report of a refit: what happened, measured, on every trainer rank alike.

:class:`nemo_dcr.refit.sender.RefitSender` fills the fields it measures on its own rank
(changes it encoded, bytes it put on the trainer group and on the transport, its phase times); :class:`DeltaRefit`
then sums the counts over the trainer ranks (:meth:`RefitReport.totals`), so every rank holds
the same report: ``changed``, ``payload_bytes`` and ``route_bytes`` are the model-wide numbers of
that refit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_dcr.verify.compare import VerifyReport

MODES = ("attach", "delta", "resync")
"""``attach``: first sync of a (re)started trainer (checksums decide what to send);
``delta``: a sparse refit; ``resync``: every owned tensor whole (forced, or after a refusal)."""


@dataclass(frozen=True)
class RefitReport:
    """What one refit did.

    Attributes:
        version: the engine's version afterwards.
        mode: one of :data:`MODES`.
        committed: the engine holds the trainer's current weights (the baseline moved).
        resynced: some tensors were sent whole (a forced resync, or recovery after a refusal,
            a version gap or a checksum mismatch).
        detected: problems seen and handled (refusals with the engine's reason, mismatches).
        changed: changed canonical elements sent.
        numel: canonical elements of the whole model.
        payload_bytes: payload bytes put on the transport (parts of DELTA and RESYNC messages).
        route_bytes: routing pack bytes put on the trainer group for other trainer ranks
            (docs/wire_format.md section 7.5; a rank's changes of the tensors it owns stay on it).
        fanout_bytes: payload bytes the engines' relay roots pass on to the other replicas of
            their view inside the rollout cluster (``dcr.fanout: relay``; refit/relay.py): what was
            sent to each root times its other replicas that answered that version without being
            sent it directly (a replica whose relay broke mid-version got it directly).
        dense_bytes: bytes of the whole model in its serving dtype (a dense refit's payload).
        bytes_by_encoding: payload bytes of the same changes in other encodings (telemetry).
        by_layer_type: layer type -> ``{"changed": n, "numel": m}``.
        times: wall seconds on this rank, keyed by the values of
            :class:`nemo_dcr.telemetry.phases.Phase` (the phases this refit ran), plus two totals
            that are not phases: ``total`` (the refit call's seconds; every phase but
            ``telemetry`` is a span inside it) and ``total_slowest_rank`` (the largest ``total``
            of the trainer ranks).
        verify: the last comparison of trainer and engine checksums (None: not checked).
        bytes_by_host: host of the sending trainer ranks -> ``{"trainer_to_trainer": routing pack
            bytes, "trainer_to_engine": payload bytes, "trainer_to_other_hosts": the routing pack
            bytes addressed to trainer ranks on another host}`` (what its ranks sent; where the
            engines run is the job's layout).
        engine_format: counts of the engine format (``dcr.engine_format: fp8``; refit/fp8_mirror.py):
            ``fp8_elements`` and ``fp8_blocks`` of the FP8 weights, ``fp8_changed`` FP8 bytes and
            ``fp8_bf16_changed`` BF16 elements of them that changed, ``scale_changes``,
            ``blocks_touched``, ``blocks_rescanned``, ``fp8_dense_bytes`` (FP8 bytes + scales
            whole) and, with telemetry encodings, ``bf16_delta_bytes`` (the same version as a BF16
            delta, encoded, not sent) and the FP8 weights' part alone: ``bf16_weights_delta_bytes``
            (their BF16 delta) and ``fp8_weights_delta_bytes`` (their FP8 bytes and scales), each
            encoded on its own, not sent.  Empty for a BF16 engine.
        detached: engine ranks found lost in this refit (their process died) and detached, the
            version committed on the other replicas of their views (refit/replicas.py).
        resynced_ranks: engine ranks a resync was sent to in this refit (as sent; empty: none).
        host_device_bytes: bytes the trainer ranks copied between host and device in this refit
            (``to_host``, ``to_device``; summed over the ranks; the capture scan's changes and the
            baseline's commit on a GPU trainer, :mod:`nemo_dcr.kernels.traffic`); zeros for attach (not measured).
        engine_seconds: the slowest engine rank's wall seconds of the version this refit committed
            or was refused (from the engines' replies, ``parts``, ``apply``, ``checksums``:
            :data:`nemo_dcr.refit.messages.ENGINE_SECONDS`; the largest over engine and trainer
            ranks, each key on its own): the engines' share of :attr:`times` ``await``.  Empty
            where no version reached the engines.
    """

    version: int
    mode: str
    committed: bool
    resynced: bool = False
    detected: tuple[str, ...] = ()
    changed: int = 0
    numel: int = 0
    payload_bytes: int = 0
    route_bytes: int = 0
    fanout_bytes: int = 0
    dense_bytes: int = 0
    bytes_by_encoding: dict[str, int] = field(default_factory=dict)
    by_layer_type: dict[str, dict[str, int]] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    verify: VerifyReport | None = None
    engine_format: dict[str, int] = field(default_factory=dict)
    bytes_by_host: dict[str, dict[str, int]] = field(default_factory=dict)
    host_device_bytes: dict[str, int] = field(default_factory=dict)
    detached: tuple[int, ...] = ()
    resynced_ranks: tuple[int, ...] = ()
    engine_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_on_links(self) -> dict[str, int]:
        """Bytes put on each link, measured from what was sent: ``trainer_to_trainer`` (routing
        packs), ``trainer_to_engine`` (payloads across to the engines: with a relay, to the relay
        roots only) and ``engine_fanout`` (the relay roots' broadcasts to the other replicas,
        inside the rollout cluster)."""
        return {"trainer_to_trainer": self.route_bytes, "trainer_to_engine": self.payload_bytes,
                "engine_fanout": self.fanout_bytes}

    @property
    def density(self) -> float:
        """Changed elements over all elements."""
        return self.changed / max(self.numel, 1)

    @property
    def fp8_density(self) -> float | None:
        """FP8 bytes changed over FP8 elements (None: the engine holds no FP8 weights)."""
        f = self.engine_format
        return f["fp8_changed"] / f["fp8_elements"] if f.get("fp8_elements") else None

    @property
    def verified(self) -> bool | None:
        """Checksums agreed (None: not compared this refit)."""
        return None if self.verify is None else self.verify.ok

    @property
    def error(self) -> str | None:
        """The first problem detected, if any (it was handled: see ``committed``)."""
        return self.detected[0] if self.detected else None
