"""Per-core refit cost against a NeMo-RL-style sparse refit, on one real step, in one run.

Usage:
    python benchmarks/peer.py RUN [--pair A B] [--reps N] [--threads T] [--dcr-threads W] [--json OUT]

RUN holds ``step_0 .. step_K`` from ``nemo-dcr make-deltas``.  The trainer's live tensors move
``A -> B -> A ...`` (a real step and back), then between ``A`` and ``A`` with ``B``'s bits at a
random tenth of the changed elements; after every move each path refits its engine copy:

* ``dcr``: the project's refit path on one rank: capture scan against the trainer's baseline,
  the trainer's checksums moved by the changes, the mirror's changes and ``encode_deltas`` with
  the kept class indexes (sender); :class:`~nemo_dcr.apply.TensorEngine` ``prepare`` + ``commit``
  (decode, validate, undo log, write, read-back check, checksums, index update; receiver); then
  the sender's commit (mirror bits, checksums and indexes; baseline) and the checksum comparison
  (each side's index move, which runs behind its commit in a job, is waited for in that side's
  phase, so its CPU time is counted there);
* ``reference``: the same path with ``dcr.encoding=reference`` (no kept indexes);
* ``nemo_rl_style``: :mod:`peer_codec` (ne/nonzero, XOR, gap-coded positions, zstd-1, scatter;
  no undo log, no verification).

Every time is CPU time of this process (``time.process_time``) on one core (torch and numba on
``--threads`` threads, default 1), the best of ``--reps`` forward/back pairs; each engine copy is
checked bit-exact against the trainer after every refit.  ``--dcr-threads`` is the project's
paths' ``dcr.threads`` (worker threads over the params of the capture scan and a part's records
on both sides, default 1); every path's wall seconds are printed too (``send_wall``,
``receive_wall``, ``total_wall``; the project's paths also ``capture_wall``), since with several
threads CPU time sums over them.  Prints one JSON object: per-phase
seconds, send/receive/total, bytes per changed element, the ratios against the NeMo-RL-style
path measured in the same run, and the ratio of a step's cost to its tenth's.  The per-phase
ns per change of the project's own path (:mod:`peer_phases`) are in ``dcr_ns_per_change``; its
fixed cost per refit, phase by phase in ms, in ``dcr_ms_at_floor``: the same probed refit at a
random ``--floor`` fraction of the step's changes (default 0.001, a few changes per tensor), where
almost nothing is per-change work, so what is left is what every refit pays whatever it changes
(the dense capture scan, and per-record work) and what keeps a step from costing 10x its tenth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_codec  # noqa: E402
import peer_phases  # noqa: E402
from codec_speed import deltas_of, load_pair, subsample  # noqa: E402

from nemo_dcr.apply import TensorEngine  # noqa: E402
from nemo_dcr.capture import BaselineStore, capture  # noqa: E402
from nemo_dcr.codec import Identity  # noqa: E402
from nemo_dcr.refit.mirror import SenderMirror  # noqa: E402
from nemo_dcr.types import bits_view, int_view, spec_of  # noqa: E402
from nemo_dcr.verify.checksum import checksums_after, tensor_checksum  # noqa: E402

PATHS = ("dcr", "reference", "nemo_rl_style")
MAX_CHANGES = 1 << 40  # one payload part


class _Clock:
    """CPU seconds per phase; with a probe, its probed calls' seconds per phase too."""

    def __init__(self, probe=None):
        self.probe, self.seconds, self.wall, self.probed = probe, {}, {}, {}

    def __call__(self, phase: str, fn):
        if self.probe is not None:
            self.probe.reset()
        w0, t0 = time.perf_counter(), time.process_time()
        out = fn()
        self.seconds[phase] = time.process_time() - t0
        self.wall[phase] = time.perf_counter() - w0
        if self.probe is not None:
            self.probed[phase] = {k: v for k, v in self.probe.seconds.items() if v}
        return out


class DcrPath:
    """The project's refit on one rank: trainer baseline and mirror, and a :class:`TensorEngine`."""

    def __init__(self, base: dict[str, torch.Tensor], encoding: str, threads: int = 1):
        self.encoding, self.threads = encoding, threads
        self.store = BaselineStore("pinned")
        for n, t in base.items():
            self.store.register(n, t)
        self.mirror = SenderMirror({n: (spec_of(t.dtype).name, tuple(t.shape)) for n, t in base.items()})
        self.mirror.reset(base, 0)
        self.engine = TensorEngine({n: t.clone() for n, t in base.items()}, keep_index=encoding == "dcr",
                                   threads=threads)
        if encoding == "dcr":
            self.mirror.build_indexes()
            self.engine.build_indexes()
        self.checksums = {n: tensor_checksum(bits_view(t)) for n, t in base.items()}
        self.version = 0

    def refit(self, params: dict[str, torch.Tensor], probe=None) -> dict:
        """One refit to ``params``: CPU seconds per phase (and, with a :class:`peer_phases.Probe`,
        of its probed calls per phase under ``"probed"``)."""
        v, clock = self.version + 1, _Clock(probe)
        deltas = clock("capture", lambda: capture(params, self.store, version=v, threads=self.threads))

        def encode():
            current = checksums_after(self.checksums, deltas)
            owned = self.mirror.changes(deltas)
            ident = Identity(base_version=v - 1, target_version=v)
            return current, self.mirror.encode(owned, ident, self.encoding, None, MAX_CHANGES, self.threads)

        current, parts = clock("encode", encode)
        clock("prepare", lambda: self.engine.prepare({0: parts}))
        # Both sides move their kept class indexes on a thread of their own after a commit
        # (MovedIndexes); their CPU time is counted here, in the side's own phase, never in
        # whatever runs next (another path's refit, or the untimed bit-exact check).
        clock("engine_commit", lambda: (self.engine.commit(), self.engine.indexes))

        def commit():
            self.mirror.commit(v, self.threads)
            self.store.commit(v)
            if self.engine.checksums().canonical != current:
                raise AssertionError("trainer and engine checksums differ")
            self.mirror.indexes  # noqa: B018 -- waits for the mirror's index move

        clock("commit", commit)
        self.checksums, self.version = current, v
        t, w = clock.seconds, clock.wall
        return {**t, "send": t["capture"] + t["encode"] + t["commit"], "receive": t["prepare"] + t["engine_commit"],
                "capture_wall": w["capture"], "send_wall": w["capture"] + w["encode"] + w["commit"],
                "receive_wall": w["prepare"] + w["engine_commit"], "bytes": sum(map(len, parts)),
                "probed": clock.probed}

    def live(self) -> dict[str, torch.Tensor]:
        return self.engine.params


class PeerPath:
    """The NeMo-RL-style refit (:mod:`peer_codec`): its own baseline and an engine copy."""

    def __init__(self, base: dict[str, torch.Tensor]):
        self.names = list(base)
        self.baseline = {n: int_view(t).clone() for n, t in base.items()}
        self.engine = {n: t.clone() for n, t in base.items()}

    def refit(self, params: dict[str, torch.Tensor]) -> dict:
        t = peer_codec.PeerTimes()
        w0 = time.perf_counter()
        payload = peer_codec.send(self.names, params, self.baseline, t)
        w1 = time.perf_counter()
        peer_codec.receive(self.names, self.engine, payload, t)
        w2 = time.perf_counter()
        times = {"scan": t.scan, "pack": t.pack, "zstd": t.zstd, "commit": t.commit, "unzstd": t.unzstd,
                 "scatter": t.scatter}
        return {**times, "send": t.scan + t.pack + t.zstd + t.commit, "receive": t.unzstd + t.scatter,
                "send_wall": w1 - w0, "receive_wall": w2 - w1, "bytes": len(payload)}

    def live(self) -> dict[str, torch.Tensor]:
        return self.engine


def _state(base: dict[str, torch.Tensor], deltas) -> dict[str, torch.Tensor]:
    """``base`` with each delta's new bits written (copies)."""
    out = {n: t.clone() for n, t in base.items()}
    for d in deltas:
        bits_view(out[d.name])[d.positions] = d.new_bits
    return out


def _same(live: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(int_view(live[n]), int_view(t)) for n, t in want.items())


def measure(paths: dict, base: dict, target: dict, reps: int) -> dict:
    """Best-of-``reps`` refit of every path over ``base -> target -> base`` pairs (interleaved)."""
    params = {n: t.clone() for n, t in base.items()}
    runs = {k: [] for k in paths}
    exact = {k: True for k in paths}
    for _ in range(reps):
        for state in (target, base):
            for n, t in state.items():
                params[n].copy_(t)
            for k, path in paths.items():
                r = path.refit(params)
                if state is target:  # the refits back restore the state; only the step itself is counted
                    runs[k].append(r)
                exact[k] &= _same(path.live(), state)
    out = {}
    for k, rs in runs.items():
        top = min(rs, key=lambda r: r["send"] + r["receive"])
        top.pop("probed", None)
        out[k] = {**top, "total": top["send"] + top["receive"], "bit_exact": exact[k]}
        if "send_wall" in top:
            out[k]["total_wall"] = top["send_wall"] + top["receive_wall"]
    return out


def phases(path: DcrPath, base: dict, target: dict, changed: int, reps: int) -> dict:
    """ns per change of each phase of ``path``'s refits to ``target`` (probed, best of ``reps`` by total;
    each followed by an unprobed refit back to ``base``)."""
    params = {n: t.clone() for n, t in target.items()}
    runs = []
    for _ in range(reps):
        for n, t in target.items():
            params[n].copy_(t)
        runs.append(peer_phases.breakdown(lambda probe: path.refit(params, probe), changed))
        for n, t in base.items():
            params[n].copy_(t)
        path.refit(params)
    return min(runs, key=lambda r: sum(p["total"] for p in r.values()))


def summarize(res: dict, changed: int) -> dict:
    peer = res["nemo_rl_style"]
    for r in res.values():
        r["B_per_changed"] = r["bytes"] / changed
        r["ns_per_changed"] = r["total"] / changed * 1e9
    ratios = {f"{k}/nemo_rl_style": {s: res[k][s] / peer[s] for s in ("send", "receive", "total", "bytes")}
              for k in ("dcr", "reference")}
    return {"changed": changed, "paths": res, "ratios": ratios}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("--pair", nargs=2, type=int, default=(1, 2))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch and numba threads")
    p.add_argument("--dcr-threads", type=int, default=1, help="dcr.threads of the project's paths")
    p.add_argument("--floor", type=float, default=0.001,
                   help="fraction of the step's changes at which the fixed cost per refit is measured")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not 0 < args.floor < 1:
        p.error(f"--floor must be a fraction in (0, 1), got {args.floor}")
    torch.set_num_threads(args.threads)
    import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    pair = load_pair(args.run, *args.pair)
    base = {n: a for n, (a, _) in pair.items()}
    deltas = deltas_of(pair)
    tenth = subsample(deltas, 0.1)
    numel = sum(t.numel() for t in base.values())
    paths = {"dcr": DcrPath(base, "dcr", args.dcr_threads), "reference": DcrPath(base, "reference", args.dcr_threads),
             "nemo_rl_style": PeerPath(base)}
    out = {"run": args.run, "pair": list(args.pair), "threads": args.threads, "dcr_threads": args.dcr_threads,
           "numel": numel}
    for label, ds in (("step", deltas), ("tenth", tenth)):
        changed = sum(d.nnz for d in ds)
        res = measure(paths, base, _state(base, ds), args.reps)
        out[label] = {"density": changed / numel, **summarize(res, changed)}
    out["dcr_ns_per_change"] = phases(paths["dcr"], base, _state(base, deltas), out["step"]["changed"], args.reps)
    floor = subsample(deltas, args.floor)
    few = sum(d.nnz for d in floor)
    at_floor = phases(paths["dcr"], base, _state(base, floor), few, args.reps)
    out["dcr_ms_at_floor"] = {"fraction": args.floor, "changed": few, "records": sum(1 for d in floor if d.nnz),
                              "phases": {ph: {k: v * few / 1e6 for k, v in subs.items()} for ph, subs in at_floor.items()},
                              "total": sum(subs["total"] for subs in at_floor.values()) * few / 1e6}
    out["cost_follows_changes"] = {k: out["step"]["paths"][k]["total"] / out["tenth"]["paths"][k]["total"]
                                   for k in PATHS}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    ok = all(r["bit_exact"] for lab in ("step", "tenth") for r in out[lab]["paths"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
