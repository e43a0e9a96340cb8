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
workers and the same training run (the same preset, seeds and steps: the same weights at every sync), one
after the other, each in fresh worker processes and fresh vLLM workers (dummy weights):

* ``export``: the policy workers hide their model (as a DTensor policy would), so the plugin
  drains NeMo-RL's export and copies the tensors each worker owns;
* ``shards``: the plugin captures from the workers' own shards; the export is never started.

Each session is a first sync (``attach``, everything into vLLM's dummy weights) and ``--syncs``
delta syncs, each after one Adam-like step of every worker.  After every sync every vLLM worker is compared,
as integer views, with a fresh model that loaded the policy's weights through its own
``load_weights`` (not timed).  Per delta sync: the driver's wall time of ``sync_weights``, the
CPU seconds it took the policy worker processes together (``os.times``; far less sensitive to
other load on the machine than wall time) and this process (the vLLM workers), the
plugin's phases on policy rank 0 (``export``: draining the export; ``total``: the refit; every
phase of the refit), the export's own seconds and the bytes it materialized on each worker, the
owned copies, payload bytes and density.  Memory (RSS, MiB) of every policy worker before and after each
session's first sync (now and the process's peak), and of this process (the vLLM workers are its
threads) with the vLLM workers built and after their first sync; the bytes each policy worker
wrote into the shared folder in the first sync, and the folder's largest size during it
(sampled every 50 ms, each inode once).  Prints one JSON object
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

import os  # noqa: E402
import secrets  # noqa: E402
import threading  # noqa: E402

from nemo_dcr.integrations.nemo_rl import SELECTOR  # noqa: E402
from nemo_dcr.layout import model_dims  # noqa: E402
from tests.standins.megatron_policy_standin import (cpu_seconds, policy_actors, reference_mismatches,  # noqa: E402
                                                    rss_mib)
from tests.standins.nemo_rl_standin import Synchronizer, vllm_engines  # noqa: E402
from tests.standins.vllm_standin import StandinDims  # noqa: E402


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, topology and training options (shared with ``benchmarks/nemo_rl_sparse.py``)."""
    p.add_argument("--model", default="dense-tiny", help="megatron-core preset (dense Llama family)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of policy and vLLM (= policy workers)")
    p.add_argument("--layers", type=int, default=None, help="another number of layers")
    p.add_argument("--syncs", type=int, default=3, help="delta syncs per path")
    p.add_argument("--lr", type=float, default=2e-5, help="Adam-like update size")
    p.add_argument("--json", default=None, help="also write the result here")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)


def _all(calls):
    return Synchronizer._all(calls)


def folder_bytes(root: str) -> int:
    """Bytes of the files under ``root`` now, each inode once (hard links share their data)."""
    seen, total = set(), 0
    for folder, _, files in os.walk(root):
        for f in files:
            try:
                st = os.stat(os.path.join(folder, f))
            except FileNotFoundError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


class PeakDisk:
    """The largest :func:`folder_bytes` of ``root`` seen while the block runs (sampled every 50 ms)."""

    def __init__(self, root: str):
        self.root, self.peak, self._stop = root, 0, threading.Event()

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, folder_bytes(self.root))
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_path(path: str, dims, vdims, args, cfg: dict) -> dict:
    """One session on ``path`` ("export" or "shards") in fresh workers: attach, then ``--syncs``
    delta syncs."""
    t0 = time.perf_counter()
    policy = policy_actors(args.tp, model=args.model, tp=args.tp, layers=args.layers, lr=args.lr,
                           shards_visible=path == "shards")
    try:
        driver_before = rss_mib()["rss"]
        engines = vllm_engines(vdims, 1, args.tp)
        driver_engines = rss_mib()["rss"]
        _all([lambda p=p: p.report() for p in policy])  # every worker built
        startup = time.perf_counter() - t0
        url = f"{cfg['url']}-{path}"
        sync = Synchronizer(policy, engines, SELECTOR, {**cfg, "url": url})
        sync.init_communicator()
        rows, memory = [], {}
        for i in range(args.syncs + 1):
            if i:
                _all([lambda p=p: p.train(i) for p in policy])
            before = [p.report() for p in policy]
            t1, c1 = time.perf_counter(), cpu_seconds()
            with PeakDisk(url) as disk:
                sync.sync_weights()
            wall, rollout_cpu = time.perf_counter() - t1, cpu_seconds() - c1
            reports = [p.report() for p in policy]
            if i == 0:
                memory = dict(policy_rss_before_mib=[x["memory"]["rss"] for x in before],
                              policy_peak_before_mib=[x["memory"]["peak"] for x in before],
                              policy_rss_mib=[x["memory"]["rss"] for x in reports],
                              policy_peak_mib=[x["memory"]["peak"] for x in reports],
                              written_bytes_per_worker=[a["written"] - b["written"] for a, b in zip(reports, before)],
                              peak_folder_bytes=disk.peak,
                              driver_before_vllm_mib=driver_before, driver_with_vllm_mib=driver_engines,
                              driver_after_attach_mib=rss_mib()["rss"])
            bad = reference_mismatches(policy, engines, vdims, args.tp)
            r = reports[0]["last"]
            if bad or not (r.committed and r.verified) or any(x["capture"] != path for x in reports):
                raise SystemExit(f"{path} sync {i}: not bit-exact or not on its path: {bad[:5]} {r} "
                                 f"{[x['capture'] for x in reports]} {reports[0]['detail']}")
            exported = [a["exported"] - b["exported"] for a, b in zip(reports, before)]
            exported_bytes = [a["exported_bytes"] - b["exported_bytes"] for a, b in zip(reports, before)]
            export_s = [a["export_s"] - b["export_s"] for a, b in zip(reports, before)]
            rows.append(dict(mode=r.mode, wall_s=wall, refit_total_s=r.times["total"],
                             policy_cpu_s=sum(a["cpu_s"] - b["cpu_s"] for a, b in zip(reports, before)),
                             rollout_cpu_s=rollout_cpu,
                             plugin_export_s=r.times.get("export", 0.0), export_generator_s=max(export_s),
                             exported_tensors_per_worker=exported,
                             exported_bytes_per_worker=exported_bytes,
                             held_bytes_per_worker=[x["held_bytes"] for x in reports],
                             payload_bytes=r.payload_bytes, route_bytes=r.route_bytes, dense_bytes=r.dense_bytes,
                             density=r.density, changed=r.changed, phases_rank0=dict(r.times)))
    finally:
        for p in policy:
            p.close()
    deltas = rows[1:]
    med = {k: statistics.median(r[k] for r in deltas) for k in
           ("wall_s", "policy_cpu_s", "rollout_cpu_s", "refit_total_s", "plugin_export_s", "export_generator_s",
            "payload_bytes", "route_bytes", "density")}
    med["phases_rank0"] = {k: statistics.median(r["phases_rank0"].get(k, 0.0) for r in deltas)
                           for k in sorted({k for r in deltas for k in r["phases_rank0"]})}
    return dict(median_delta=med, attach=rows[0], syncs=rows, memory_after_attach=memory, startup_s=startup,
                detail=reports[0]["detail"])


def plugin_paths(args, dims, vdims) -> tuple[dict, dict]:
    """Both plugin sessions (export path, then shard path) over a fresh refit folder and key."""
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "hmac.key"
        key.write_bytes(secrets.token_bytes(32))
        cfg = {"url": str(Path(tmp) / "refit"), "key_file": str(key), "reply_timeout_s": 600,
               "verify": "incremental", "telemetry_dir": None}
        return run_path("export", dims, vdims, args, cfg), run_path("shards", dims, vdims, args, cfg)


def main(argv=None) -> int:
    args = parse_args(argv)
    dims = model_dims(args.model, args.layers)
    vdims = StandinDims.of(dims)
    export, shards = plugin_paths(args, dims, vdims)
    e, s = export["median_delta"], shards["median_delta"]
    result = dict(
        model=args.model, layers=dims.num_layers, tp=args.tp, policy_workers=args.tp, vllm_workers=args.tp,
        params=export["attach"]["dense_bytes"] // 2, delta_syncs=args.syncs, lr=args.lr,
        export=export, shards=shards,
        ratios=dict(wall_export_over_shards=e["wall_s"] / s["wall_s"],
                    export_time_saved_s=e["wall_s"] - s["wall_s"],
                    export_share_of_export_path=e["plugin_export_s"] / e["wall_s"],
                    refit_shards_over_export=s["refit_total_s"] / e["refit_total_s"],
                    policy_cpu_export_over_shards=e["policy_cpu_s"] / s["policy_cpu_s"],
                    policy_cpu_saved_s=e["policy_cpu_s"] - s["policy_cpu_s"],
                    attach_wall_export_over_shards=export["attach"]["wall_s"] / shards["attach"]["wall_s"],
                    payload_export_over_shards=e["payload_bytes"] / s["payload_bytes"]))
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
