"""Sender side of engine routing: each engine shard gets only the records for elements it holds.

With a placement per engine shard (:mod:`nemo_dcr.apply.placement`), the owner of a canonical
tensor cuts its merged changes per shard with :meth:`Runs.select` (cost ∝ changes) into the
shard's view index space and encodes them against the mirror's bits of that view, so the engine's
codec checks (base/target checksums of the view) hold.

Two shortcuts keep the cost with the changes:

* a *whole* view (a shard holding every element of the tensor, e.g. vLLM at TP=1 packing
  ``q_proj`` into ``qkv_proj``: the view index is the canonical index) is the mirror itself: no
  gather of the view's bits, the mirror's checksum and its kept ``dcr`` class index;
* shards with the same view of every tensor they receive (engine data-parallel replicas) share one
  encoding: the payload parts are made once and sent to each of them.

The expected checksums of every view are the mirror's (:meth:`SenderMirror.view_checksum`: the
one owner of the sender's checksum bookkeeping), moved by its commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.apply.placement import RankPlacement, view_delta
from nemo_dcr.codec import Identity, encode_deltas
from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.checksum import tensor_checksum
from nemo_dcr.verify.sample import Sample

from .mirror import SenderMirror
from .payloads import buckets, resync_payload


@dataclass
class Fanout:
    """Per-engine-rank encoding for the tensors this trainer rank owns.

    Args:
        routes: route key (``(engine rank, shard)``) -> its placement (canonical name -> held elements).
        mirror: this trainer rank's sender mirror (canonical index space).
    """

    routes: Mapping[object, RankPlacement]
    mirror: SenderMirror

    def __post_init__(self):
        self._views = {(r, n): (n, tp.runs.canon.tobytes() + tp.runs.length.tobytes())
                       for r, placement in self.routes.items() for n, tp in placement.items()}

    def signature(self, rank) -> tuple:
        """What ``rank`` (a route key) holds, comparable between ranks: its views of every tensor."""
        return tuple(sorted(v for (r, _), v in self._views.items() if r == rank))

    def whole(self, rank, name: str) -> bool:
        """``rank``'s view of ``name`` is every element in canonical order (view index = canonical)."""
        tp = self.routes[rank][name]
        return tp.numel == int(np.prod(tp.shape)) if tp.shape else tp.numel == 1

    def view_bits(self, rank, name: str, bits: np.ndarray | None = None) -> np.ndarray:
        """Mirror bits (or ``bits``, canonical flat) of ``name`` in ``rank``'s view order."""
        source = self.mirror.bits[name] if bits is None else bits
        if self.whole(rank, name):
            return source
        canon, _ = self.routes[rank][name].runs.expand()
        return source[canon]

    def _checksum(self, rank, name: str) -> int:
        return self.mirror.view_checksum(name, self.routes[rank][name].runs, self._views[(rank, name)])

    def view_mismatches(self, names: Sequence[str], views: Mapping[object, Mapping[str, int] | None],
                        current: Callable[[str], np.ndarray] | None = None, sample: Sample | None = None
                        ) -> tuple[list[tuple[str, object, int, int | None]], int]:
        """Compare the views of ``names`` each engine shard in ``views`` (route key -> what it
        reported; None: it did not answer, so every view it holds differs) reported with the
        expected values: from the committed mirror, from ``current(name)`` (canonical flat bits:
        the trainer's state) when given, or ``sample``'s slice of the committed mirror.

        Returns:
            ``(name, route key, expected, reported)`` of each differing view, and the views compared.
        """
        out, compared = [], 0
        for name in names:
            bits = None if current is None else current(name)
            for rank, placement in self.routes.items():
                if name not in placement or rank not in views:
                    continue
                compared += 1
                got = None if views[rank] is None else views[rank].get(name)
                if sample is not None:
                    want = self.mirror.sampled_view(name, placement[name].runs, sample)
                elif bits is None:
                    want = self._checksum(rank, name)
                else:
                    want = tensor_checksum(self.view_bits(rank, name, bits))
                if got != want:
                    out.append((name, rank, want, got))
        return out, compared

    def split(self, deltas: Sequence[SparseDelta]) -> dict[object, list[SparseDelta]]:
        """Canonical deltas cut into each engine shard's view index space (held elements only)."""
        out: dict[object, list[SparseDelta]] = {r: [] for r in self.routes}
        for rank, placement in self.routes.items():
            for d in deltas:
                tp = placement.get(d.name)
                if tp is None:
                    continue
                if self.whole(rank, d.name):
                    out[rank].append(SparseDelta(d.name, d.dtype, (tp.numel,), d.positions, d.new_bits, d.old_bits))
                    continue
                out[rank].append(view_delta(d, tp.runs))
        return out

    def encode(self, deltas: Sequence[SparseDelta], identity: Identity, encoding: str, key: bytes | None,
               max_changes: int, threads: int = 1) -> dict[object, list[bytes]]:
        """Payload parts per engine shard (at least one each) for changes the mirror staged.  Shards
        with the same views of the tensors they receive share one encoding (``threads``: worker
        threads over each part's records)."""
        per_rank = self.split(deltas)
        out: dict[object, list[bytes]] = {}
        made: dict[tuple, list[bytes]] = {}
        for rank, ds in per_rank.items():
            signature = tuple(self._views[(rank, d.name)] for d in ds)
            if signature not in made:
                made[signature] = self._encode_views(rank, ds, identity, encoding, key, max_changes, threads)
            out[rank] = made[signature]
        return out

    def _encode_views(self, rank, ds: Sequence[SparseDelta], identity: Identity, encoding: str,
                      key: bytes | None, max_changes: int, threads: int = 1) -> list[bytes]:
        base = {d.name: self.view_bits(rank, d.name) for d in ds}
        cks = {d.name: self._checksum(rank, d.name) for d in ds}
        whole = all(self.whole(rank, d.name) for d in ds)
        indexes = self.mirror.indexes if whole else None  # a whole view is the mirror: its kept index
        groups = list(buckets(ds, max_changes)) or [[]]
        return [encode_deltas(g, base, identity, encoding, key, cks, indexes, threads) for g in groups]

    def resync_payloads(self, names: Sequence[str], target: int, key: bytes | None, model: str = "",
                        run: str = "") -> dict[int, list[bytes]]:
        """Per engine rank, one resync payload with its views of the trainer-side canonical ``names``
        (their engine tensors: the mirror's format names them)."""
        current = self.mirror.current(names)
        out = {}
        for rank, placement in self.routes.items():
            views = {}
            for n, t in current.items():
                if n in placement:
                    flat = t.reshape(-1)
                    views[n] = flat[torch.from_numpy(placement[n].runs.expand()[0])]
            out[rank] = [resync_payload(views, target, key, model=model, run=run)]
        return out
