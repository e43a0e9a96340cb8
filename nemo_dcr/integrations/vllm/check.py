"""The engine-truth check: a live vLLM engine delta-refit along some steps, against a fresh one.

:func:`check_engine` starts a vLLM engine on a base checkpoint (probing every param; an engine
that cannot be refit is refused here, before anything is sent), attaches a trainer holding the
base weights through the one refit path (``DeltaRefit`` over canonical tensors, in this process;
``dcr.preflight`` on, so the first sync is compared with the engine's own reload), refits it to
each step's weights, then compares every param, buffer and tensor attribute of every rank with a
*fresh* engine loaded densely from the last step (its loader and post-load processing
included), by integer views, and compares greedy tokens.  ``nemo-dcr check-engine`` runs it on
random weights made from a config; the vLLM tests run it per model family.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from nemo_dcr.apply import EngineRefusedError, PreflightError

from .verify import StateDiff, engine_state, state_differences

EXIT_EXACT, EXIT_DIFFERS, EXIT_BAD_ARGS, EXIT_REFUSED = 0, 1, 2, 3
"""``nemo-dcr check-engine`` exit codes."""

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 6]
"""Token-id prompts of the greedy comparison (no tokenizer needed)."""


@dataclass
class EngineCheck:
    """What :func:`check_engine` found.

    Attributes:
        refused: what -> why, when the engine was refused up front (nothing was sent).
        kinds: engine param kind -> count, over every rank (in_place, transformed, ...).
        reloaded: canonical tensors refit by reloading them through the engine's loader.
        rearranged: engine params followed through a known post-load shuffle.
        derived: engine params re-derived by a post-load step.
        skipped: canonical tensors the engine's loader does not load (named by the probe).
        refits: per refit, ``version``, ``mode``, ``changed``, ``committed``, ``resynced``,
            ``seconds`` and what it ``detected`` (the first sync resyncs what the engine lacks).
        differences: every tensor that differs from the fresh engine (empty: bit-exact).
        preflight: the first sync's preflight differences (empty: bit-identical to the reload).
        tokens_equal: greedy tokens of both engines equal (None: not compared).
        attach_seconds: engine start to attached (probe, attach, first sync, preflight).
        probe: rank 0's probe cost (seconds, ``load_weights`` calls, peak probe bytes).
    """

    refused: dict[str, str] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    reloaded: list[str] = field(default_factory=list)
    rearranged: list[str] = field(default_factory=list)
    derived: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    refits: list[dict] = field(default_factory=list)
    differences: list[StateDiff] = field(default_factory=list)
    preflight: list[str] = field(default_factory=list)
    tokens_equal: bool | None = None
    attach_seconds: float = 0.0
    probe: dict = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        """Bit-exact: nothing refused, every refit committed (the delta refits without a recovery
        resync), no difference from the fresh engine or in the preflight, tokens equal."""
        refits_ok = bool(self.refits) and all(r["committed"] for r in self.refits) \
            and not any(r["resynced"] for r in self.refits[1:])
        return (not self.refused and refits_ok and not self.differences and not self.preflight
                and self.tokens_equal is True)

    @property
    def exit_code(self) -> int:
        """0 bit-exact, 1 something differs, 3 refused up front."""
        return EXIT_REFUSED if self.refused else EXIT_EXACT if self.exact else EXIT_DIFFERS

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(exact=self.exact, exit_code=self.exit_code, differences=[asdict(d) for d in self.differences])
        return out

    def lines(self) -> list[str]:
        """A human-readable account."""
        if self.refused:
            return ["refused before the first sync:"] + [f"  {w}: {why}" for w, why in sorted(self.refused.items())]
        out = [f"engine params by kind: {dict(sorted(self.kinds.items()))}"]
        for what, items in (("reloaded through the loader", self.reloaded), ("rearranged (followed)", self.rearranged),
                            ("derived (re-run)", self.derived), ("skipped by the engine", sorted(self.skipped))):
            if items:
                out.append(f"{what}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}")
        out += [f"refit v{r['version']} {r['mode']}: {r['changed']} changed, committed={r['committed']}, "
                f"resynced={r['resynced']}, {r['seconds']:.2f} s{'; ' + r['detected'] if r['detected'] else ''}"
                for r in self.refits]
        out += [f"preflight: {d}" for d in self.preflight]
        out += [f"differs from a fresh engine: {d}" for d in self.differences]
        out.append(f"greedy tokens equal to a fresh engine's: {self.tokens_equal}")
        out.append("BIT-EXACT" if self.exact else "NOT BIT-EXACT")
        return out


def _summary(check: EngineCheck, engine) -> None:
    truth = engine.truth
    check.kinds = dict(Counter(t["kind"] for rank in truth for t in rank.values()))
    check.reloaded = sorted({s for rank in truth for t in rank.values() if t["kind"] == "transformed"
                             for s in t["sources"]})
    check.rearranged = sorted({n for rank in truth for n, t in rank.items() if t["kind"] == "rearranged"})
    check.derived = sorted({n for rank in truth for n, t in rank.items() if t["kind"] == "derived"})
    check.skipped = dict(engine.skipped)
    check.probe = dict(engine.probed[0]["stats"])


def check_engine(base: str | Path, steps: Sequence[str | Path], tp: int = 1,
                 key: bytes = b"check-engine-key-0123456789abcd",
                 **engine_args) -> EngineCheck:
    """Refit a vLLM engine started on ``base`` along ``steps`` (HF folders), then compare it with a
    fresh engine on ``steps[-1]``.

    Args:
        base: HF folder the engine starts from (and the trainer's first weights).
        steps: HF folders of the trainer's weights after each step (same tensors as ``base``).
        tp: tensor-parallel ranks of both engines.
        key: HMAC key of the payloads.
        **engine_args: more ``vllm.LLM`` arguments (defaults: no tokenizer, small engine).
    """
    from nemo_dcr.checkpoint import load_checkpoint
    from nemo_dcr.config.schema import DcrConfig
    from nemo_dcr.refit import DeltaRefit, colocated_wiring
    from nemo_dcr.refit.canonical import CanonicalSource

    from .engine import VllmEngine, greedy, start_llm

    args = {**dict(skip_tokenizer_init=True, max_num_seqs=4, max_model_len=256), **engine_args}
    check = EngineCheck()
    t0 = time.perf_counter()
    try:
        engine = VllmEngine.start(str(base), tensor_parallel_size=tp, key=key, **args)
    except EngineRefusedError as exc:
        check.refused = exc.reasons
        return check
    with engine:
        _summary(check, engine)
        params = {n: t.clone() for n, t in load_checkpoint(base).items()}
        cfg = DcrConfig(transport="inprocess", reply_timeout_s=900, verify="full", telemetry_encodings=[])
        refit = DeltaRefit(cfg, CanonicalSource(params), colocated_wiring(cfg, 0, key), engine, key=key)
        try:
            try:
                first = refit.attach()
            except PreflightError as exc:
                check.preflight = exc.differences
                first = None
            check.attach_seconds = time.perf_counter() - t0
            if first is not None:
                check.refits.append(_row(first))
                for step in steps:
                    for n, t in load_checkpoint(step).items():
                        params[n].copy_(t)
                    check.refits.append(_row(refit.step()))
        finally:
            refit.close(60)
        with engine.serving():
            got = engine_state(engine.llm)
        tokens = engine.generate(PROMPTS)[0]
    fresh = start_llm(str(steps[-1] if steps else base), tp, **args)  # a plain engine: nothing probed, attached
    try:
        want, want_tokens = engine_state(fresh), greedy(fresh, PROMPTS)
    finally:
        fresh.llm_engine.engine_core.shutdown()
    check.differences = state_differences(got, want)
    check.tokens_equal = tokens == want_tokens
    return check


def _row(r) -> dict:
    return dict(version=r.version, mode=r.mode, changed=r.changed, committed=r.committed, resynced=r.resynced,
                seconds=round(r.times.get("total", 0.0), 4), detected="; ".join(r.detected)[:600])
