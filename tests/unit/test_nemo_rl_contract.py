"""The NeMo-RL plugin driven the way NeMo-RL's own driver drives it (stand-in: tests/standins/nemo_rl_standin.py).

Policy ``send_weights`` and every vLLM worker's ``receive_weight_batches`` run at the same time,
as NeMo-RL's ``sync_weights`` submits them in one ``ray.get``; vLLM runs at TP=2 (and DP=2) on the
loader-contract model stand-in, starting from dummy weights.  After every sync every vLLM worker's
parameters are compared, as integer views, with an independent reference: a fresh stand-in model
that loaded the policy's tensors through its own ``load_weights`` (what NeMo-RL's dense refit
would have produced), never with the refit's own mirror or checksums.

The Megatron cases run two policy worker processes over real megatron-core shards (TP=2 on gloo,
tests/standins/megatron_policy_standin.py): capture from the shards with NeMo-RL's export left
unstarted, and the export path where the plugin cannot read the model.
"""

from __future__ import annotations

import re

import pytest
import torch

from nemo_dcr.config import ConfigError
from nemo_dcr.integrations.nemo_rl import SELECTOR, DcrCheckpointEngine
from nemo_dcr.telemetry import read_steps
from nemo_dcr.tools.run_report import markdown
from nemo_dcr.transport import MessageKind
from nemo_dcr.transport.store import StoreTransport
from nemo_dcr.types import int_view
from tests.report_reader import check_phases_shown
from tests.standins.nemo_rl_standin import (SKIPPED, PolicyWorker, Synchronizer, busy, initial_state, train_step,
                                            vllm_engines)
from tests.standins.vllm_standin import StandinDims, reference_mismatches_of

D = StandinDims(hidden=32, heads=4, kv_heads=1, head_dim=8, ffn=64, vocab=100, pad_to=64, experts=4, moe_ffn=32)
TP, POLICY = 2, 2


@pytest.fixture
def refit_cfg(tmp_path) -> dict:
    key = tmp_path / "hmac.key"
    key.write_bytes(b"nemo-rl-contract-test-key-0123456789")
    return {"update_weights_bucket_memory_ratio": 0.05, "url": str(tmp_path / "refit"), "key_file": str(key),
            "reply_timeout_s": 60, "verify": "incremental", "verify_steps": 3}


def mismatches(state: dict, engines) -> list[str]:
    """Params of each vLLM worker whose bits differ from a fresh model loaded with ``state``."""
    return reference_mismatches_of(state, engines, D, TP)


def versions(engines) -> list[int]:
    return [w.checkpoint_engine.rollout.last["version"] for e in engines for w in e]


def policy_workers(state, delay=0.0):
    return [PolicyWorker(r, state, delay) for r in range(POLICY)]


def step_all(state, policy, step) -> None:
    train_step(state, step)
    for p in policy:
        train_step(p.state, step)


@pytest.mark.parametrize("export_delay,busy_max,dp", [(0.0, 0.0, 1), (0.01, 0.0, 1), (0.0, 0.3, 1), (0.0, 0.1, 2)],
                         ids=["fast-export", "slow-export", "busy-engines", "dp2"])
def test_concurrent_syncs_are_bit_exact_after_every_step(refit_cfg, tmp_path, export_delay, busy_max, dp):
    state = initial_state(D)
    policy = policy_workers(state, export_delay)
    engines = vllm_engines(D, dp, TP)
    for i, w in enumerate(w for e in engines for w in e):
        w.busy_s = busy(i, busy_max)
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    sync.init_communicator()
    assert mismatches(state, engines)  # dummy weights
    seen = []
    for step in range(4):
        if step:
            step_all(state, policy, step)
        sync.sync_weights()
        assert not sync.is_stale and mismatches(state, engines) == [], step
        r = policy[0].checkpoint_engine.policy.last
        assert r.committed and r.verified and versions(engines) == [r.version] * (dp * TP)
        if step == 0:  # vLLM starts from dummy weights: the first sync sends everything
            assert r.mode == "attach" and r.resynced
        else:
            assert r.mode == "delta" and not r.resynced and r.payload_bytes < r.dense_bytes / 3, r
        seen.append(r.version)
    assert seen == sorted(set(seen))
    assert all(w.loaded_tensors == 0 for e in engines for w in e)  # nothing went through load_weights
    rows = read_steps(tmp_path / "refit")  # the one row schema, written through TelemetryWriter
    assert [r["version"] for r in rows] == seen and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["times"]["export"] > 0 and r["sync_s"] >= r["times"]["total"] for r in rows)
    check_phases_shown(rows, markdown(rows))
    session = tmp_path / "refit" / f"session-{policy[0].checkpoint_engine.policy.topo.session}"
    assert sorted(p.name for p in session.iterdir()) == ["sync-000003", "sync-000004"]  # older syncs removed
    assert not list((tmp_path / "refit").rglob("*.env"))  # every message was consumed and deleted


def test_dp_replicas_share_one_copy_of_the_first_sync_on_disk(refit_cfg, tmp_path):
    """vLLM DP=2 x TP=2: both replicas hold the same views, so each policy worker writes every
    payload part of the first sync once (hard-linked for the second replica): the bytes written
    into the shared folder are those of DP=1, while twice the bytes reach the vLLM workers."""
    dims = StandinDims(hidden=64, heads=4, kv_heads=1, head_dim=8, ffn=128, vocab=256, pad_to=64, experts=4,
                       moe_ffn=32)
    written, sent = {}, {}
    for dp in (1, 2):
        state = initial_state(dims)
        policy, engines = policy_workers(state), vllm_engines(dims, dp, TP)
        sync = Synchronizer(policy, engines, SELECTOR, {**refit_cfg, "url": str(tmp_path / f"refit-dp{dp}")})
        sync.sync_weights()
        sides = [p.checkpoint_engine.policy for p in policy]
        assert sides[0].last.mode == "attach" and sides[0].last.committed
        assert reference_mismatches_of(state, engines, dims, TP) == []  # every replica as its own fresh load
        written[dp] = sum(s.transport.bytes_written for s in sides)
        sent[dp] = sum(s.last.payload_bytes for s in sides[:1])
        assert not [p for p in (tmp_path / f"refit-dp{dp}").rglob("*") if p.is_file() and p.name != "telemetry.jsonl"]
    assert sent[2] == 2 * sent[1] and written[1] >= sent[1]  # payload_bytes: every receiver counted
    assert written[2] < 1.08 * written[1], (written, sent)


def test_each_policy_worker_keeps_only_its_owned_tensors(refit_cfg):
    state = initial_state(D)
    policy, engines = policy_workers(state), vllm_engines(D, 1, TP)
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    sync.sync_weights()
    held = [set(p.checkpoint_engine.policy.held) for p in policy]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(state) - {SKIPPED} and all(held)
    assert policy[0].checkpoint_engine.policy.topo.unloaded == {SKIPPED}  # vLLM skips it: so does the refit
    for p in policy:
        for n, t in p.checkpoint_engine.policy.held.items():
            assert torch.equal(int_view(t), int_view(state[n]))
    for w in engines[0]:  # the rollout engine writes into the live params: no copy of the model
        live = {p.data_ptr() for p in w.model_runner.model.parameters()}
        assert {t.data_ptr() for t in w.checkpoint_engine._engine.params.values()} <= live


def test_release_after_refit_keeps_the_session(refit_cfg):
    state = initial_state(D)
    policy, engines = policy_workers(state), vllm_engines(D, 1, TP)
    sync = Synchronizer(policy, engines, SELECTOR, {**refit_cfg, "release_after_refit": True})
    modes = []
    for step in range(3):  # NeMo-RL finalizes every engine after each sync and re-initialises them
        if step:
            step_all(state, policy, step)
        sync.sync_weights()
        assert not sync._ready and mismatches(state, engines) == []
        modes.append(policy[0].checkpoint_engine.policy.last.mode)
    assert modes == ["attach", "delta", "delta"]  # the same engine objects: the same session


def test_policy_restart_mid_run(refit_cfg):
    state = initial_state(D)
    engines = vllm_engines(D, 1, TP)
    sync = Synchronizer(policy_workers(state), engines, SELECTOR, refit_cfg)
    for step in range(2):
        if step:
            step_all(state, sync.policy, step)
        sync.sync_weights()
    before = versions(engines)[0]
    train_step(state, 2)  # trained, checkpointed, then the policy workers died
    policy = policy_workers(state)  # restarted from that checkpoint: new engine objects
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    sync.init_communicator()
    sync.sync_weights()
    r = policy[0].checkpoint_engine.policy.last
    assert r.mode == "attach" and r.committed and mismatches(state, engines) == []
    assert r.version > before and versions(engines) == [r.version] * TP  # versions come from the engines
    step_all(state, policy, 3)
    sync.sync_weights()
    assert policy[0].checkpoint_engine.policy.last.mode == "delta" and mismatches(state, engines) == []


def test_rollout_restart(refit_cfg, tmp_path):
    state = initial_state(D)
    policy = policy_workers(state)
    sync = Synchronizer(policy, vllm_engines(D, 1, TP), SELECTOR, refit_cfg)
    for step in range(2):
        if step:
            step_all(state, policy, step)
        sync.sync_weights()
    engines = vllm_engines(D, 1, TP, seed=7)  # new vLLM workers, dummy weights again
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    sync.init_communicator()
    step_all(state, policy, 2)
    sync.sync_weights()
    r = policy[0].checkpoint_engine.policy.last
    assert r.mode == "attach" and r.resynced and mismatches(state, engines) == []
    sessions = sorted(p.name for p in (tmp_path / "refit").glob("session-*"))
    assert sessions == [f"session-{policy[0].checkpoint_engine.policy.topo.session}"]  # the old one is gone


def test_dropped_payload_part_is_recovered(refit_cfg, monkeypatch):
    state = initial_state(D)
    policy, engines = policy_workers(state), vllm_engines(D, 1, TP)
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    sync.sync_weights()
    dropped, send = [], StoreTransport.send

    def lossy(self, dst, env):
        if env.kind == MessageKind.DELTA and dst == POLICY + 1 and env.body and not dropped:
            dropped.append((self.rank, env.part))  # lost on the way to vLLM worker tp1
            return
        send(self, dst, env)

    monkeypatch.setattr(StoreTransport, "send", lossy)
    step_all(state, policy, 1)
    sync.sync_weights()
    r = policy[0].checkpoint_engine.policy.last
    assert dropped and r.committed and r.resynced and any("MissingPartError" in d for d in r.detected), r
    assert engines[0][1].checkpoint_engine.rollout.last["refused"] == {"MissingPartError": 1}
    assert mismatches(state, engines) == []  # replicated norms of tp1 included
    step_all(state, policy, 2)
    sync.sync_weights()
    assert policy[0].checkpoint_engine.policy.last.mode == "delta" and mismatches(state, engines) == []


def test_a_failed_sync_fails_on_both_sides_and_the_next_one_recovers(refit_cfg):
    state = initial_state(D)
    policy, engines = policy_workers(state), vllm_engines(D, 1, TP)
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    sync.sync_weights()
    step_all(state, policy, 1)
    for p in policy:
        p.state["model.norm.weight"] = p.state["model.norm.weight"][:4].clone()  # a broken export
    with pytest.raises(RuntimeError, match=r"policy rank 0: ValueError: .*model\.norm\.weight.*no resync was possible"):
        sync.sync_weights()  # a bad export is read once: no resync, the sync fails naming the rank and cause
    assert sync.is_stale
    for p in policy:
        p.state["model.norm.weight"] = state["model.norm.weight"].clone()
    sync.sync_weights()
    assert mismatches(state, engines) == []


def _fail_once(monkeypatch, cls, method, when):
    """Make ``cls.method`` raise once, the first time ``when(self, *args)`` holds."""
    failed, real = [], getattr(cls, method)

    def flaky(self, *args, **kwargs):
        if not failed and when(self, *args):
            failed.append(True)
            raise OSError("injected failure inside the sync")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, flaky)
    return failed


@pytest.mark.parametrize("where", ["policy", "rollout"])
def test_a_failure_inside_the_sync_is_resynced_within_the_same_sync(refit_cfg, tmp_path, monkeypatch, where):
    """A policy worker failing after the export was drained, or a vLLM worker failing while it
    applies a payload: every party leaves that attempt and the same ``sync_weights`` resyncs
    through the same path (a fresh attach from the owned copies); nothing is raised to NeMo-RL."""
    from nemo_dcr.integrations.nemo_rl.policy import PolicySide
    from nemo_dcr.refit.server import EngineServer

    state = initial_state(D)
    policy, engines = policy_workers(state), vllm_engines(D, 1, TP)
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    sync.sync_weights()
    step_all(state, policy, 1)
    if where == "policy":  # policy rank 1, after its drain, in the refit's step
        failed = _fail_once(monkeypatch, PolicySide, "_refit_once", lambda self: self.rank == 1)
        who = "policy rank 1"
    else:  # vLLM worker tp1, on the first payload part it is handed
        failed = _fail_once(monkeypatch, EngineServer, "handle",
                            lambda self, env: env.kind == MessageKind.DELTA and self.transport.rank == POLICY + 1)
        who = "rollout rank 1"
    sync.sync_weights()
    assert failed and not sync.is_stale and mismatches(state, engines) == []
    r = policy[0].checkpoint_engine.policy
    assert r.last.mode == "attach" and r.last.committed and r.last.verified
    assert len(r.recovered) == 1 and r.recovered[0].startswith(f"{who}: OSError: injected failure"), r.recovered
    assert all(w.checkpoint_engine.rollout.last["attempt"] == 1 for w in engines[0])
    assert all(w.checkpoint_engine.rollout.last["recovered"] == r.recovered for w in engines[0])
    row = read_steps(tmp_path / "refit")[-1]
    assert row["recovered"] == r.recovered and row["committed"]
    step_all(state, policy, 2)
    sync.sync_weights()  # the next sync is a delta again
    assert r.last.mode == "delta" and not r.recovered and mismatches(state, engines) == []


def test_a_sync_whose_resync_fails_too_raises_naming_both(refit_cfg, monkeypatch):
    from nemo_dcr.integrations.nemo_rl.policy import PolicySide

    state = initial_state(D)
    policy, engines = policy_workers(state), vllm_engines(D, 1, TP)
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    sync.sync_weights()
    step_all(state, policy, 1)
    real = PolicySide._refit_once

    def broken(self):
        if self.rank == 1:
            raise OSError(f"injected failure {self.transport.attempt}")
        return real(self)

    monkeypatch.setattr(PolicySide, "_refit_once", broken)
    with pytest.raises(RuntimeError, match=r"attempt 1 ended by policy rank 1: OSError: injected failure 0; "
                                           r"attempt 2 ended by policy rank 1: OSError: injected failure 1; "
                                           r"its resync failed too"):
        sync.sync_weights()
    assert sync.is_stale
    monkeypatch.setattr(PolicySide, "_refit_once", real)
    sync.sync_weights()  # the next sync re-attaches
    assert policy[0].checkpoint_engine.policy.last.mode == "attach" and mismatches(state, engines) == []


def test_skipped_names_are_logged_once_and_metrics_reach_a_nemo_rl_logger(refit_cfg, tmp_path, capsys):
    from nemo_dcr.integrations.nemo_rl.sync_log import log_latest

    class Logger:  # NeMo-RL's Logger.log_metrics(metrics, step, prefix=...)
        def __init__(self):
            self.calls = []

        def log_metrics(self, metrics, step, prefix=""):
            self.calls.append((dict(metrics), step, prefix))

    state = initial_state(D)
    policy = policy_workers(state)
    sync = Synchronizer(policy, vllm_engines(D, 1, TP), SELECTOR, refit_cfg)
    logger = Logger()
    assert log_latest(logger, str(tmp_path / "refit"), 0) is None and not logger.calls  # no sync yet
    for step in range(2):
        if step:
            step_all(state, policy, step)
        sync.sync_weights()
        log_latest(logger, str(tmp_path / "refit"), step)
    out = capsys.readouterr().out
    assert out.count("1 exported tensor(s) no vLLM worker's load_weights loads are skipped") == 1
    assert SKIPPED in out
    r = policy[0].checkpoint_engine.policy.last
    (first, s0, prefix), (m, s1, _) = logger.calls
    assert (s0, s1, prefix) == (0, 1, "nemo_dcr") and all(isinstance(v, float) for v in m.values())
    assert m["payload_bytes"] == r.payload_bytes and m["density"] == r.density and m["bit_exact"] == 1.0
    assert m["time/export"] > 0 and m["sync_s"] >= m["time/total"] and first["resynced"] == 1.0


def test_rollout_waits_with_a_bounded_clear_timeout(refit_cfg):
    cfg = {**refit_cfg, "reply_timeout_s": 0.5}
    sync = Synchronizer(policy_workers(initial_state(D)), vllm_engines(D, 1, TP), SELECTOR, cfg)
    sync.init_communicator()
    with pytest.raises(TimeoutError, match=r"rollout rank 0: nothing from the policy workers for 0\.5s in sync 1"):
        sync.rollout[0].update_weights_from_checkpoint_engine()


def test_refit_cfg_errors_name_the_key(refit_cfg):
    kw = {k: v for k, v in refit_cfg.items() if k != "update_weights_bucket_memory_ratio"}
    where = re.escape(f"refit_cfg['{SELECTOR}']")
    with pytest.raises(ConfigError, match=rf"^{where}\.bogus: unknown key"):
        DcrCheckpointEngine(1 << 20, **kw, bogus=1)
    with pytest.raises(ConfigError, match=r"\.timeout_s: unknown key \(did you mean 'reply_timeout_s'\?\)"):
        DcrCheckpointEngine(1 << 20, **kw, timeout_s=60)  # the keys are DcrConfig's, old names are gone
    with pytest.raises(ConfigError, match=r"\.encoding: must be one of"):
        DcrCheckpointEngine(1 << 20, **{**kw, "encoding": "zip"})
    with pytest.raises(ConfigError, match=r"\.verify_steps: must be int, got str"):
        DcrCheckpointEngine(1 << 20, **{**kw, "verify_steps": "1"})
    with pytest.raises(ConfigError, match=r"\.key_file: the store transport authenticates"):
        DcrCheckpointEngine(1 << 20, url=kw["url"])
    with pytest.raises(ConfigError, match=r"\.transport: the NeMo-RL plugin uses 'store', got 'gloo'"):
        DcrCheckpointEngine(1 << 20, **{**kw, "transport": "gloo"})
    with pytest.raises(ConfigError, match=r"\.engine_format: the NeMo-RL plugin uses 'bf16'"):
        DcrCheckpointEngine(1 << 20, **{**kw, "engine_format": "fp8"})
    with pytest.raises(ConfigError, match=r"\.bucket_size: NeMo-RL's bucket_size must be >= 1 byte"):
        DcrCheckpointEngine(0, **kw)
    with pytest.raises(ValueError, match=r"holds 3 bytes"):
        bad = refit_cfg["key_file"] + ".short"
        open(bad, "wb").write(b"abc")
        DcrCheckpointEngine(1 << 20, **{**kw, "key_file": bad})


def test_refit_cfg_is_the_dcr_config(refit_cfg):
    """The keys are DcrConfig's, in its units; NeMo-RL's bucket_size (bytes) and the plugin's own
    defaults fill only what the user did not set."""
    kw = {k: v for k, v in refit_cfg.items() if k != "update_weights_bucket_memory_ratio"}
    opts = DcrCheckpointEngine(3 << 20, **kw, release_after_refit=True).options
    assert opts.release_after_refit is True
    cfg = opts.dcr
    assert (cfg.transport, cfg.engine_format, cfg.bucket_size_mb, cfg.reply_timeout_s) == ("store", "bf16", 3.0, 60.0)
    assert (cfg.url, cfg.telemetry_dir, cfg.verify, cfg.verify_steps, cfg.engine_index) == (
        kw["url"], kw["url"], "incremental", 3, True)
    assert opts.session_config("/x/session-1").url == "/x/session-1"
    mine = DcrCheckpointEngine(3 << 20, **{**kw, "bucket_size_mb": 0.5, "transport": "store", "engine_index": False,
                                           "telemetry_dir": None}).options.dcr
    assert (mine.bucket_size_mb, mine.engine_index, mine.telemetry_dir) == (0.5, False, None)
    bare = {k: v for k, v in kw.items() if k != "reply_timeout_s"}
    assert DcrCheckpointEngine(1 << 20, **bare).options.dcr.reply_timeout_s == 600.0


def test_no_engine_index_and_no_telemetry(refit_cfg, tmp_path):
    """``engine_index: false`` (vLLM workers keep no class index) stays bit-exact; ``telemetry_dir:
    null`` writes no telemetry."""
    state = initial_state(D)
    policy, engines = policy_workers(state), vllm_engines(D, 1, TP)
    cfg = {**refit_cfg, "engine_index": False, "telemetry_dir": None}
    sync = Synchronizer(policy, engines, SELECTOR, cfg)
    for step in range(2):
        if step:
            step_all(state, policy, step)
        sync.sync_weights()
        assert mismatches(state, engines) == []
    assert all(not w.checkpoint_engine.options.dcr.engine_index for e in engines for w in e)
    assert not (tmp_path / "refit" / "telemetry.jsonl").exists()


def test_key_file_is_read_by_the_one_rule(refit_cfg, tmp_path):
    """The plugin's key is the key file's raw bytes (surrounding whitespace and a trailing newline
    included), as for every other entry point (``codec.auth.read_key_file``)."""
    kw = {k: v for k, v in refit_cfg.items() if k != "update_weights_bucket_memory_ratio"}
    raw = b" 0123456789abcdef0123\n"
    path = tmp_path / "ws.key"
    path.write_bytes(raw)
    assert DcrCheckpointEngine(1 << 20, **{**kw, "key_file": str(path)}).key == raw


# -- capture from the policy's own Megatron shards -------------------------------------------------

MEGATRON = "dense-tiny"
"""The megatron-core preset the Megatron policy workers are built from (TP=2 on gloo)."""


@pytest.fixture(scope="module")
def megatron_policy(tmp_path_factory):
    """Two Megatron policy workers (one process each, a gloo job: TP=2), the model's shapes and
    the workers' log files."""
    from nemo_dcr.layout import model_dims
    from tests.standins.megatron_policy_standin import policy_actors

    logs = tmp_path_factory.mktemp("policy-logs")
    actors = policy_actors(POLICY, log_dir=str(logs), model=MEGATRON, tp=2)
    try:
        yield actors, StandinDims.of(model_dims(MEGATRON)), logs
    finally:
        for a in actors:
            a.close()


def test_megatron_policy_captures_from_its_shards_without_the_export(refit_cfg, megatron_policy):
    """Real megatron-core shards (TP=2, DDP with the distributed optimizer): every sync is bit-exact
    against vLLM's own full load, NeMo-RL's export iterator is never started (no tensor yielded)
    and no owned copy is kept; a failure inside a sync resyncs from the shards in the same sync;
    a worker whose model the plugin cannot see takes the export path, said once, and stays
    bit-exact."""
    from tests.standins.megatron_policy_standin import reference_mismatches

    policy, dims, logs = megatron_policy
    engines = vllm_engines(dims, 1, TP)
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    modes = []
    for step in range(3):
        if step:
            Synchronizer._all([lambda p=p: p.train(step) for p in policy])
        if step == 2:
            policy[1].fail_next_refit()
        sync.sync_weights()
        reports = [p.report() for p in policy]
        r = reports[0]["last"]
        assert r.committed and r.verified and reference_mismatches(policy, engines, dims, TP) == [], step
        assert all(x["capture"] == "shards" and x["exported"] == 0 and x["held_bytes"] == 0 for x in reports)
        modes.append((r.mode, r.changed < r.numel, bool(reports[0]["recovered"])))
    assert modes == [("attach", False, False), ("delta", True, False), ("attach", False, True)]
    assert reports[0]["recovered"][0].startswith("policy rank 1: OSError: injected failure inside the sync")
    assert "optimizer MasterAdamW, capture ranges from the distributed optimizer" in reports[0]["detail"]

    for p in policy:  # restarted policy workers whose model the plugin cannot read
        p.restart_engine(shards_visible=False)
    sync = Synchronizer(policy, engines, SELECTOR, refit_cfg)
    for step in (3, 4):
        Synchronizer._all([lambda p=p: p.train(step) for p in policy])
        sync.sync_weights()
        reports = [p.report() for p in policy]
        assert all(x["capture"] == "export" and x["held_bytes"] > 0 for x in reports)
        assert reference_mismatches(policy, engines, dims, TP) == []
    assert reports[0]["last"].mode == "delta" and reports[0]["detail"] == "MegatronPolicyWorker has no .model"
    out = "".join((logs / f"policy-{r}.log").read_text() for r in range(POLICY))
    assert out.count("capture from the policy's own Megatron shards, NeMo-RL's export is not run") == 1
    assert out.count("capture from NeMo-RL's export, copying owned tensors (MegatronPolicyWorker has no .model)") == 2
    for p in policy:
        p.restart_engine()


def test_a_policy_without_megatron_shards_is_told_why_it_takes_the_export():
    """No worker, no ``.model``, a model no registered framework understands (a DTensor policy's HF
    module): the export path, with the reason; never an exception."""
    from types import SimpleNamespace

    from nemo_dcr.integrations.nemo_rl.shards import policy_shards, table_differences

    table = {"model.embed_tokens.weight": ("bf16", (10, 4))}

    class DTensorPolicyWorkerV2:
        def __init__(self, model=None):
            if model is not None:
                self.model = model

    assert policy_shards(None, table).detail == "no policy worker holds this checkpoint engine as .checkpoint_engine"
    assert policy_shards(DTensorPolicyWorkerV2(), table).detail == "DTensorPolicyWorkerV2 has no .model"
    found = policy_shards(DTensorPolicyWorkerV2(torch.nn.Linear(4, 4)), table)
    assert found.source is None and found.detail.startswith(
        "DTensorPolicyWorkerV2.model is a Linear, no megatron-core model (no trainer source for a Linear")
    cp = SimpleNamespace(config=SimpleNamespace(context_parallel_size=2))
    assert "context parallelism" in policy_shards(DTensorPolicyWorkerV2(cp), table).detail
    assert table_differences({**table, "lm_head.weight": ("bf16", (10, 4))}, {"model.embed_tokens.weight": (
        "fp32", (10, 4))}) == ("1 in the shards but not loaded by vLLM ['lm_head.weight']; 1 of another dtype or "
                               "shape [('model.embed_tokens.weight', ('bf16', (10, 4)), ('fp32', (10, 4)))]")
