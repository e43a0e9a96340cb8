"""Which fault hits which refit, and how each is injected.

Fault kinds and how each is meant to be caught (the catch is measured, see :mod:`.tally`):

Messages and the engine's transaction:
  drop: trainer rank 0 loses its first payload part -> the engine sees a part-index gap -> NACK
      (MissingPartError) -> the trainers resync what differs.
  duplicate: every part is sent twice -> the engine drops the copies (counted per version).
  reorder: parts are sent in reverse order -> the engine puts them back in order (counted).
  corrupt: trainer rank 0 flips bytes at a random offset of a payload part: preamble, header,
      record bodies or MAC alike -> the codec refuses it (its exception names the rule) -> NACK.
  crash-mid-apply: the engine raises inside the transaction (the transformers engine after its
      2nd tensor is written; vLLM once every rank wrote and verified the version, before commit)
      -> rollback -> NACK -> resync.
  trainer-resume: the trainers reload masters and optimizer from two refits ago into a fresh
      DeltaRefit -> its attach finds the engine's checksums differ -> resync of what moved.
  version-skew: the payload's base version is off by one -> VersionMismatchError -> NACK.

Processes, links and disks (real: signals, sleeps, a full filesystem):
  kill-engine: SIGKILL of the engine process at a random point between receiving a part and
      replying (after part k arrived, after the version was written and verified, or after it
      committed) -> the trainers lose the exchange, the supervisor sees the death and starts a
      fresh engine from the initial weights -> the trainers attach to it: resync.
  kill-trainer: SIGKILL of a random trainer rank mid-refit (after k of its messages went out, or
      after the engine acknowledged) -> the supervisor sees the death, stops the other ranks and
      relaunches the job from its last trainer checkpoint -> the engine, ahead of or behind that
      checkpoint, is brought back to it by the restarted trainers' attach.
  stall: the engine stops reading for longer than ``dcr.reply_timeout_s`` when the version's first
      part arrives -> the trainers time out with a clear error ("no reply ... within") and the
      next refit recovers first (what the engine holds is unknown) and succeeds.
  disk-full: (store transport) the store's folder fills up for real before the refit (a tmpfs
      filled to ENOSPC, or a read-only folder) -> every send fails naming the OS error, nothing
      is published -> the space returns after the refit and the next refit recovers.
"""

from __future__ import annotations

import dataclasses
import random

from nemo_dcr.codec.header import PREAMBLE, read_preamble
from nemo_dcr.transport import Envelope

MESSAGE_FAULTS = ("drop", "duplicate", "reorder", "corrupt", "crash-mid-apply", "trainer-resume", "version-skew")
PROCESS_FAULTS = ("kill-engine", "kill-trainer", "stall", "disk-full")
FAULTS = MESSAGE_FAULTS + PROCESS_FAULTS
FAILS_BY_DESIGN = ("stall", "disk-full")
"""Faults whose refit cannot commit: the next refit (which gets no fault) must recover."""
MAC_BYTES = 32
ENGINE_KILL_POINTS = ("after a part arrived", "after the version was written", "after the version committed")
TRAINER_KILL_POINTS = ("while sending", "after the engine acknowledged")


def schedule(refits: int, faults: tuple[str, ...], seed: int, fault_rate: float) -> dict[int, str]:
    """Refit index (1-based) -> fault kind; identical in every process.

    With ``fault_rate >= 1`` every refit from the second on gets a fault, cycling through the
    kinds in a seeded order; otherwise each refit draws a fault with that probability.  The refit
    after one that fails by design (:data:`FAILS_BY_DESIGN`) is its recovery and gets no fault.
    """
    rng = random.Random(seed)
    order = list(faults)
    rng.shuffle(order)
    plan: dict[int, str] = {}
    i = 2
    while i <= refits and faults:
        if fault_rate >= 1.0:
            plan[i] = order[len(plan) % len(order)]
        elif rng.random() < fault_rate:
            plan[i] = rng.choice(faults)
        if plan.get(i) in FAILS_BY_DESIGN and i == refits:
            del plan[i]  # no refit after it would recover it
        i += 2 if plan.get(i) in FAILS_BY_DESIGN else 1
    return plan


def region(body: bytes, offset: int, keyed: bool) -> str:
    """Which part of a payload ``offset`` falls in: preamble, header, records or mac."""
    if offset < PREAMBLE.size:
        return "preamble"
    if keyed and offset >= len(body) - MAC_BYTES:
        return "mac"
    _, h_len, _ = read_preamble(body)
    return "header" if offset < PREAMBLE.size + h_len else "records"


def corrupt(envs: list[Envelope], rng: random.Random, keyed: bool, log: list) -> list[Envelope]:
    """Flip 1-3 bytes at a random offset of one non-empty part; ``log`` gets (part, offset, region)."""
    parts = [i for i, e in enumerate(envs) if e.body]
    if not parts:
        return envs
    i = rng.choice(parts)
    body = bytearray(envs[i].body)
    offset = rng.randrange(len(body))
    log.append((envs[i].part, offset, region(envs[i].body, offset, keyed)))
    for k in range(offset, min(len(body), offset + rng.randint(1, 3))):
        body[k] ^= rng.randint(1, 255)
    e = envs[i]
    out = list(envs)
    out[i] = dataclasses.replace(e, body=bytes(body))
    return out


def tamper_for(kind: str | None, rank: int, rng: random.Random, keyed: bool, log: list):
    """The outgoing-envelope tamper of ``kind`` on trainer ``rank`` (None: send as is)."""
    if kind == "drop" and rank == 0:
        return lambda envs: envs[1:]
    if kind == "duplicate":
        return lambda envs: envs + envs
    if kind == "reorder":
        return lambda envs: envs[::-1]
    if kind == "corrupt" and rank == 0:
        return lambda envs: corrupt(envs, rng, keyed, log)
    return None
