"""What the same job would cost without a sparse refit, and with an export-then-diff sparse refit.

* **Dense refit**: the trainer assembles full canonical tensors (Megatron-Bridge style export:
  TP/EP gathers and pipeline broadcasts bring every tensor to every trainer node, one collective
  per tensor, one conversion pass), the owner of
  each tensor sends every engine rank its whole shard over the same link tiers (streamed with the
  export), and the engine copies it in.
* **Export-then-diff** (NeMo-RL's sparse refit design): the same full export on every trainer
  rank; chunks are owned ``chunk_index % producers`` (every trainer rank produces, so each holds
  ``model / producers``); a producer copies its chunks to the host and diffs them against a host
  baseline (about one model copy over all producers), codes them ``reference``-style (gaps, XOR,
  zstd) on the host, ships them over the same links; the engine decodes on the host and reloads
  every touched tensor.  Diffing streams with the export.
"""

from __future__ import annotations

import math

import numpy as np

from .cost import ELEMENT_BYTES, RankCost, TensorCosts, send_transfer
from .figures import Figures
from .inputs import PlanSetup
from .links import GBIT
from .work import TensorTable


def export_seconds(model_bytes: float, tensors: int, setup: PlanSetup, fig: Figures) -> tuple[float, str]:
    """Full export: every GPU sees every tensor (NVLink), every node receives what it lacks (IB), one
    collective per canonical tensor (its latency), and one conversion pass over the model."""
    links, nodes = setup.links, math.ceil(setup.trainer.world_size / setup.hardware.gpus_per_node)
    nv = model_bytes / (links.nvlink_gbps * GBIT)
    ib = model_bytes * (1 - 1 / nodes) / (links.ib_gbps * GBIT) if nodes > 1 else 0.0
    lat = links.ib_latency_s if nodes > 1 else links.nvlink_latency_s
    convert = model_bytes / (_load_kernels(setup, fig).memcpy_gbps * 1e9)
    extra = tensors * lat + convert
    if ib > nv:
        return ib + extra, f"every trainer node receives the model over IB {links.ib_gbps:g} Gbit/s"
    return nv + extra, f"every GPU receives the model over the {links.intra_node_name} ({links.nvlink_gbps:g} Gbit/s)"


def _load_kernels(setup: PlanSetup, fig: Figures):
    return fig.gpu if setup.hardware.gpus else fig.cpu


def dense_refit(table: TensorTable, tc: TensorCosts, trainers: list[RankCost], engines: list[RankCost],
                setup: PlanSetup, fig: Figures) -> dict:
    """Seconds and bytes of a dense refit through the same links."""
    model_bytes = float(table.numel.sum()) * ELEMENT_BYTES
    export, export_bound = export_seconds(model_bytes, len(table.names), setup, fig)
    out_b = table.by_owner(table.numel * ELEMENT_BYTES * tc.views, setup.trainer.world_size)
    in_b = np.array([sum(c.share.canonical.values()) * ELEMENT_BYTES for c in engines], float)
    send = send_transfer(trainers, engines, setup, out_b, in_b)
    load = float(in_b.max()) / (_load_kernels(setup, fig).memcpy_gbps * 1e9)
    total = max(export, send.seconds) + load
    return {"seconds": total, "bytes": float(in_b.sum()),
            "phases": {"export": export, "send": send.seconds, "load": load},
            "bound": send.bound if send.seconds >= export else export_bound,
            "note": "export streamed into the sends; engine copies whole shards in"}


def export_then_diff(table: TensorTable, tc_ref: TensorCosts, trainers: list[RankCost], engines: list[RankCost],
                     setup: PlanSetup, fig: Figures) -> dict:
    """Seconds, bytes and memory of NeMo-RL's sparse refit design on the same job."""
    producers = setup.trainer.world_size
    model_bytes = float(table.numel.sum()) * ELEMENT_BYTES
    export, export_bound = export_seconds(model_bytes, len(table.names), setup, fig)
    chunk = model_bytes / producers
    d2h = chunk / (setup.hardware.pcie_gbytes_s * 1e9) if setup.hardware.gpus else 0.0
    diff = d2h + chunk / (fig.cpu.scan_gbps * 1e9)
    changes = float(tc_ref.changes.sum())
    encode = changes / producers / fig.cpu.ref_encode_per_s
    per_view = tc_ref.changes * tc_ref.bpc * tc_ref.views + tc_ref.views * tc_ref.header
    out_b = np.full(producers, float(per_view.sum()) / producers)
    in_b = np.array([sum(v * tc_ref.density_by_kind[k] * tc_ref.bpc_by_kind[k] for k, v in c.share.canonical.items())
                     + c.share.records * tc_ref.header for c in engines])
    send = send_transfer(trainers, engines, setup, out_b, in_b)
    load_k = _load_kernels(setup, fig)
    engine = max(c.changes / fig.cpu.ref_decode_per_s
                 + sum(c.share.canonical.values()) * ELEMENT_BYTES / (load_k.memcpy_gbps * 1e9) for c in engines)
    total = max(export, diff + encode) + send.seconds + engine
    return {"seconds": total, "payload_bytes": float(in_b.sum()),
            "phases": {"export": export, "diff": diff, "encode": encode, "send": send.seconds, "engine": engine},
            "bound": max((("export", export), ("diff+encode", diff + encode), ("send", send.seconds),
                          ("engine", engine)), key=lambda kv: kv[1])[0],
            "export_bound": export_bound, "send_bound": send.bound,
            "baseline_bytes_per_producer": chunk, "producers": producers,
            "note": "every trainer rank exports the full model; chunk i diffed by producer i % producers "
                    "against a host baseline; reference coding on the host; engine reloads touched tensors"}
