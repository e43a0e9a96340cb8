"""Engine formats on the sender side: what the engine holds of the canonical tensors.

``dcr.engine_format: bf16``: the engine holds the canonical tensors as they are, and the owner's
:class:`~.mirror.SenderMirror` is what payloads are encoded against.

``dcr.engine_format: fp8`` (docs/fp8.md): the engine holds each linear layer's weight ``X.weight``
as FP8 e4m3 bytes plus fp32 scales ``X.weight_scale_inv``, every other tensor in BF16
(:class:`~nemo_dcr.quant.Fp8Plan`, the same on both sides).  The owner of a tensor keeps an
:class:`Fp8Mirror`, used by the sender exactly like a :class:`~.mirror.SenderMirror`:

* the BF16 mirror of what the engine was synced to: the old bits of each BF16 change, and the
  new target of the blocks a change touches;
* the engine-format mirror (FP8 bytes, scales, kept BF16 tensors: about one byte per FP8
  element), which payloads are encoded against and whose checksums the engine's are compared
  with (the trainer's weights as the engine should hold them);
* the fp32 block maxima, the state of the FP8 delta.

:meth:`Fp8Mirror.stage` turns a step's merged BF16 changes into engine changes: kept tensors pass
through; an FP8 weight's come from :meth:`nemo_dcr.quant.Fp8Plan.weight_delta` given the engine-format
mirror's bits (the delta, or above :data:`nemo_dcr.quant.fp8_plan.REQUANTIZE_FRACTION` of its elements
changed, re-quantizing it whole and comparing with the mirror).  Both equal quantizing the whole new
target (the tests check the engine against an independent quantizer).  The three parts are staged
together and move only when the engine acknowledged; a refused version leaves them as they were,
and a resync sends the engine-format tensors of the trainer's current BF16 state.

Invariant: the engine-format mirror (plus its staged changes) is ``quantize`` of the BF16 mirror
(plus its staged changes).  It holds from the start: zeros quantize to zero bytes and floor scales.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr import quant
from nemo_dcr.codec import Identity, encode_deltas
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.quant.fp8 import scale_inv_from_amax
from nemo_dcr.types import DTYPES, SparseDelta, carrier
from nemo_dcr.verify.sample import Sample, whole_checksum

from .mirror import SenderMirror

Meta = Mapping[str, tuple[str, tuple[int, ...]]]


def fp8_plan(cfg: DcrConfig, shapes: Mapping[str, Sequence[int]]) -> quant.Fp8Plan:
    """The FP8 plan of a model with these canonical shapes under the ``dcr`` settings (both sides
    build it from the same settings and names, so they agree on every engine tensor)."""
    scheme = quant.Fp8Scheme(cfg.fp8_granularity, (int(cfg.fp8_block[0]), int(cfg.fp8_block[1])))
    rule = quant.Fp8Rule() if cfg.fp8_keep is None else quant.Fp8Rule(keep=tuple(cfg.fp8_keep))
    return quant.Fp8Plan.build(shapes, rule, scheme)


def sender_mirror(cfg: DcrConfig, canonical: Meta, owned: Sequence[str]) -> SenderMirror | Fp8Mirror:
    """The mirror of the ``owned`` canonical tensors in the engine format of ``cfg``."""
    meta = {n: canonical[n] for n in owned}
    if cfg.engine_format == "bf16":
        return SenderMirror(meta)
    return Fp8Mirror(fp8_plan(cfg, {n: s for n, (_, s) in canonical.items()}), meta)


@contextmanager
def _applied(mirror: SenderMirror, d: SparseDelta) -> Iterator[torch.Tensor]:
    """The mirror's tensor with ``d`` written in (its old bits are the mirror's), restored after."""
    bits = mirror.bits[d.name]
    bits[d.positions] = d.new_bits
    try:
        dtype, shape = mirror.meta[d.name]
        yield carrier(bits).view(DTYPES[dtype].torch_dtype).reshape(shape)
    finally:
        bits[d.positions] = d.old_bits


class Fp8Mirror:
    """What the engine holds of the owned tensors in the FP8 format (see the module docstring).

    Args:
        plan: the model's FP8 plan.
        shapes: owned canonical tensor -> (wire dtype, shape); FP8 weights must be ``bf16``.
        version: version of the engine the mirror describes.
    """

    def __init__(self, plan: quant.Fp8Plan, shapes: Meta, version: int = 0):
        wrong = sorted(n for n, (d, _) in shapes.items() if n in plan.fp8 and d != "bf16")
        if wrong:
            raise quant.Fp8Error(f"the FP8 engine format quantizes bf16 weights; {wrong[:3]} are "
                                 f"{shapes[wrong[0]][0]}")
        self.plan = plan
        self.canonical = SenderMirror(shapes, version)
        self.engine = SenderMirror(self._engine_meta(shapes), version)
        self.amax = {n: torch.zeros(plan.scheme.grid(s)) for n, (_, s) in shapes.items() if n in plan.fp8}
        self.engine.reset({plan.scale_names[n]: scale_inv_from_amax(a) for n, a in self.amax.items()}, version)
        self._scale_of = {s: w for w, s in plan.scale_names.items()}
        self._staged: tuple[int, dict, dict, list[SparseDelta], list[SparseDelta]] | None = None

    def _engine_meta(self, shapes: Meta) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = {}
        for n, (dtype, shape) in shapes.items():
            if n in self.plan.fp8:
                out[n] = ("fp8_e4m3", tuple(shape))
                out[self.plan.scale_names[n]] = ("fp32", self.plan.scheme.grid(shape))
            else:
                out[n] = (dtype, tuple(shape))
        return out

    # -- what the sender and the fanout read: the engine-format mirror ----------------------------

    @property
    def meta(self):
        return self.engine.meta

    @property
    def bits(self) -> dict[str, np.ndarray]:
        return self.engine.bits

    @property
    def checksums(self) -> dict[str, int]:
        return self.engine.checksums

    @property
    def indexes(self):
        return self.engine.indexes

    @property
    def version(self) -> int:
        return self.engine.version

    # -- a version: BF16 changes in, engine changes out, staged until acknowledged -----------------

    def changes(self, pieces: Sequence[SparseDelta]) -> list[SparseDelta]:
        """Merged BF16 deltas of owned tensors, old bits from the BF16 mirror, no-ops removed."""
        return self.canonical.changes(pieces)

    def stage(self, deltas: Sequence[SparseDelta], version: int) -> list[SparseDelta]:
        """Stage BF16 ``deltas`` (from :meth:`changes`) for ``version``; returns the engine changes.

        Raises:
            Fp8Error: a target holds NaN/Inf (nothing staged).
        """
        out, amax, stats = [], {}, {}
        for d in deltas:
            if d.name not in self.plan.fp8:
                out.append(d)
            elif d.nnz:
                with _applied(self.canonical, d) as target:
                    fd = self.plan.weight_delta(d, target, self.amax[d.name], self.engine.bits)
                out += [fd.weight, fd.scale]
                amax[d.name], stats[d.name] = fd.amax, fd.stats
        self.canonical.stage(deltas, version)
        self.engine.stage(out, version)
        self._staged = (version, amax, stats, list(deltas), out)
        return out

    def encode(self, deltas: Sequence[SparseDelta], identity: Identity, encoding: str, key: bytes | None,
               max_changes: int, threads: int = 1) -> list[bytes]:
        """Payload parts for engine changes ``deltas`` (from :meth:`stage`) against the engine bits
        (their old bits are read there: the quantizer made them, not the engine mirror)."""
        return self.engine.encode(deltas, identity, encoding, key, max_changes, threads, from_changes=False)

    def commit(self, version: int, threads: int = 1) -> None:
        """The engine acknowledged ``version``: the three parts move together."""
        if self._staged is not None and self._staged[0] == version:
            self.amax.update(self._staged[1])
        self._staged = None
        self.canonical.commit(version, threads)
        self.engine.commit(version, threads)

    def settle(self, names: Sequence[str], version: int) -> None:
        """The engine holds the trainer-side state of canonical ``names`` at ``version`` (a resync)."""
        staged = self._staged[1] if self._staged is not None else {}
        self.amax.update({n: staged[n] for n in names if n in staged})
        self._staged = None
        self.canonical.settle(names, version)
        self.engine.settle(self.engine_names(names), version)

    def current(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Engine tensors of canonical ``names`` as the trainer's current state quantizes them."""
        return self.engine.current(self.engine_names(names))

    def current_checksums(self) -> dict[str, int]:
        """Checksums of the engine-format tensors of the trainer's current state."""
        return self.engine.current_checksums()

    def build_indexes(self) -> None:
        """Kept ``dcr`` class indexes of the engine-format tensors (what payloads are coded against)."""
        self.engine.build_indexes()

    # -- naming, verification and telemetry --------------------------------------------------------

    def engine_names(self, names: Sequence[str]) -> list[str]:
        """The engine tensors of canonical tensors ``names`` (any, owned or not)."""
        return [x for n in names for x in ((n, self.plan.scale_names[n]) if n in self.plan.fp8 else (n,))]

    def canonical_name(self, engine_name: str) -> str:
        """The canonical tensor an engine tensor belongs to."""
        return self._scale_of.get(engine_name, engine_name)

    def trainer_side(self, checksums: Mapping[str, int], sample: Sample | None = None) -> dict[str, int]:
        """The trainer-side checksums to compare with the engine's: the engine-format tensors of
        the trainer's current state (the engine holds no BF16 copy of the FP8 weights); for a
        sampled check (after the version committed), ``sample``'s slice of them."""
        if sample is not None:
            return {n: whole_checksum(b, sample, n) for n, b in self.engine.bits.items()}
        return self.current_checksums()

    def telemetry(self, encoding: str | None) -> dict[str, int]:
        """Counts of the staged version (FP8 density, scale changes) and, with ``encoding``, the
        bytes the same version's BF16 delta would take (encoded, not sent), whole and for the FP8
        weights alone (``bf16_weights_delta_bytes``, against ``fp8_weights_delta_bytes``: the
        same weights' FP8 bytes and scales encoded alone, also not sent)."""
        stats = list(self._staged[2].values()) if self._staged is not None else []
        grids = [a.numel() for a in self.amax.values()]
        numel = sum(int(np.prod(self.plan.fp8[n])) for n in self.amax)
        out = {"fp8_elements": numel, "fp8_blocks": sum(grids), "fp8_dense_bytes": numel + 4 * sum(grids),
               "fp8_changed": sum(s.fp8_changed for s in stats), "fp8_bf16_changed": sum(s.bf16_changed for s in stats),
               "scale_changes": sum(s.blocks_rescaled for s in stats),
               "blocks_touched": sum(s.blocks_touched for s in stats),
               "blocks_rescanned": sum(s.blocks_rescanned for s in stats)}
        if encoding is not None:
            deltas, sent = self._staged[3:] if self._staged is not None else ([], [])
            fp8_bf16 = [d for d in deltas if d.name in self.plan.fp8]
            fp8_sent = [d for d in sent if self.canonical_name(d.name) in self.plan.fp8]
            out["bf16_delta_bytes"] = _encoded_bytes(self.canonical, deltas, encoding)
            out["bf16_weights_delta_bytes"] = _encoded_bytes(self.canonical, fp8_bf16, encoding)
            out["fp8_weights_delta_bytes"] = _encoded_bytes(self.engine, fp8_sent, encoding)
        return out

    def dense_bytes(self) -> int:
        """Bytes of the engine-format tensors whole (a dense refit of an FP8 engine)."""
        return self.engine.dense_bytes()


def _encoded_bytes(mirror: SenderMirror, deltas: Sequence[SparseDelta], encoding: str) -> int:
    """Bytes of one payload of ``deltas`` against ``mirror`` (measured for telemetry, not sent)."""
    return len(encode_deltas(deltas, mirror.bits, Identity(), encoding, None, mirror.checksums, mirror.indexes))
