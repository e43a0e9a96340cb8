"""Refit benchmark: delta refit vs dense refit of SmolLM2-135M through one gloo transport, one run.

Usage:
    python benchmarks/refit.py [RUN_DIR] [--pair A B] [--repeats N] [--encoding reference|dcr] [--json OUT]

RUN_DIR holds real RL step checkpoints ``step_0 .. step_K`` (``nemo-dcr make-deltas --steps 2
--out RUN_DIR`` writes them; generated here when missing).  Two processes on this machine: a
trainer process (rank 0) and an engine process (rank 1, a transformers ``LlamaForCausalLM``
loaded from ``step_A`` in bf16, wrapped in :class:`nemo_dcr.integrations.hf.engine.HFEngine`),
joined by a ``ProcessGroupGloo`` over loopback and :class:`nemo_dcr.transport.DistTransport`.

The trainer alternates its live params between ``step_A`` and ``step_B`` (real densities) and
after every change runs, back to back:

* a **delta refit**: ``capture`` against the committed baseline, identity remap (HF layout),
  then :meth:`nemo_dcr.refit.sender.RefitSender.refit` (owner routing, mirror encode,
  send, engine transaction, ACK, checksum verification);
* a **dense refit**: every tensor's raw bf16 bytes (``MessageKind.DENSE``) through the same
  transport, copied into the engine's live params under its write guard; its ``verify`` is a
  full checksum scan on both sides (the delta path verifies incrementally).

Phases (seconds, wall): capture, remap, encode (delta: owner routing + coding; dense: bytes
serialization), transfer (sender's send + wait for the ACK, minus the engine's apply), apply
(engine: decode, validate, write, read-back check; dense: copy), verify.  The table reports
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

import torch
import torch.distributed as dist

from nemo_dcr.capture import BaselineStore, capture
from nemo_dcr.types import int_view
from nemo_dcr.types import SparseDelta
from nemo_dcr.checkpoint import load_checkpoint
from nemo_dcr.types import spec_of
from nemo_dcr.refit.sender import PhaseClock, RefitConfig, RefitSender
from nemo_dcr.refit.group import LocalGroup
from nemo_dcr.refit.messages import QUERY_DIGESTS, EngineReply
from nemo_dcr.refit.mirror import SenderMirror
from nemo_dcr.transport import DistTransport, Envelope, MessageKind
from nemo_dcr.verify.checksum import tensor_checksum, updated_checksum

KEY = b"benchmark-refit-key-0123456789ab"
TRAINER, ENGINE = 0, 1
PHASES = ("capture", "remap", "encode", "transfer", "apply", "verify")
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
class TimedEngine:
    """Forwards the server's verbs to an :class:`HFEngine` and times every apply."""

    def __init__(self, engine):
        self.inner = engine
        self.apply_s: dict[int, float] = {}

    version = property(lambda self: self.inner.version)
    tensors = property(lambda self: self.inner.tensors)

    def apply(self, parts):
        t0 = time.perf_counter()
        result = self.inner.apply(parts)
        self.apply_s[result.target_version] = time.perf_counter() - t0
        return result

    def resync(self, parts):
        return self.inner.resync(parts)

    def checksums(self, full: bool = False):
        return self.inner.checksums(full)


def _dense_part(timed: TimedEngine, env: Envelope, transport, held: list, times: dict) -> None:
    """Hold dense parts; on the last one write them all (apply), scan checksums (verify), ACK."""
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

    t0 = time.perf_counter()
    checksums = timed.inner.engine.dense_refit(write, env.version)
    times[env.version] = dict(apply=clock["apply"], verify=time.perf_counter() - t0 - clock["apply"])
    held.clear()
    reply = EngineReply(True, env.version, checksums=checksums)
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
class Trainer:
    """Live params, capture baseline, incremental checksums and a sender for rank 0."""

    def __init__(self, states: list[dict[str, torch.Tensor]], transport: DistTransport, encoding: str):
        self.states = states
        self.params = {n: t.clone() for n, t in states[0].items()}
        self.transport = transport
        self.baseline = BaselineStore("pinned")
        for n, p in self.params.items():
            self.baseline.register(n, p)
        self.checksums = {n: tensor_checksum(_bits(p)) for n, p in self.params.items()}
        mirror = SenderMirror({n: (spec_of(p.dtype).name, tuple(p.shape)) for n, p in self.params.items()})
        mirror.reset(self.params, 0)
        config = RefitConfig(key=KEY, encoding=encoding, reply_timeout=600, model="SmolLM2-135M")
        self.sender = RefitSender(config, LocalGroup(), transport, [ENGINE], {n: 0 for n in self.params}, mirror)

    def set_state(self, k: int) -> None:
        """The optimizer step: live params become checkpoint ``k`` (not timed)."""
        for n, p in self.params.items():
            p.copy_(self.states[k][n])

    def delta_refit(self) -> dict:
        """One delta refit with every phase timed (seconds) and bytes moved."""
        clock, version = PhaseClock(), self.sender.mirror.version + 1
        sent0 = self.transport.bytes_sent
        with clock("capture"):
            local = capture(self.params, self.baseline, version=version)
        with clock("remap"):  # HF layout: canonical index = local flat index
            pieces = [SparseDelta(d.name, d.dtype, d.shape, d.positions, d.new_bits, d.old_bits) for d in local]
        with clock("verify"):
            for d in pieces:
                self.checksums[d.name] = updated_checksum(self.checksums[d.name], d.positions, d.old_bits,
                                                          d.new_bits)
        out = self.sender.refit(pieces, self.checksums)
        if not (out.committed and out.verify is not None and out.verify.ok):
            raise RuntimeError(f"delta refit v{version} failed: {out.detected}")
        self.baseline.commit(version)
        ph = {**clock.seconds, "encode": out.phases["route"] + out.phases["encode"],
              "wire": out.phases["send"] + out.phases["await"]}
        ph["verify"] += out.phases["verify"]
        return dict(version=version, kind="delta", changed=out.changed, numel=self._numel(),
                    bytes=self.transport.bytes_sent - sent0, **ph)

    def dense_refit(self) -> dict:
        """Every tensor's bytes through the same transport; full checksums compared."""
        clock, version = PhaseClock(), self.sender.mirror.version + 1
        sent0 = self.transport.bytes_sent
        names = list(self.params)
        with clock("encode"):
            bodies = [pack_dense({n: self.params[n] for n in names[i:i + 16]}) for i in range(0, len(names), 16)]
        with clock("wire"):
            for i, body in enumerate(bodies):
                self.transport.send(ENGINE, Envelope(MessageKind.DENSE, version, TRAINER, i, False, body))
            self.transport.send(ENGINE, Envelope(MessageKind.DENSE, version, TRAINER, len(bodies), True))
            self.transport.flush()
            reply = EngineReply.from_bytes(self.transport.recv(src=ENGINE, timeout=600).body)
        with clock("verify"):
            mine = {n: tensor_checksum(_bits(p)) for n, p in self.params.items()}
        if reply.checksums != mine:
            raise RuntimeError(f"dense refit v{version}: engine checksums differ")
        self._resync_state(version)
        return dict(version=version, kind="dense", changed=self._numel(), numel=self._numel(), capture=0.0,
                    remap=0.0, bytes=self.transport.bytes_sent - sent0, **clock.seconds)

    def _resync_state(self, version: int) -> None:
        """After a dense refit, baseline and mirror describe the engine again (not timed)."""
        for n, p in self.params.items():
            self.baseline.register(n, p, version)
        self.sender.mirror.reset(self.params, version)

    def _numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def digests_match(self) -> bool:
        """sha256 of every tensor, trainer vs engine."""
        self.transport.send(ENGINE, Envelope(MessageKind.QUERY, QUERY_DIGESTS, TRAINER))
        self.transport.flush()
        engine = self.sender._await(QUERY_DIGESTS, (MessageKind.STATE,))[0].digests
        mine = {n: hashlib.sha256(int_view(p).numpy().tobytes()).hexdigest() for n, p in self.params.items()}
        return engine == mine


def trainer_main(workdir: str, steps: list[str], repeats: int, encoding: str) -> None:
    """Trainer rank: alternate A/B, one delta and one dense refit per change; write rows."""
    torch.set_num_threads(1)
    trainer = Trainer([load_checkpoint(s) for s in steps], _transport(workdir, TRAINER), encoding)
    rows = []
    for i in range(2 * repeats):
        trainer.set_state(1 - i % 2)
        rows.append(trainer.delta_refit())
        rows.append(trainer.dense_refit())
    exact = trainer.digests_match()
    trainer.transport.send(ENGINE, Envelope(MessageKind.STOP, 0, TRAINER))
    trainer.transport.flush()
    Path(workdir, "trainer.json").write_text(json.dumps(dict(rows=rows, bit_exact=exact)))
    trainer.transport.close()


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
        row["total"] = sum(row[p] for p in PHASES)
        out.append(row)
    return out


def summarize(rows: list[dict]) -> dict:
    """Best-of-N per kind, per-phase minima, and the delta/dense ratios of this run."""
    kinds = {k: [r for r in rows if r["kind"] == k] for k in ("delta", "dense")}
    out = {}
    for kind, rs in kinds.items():
        best = min(rs, key=lambda r: r["total"])
        out[kind] = dict(best=best, median_total=statistics.median(r["total"] for r in rs),
                         min_phase={p: min(r[p] for r in rs) for p in PHASES}, n=len(rs))
    pairs = [d["total"] / e["total"] for d, e in zip(kinds["delta"], kinds["dense"])]
    no_verify = [d["total"] / (e["total"] - e["verify"]) for d, e in zip(kinds["delta"], kinds["dense"])]
    out["ratio_best"] = out["delta"]["best"]["total"] / out["dense"]["best"]["total"]
    out["ratio_paired_median"] = statistics.median(pairs)
    out["ratio_vs_dense_without_verify_median"] = statistics.median(no_verify)
    out["bytes_ratio"] = out["delta"]["best"]["bytes"] / out["dense"]["best"]["bytes"]
    return out


def table(summary: dict) -> str:
    """Markdown table of the best refit of each kind."""
    head = "| refit | " + " | ".join(PHASES) + " | total s | MB moved | changed |"
    lines = [head, "|" + "---|" * (len(PHASES) + 4)]
    for kind in ("delta", "dense"):
        b = summary[kind]["best"]
        cells = " | ".join(f"{b[p]:.3f}" for p in PHASES)
        lines.append(f"| {kind} (best of {summary[kind]['n']}) | {cells} | {b['total']:.3f} | "
                     f"{b['bytes'] / 1e6:.1f} | {b['changed'] / b['numel']:.2%} |")
    lines.append(f"\ndelta/dense time: best {summary['ratio_best']:.3f}x, paired median "
                 f"{summary['ratio_paired_median']:.3f}x (vs dense without verify "
                 f"{summary['ratio_vs_dense_without_verify_median']:.3f}x); bytes {summary['bytes_ratio']:.4f}x")
    return "\n".join(lines)


def step_dirs(run: Path, steps: int) -> list[Path]:
    """``step_0 .. step_K`` of ``run``; generated with ``make_deltas`` when missing."""
    if not (run / "step_1").is_dir():
        from nemo_dcr.demo.task import make_deltas

        make_deltas(run, steps, 1e-6)
    return sorted(run.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def run(run_dir: Path, pair: tuple[int, int], repeats: int, encoding: str, steps: int = 2) -> dict:
    """Spawn trainer and engine, return the report (rows, summary, bit_exact)."""
    dirs = step_dirs(run_dir, steps)
    chosen = [str(dirs[pair[0]]), str(dirs[pair[1]])]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="nemo-dcr-bench-") as tmp:
        procs = [ctx.Process(target=engine_main, args=(tmp, chosen[0])),
                 ctx.Process(target=trainer_main, args=(tmp, chosen, repeats, encoding))]
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
                encoding=encoding, pair=[Path(c).name for c in chosen], repeats=repeats,
                bit_exact=trainer["bit_exact"], mixed_version_served=engine["mixed"],
                summary=summarize(rows), rows=rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", nargs="?", default="runs/refit_bench", type=Path)
    ap.add_argument("--pair", nargs=2, type=int, default=(1, 2), help="step indices A B to alternate")
    ap.add_argument("--repeats", type=int, default=3, help="A->B->A cycles (2 delta + 2 dense refits each)")
    ap.add_argument("--encoding", default="reference", choices=("dcr", "reference"),
                    help="payload coding of the delta refit (dcr: smaller, slower on one CPU thread)")
    ap.add_argument("--steps", type=int, default=2, help="steps to generate when RUN_DIR is empty")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    report = run(args.run_dir, tuple(args.pair), args.repeats, args.encoding, args.steps)
    print(table(report["summary"]))
    print(f"bit_exact={report['bit_exact']} mixed_version_served={report['mixed_version_served']}")
    text = json.dumps({k: v for k, v in report.items() if k != "rows"} | {"rows": report["rows"]}, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
