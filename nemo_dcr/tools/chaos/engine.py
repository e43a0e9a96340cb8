"""The chaos engine process: a real engine (the transformers model, or vLLM) behind an
:class:`~nemo_dcr.refit.EngineServer`, serving rollouts while it is refitted.

* **Generations**: the refit group (trainers + this engine) of generation ``g`` meets over its own
  gloo rendezvous file (or its own store run); when the supervisor relaunches the trainers it
  publishes ``g + 1`` and this process serves the new group with the same engine.
* **Rollouts**: a thread keeps generating under the engine's read guard and reads the engine's
  weights (sha256 of every param) right before and right after each generation; both go to the
  log with the version the guard handed out.  :mod:`.tally` counts a rollout whose weights moved
  during its generation, or differ from the weights that version had everywhere else, as a
  mixed version served: measured from the engine as it serves, not assumed.
* **Checks**: trainer rank 0 drops an independent dense export into ``checks/``; a thread compares
  it with the engine by the engine's own means (every placed element of every vLLM rank against
  the file) under the read guard and answers with the version and the weights it compared.
* **Faults acting here** (armed through files, :class:`~.state.Workdir`): crash-mid-apply,
  kill-engine (a SIGKILL of this process at a random point between a part and the reply), stall.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time
from pathlib import Path

import torch

from nemo_dcr.apply import ForwardingEngine

from .faults import ENGINE_KILL_POINTS
from .state import Workdir

PROMPT = [5, 17, 42, 7, 99]


class Served:
    """What the chaos needs of an engine besides the contract: generate, read its weights and
    compare them with a checkpoint, all without taking the read guard (the caller holds it)."""

    def __init__(self, kind: str, engine):
        self.kind, self.engine = kind, engine

    def fingerprint(self) -> str:
        """sha256 over every param's bits (16 hex digits)."""
        from nemo_dcr.apply.contract import tensor_digests

        if self.kind == "vllm":
            digests = {f"{r}:{n}": d for r, ds in enumerate(self.engine.llm.collective_rpc("dcr_digests"))
                       for n, d in ds.items()}
        else:
            digests = tensor_digests(self.engine.engine.params)
        return hashlib.sha256("".join(f"{n}={d};" for n, d in sorted(digests.items())).encode()).hexdigest()[:16]

    def generate(self) -> list[int]:
        if self.kind == "vllm":
            import vllm
            from vllm.inputs import TokensPrompt

            params = vllm.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            out = self.engine.llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
            return list(out[0].outputs[0].token_ids)
        with torch.no_grad():
            ids = torch.tensor([PROMPT])
            out = self.engine.model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids),
                                             pad_token_id=0)
        return out[0, len(PROMPT):].tolist()

    def differing(self, path: Path) -> list[str]:
        """Canonical tensors whose held elements differ from the checkpoint at ``path``."""
        if self.kind == "vllm":
            return sorted({n for bad in self.engine.llm.collective_rpc("dcr_compare", args=(str(path),)) for n in bad})
        from nemo_dcr.checkpoint import load_checkpoint
        from nemo_dcr.types import int_view

        ref = load_checkpoint(path)
        live = self.engine.tensors
        return sorted(set(ref) ^ set(live)) + [n for n in sorted(set(ref) & set(live))
                                               if not torch.equal(int_view(live[n]), int_view(ref[n].contiguous()))]


def build(kind: str, wd: Workdir, key: bytes | None, dcr):
    """The engine of ``kind`` loaded from the initial weights (each start is a fresh load)."""
    if kind == "vllm":
        from nemo_dcr.integrations.vllm.engine import VllmEngine

        return VllmEngine.start(str(wd.hf), key=key, keep_index=dcr.engine_index, threads=dcr.threads,
                                skip_tokenizer_init=True, max_num_seqs=2, max_model_len=128)
    from transformers import AutoModelForCausalLM

    from nemo_dcr.integrations.hf.engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(wd.hf, dtype=torch.float32)
    return HFEngine(model, torch.bfloat16, key=key, keep_index=dcr.engine_index, threads=dcr.threads)


class ChaosEngine(ForwardingEngine):
    """The engine contract around the real engine, with the faults that act inside it.

    Args:
        served: the engine (and its chaos accessors).
        wd: the work folder (armed faults, the log).
        log: appends one event row.
        seed: seeds the random kill points.
    """

    def __init__(self, served: Served, wd: Workdir, log, seed: int):
        super().__init__(served.engine)
        self.served, self.wd, self.log = served, wd, log
        self.rng = random.Random(seed)
        self.kill: str | None = None
        self.writes = 0
        if served.kind != "vllm":  # the transformers engine: raise between the tensors it writes
            self.inner.engine.fault = self._mid_write

    # -- faults ---------------------------------------------------------------------------------

    def arm_for(self, version: int) -> float:
        """Take the faults armed for the version whose first part just arrived; returns the seconds
        to stall (0: none)."""
        armed = self.wd.take("kill-engine")
        if armed is not None:
            self.kill = self.rng.choice(ENGINE_KILL_POINTS)
        stall = self.wd.take("stall")
        if stall is not None:
            self.log(dict(event=[version, "stalled", f"{stall['seconds']}s"]))
            return float(stall["seconds"])
        return 0.0

    def die(self, point: str, version: int) -> None:
        """SIGKILL of this process (logged first: the log is all that survives it)."""
        if self.kill != point:
            return
        self.log(dict(kill=point, version=version, pid=os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)

    def _mid_write(self, name: str) -> None:
        from nemo_dcr.apply import InjectedFault

        self.writes += 1
        if self.writes >= 2 and self.wd.take("crash") is not None:
            raise InjectedFault(f"chaos: crash after writing {name}")

    # -- the contract: what the faults act on (the rest is forwarded) ----------------------------

    def prepare(self, parts, resync: bool = False):
        from nemo_dcr.apply import InjectedFault

        self.writes = 0
        result = self.inner.prepare(parts, resync)
        self.die(ENGINE_KILL_POINTS[1], result.target_version)
        if self.served.kind == "vllm" and not resync and self.wd.take("crash") is not None:
            self.inner.rollback()
            raise InjectedFault("chaos: crash after every rank wrote and verified the version, before commit")
        return result

    def commit(self):
        result = self.inner.commit()
        self.die(ENGINE_KILL_POINTS[2], result.target_version)
        return result

def rollouts(engine: ChaosEngine, log, stop: threading.Event, pause_s: float = 0.02) -> None:
    """Generate until ``stop``; log each rollout's version and its weights before and after."""
    while not stop.is_set():
        with engine.serving() as version:
            before = engine.served.fingerprint()
            engine.served.generate()
            after = engine.served.fingerprint()
        log(dict(rollout=[version, before, after]))
        time.sleep(pause_s)


def checks(engine: ChaosEngine, wd: Workdir, log, stop: threading.Event) -> None:
    """Answer every dense export dropped into ``checks/`` (see the module docstring)."""
    while not stop.is_set():
        for path in sorted(wd.checks.glob("*.safetensors")):
            answer = path.with_suffix(".json").name
            if wd.look(f"checks/{answer}") is not None:
                continue
            with engine.serving() as version:
                bad = engine.served.differing(path)
                fp = engine.served.fingerprint()
            log(dict(check=[path.stem, version, fp, not bad]))
            wd.publish(f"checks/{answer}", dict(version=version, fingerprint=fp, differing=bad[:20]))
        time.sleep(0.05)


def _transport(cfg, wd: Workdir, generation: int):
    """This engine's endpoint of generation ``generation`` of the refit group."""
    from .config import refit_transport

    return refit_transport(cfg, wd, cfg.trainers, generation)


def _serve(cfg, wd: Workdir, server, engine: ChaosEngine, generation: int, log) -> str:
    """Serve one generation; returns ``stop`` (the trainers finished) or ``next`` (they were
    relaunched: a newer generation is published, or a trainer's connection was lost)."""
    from nemo_dcr.transport import MessageKind, TransportError, TransportTimeout

    seen: set[int] = set()
    while True:
        try:
            env = server.transport.recv(timeout=0.5)
        except TransportTimeout:
            if (wd.look("generation") or {}).get("gen", generation) > generation:
                return "next"
            continue
        except TransportError as exc:
            log(dict(event=[engine.version, "lost", str(exc)[:300]]))
            return "next"
        if env.kind in (MessageKind.DELTA, MessageKind.RESYNC) and env.version > engine.version:
            if env.version not in seen:
                seen.add(env.version)
                stall = engine.arm_for(env.version)
                if stall:
                    time.sleep(stall)  # stops reading: the trainers time out meanwhile
            if env.body:
                engine.die(ENGINE_KILL_POINTS[0], env.version)
        if not server.handle(env):
            return "stop"


def engine_main(cfg, generation: int) -> None:
    """The engine process: load, then serve every generation of the refit group until STOP."""
    from nemo_dcr.refit.server import EngineServer

    from .config import KEY, dcr_config

    wd = Workdir(cfg.workdir)

    def log(row: dict) -> None:
        wd.append("engine.jsonl", dict(row, gen=generation, pid=os.getpid(), t=round(time.time(), 3)))

    served = Served(cfg.engine, build(cfg.engine, wd, KEY if cfg.keyed else None, dcr_config(cfg)))
    engine = ChaosEngine(served, wd, log, seed=cfg.seed * 7919 + generation)
    log(dict(started=cfg.engine))
    wd.publish("engine-ready", dict(pid=os.getpid()))
    stop = threading.Event()
    threads = [threading.Thread(target=f, args=a, daemon=True)
               for f, a in ((rollouts, (engine, log, stop)), (checks, (engine, wd, log, stop)))]
    for th in threads:
        th.start()
    while True:
        server = EngineServer(engine, _transport(cfg, wd, generation), list(range(cfg.trainers)))
        wd.publish("engine-joined", dict(pid=os.getpid(), gen=generation))
        note = server.stats.note
        server.stats.note = lambda v, what, detail="", note=note: (note(v, what, detail),
                                                                   log(dict(event=[v, what, detail[:300]])))
        if _serve(cfg, wd, server, engine, generation, log) == "stop":
            break
        while (wd.look("generation") or {}).get("gen", generation) <= generation:
            time.sleep(0.2)
        generation = wd.look("generation")["gen"]
    stop.set()
    for th in threads:
        th.join(30)
    log(dict(stopped=True, mixed_version_guard=engine.inner.engine.guard.mixed_version_served
             if cfg.engine != "vllm" else engine.inner.guard.mixed_version_served))
    try:
        if hasattr(server.transport, "close"):  # DistTransport; the store's files need no closing
            server.transport.close(30)
    finally:
        if cfg.engine == "vllm":
            served.engine.close()
