"""The chaos report: every injected fault, whether it was detected and how, whether the engine
recovered, all counted from what happened (trainer rows and the engine server's own events).

A fault at refit ``i`` covers the engine versions ``(version_before, version]`` of that refit
(the delta, and the resync that may follow it).  It counts as *detected* only when the receiver
did the thing the fault calls for in that range: refused the version with the matching error
(drop: MissingPartError; corrupt: any codec rule, named by its exception; crash-mid-apply:
InjectedFault; version-skew: VersionMismatchError), dropped duplicate parts, put reordered parts
back in order, or (trainer-resume) the restarted trainer's checksum comparison with the engine
found tensors that differ.  *Recovered*: the refit ended committed and bit-exact against the
independent dense export.
"""

from __future__ import annotations

from collections import Counter

from nemo_dcr.codec import errors as codec_errors

CODEC_ERRORS = {n for n in dir(codec_errors) if n.endswith("Error") and n != "DeltaFormatError"}
EXPECTED_REFUSAL = {"drop": {"MissingPartError"}, "crash-mid-apply": {"InjectedFault"},
                    "version-skew": {"VersionMismatchError"}, "corrupt": CODEC_ERRORS}


def _events(engine: dict, lo: int, hi: int) -> list[tuple[int, str, str]]:
    return [tuple(e) for e in engine["events"] if lo < e[0] <= hi]


def _detection(row: dict, events: list) -> str | None:
    """How the fault of ``row`` was detected (None: it was not)."""
    kind = row["fault"]
    if kind in EXPECTED_REFUSAL:
        for _, what, detail in events:
            name = detail.split(":", 1)[0]
            if what == "refused" and name in EXPECTED_REFUSAL[kind]:
                return name
        return None
    if kind == "duplicate":
        return "duplicates dropped" if any(w == "duplicate" for _, w, _ in events) else None
    if kind == "reorder":
        return "parts reordered" if any(w == "reordered" for _, w, _ in events) else None
    if kind == "trainer-resume":
        return "checksums differ" if any("differ at (re)start" in d for d in row["detected"]) else None
    raise ValueError(f"unknown fault kind {kind!r}")


def summarize(cfg, rows: list[dict], engine: dict) -> dict:
    """The JSON report of a chaos run."""
    by = {k: dict(injected=0, detected=0, recovered=0) for k in cfg.faults}
    how: Counter = Counter()
    regions: Counter = Counter()
    false_alarms = 0
    for r in rows:
        events = _events(engine, r["version_before"], r["version"])
        if r["fault"] is None:
            false_alarms += sum(1 for _, w, _ in events if w == "refused")
            continue
        k = by[r["fault"]]
        k["injected"] += 1
        found = _detection(r, events)
        if found:
            k["detected"] += 1
            how[f"{r['fault']}: {found}"] += 1
        k["recovered"] += int(r["committed"] and r["bit_exact"])
        regions.update(c[2] for c in r["corrupted"])
    summary = {k: v for k, v in engine.items() if k != "events"}
    return dict(
        refits=len(rows), faults_injected={k: v["injected"] for k, v in by.items()},
        detected=sum(v["detected"] for v in by.values()), recovered=sum(v["recovered"] for v in by.values()),
        by_fault=by, detected_by=dict(how), corrupted_regions=dict(regions), refusals_without_fault=false_alarms,
        bit_exact_after_every_refit=all(r["bit_exact"] for r in rows) and len(rows) == cfg.refits,
        mixed_version_served=engine["mixed_version_served"], engine=summary,
        changed_per_refit=[r["changed"] for r in rows], seed=cfg.seed, trainer_ranks=cfg.trainers,
        engine_ranks=1, keyed=cfg.keyed,
        trainer=f"megatron-core GPTModel {cfg.model} at TP={cfg.tp} PP={cfg.pp} (fp32-master AdamW, real steps)")
