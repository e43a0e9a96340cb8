"""Refit benchmark: delta refit vs dense refit of SmolLM2-135M through one gloo transport, one run.

Usage:
    python benchmarks/refit.py [RUN_DIR] [--pair A B] [--repeats N] [--encoding reference|dcr] [--json OUT]

RUN_DIR holds real RL step checkpoints ``step_0 .. step_K`` (``nemo-dcr make-deltas --steps 2
--out RUN_DIR`` writes them; generated here when missing).  Two processes on this machine: a
trainer process (rank 0) and an engine process (rank 1, a transformers ``LlamaForCausalLM``
loaded from ``step_A`` in bf16, wrapped in :class:`nemo_dcr.integrations.hf.engine.HFEngine`),
joined by a ``ProcessGroupGloo`` over loopback and :class:`nemo_dcr.transport.DistTransport`.

The trainer alternates its live params between ``step_A`` and ``step_B`` (a real step), then
between ``step_A`` and mixes of the two at chosen densities (``--densities``: ``B``'s bits at a
random fraction of the elements where the checkpoints differ), and after every change runs, back
to back:

* a **delta refit** through the one refit path, :meth:`nemo_dcr.refit.DeltaRefit.step` over a
  :class:`~nemo_dcr.refit.canonical.CanonicalSource` (capture against the committed baseline,
  identity remap, owner routing, mirror encode, send, engine transaction, ACK, checksum
  verification);
* a **dense refit**: every tensor's raw bf16 bytes (``MessageKind.DENSE``) through the same
  transport, copied into the engine's live params under its write guard; its ``verify`` is a
  full checksum scan on both sides (the delta path verifies incrementally).

Columns (seconds, wall; :data:`COLUMNS`, sums of the recorded :class:`~nemo_dcr.telemetry.phases.Phase`
times, :func:`columns`): capture, remap, encode (route + encode; dense: bytes serialization),
transfer (send + await, minus the engine's apply), apply (engine: decode, validate, write,
read-back check; dense: copy), verify (checksum + verify + commit).  The table reports
the best of N refits of each kind and the median of the per-pair ratios delta/dense; the
machine is shared, so only ratios from the same run are meaningful.  The default pair (1, 2) is a
typical RL step (the first AdamW step, 0 -> 1, changes ~10x more elements).  After the last refit the
engine's sha256 digests must equal the trainer's (``bit_exact``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nemo_dcr.apply import ForwardingEngine
from nemo_dcr.checkpoint import load_checkpoint
from nemo_dcr.refit.messages import Ask, EngineReply
from nemo_dcr.telemetry.phases import Phase, PhaseClock
from nemo_dcr.transport import DistTransport, Envelope, MessageKind
from nemo_dcr.types import int_view, spec_of
from nemo_dcr.verify.checksum import tensor_checksum

KEY = b"benchmark-refit-key-0123456789ab"
TRAINER, ENGINE = 0, 1
COLUMNS = ("capture", "remap", "encode", "transfer", "apply", "verify")
"""The benchmark's comparison columns (not phases: see :func:`columns` and :func:`combine`)."""
_LEN = struct.Struct("<Q")


def _transport(workdir: str, rank: int) -> DistTransport:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(os.path.join(workdir, "store"), 2)
    return DistTransport(dist.ProcessGroupGloo(store, rank, 2), rank)


def _bits(t: torch.Tensor):
    return int_view(t).numpy().view(spec_of(t.dtype).uint)


# ---------------------------------------------------------------- dense wire format (benchmark only)
def pack_dense(tensors: dict[str, torch.Tensor]) -> bytes:
    """JSON head (names, byte counts) + raw bytes of every tensor, in order."""
    head = json.dumps([[n, t.numel() * t.element_size()] for n, t in tensors.items()]).encode()
    return _LEN.pack(len(head)) + head + b"".join(int_view(t).numpy().tobytes() for t in tensors.values())


def unpack_dense_into(body: bytes, tensors: dict[str, torch.Tensor]) -> int:
    """Copy a :func:`pack_dense` body into live tensors; returns elements written."""
    (n,) = _LEN.unpack_from(body)
    off, count = _LEN.size + n, 0
    for name, nbytes in json.loads(body[_LEN.size:off]):
        view = int_view(tensors[name])
        view.copy_(torch.frombuffer(bytearray(body[off:off + nbytes]), dtype=view.dtype))
        off, count = off + nbytes, count + view.numel()
    return count


# ---------------------------------------------------------------- engine process
class TimedEngine(ForwardingEngine):
    """An :class:`HFEngine` behind the engine contract, timing every apply (prepare to commit)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.apply_s: dict[int, float] = {}
        self._t0 = 0.0

    def prepare(self, parts, resync=False):
        self._t0 = time.perf_counter()
        return self.inner.prepare(parts, resync)

    def commit(self):
        result = self.inner.commit()
        if not result.resync:
            self.apply_s[result.target_version] = time.perf_counter() - self._t0
        return result

def _dense_part(timed: TimedEngine, env: Envelope, transport, held: list, times: dict) -> None:
    """Hold dense parts; on the last one (once the engine settled) write them all (apply), scan checksums
    (verify), ACK."""
    if env.body:
        held.append(env.body)
    if not env.last:
        return
    clock = {"apply": 0.0}

    def write(tensors):
        t0 = time.perf_counter()
        for body in held:
            unpack_dense_into(body, tensors)
        clock["apply"] = time.perf_counter() - t0

    timed.inner.settle()  # the last delta refit's index move, if still running, is not the dense refit's time
    t0 = time.perf_counter()
    checksums = timed.inner.engine.dense_refit(write, env.version)
    times[env.version] = dict(apply=clock["apply"], verify=time.perf_counter() - t0 - clock["apply"])
    held.clear()
    reply = EngineReply(True, env.version, checksums=checksums.canonical)
    transport.send(env.sender, Envelope(MessageKind.ACK, env.version, ENGINE, body=reply.to_bytes()))
    transport.flush()


def engine_main(workdir: str, step_a: str) -> None:
    """Engine rank: serve delta and dense refits until STOP; write the engine's timings."""
    from transformers import AutoModelForCausalLM

    from nemo_dcr.integrations.hf.engine import HFEngine
    from nemo_dcr.refit.server import EngineServer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(step_a, dtype=torch.bfloat16)
    timed = TimedEngine(HFEngine(model, key=KEY))
    transport = _transport(workdir, ENGINE)
    server, dense_times, held = EngineServer(timed, transport, [TRAINER]), {}, []
    while True:
        env = transport.recv()
        if env.kind == MessageKind.DENSE:
            _dense_part(timed, env, transport, held, dense_times)
        elif not server.handle(env):
            break
    Path(workdir, "engine.json").write_text(json.dumps(dict(delta_apply=timed.apply_s, dense=dense_times,
                                                            mixed=timed.inner.engine.guard.mixed_version_served)))
    transport.close()


# ---------------------------------------------------------------- trainer process
def mixed_state(a: dict, b: dict, density: float, seed: int = 0) -> dict:
    """``a`` with ``b``'s bits at a random ``density`` fraction of all elements, drawn from the
    elements where the two real checkpoints differ (all of them when there are fewer)."""
    rng = np.random.default_rng(seed)
    diff = {n: np.flatnonzero(_bits(a[n]) != _bits(b[n])) for n in a}
    total = sum(t.numel() for t in a.values())
    have = sum(d.size for d in diff.values())
    keep = min(1.0, density * total / max(have, 1))
    out = {}
    for n, t in a.items():
        bits = _bits(t).copy()
        pos = diff[n][rng.random(diff[n].size) < keep]
        bits[pos] = _bits(b[n])[pos]
        out[n] = torch.from_numpy(bits.view(np.int16)).view(t.dtype).reshape(t.shape)
    return out


class Trainer:
    """Live params as a canonical source, the one refit path (``DeltaRefit``) to the engine rank."""

    def __init__(self, states: list[dict[str, torch.Tensor]], transport: DistTransport, encoding: str):
        from nemo_dcr.config.schema import DcrConfig
        from nemo_dcr.refit import DeltaRefit, engine_wiring
        from nemo_dcr.refit.canonical import CanonicalSource
        from nemo_dcr.refit.group import LocalGroup

        self.states = states
        self.params = {n: t.clone() for n, t in states[0].items()}
        self.transport = transport
        cfg = DcrConfig(encoding=encoding, reply_timeout_s=600, verify="incremental", verify_steps=0,
                        telemetry_encodings=[])
        wiring = engine_wiring(transport, [TRAINER], [ENGINE], LocalGroup())
        self.refit = DeltaRefit(cfg, CanonicalSource(self.params), wiring, key=KEY, model="SmolLM2-135M")
        first = self.refit.attach()
        if first.resynced:
            raise RuntimeError("the engine was loaded from step A: the first sync should send nothing")

    def set_state(self, state: dict) -> None:
        """The optimizer step: live params become ``state`` (not timed)."""
        for n, p in self.params.items():
            p.copy_(state[n])

    def delta_refit(self) -> dict:
        """One refit through DeltaRefit, with its phases (seconds) and payload bytes."""
        r = self.refit.step()
        if not (r.committed and r.verified and not r.resynced):
            raise RuntimeError(f"delta refit v{r.version} failed: {r.detected}")
        return dict(version=r.version, kind="delta", changed=r.changed, numel=r.numel, bytes=r.payload_bytes,
                    **columns(r.times))

    def dense_refit(self) -> dict:
        """Every tensor's bytes through the same transport; full checksums compared (timed once
        the delta refit before it has no work left on this process: its index moves)."""
        self.refit.wait()
        clock, version = PhaseClock(), self.refit.sender.mirror.version + 1
        sent0 = self.transport.bytes_sent
        names = list(self.params)
        with clock(Phase.ENCODE):
            bodies = [pack_dense({n: self.params[n] for n in names[i:i + 16]}) for i in range(0, len(names), 16)]
        with clock(Phase.SEND):
            for i, body in enumerate(bodies):
                self.transport.send(ENGINE, Envelope(MessageKind.DENSE, version, TRAINER, i, False, body))
            self.transport.send(ENGINE, Envelope(MessageKind.DENSE, version, TRAINER, len(bodies), True))
            self.transport.flush()
        with clock(Phase.AWAIT):
            reply = EngineReply.from_bytes(self.transport.recv(src=ENGINE, timeout=600).body)
        with clock(Phase.VERIFY):
            mine = {n: tensor_checksum(_bits(p)) for n, p in self.params.items()}
        if reply.checksums != mine:
            raise RuntimeError(f"dense refit v{version}: engine checksums differ")
        if self.refit.attach().resynced:  # not timed: the refit learns the engine's new version
            raise RuntimeError("after a dense refit the engine should hold the trainer's weights")
        return dict(version=version, kind="dense", changed=self._numel(), numel=self._numel(),
                    bytes=self.transport.bytes_sent - sent0, **columns(clock.seconds))

    def _numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def digests_match(self) -> bool:
        """sha256 of every tensor, trainer vs engine."""
        engine = self.refit.sender.query(Ask.DIGESTS)[0].digests
        mine = {n: hashlib.sha256(int_view(p).numpy().tobytes()).hexdigest() for n, p in self.params.items()}
        return engine == mine


def trainer_main(workdir: str, steps: list[str], repeats: int, encoding: str, densities: list[float]) -> None:
    """Trainer rank: for the real step and each density, alternate A <-> B with one delta and one
    dense refit per change; write rows."""
    torch.set_num_threads(1)
    states = [load_checkpoint(s) for s in steps]
    trainer = Trainer(states, _transport(workdir, TRAINER), encoding)
    mix = states[2] if len(states) > 2 else states[1]
    targets = [("real step", states[1])] + [(f"{d:.2%}", mixed_state(states[0], mix, d)) for d in densities]
    rows = []
    for label, target in targets:
        for i in range(2 * repeats):
            trainer.set_state(target if i % 2 == 0 else states[0])
            rows.append(dict(trainer.delta_refit(), target=label))
            rows.append(dict(trainer.dense_refit(), target=label))
    exact = trainer.digests_match()
    trainer.transport.send(ENGINE, Envelope(MessageKind.STOP, 0, TRAINER))
    trainer.transport.flush()
    Path(workdir, "trainer.json").write_text(json.dumps(dict(rows=rows, bit_exact=exact)))
    trainer.transport.close()


def columns(times: dict[str, float]) -> dict[str, float]:
    """A row's trainer columns from recorded phase times (``wire``: send + await, split by :func:`combine`)."""
    def t(*phases: Phase) -> float:
        return sum(times.get(p, 0.0) for p in phases)

    return dict(capture=t(Phase.CAPTURE), remap=t(Phase.REMAP), encode=t(Phase.ROUTE, Phase.ENCODE),
                wire=t(Phase.SEND, Phase.AWAIT), verify=t(Phase.CHECKSUM, Phase.VERIFY, Phase.COMMIT))


# ---------------------------------------------------------------- parent: run, combine, report
def combine(rows: list[dict], engine: dict) -> list[dict]:
    """Per-refit phases: the engine's apply (and dense verify) taken out of the sender's wire time."""
    out = []
    for r in rows:
        v = str(r["version"])
        if r["kind"] == "delta":
            apply, engine_verify = engine["delta_apply"][v], 0.0
        else:
            apply, engine_verify = engine["dense"][v]["apply"], engine["dense"][v]["verify"]
        row = dict(r, apply=apply, transfer=max(r.pop("wire") - apply - engine_verify, 0.0))
        row["verify"] = r["verify"] + engine_verify
        row["total"] = sum(row[p] for p in COLUMNS)
        out.append(row)
    return out


def summarize_all(rows: list[dict]) -> dict:
    """:func:`summarize` per target (the real step and each density), and how the delta refit's
    time follows the number of changes (largest over smallest density)."""
    out = {t: summarize([r for r in rows if r["target"] == t]) for t in dict.fromkeys(r["target"] for r in rows)}
    dens = [t for t in out if t != "real step"]
    if len(dens) >= 2:
        lo, hi = min(dens, key=lambda t: out[t]["delta"]["best"]["changed"]), \
            max(dens, key=lambda t: out[t]["delta"]["best"]["changed"])
        out["cost_follows_changes"] = dict(
            low=lo, high=hi, changed_ratio=out[hi]["delta"]["best"]["changed"] / out[lo]["delta"]["best"]["changed"],
            time_ratio=out[hi]["delta"]["best"]["total"] / out[lo]["delta"]["best"]["total"])
    return out


def summarize(rows: list[dict]) -> dict:
    """Best-of-N per kind, per-phase minima, and the delta/dense ratios of this run."""
    kinds = {k: [r for r in rows if r["kind"] == k] for k in ("delta", "dense")}
    out = {}
    for kind, rs in kinds.items():
        best = min(rs, key=lambda r: r["total"])
        out[kind] = dict(best=best, median_total=statistics.median(r["total"] for r in rs),
                         min_phase={p: min(r[p] for r in rs) for p in COLUMNS}, n=len(rs))
    pairs = [d["total"] / e["total"] for d, e in zip(kinds["delta"], kinds["dense"])]
    no_verify = [d["total"] / (e["total"] - e["verify"]) for d, e in zip(kinds["delta"], kinds["dense"])]
    out["ratio_best"] = out["delta"]["best"]["total"] / out["dense"]["best"]["total"]
    out["ratio_paired_median"] = statistics.median(pairs)
    out["ratio_vs_dense_without_verify_median"] = statistics.median(no_verify)
    out["bytes_ratio"] = out["delta"]["best"]["bytes"] / out["dense"]["best"]["bytes"]
    return out


def table(summaries: dict) -> str:
    """Markdown table of the best refit of each kind, per target."""
    head = "| target | refit | " + " | ".join(COLUMNS) + " | total s | MB moved | changed |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 5)]
    notes = []
    for target, summary in summaries.items():
        if target == "cost_follows_changes":
            continue
        for kind in ("delta", "dense"):
            b = summary[kind]["best"]
            cells = " | ".join(f"{b[p]:.3f}" for p in COLUMNS)
            lines.append(f"| {target} | {kind} (best of {summary[kind]['n']}) | {cells} | {b['total']:.3f} | "
                         f"{b['bytes'] / 1e6:.2f} | {b['changed'] / b['numel']:.3%} |")
        notes.append(f"{target}: delta/dense time best {summary['ratio_best']:.3f}x, paired median "
                     f"{summary['ratio_paired_median']:.3f}x (vs dense without verify "
                     f"{summary['ratio_vs_dense_without_verify_median']:.3f}x); bytes {summary['bytes_ratio']:.5f}x")
    c = summaries.get("cost_follows_changes")
    if c:
        notes.append(f"cost follows changes: {c['high']} vs {c['low']}: {c['changed_ratio']:.1f}x the changes, "
                     f"{c['time_ratio']:.2f}x the delta refit time")
    return "\n".join(lines + [""] + notes)


def step_dirs(run: Path, steps: int) -> list[Path]:
    """``step_0 .. step_K`` of ``run``; generated with ``make_deltas`` when missing."""
    if not (run / "step_1").is_dir():
        from nemo_dcr.tools.demo.task import make_deltas

        make_deltas(run, steps, 1e-6)
    return sorted(run.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def run(run_dir: Path, pair: tuple[int, int], repeats: int, encoding: str, steps: int = 2,
        densities: tuple[float, ...] = (), mix_with: int = 0) -> dict:
    """Spawn trainer and engine, return the report (rows, summary, bit_exact)."""
    dirs = step_dirs(run_dir, steps)
    chosen = [str(dirs[pair[0]]), str(dirs[pair[1]]), str(dirs[mix_with])]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="nemo-dcr-bench-") as tmp:
        procs = [ctx.Process(target=engine_main, args=(tmp, chosen[0])),
                 ctx.Process(target=trainer_main, args=(tmp, chosen, repeats, encoding, list(densities)))]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"benchmark processes failed: {[p.exitcode for p in procs]} (engine first)")
        trainer = json.loads(Path(tmp, "trainer.json").read_text())
        engine = json.loads(Path(tmp, "engine.json").read_text())
    rows = combine(trainer["rows"], engine)
    return dict(model="SmolLM2-135M-Instruct (bf16)", transport="DistTransport over ProcessGroupGloo, loopback",
                encoding=encoding, pair=[Path(c).name for c in chosen[:2]], mix_with=Path(chosen[2]).name,
                densities=list(densities), repeats=repeats,
                bit_exact=trainer["bit_exact"], mixed_version_served=engine["mixed"],
                summary=summarize_all(rows), rows=rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", nargs="?", default="runs/refit_bench", type=Path)
    ap.add_argument("--pair", nargs=2, type=int, default=(1, 2), help="step indices A B to alternate")
    ap.add_argument("--repeats", type=int, default=2, help="A->B->A cycles per target (2 delta + 2 dense refits each)")
    ap.add_argument("--encoding", default="dcr", choices=("dcr", "reference"), help="payload coding of the delta refit")
    ap.add_argument("--densities", default="0.001,0.01",
                    help="also refit to mixes of A and B at these densities (comma-separated; '' for none)")
    ap.add_argument("--mix-with", type=int, default=0,
                    help="density mixes are step A with this step's bits (the first AdamW step changes ~4%%)")
    ap.add_argument("--steps", type=int, default=2, help="steps to generate when RUN_DIR is empty")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    densities = tuple(float(x) for x in args.densities.split(",") if x)
    report = run(args.run_dir, tuple(args.pair), args.repeats, args.encoding, args.steps, densities, args.mix_with)
    print(table(report["summary"]))
    print(f"bit_exact={report['bit_exact']} mixed_version_served={report['mixed_version_served']}")
    text = json.dumps({k: v for k, v in report.items() if k != "rows"} | {"rows": report["rows"]}, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
