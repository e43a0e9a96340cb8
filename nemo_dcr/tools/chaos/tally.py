"""The chaos report: every injected fault, whether it was detected and how, whether the run
recovered, all counted from what the processes logged as it happened (:mod:`.state`).

A fault counts as *detected* only when the side that must react shows the reaction:

* messages and the transaction: the engine server's own events of that refit's versions (in the
  refit group generation it ran in): a refusal with the matching error (drop: MissingPartError;
  corrupt: any codec rule, named by its exception; crash-mid-apply: InjectedFault; version-skew:
  VersionMismatchError), dropped duplicates, parts put back in order; trainer-resume: the
  restarted trainer's checksum comparison found tensors that differ;
* kill-engine: the engine logged the kill point, the supervisor saw that process exit by SIGKILL,
  and the trainers lost the exchange and wired up to its successor;
* kill-trainer: the rank logged the kill point and the supervisor saw that very process exit by
  SIGKILL (and relaunched the job);
* stall: the engine logged the stall and the trainers' refit failed on the reply timeout;
* disk-full: the trainers' sends failed with the operating system's error.

*Recovered*: the refit (after a kill-trainer: the relaunched job's first sync; after a stall or a
full disk: the next refit) ended committed, and the engine then equalled the trainer's
independent dense export bit for bit (the engine's own comparison).

``mixed_version_served`` is measured from the rollouts: a rollout whose engine weights changed
between the start and the end of its generation, or differ from the weights its version had at
the dense check (or in the other rollouts of that version), is a mixed version served.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from nemo_dcr.codec import errors as codec_errors

from .faults import FAILS_BY_DESIGN
from .state import Workdir

CODEC_ERRORS = {n for n in dir(codec_errors) if n.endswith("Error") and n != "DeltaFormatError"}
EXPECTED_REFUSAL = {"drop": {"MissingPartError"}, "crash-mid-apply": {"InjectedFault"},
                    "version-skew": {"VersionMismatchError"}, "corrupt": CODEC_ERRORS}


def _events(engine: list[dict], gen: int, lo: int, hi: int) -> list[tuple[int, str, str]]:
    return [tuple(r["event"]) for r in engine if "event" in r and r["gen"] == gen and lo < r["event"][0] <= hi]


def _error_names(detail: str) -> set[str]:
    """The exceptions a refusal names: its own, and those of the ranks it reports (an engine over
    several ranks refuses with ``RankRefusedError: ... rank 0: AuthenticationError: ...``)."""
    return set(re.findall(r"\b([A-Z]\w*(?:Error|Fault)):", detail))


def _message_fault(row: dict, engine: list[dict]) -> str | None:
    kind, events = row["fault"], _events(engine, row["gen_before"], row["version_before"], row["version"])
    if row["rewired"]:
        return None
    if kind in EXPECTED_REFUSAL:
        for _, what, detail in events:
            named = _error_names(detail) & EXPECTED_REFUSAL[kind] if what == "refused" else set()
            if named:
                return min(named)
        return None
    if kind == "duplicate":
        return "duplicates dropped" if any(w == "duplicate" for _, w, _ in events) else None
    if kind == "reorder":
        return "parts reordered" if any(w == "reordered" for _, w, _ in events) else None
    if kind == "trainer-resume":
        return "checksums differ" if any("differ at (re)start" in d for d in row["detected"]) else None
    raise ValueError(f"unknown fault kind {kind!r}")


def _process_fault(row: dict, engine: list[dict], deaths: list[dict]) -> str | None:
    kind, gen = row["fault"], row["gen_before"]
    if kind == "kill-engine":
        kills = [r for r in engine if "kill" in r and r["gen"] == gen]
        died = [d for d in deaths if d["died"] == "engine" and d["gen"] == gen and d["code"] == -9]
        if kills and died and row["rewired"]:
            return f"engine SIGKILL {kills[-1]['kill']}: the supervisor saw exit -9, the trainers lost the exchange"
        return None
    if kind == "stall":
        stalled = [e for e in _events(engine, gen, row["version_before"], row["version_before"] + 1)
                   if e[1] == "stalled"]
        timed_out = any("no reply from engine rank" in d for d in row["detected"])
        return "reply timeout while the engine stalled" if stalled and timed_out and not row["committed"] else None
    if kind == "disk-full":
        full = [d for d in row["detected"] if "could not send" in d and ("No space left" in d or "Permission" in d)]
        return "send refused by the OS: " + ("ENOSPC" if "No space left" in full[0] else "EACCES") if full else None
    raise ValueError(f"unknown fault kind {kind!r}")


def _kill_trainer(kills: list[dict], deaths: list[dict], rows: list[dict]) -> list[tuple[str | None, bool]]:
    """Each trainer kill: how it was seen (None: the supervisor did not see that process die by
    SIGKILL), and whether the relaunched job's first sync recovered (committed, then bit-exact)."""
    out = []
    restarts = [r for r in rows if r.get("restart")]
    for k in kills:
        died = [d for d in deaths if d["died"] == "trainer" and d["pid"] == k["pid"] and d["code"] == -9]
        after = [r for r in restarts if r["t"] > k["t"]]
        ok = bool(after) and after[0]["committed"] and after[0]["bit_exact"] is True
        out.append((f"SIGKILL {k['point']}: the supervisor saw exit -9, relaunched from the checkpoint"
                    if died else None, ok))
    return out


def _mixed(engine: list[dict]) -> tuple[int, int]:
    """(mixed versions served, rollouts) measured from the rollouts and the checks."""
    rollouts = [(r["gen"], *r["rollout"]) for r in engine if "rollout" in r]
    checked = {(r["gen"], r["check"][1]): r["check"][2] for r in engine if "check" in r and r["check"][3]}
    seen: dict[tuple, Counter] = defaultdict(Counter)
    for gen, version, before, _ in rollouts:
        seen[(gen, version)][before] += 1
    mixed = 0
    for gen, version, before, after in rollouts:
        want = checked.get((gen, version)) or seen[(gen, version)].most_common(1)[0][0]
        mixed += int(before != after or before != want)
    return mixed, len(rollouts)


def summarize(cfg, wd: Workdir, seconds: float) -> dict:
    """The JSON report of a chaos run."""
    rows, engine = wd.read("rows.jsonl"), wd.read("engine.jsonl")
    supervisor, kills = wd.read("supervisor.jsonl"), wd.read("faults.jsonl")
    deaths = [r for r in supervisor if "died" in r]
    by = {k: dict(injected=0, detected=0, recovered=0) for k in cfg.faults}
    how: Counter = Counter()
    regions: Counter = Counter()
    false_alarms = unexpected_failures = 0
    for n, r in enumerate(rows):
        if r["fault"] is None:
            if not r.get("restart"):
                false_alarms += sum(1 for e in _events(engine, r["gen_before"], r["version_before"], r["version"])
                                    if e[1] == "refused")
                unexpected_failures += int(not r["committed"] and not _after_failure(rows, n))
            continue
        if r["fault"] == "kill-trainer":
            continue  # counted from the kills the ranks logged (the killed refit has no row)
        k = by[r["fault"]]
        k["injected"] += 1
        found = _message_fault(r, engine) if r["fault"] not in ("kill-engine", "stall", "disk-full") \
            else _process_fault(r, engine, deaths)
        if found:
            k["detected"] += 1
            how[f"{r['fault']}: {found}"] += 1
        done = rows[n + 1] if r["fault"] in FAILS_BY_DESIGN and n + 1 < len(rows) else r
        k["recovered"] += int(done["committed"] and done["bit_exact"] is True)
        regions.update(c[2] for c in r["corrupted"])
    for found, ok in _kill_trainer(kills, deaths, rows):
        k = by.setdefault("kill-trainer", dict(injected=0, detected=0, recovered=0))
        k["injected"] += 1
        k["detected"] += int(found is not None)
        k["recovered"] += int(found is not None and ok)
        if found:
            how[f"kill-trainer: {found}"] += 1
    return _report(cfg, rows, engine, supervisor, by, how, regions, false_alarms, unexpected_failures, seconds)


def _after_failure(rows: list[dict], n: int) -> bool:
    """Row ``n`` follows a refit that failed by design (it may carry on its recovery)."""
    return n > 0 and rows[n - 1]["fault"] in FAILS_BY_DESIGN


def _report(cfg, rows, engine, supervisor, by, how, regions, false_alarms, unexpected, seconds) -> dict:
    committed = [r for r in rows if r["committed"]]
    not_exact = [r["refit"] for r in committed if r["bit_exact"] is not True]
    failed = [r for n, r in enumerate(rows) if not r["committed"]]
    by_design = all(r["fault"] in FAILS_BY_DESIGN for r in failed)
    mixed, served = _mixed(engine)
    injected = sum(v["injected"] for v in by.values())
    events = Counter(r["event"][1] for r in engine if "event" in r)
    first_refit = min((r["t"] for r in rows if r["refit"] > 0), default=0.0)
    rss = [r["rss"] for r in supervisor if "rss" in r and r["rss"]["t"] >= first_refit]  # loaded and refitting
    hours = seconds / 3600
    return dict(
        refits=len({r["refit"] for r in rows if r["refit"] > 0}), refit_rows=len(rows), faults_injected=injected,
        detected=sum(v["detected"] for v in by.values()), recovered=sum(v["recovered"] for v in by.values()),
        by_fault=by, detected_by=dict(how), corrupted_regions=dict(regions), refusals_without_fault=false_alarms,
        failed_without_fault=unexpected, mismatched_refits=not_exact,
        bit_exact_after_every_refit=not not_exact and by_design and bool(rows),
        mixed_version_served=mixed, rollouts=served,
        engine=dict(events=dict(events), starts=sum(1 for r in engine if "started" in r),
                    kills=sum(1 for r in engine if "kill" in r)),
        restarts=dict(engine=sum(1 for r in supervisor if r.get("started") == "engine") - 1,
                      trainer_jobs=len({r["gen"] for r in supervisor if r.get("started") == "trainer"}) - 1),
        deaths=[dict(died=d["died"], rank=d["rank"], code=d["code"]) for d in supervisor if "died" in d],
        seconds=round(seconds, 1), refits_per_hour=round(len(rows) / hours, 1) if hours else None,
        faults_per_hour=round(injected / hours, 1) if hours else None, memory_mb=_memory(rss),
        memory_trace=_trace(rss), duration_s=cfg.duration_s,
        changed_per_refit=[r["changed"] for r in rows], seed=cfg.seed, trainer_ranks=cfg.trainers, engine_ranks=1,
        keyed=cfg.keyed, engine_kind=cfg.engine, transport=cfg.transport, verify=cfg.verify,
        trainer=f"megatron-core GPTModel dense-tiny (width 128) at TP={cfg.tp} PP={cfg.pp} (fp32-master AdamW, "
                f"real steps)")


def _trace(samples: list[dict], every_s: float = 600.0) -> list[dict]:
    """The resident memory (MB) of the engine and the trainer ranks, one sample per ``every_s``
    from the first refit on (whichever processes were alive then): growth over a soak, across
    restarts."""
    out, next_t = [], None
    for s in samples:
        if next_t is None or s["t"] >= next_t:
            t0 = out[0]["t"] if out else s["t"]
            out.append(dict(t=s["t"], minute=round((s["t"] - t0) / 60, 1), **{
                role: s[role]["mb"] for role in ("engine", "trainers") if role in s}))
            next_t = s["t"] + every_s
    return [{k: v for k, v in r.items() if k != "t"} for r in out]


def _memory(samples: list[dict]) -> dict:
    """Resident memory (MB) of the engine and the trainer ranks at the first and the last sample of
    the longest-lived process of each (restarts begin afresh)."""
    out = {}
    for role in ("engine", "trainers"):
        by_pid = defaultdict(list)
        for s in samples:
            if role in s:
                by_pid[s[role]["pid"]].append(s[role]["mb"])
        if by_pid:
            longest = max(by_pid.values(), key=len)
            out[role] = dict(first=longest[0], last=longest[-1], max=max(longest), samples=len(longest))
    return out
