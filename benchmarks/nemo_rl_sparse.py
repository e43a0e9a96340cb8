"""Per sync, same model and steps: the plugin's export path, its shard path, and NeMo-RL's own
sparse refit (``vllm_zmq_sparse``), run from a NeMo-RL checkout.

Usage:
    python benchmarks/nemo_rl_sparse.py --nemo-rl PATH [--model dense-tiny] [--tp 2] [--layers L]
        [--syncs N] [--lr LR] [--nemo-rl-refit-cfg JSON] [--json OUT]

``PATH`` is a checkout of NVIDIA-NeMo/RL with the remote sparse refit
(``nemo_rl/weight_sync/vllm_remote_sparse_weight_synchronizer.py``; tested at 7ea279abf). Nothing
of it is installed or copied: it is put on ``sys.path`` at run time, and the benchmark refuses to
start, naming what is missing, when a file or a Python dependency of it is absent (its ZeroMQ
path needs ``pyzmq``, ``zstandard``, ``pydantic``, ``fastapi``, ``uvicorn``, ``requests`` and
``ray``'s Python package for two helpers; install missing ones anywhere on ``PYTHONPATH``).

The plugin's two paths are :func:`benchmarks.nemo_rl_shards.run_path` unchanged (the same stand-in
Megatron policy workers over real megatron-core shards on gloo, one process each, and the same
vLLM-layout stand-in workers).  The third session runs on the same stand-ins, with the same preset,
seeds and steps, **NeMo-RL's own code** for everything from the synchronizer down:

* ``VllmRemoteSparseWeightSynchronizer`` (``init_communicator``: baseline start, relay start and
  tree, receiver prewarm over HTTP; ``sync_weights``: KV-cache invalidation, streaming on every
  policy worker, ZeroMQ relay flush and receiver flush over HTTP, baseline commit);
* in every policy worker process ``MegatronRemoteSparseRefit`` with its ``DeltaCompressionTracker``
  (file-backed baseline, compare, XOR encode, serialize, zstd) and the ZeroMQ streamer
  (``stream_sparse_delta_payloads_via_zmq``: DEALER client, real TCP sockets), fed by the stand-in's
  Bridge-like export exactly as the plugin's export path is (every rank iterates all of it);
* in this process, per vLLM engine, ``VllmSparseRefitReceiver`` (its FastAPI control plane under
  uvicorn, its ``ZmqSparseRefitServer`` relay, its deduplicating FIFO and the staged path through
  the shared-memory folder, as for ranks on one node) and, in every vLLM worker,
  ``VllmInternalWorkerExtension``'s sparse methods with ``VllmSparseDeltaApplier`` (decode, scratch,
  the dispatch mode that turns the stand-in's native ``load_weights`` copies into XOR writes).

Replaced: Ray (the policy workers are the stand-in's processes, the vLLM engine's workers threads
of this process; ``ray.get`` resolves futures), vLLM's ``collective_rpc`` (a call on every worker
thread), NeMo-RL's package ``__init__`` files (not run: they import its whole stack; only the
modules above are loaded), the three delegating methods of ``MegatronPolicyWorkerImpl`` and
``_iter_params_with_optional_kv_scales`` (the stand-in's export), Megatron Bridge and vLLM
themselves (the stand-ins), and CUDA (CPU tensors; NeMo-RL's NVTX ranges are no-ops).

NeMo-RL's sparse refit never sends a full copy: vLLM must start from the checkpoint the policy
starts from.  So its vLLM workers first load the policy's initial weights through their own
``load_weights`` (not timed), and ``init_communicator`` (baseline export and snapshot, prewarm)
is reported in place of the plugin's first sync.  After every sync every vLLM worker is compared,
as integer views, with a fresh model loaded with the policy's weights (``reference_mismatches``).

Bytes per link, NeMo-RL: the compressed payloads policy -> relay (counted by the receiver as they
arrive), the staged payload files the relay hands its vLLM workers (each worker reads every file),
and the export every policy worker materializes; the HTTP control plane's JSON is not counted.
Prints one JSON object, then the table of medians over the delta syncs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import re
import secrets
import statistics
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.nemo_rl_shards import add_arguments, plugin_paths  # noqa: E402
from nemo_dcr.layout import model_dims  # noqa: E402
from tests.standins.megatron_policy_standin import (MegatronPolicyWorker, cpu_seconds, policy_actors,  # noqa: E402
                                                    reference_mismatches, rss_mib)
from tests.standins.nemo_rl_standin import VllmWorker  # noqa: E402
from tests.standins.vllm_standin import StandinDims  # noqa: E402

NEEDED_FILES = ("nemo_rl/weight_sync/vllm_remote_sparse_weight_synchronizer.py",
                "nemo_rl/models/policy/workers/megatron_remote_sparse_refit.py",
                "nemo_rl/models/generation/vllm/vllm_sparse_refit.py",
                "nemo_rl/models/generation/vllm/vllm_sparse_delta.py",
                "nemo_rl/models/generation/vllm/vllm_backend.py",
                "nemo_rl/utils/weight_transfer_sparse_codec.py",
                "nemo_rl/utils/weight_transfer_stream.py",
                "nemo_rl/utils/weight_transfer_zmq.py")
NEEDED_MODULES = ("zmq", "zstandard", "pydantic", "fastapi", "uvicorn", "requests", "ray")
_PACKAGES = ("nemo_rl", "nemo_rl.weight_sync", "nemo_rl.models", "nemo_rl.models.generation",
             "nemo_rl.models.generation.vllm", "nemo_rl.models.policy", "nemo_rl.models.policy.workers")
API_KEY_ENV = "NEMO_DCR_BENCH_REFIT_KEY"


def check_nemo_rl(path: str) -> Path:
    """The checkout at ``path``, resolved.

    Raises:
        SystemExit: a file of the sparse refit or one of its Python dependencies is missing.
    """
    root = Path(path).resolve()
    missing = [f for f in NEEDED_FILES if not (root / f).is_file()]
    if missing:
        raise SystemExit(f"--nemo-rl {path}: not a NeMo-RL checkout with the remote sparse refit "
                         f"(missing {', '.join(missing)}); use NVIDIA-NeMo/RL at 7ea279abf or later")
    absent = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if absent:
        raise SystemExit(f"NeMo-RL's sparse refit needs {', '.join(absent)}: install them into a folder of "
                         f"their own (pip install --target DIR ...) and put it on PYTHONPATH")
    return root


def load_nemo_rl(path: str) -> types.SimpleNamespace:
    """NeMo-RL's modules from the checkout at ``path`` (checked first), imported on demand with
    ``.module(name)``: its package ``__init__`` files are not run (each is replaced by an empty
    package over the same folder) and the checkout is not put on ``sys.path`` (its own ``tests``
    package would shadow this project's)."""
    root = check_nemo_rl(path)
    for pkg in _PACKAGES:
        if pkg not in sys.modules:
            folder = root.joinpath(*pkg.split("."))
            module = types.ModuleType(pkg)
            module.__path__ = [str(folder)]
            module.__file__ = str(folder / "__init__.py")
            module.__spec__ = importlib.machinery.ModuleSpec(pkg, None, origin=module.__file__, is_package=True)
            module.__spec__.submodule_search_locations = [str(folder)]
            sys.modules[pkg] = module
    return types.SimpleNamespace(root=root, module=importlib.import_module)


# -- the policy side: the stand-in Megatron worker with NeMo-RL's sparse-refit methods ---------------

class SparsePolicyWorker(MegatronPolicyWorker):
    """The stand-in Megatron policy worker holding NeMo-RL's ``MegatronRemoteSparseRefit`` (what
    ``MegatronPolicyWorkerImpl._require_remote_sparse_refit`` builds), its export as
    ``_iter_params_with_optional_kv_scales``."""

    def __init__(self, *args, nemo_rl: str, refit_cfg: dict | None = None, **kwargs):
        super().__init__(*args, shards_visible=False, **kwargs)
        nr = load_nemo_rl(nemo_rl)
        config = nr.module("nemo_rl.models.generation.vllm.config").VllmRefitConfig.model_validate(refit_cfg or {})
        refit = nr.module("nemo_rl.models.policy.workers.megatron_remote_sparse_refit")
        self._remote_sparse_refit = refit.MegatronRemoteSparseRefit(self, config.sparse)

    def _iter_params_with_optional_kv_scales(self):
        return self.export()

    def init_remote_sparse_delta_baseline(self, **kwargs):
        with torch.no_grad():
            return self._remote_sparse_refit.initialize_baseline(**kwargs)

    def stream_remote_sparse_weights(self, transport, targets, **kwargs):
        with torch.no_grad():
            return self._remote_sparse_refit.stream(transport, targets, **kwargs)

    def finish_remote_sparse_delta_sync(self, *, succeeded: bool) -> None:
        self._remote_sparse_refit.finish(succeeded)

    def baseline_bytes(self) -> int:
        """Bytes of the canonical baseline this worker keeps (file-backed by NeMo-RL's default)."""
        return sum(t.numel() * t.element_size() for t in self._remote_sparse_refit._tracker.baseline.values())


class _Pool:
    """Ray's ``remote`` calls and ``ray.get`` over threads: each call a future."""

    def __init__(self):
        self.ex = cf.ThreadPoolExecutor(32, thread_name_prefix="bench-ray")

    def get(self, refs):
        return [r.result() for r in refs] if isinstance(refs, list) else refs.result()

    @staticmethod
    def cancel(ref, force=False):
        ref.cancel()


class PolicyGroup:
    """``policy.worker_group`` (a ``RayWorkerGroup``) over the stand-in's policy processes."""

    def __init__(self, actors, pool: _Pool):
        self.workers, self.pool = actors, pool

    def run_all_workers_multiple_data(self, method, common_kwargs=None, **sharded):
        return [self.pool.ex.submit(a.call, method, **(common_kwargs or {}), **{k: v[i] for k, v in sharded.items()})
                for i, a in enumerate(self.workers)]

    def run_all_workers_single_data(self, method, **kwargs):
        return [self.pool.ex.submit(a.call, method, **kwargs) for a in self.workers]


# -- the vLLM side: NeMo-RL's receiver and worker extension on the vLLM-layout stand-in ---------------

def sparse_vllm_worker(nr):
    """The stand-in vLLM worker with NeMo-RL's ``VllmInternalWorkerExtension`` mixed in, as vLLM's
    ``worker_extension_cls`` does."""

    backend = nr.module("nemo_rl.models.generation.vllm.vllm_backend")

    class SparseVllmWorker(VllmWorker, backend.VllmInternalWorkerExtension):
        device = torch.device("cpu")

    return SparseVllmWorker


class CollectiveRpc:
    """vLLM's ``LLM.collective_rpc``: the method on every worker of the engine at once; counts the
    bytes of the staged payload files each worker reads."""

    def __init__(self, workers):
        self.workers, self.read_bytes = workers, 0

    def collective_rpc(self, method, args=()):
        if method == "update_weights_from_decoded_sparse_payload":
            self.read_bytes += len(self.workers) * sum(
                os.path.getsize(a) if isinstance(a, str) else len(a) for a in args)
        with cf.ThreadPoolExecutor(len(self.workers)) as ex:
            return list(ex.map(lambda w: getattr(w, method)(*args), self.workers))


class GenerationWorker:
    """One vLLM engine's ``VllmGenerationWorker`` (the model owner, TP rank 0): NeMo-RL's
    ``VllmSparseRefitReceiver`` over :class:`CollectiveRpc`, with the delegating methods of
    NeMo-RL's worker; counts the compressed bytes that reach its relay."""

    def __init__(self, nr, workers, refit_cfg: dict):
        self.cfg = {"refit_transport": "vllm_zmq_sparse", "refit_cfg": refit_cfg,
                    "vllm_cfg": {"async_engine": False, "http_refit_api_key_env_var": API_KEY_ENV,
                                 "http_refit_server_port": None, "zmq_refit_server_port": None}}
        self.llm = CollectiveRpc(workers)
        self.wire_bytes = self.wire_payloads = 0
        lock, count = threading.Lock(), self

        class Receiver(nr.module("nemo_rl.models.generation.vllm.vllm_sparse_refit").VllmSparseRefitReceiver):
            def _apply_zmq_payload(self, compressed, metadata):
                with lock:
                    count.wire_bytes += len(compressed)
                    count.wire_payloads += 1
                return super()._apply_zmq_payload(compressed, metadata)

        self._sparse_refit_receiver = Receiver(self)
        self._sparse_refit_receiver.start_sync_server()  # NeMo-RL: post_init

    def report_refit_server_base_url(self):
        return self._sparse_refit_receiver.report_refit_server_base_url()

    def start_zmq_sparse_refit_relay(self):
        return self._sparse_refit_receiver.start_zmq_sparse_refit_relay()

    def configure_zmq_sparse_refit_relay(self, relay_addresses):
        self._sparse_refit_receiver.configure_zmq_sparse_refit_relay(relay_addresses)

    def stop_zmq_sparse_refit_relay(self):
        self._sparse_refit_receiver.stop_zmq_sparse_refit_relay()


class Generation:
    """``VllmGeneration`` as the synchronizer uses it: the owners' worker group and the KV-cache reset
    (the stand-in has no KV cache)."""

    def __init__(self, owners, pool: _Pool):
        self.owners, self.pool = owners, pool
        self.worker_group = self

    def run_all_workers_single_data(self, method, run_rank_0_only_axes=None, **kwargs):
        return [self.pool.ex.submit(getattr(o, method), **kwargs) for o in self.owners]

    def invalidate_kv_cache(self) -> bool:
        return True


_TIMING = re.compile(r"^REFIT_ZMQ_TIMING (.*)$", re.M)


def _timing_rows(log: str) -> list[dict]:
    """The ``REFIT_ZMQ_TIMING`` lines a policy worker printed (its own per-sync report)."""
    out = []
    for m in _TIMING.finditer(log):
        row = {}
        for kv in m.group(1).split():
            k, _, v = kv.partition("=")
            try:
                row[k] = float(v)
            except ValueError:
                row[k] = v
        out.append(row)
    return out


def run_nemo_rl(args, dims, vdims) -> dict:
    """NeMo-RL's ``vllm_zmq_sparse`` on the stand-ins: load, ``init_communicator``, then ``--syncs``
    delta syncs, each after the same training step as the plugin's sessions."""
    nr = load_nemo_rl(args.nemo_rl)
    if not torch.cuda.is_available():  # NeMo-RL's NVTX ranges need CUDA: no-ops here
        torch.cuda.nvtx.range_push = torch.cuda.nvtx.range_pop = lambda *a, **k: None
    os.environ[API_KEY_ENV] = secrets.token_hex(16)
    pool = _Pool()
    logs = tempfile.mkdtemp(prefix="nrl-bench-")
    t0 = time.perf_counter()
    policy = policy_actors(args.tp, log_dir=logs, factory=f"{__name__}:SparsePolicyWorker", model=args.model,
                           tp=args.tp, layers=args.layers, lr=args.lr, nemo_rl=str(nr.root),
                           refit_cfg=args.nemo_rl_refit_cfg)
    captured = io.StringIO()
    try:
        cls = sparse_vllm_worker(nr)
        workers = [cls(vdims, args.tp, r, r) for r in range(args.tp)]
        engines = [workers]
        [p.report() for p in policy]
        state = _collective(pool, policy, "hf_state")[0]  # the checkpoint both sides start from
        for w in workers:
            w.model_runner.model.load_weights(state.items())
        del state
        startup = time.perf_counter() - t0
        with contextlib.redirect_stdout(captured):
            owner = GenerationWorker(nr, workers, args.nemo_rl_refit_cfg)
            sync_module = nr.module("nemo_rl.weight_sync.vllm_remote_sparse_weight_synchronizer")
            sync_module.ray = pool  # the module's ray.get / ray.cancel
            sync = sync_module.VllmRemoteSparseWeightSynchronizer(
                types.SimpleNamespace(worker_group=PolicyGroup(policy, pool)), Generation([owner], pool),
                transport="zmq", api_key_env_var=API_KEY_ENV, request_timeout_s=600.0)
            before = [p.report() for p in policy]
            t1, c1 = time.perf_counter(), cpu_seconds()
            sync.init_communicator()
            init = dict(wall_s=time.perf_counter() - t1, rollout_cpu_s=cpu_seconds() - c1)
        reports = [p.report() for p in policy]
        init.update(policy_cpu_s=sum(a["cpu_s"] - b["cpu_s"] for a, b in zip(reports, before)),
                    exported_bytes_per_worker=[a["exported_bytes"] - b["exported_bytes"]
                                               for a, b in zip(reports, before)],
                    baseline_bytes_per_worker=[p.baseline_bytes() for p in policy],
                    policy_rss_mib=[x["memory"]["rss"] for x in reports],
                    policy_peak_mib=[x["memory"]["peak"] for x in reports], driver_rss_mib=rss_mib()["rss"])
        bad = reference_mismatches(policy, engines, vdims, args.tp)
        if bad:
            raise SystemExit(f"nemo-rl: vLLM workers differ from the checkpoint before any sync: {bad[:5]}")
        rows = []
        for i in range(1, args.syncs + 1):
            _collective(pool, policy, "train", i)
            before = [p.report() for p in policy]
            wire0, read0 = owner.wire_bytes, owner.llm.read_bytes
            with contextlib.redirect_stdout(captured):
                t1, c1 = time.perf_counter(), cpu_seconds()
                metrics = sync.sync_weights()
                wall, rollout_cpu = time.perf_counter() - t1, cpu_seconds() - c1
            reports = [p.report() for p in policy]
            bad = reference_mismatches(policy, engines, vdims, args.tp)
            if bad:
                raise SystemExit(f"nemo-rl sync {i}: not bit-exact: {len(bad)} params differ, e.g. {bad[:5]}")
            rows.append(dict(
                wall_s=wall, rollout_cpu_s=rollout_cpu,
                policy_cpu_s=sum(a["cpu_s"] - b["cpu_s"] for a, b in zip(reports, before)),
                export_generator_s=max(a["export_s"] - b["export_s"] for a, b in zip(reports, before)),
                exported_bytes_per_worker=[a["exported_bytes"] - b["exported_bytes"] for a, b in zip(reports, before)],
                wire_bytes=owner.wire_bytes - wire0, staged_read_bytes=owner.llm.read_bytes - read0,
                payloads=metrics["transfer/payloads"], changed_pct=metrics["delta/changed_pct"],
                density=metrics["delta/changed_pct"] / 100, relay_flush_s=metrics["transfer/relay_flush_s"],
                global_commit_s=metrics["transfer/global_commit_s"], bit_exact=True))
        owner._sparse_refit_receiver.shutdown()
    finally:
        for p in policy:
            p.close()
    per_worker = [_timing_rows(Path(logs, f"policy-{r}.log").read_text()) for r in range(args.tp)]
    for i, row in enumerate(rows):  # each worker printed one timing line per sync
        row["policy_timing"] = [w[i] if i < len(w) else None for w in per_worker]
    med = {k: statistics.median(r[k] for r in rows) for k in
           ("wall_s", "policy_cpu_s", "rollout_cpu_s", "export_generator_s", "wire_bytes", "staged_read_bytes",
            "density", "relay_flush_s", "global_commit_s")}
    return dict(median_delta=med, init=init, syncs=rows, startup_s=startup,
                receiver_log=[line for line in captured.getvalue().splitlines() if line.startswith("REFIT_")][-8:])


def _collective(pool, policy, method, *args):
    """``method`` on every policy worker at once (their collectives need all of them)."""
    return pool.get([pool.ex.submit(p.call, method, *args) for p in policy])


def table(result: dict) -> str:
    """The per-sync table (medians over the delta syncs) of one run."""
    e, s, n = (result[k]["median_delta"] for k in ("export", "shards", "nemo_rl"))
    mib = 2 ** 20

    def exported(path):
        rows = result[path]["syncs"][1:] if path != "nemo_rl" else result[path]["syncs"]
        return statistics.median(max(r["exported_bytes_per_worker"]) for r in rows) / mib

    lines = [
        "| per delta sync (median) | plugin, export path | plugin, shard path | NeMo-RL vllm_zmq_sparse |",
        "|---|---|---|---|",
        f"| wall s of the sync | {e['wall_s']:.2f} | {s['wall_s']:.2f} | {n['wall_s']:.2f} |",
        f"| CPU s, policy workers together | {e['policy_cpu_s']:.2f} | {s['policy_cpu_s']:.2f} | {n['policy_cpu_s']:.2f} |",
        f"| CPU s, vLLM side (this process) | {e['rollout_cpu_s']:.2f} | {s['rollout_cpu_s']:.2f} | {n['rollout_cpu_s']:.2f} |",
        f"| export materialized per policy worker, MiB | {exported('export'):.1f} | 0 | {exported('nemo_rl'):.1f} |",
        f"| seconds in the export generator (max worker) | {e['export_generator_s']:.2f} | 0 | {n['export_generator_s']:.2f} |",
        f"| policy -> vLLM, MiB | {e['payload_bytes'] / mib:.3f} (store files) | {s['payload_bytes'] / mib:.3f} (store files) "
        f"| {n['wire_bytes'] / mib:.3f} (ZeroMQ, zstd) |",
        f"| between policy workers, MiB | {e['route_bytes'] / mib:.3f} | {s['route_bytes'] / mib:.3f} | 0 |",
        f"| relay -> vLLM workers, MiB | - | - | {n['staged_read_bytes'] / mib:.3f} (staged files, read by each) |",
        f"| changed elements | {100 * e['density']:.2f}% | {100 * s['density']:.2f}% | {100 * n['density']:.2f}% |",
        "| bit-exact against vLLM's own full load, every sync | yes | yes | yes |",
    ]
    ea, sa, ni = result["export"]["attach"], result["shards"]["attach"], result["nemo_rl"]["init"]
    em, sm = result["export"]["memory_after_attach"], result["shards"]["memory_after_attach"]
    lines += [
        f"| first sync (plugin: attach into dummy weights; NeMo-RL: init_communicator, vLLM loaded the "
        f"checkpoint itself): wall / policy CPU s | {ea['wall_s']:.2f} / {ea['policy_cpu_s']:.2f} "
        f"| {sa['wall_s']:.2f} / {sa['policy_cpu_s']:.2f} | {ni['wall_s']:.2f} / {ni['policy_cpu_s']:.2f} |",
        f"| policy worker RSS after it, MiB | {_span(em['policy_rss_mib'])} | {_span(sm['policy_rss_mib'])} "
        f"| {_span(ni['policy_rss_mib'])} |",
        f"| kept per policy worker between syncs, MiB | owned copies {_span(_mib(result['export']['syncs'][-1]['held_bytes_per_worker']))} "
        f"| none | baseline {_span(_mib(ni['baseline_bytes_per_worker']))} (file-backed) |",
    ]
    return "\n".join(lines)


def _mib(values):
    return [v / 2 ** 20 for v in values]


def _span(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}-{hi:.1f}"


def main(argv=None) -> int:
    p = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--nemo-rl", required=True, metavar="PATH", help="a checkout of NVIDIA-NeMo/RL (not installed)")
    p.add_argument("--nemo-rl-refit-cfg", default="{}", metavar="JSON",
                   help="NeMo-RL's policy.generation.refit_cfg (default: its defaults), e.g. "
                        '\'{"sparse": {"delta_compression": {"export_chunk_bytes": {"zmq": 16777216}}}}\'')
    args = p.parse_args(argv)
    args.nemo_rl_refit_cfg = json.loads(args.nemo_rl_refit_cfg)
    check_nemo_rl(args.nemo_rl)  # refuse before anything starts
    dims = model_dims(args.model, args.layers)
    vdims = StandinDims.of(dims)
    export, shards = plugin_paths(args, dims, vdims)
    nemo = run_nemo_rl(args, dims, vdims)
    commit = _git_head(args.nemo_rl)
    result = dict(model=args.model, layers=dims.num_layers, tp=args.tp, policy_workers=args.tp, vllm_workers=args.tp,
                  params=export["attach"]["dense_bytes"] // 2, delta_syncs=args.syncs, lr=args.lr,
                  nemo_rl_commit=commit, nemo_rl_refit_cfg=args.nemo_rl_refit_cfg, load_average=os.getloadavg(), export=export, shards=shards, nemo_rl=nemo)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    print(table(result))
    if args.json:
        Path(args.json).write_text(text)
    return 0


def _git_head(path: str) -> str | None:
    import subprocess

    out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
