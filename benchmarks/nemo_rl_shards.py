"""NeMo-RL plugin per sync: capture from NeMo-RL's export vs from the policy's own Megatron shards.

Usage:
    python benchmarks/nemo_rl_shards.py [--model dense-tiny] [--tp 2] [--layers L] [--syncs N]
        [--lr LR] [--json OUT]

The Megatron policy workers are the stand-in of NeMo-RL's ``MegatronPolicyWorkerImpl``
(:mod:`tests.standins.megatron_policy_standin`): real megatron-core shards of a preset at
TP=``--tp`` on gloo (DDP with the distributed optimizer), one process per worker; the export is
a generator like Megatron-Bridge's (a TP all-gather per tensor, then the HF conversion).  The
vLLM workers are the loader-contract stand-in at the same TP (threads of this process), driven
by the stand-in of NeMo-RL's ``CheckpointEngineWeightSynchronizer``.  Two sessions over the same
workers and the same training run, one after the other:

* ``export``: the policy workers hide their model (as a DTensor policy would), so the plugin
  drains NeMo-RL's export and copies the tensors each worker owns;
* ``shards``: the plugin captures from the workers' own shards; the export is never started.

Each session is a first sync (``attach``, vLLM from dummy weights) and ``--syncs`` delta syncs,
each after one Adam-like step of every worker.  After every sync every vLLM worker is compared,
as integer views, with a fresh model that loaded the policy's weights through its own
``load_weights`` (not timed).  Per delta sync: the driver's wall time of ``sync_weights``, the
plugin's phases on policy rank 0 (``export``: draining the export; ``total``: the refit), the
export's own seconds and the bytes it materialized on each worker, the owned copies, payload
bytes and density.  Memory (RSS, MiB) of every policy worker after each session's first sync and
of this process (both vLLM workers) before and after the first attach.  Prints one JSON object
(medians over the delta syncs, and every sync); times are wall seconds on a shared machine:
compare the two paths by the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import secrets  # noqa: E402

from nemo_dcr.integrations.nemo_rl import SELECTOR  # noqa: E402
from nemo_dcr.layout import model_dims  # noqa: E402
from tests.standins.megatron_policy_standin import policy_actors, reference_mismatches, rss_mib  # noqa: E402
from tests.standins.nemo_rl_standin import Synchronizer, vllm_engines  # noqa: E402
from tests.standins.vllm_standin import StandinDims  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense-tiny", help="megatron-core preset (dense Llama family)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of policy and vLLM (= policy workers)")
    p.add_argument("--layers", type=int, default=None, help="another number of layers")
    p.add_argument("--syncs", type=int, default=3, help="delta syncs per path")
    p.add_argument("--lr", type=float, default=2e-5, help="Adam-like update size")
    p.add_argument("--json", default=None, help="also write the result here")
    return p.parse_args(argv)


def _all(calls):
    return Synchronizer._all(calls)


def run_path(path: str, policy, engines, dims, args, cfg: dict, first_step: int) -> dict:
    """One session on ``path`` ("export" or "shards"): attach, then ``--syncs`` delta syncs."""
    for p in policy:
        p.restart_engine(shards_visible=path == "shards")
    sync = Synchronizer(policy, engines, SELECTOR, cfg)
    sync.init_communicator()
    rows, memory = [], {}
    for i in range(args.syncs + 1):
        if i:
            _all([lambda p=p: p.train(first_step + i) for p in policy])
        before = [p.report() for p in policy]
        driver_rss = rss_mib()["rss"]
        t0 = time.perf_counter()
        sync.sync_weights()
        wall = time.perf_counter() - t0
        reports = [p.report() for p in policy]
        bad = reference_mismatches(policy, engines, dims, args.tp)
        r = reports[0]["last"]
        if bad or not (r.committed and r.verified) or any(x["capture"] != path for x in reports):
            raise SystemExit(f"{path} sync {i}: not bit-exact or not on its path: {bad[:5]} {r} "
                             f"{[x['capture'] for x in reports]} {reports[0]['detail']}")
        exported = [a["exported"] - b["exported"] for a, b in zip(reports, before)]
        export_s = [a["export_s"] - b["export_s"] for a, b in zip(reports, before)]
        rows.append(dict(mode=r.mode, wall_s=wall, refit_total_s=r.times["total"],
                         plugin_export_s=r.times.get("export", 0.0), export_generator_s=max(export_s),
                         exported_tensors_per_worker=exported[0],
                         exported_bytes_per_worker=(r.dense_bytes if exported[0] else 0),
                         held_bytes_per_worker=[x["held_bytes"] for x in reports],
                         payload_bytes=r.payload_bytes, dense_bytes=r.dense_bytes, density=r.density,
                         changed=r.changed))
        if i == 0:
            memory = dict(policy_rss_mib=[x["memory"]["rss"] for x in reports],
                          policy_peak_mib=[x["memory"]["peak"] for x in reports],
                          driver_rss_before_mib=driver_rss, driver_rss_after_mib=rss_mib()["rss"])
    deltas = rows[1:]
    med = {k: statistics.median(r[k] for r in deltas) for k in
           ("wall_s", "refit_total_s", "plugin_export_s", "export_generator_s", "payload_bytes", "density")}
    return dict(median_delta=med, attach=rows[0], syncs=rows, memory_after_attach=memory,
                detail=reports[0]["detail"])


def main(argv=None) -> int:
    args = parse_args(argv)
    dims = model_dims(args.model, args.layers)
    vdims = StandinDims.of(dims)
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "hmac.key"
        key.write_bytes(secrets.token_bytes(32))
        cfg = {"url": str(Path(tmp) / "refit"), "key_file": str(key), "reply_timeout_s": 600,
               "verify": "incremental", "telemetry_dir": None}
        t0 = time.perf_counter()
        policy = policy_actors(args.tp, model=args.model, tp=args.tp, layers=args.layers, lr=args.lr)
        try:
            driver_before = rss_mib()["rss"]
            engines = vllm_engines(vdims, 1, args.tp)
            driver_engines = rss_mib()["rss"]
            _all([lambda p=p: p.report() for p in policy])  # every worker built
            startup = time.perf_counter() - t0
            export = run_path("export", policy, engines, vdims, args, cfg, 1)
            shards = run_path("shards", policy, engines, vdims, args, cfg, 1 + args.syncs)
        finally:
            for p in policy:
                p.close()
    e, s = export["median_delta"], shards["median_delta"]
    result = dict(
        model=args.model, layers=dims.num_layers, tp=args.tp, policy_workers=args.tp, vllm_workers=args.tp,
        params=export["attach"]["dense_bytes"] // 2, delta_syncs=args.syncs, lr=args.lr, startup_s=startup,
        driver_rss_mib=dict(before_vllm=driver_before, with_vllm_workers=driver_engines),
        export=export, shards=shards,
        ratios=dict(wall_export_over_shards=e["wall_s"] / s["wall_s"],
                    export_time_saved_s=e["wall_s"] - s["wall_s"],
                    export_share_of_export_path=e["plugin_export_s"] / e["wall_s"],
                    payload_export_over_shards=e["payload_bytes"] / s["payload_bytes"]))
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
