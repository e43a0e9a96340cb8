"""``nemo-dcr plan``: rank shares derived from the layout tables, totals that must add up, model
configs against published parameter counts, owners, the comparison logic of ``--validate``, the
calibration's document, and the command line (JSON keys, refusals)."""

from __future__ import annotations

import io
import json
import math
import random
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace

import pytest

from nemo_dcr.tools.cli import main
from nemo_dcr.codec.stats import layer_type
from nemo_dcr.layout import (HF_CONFIGS, LayoutError, MegatronSpec, ParallelLayout, canonical_shapes, dims_from_hf_config,
                             model_dims)
from nemo_dcr.tools.planner import figures as F
from nemo_dcr.tools.planner.inputs import EngineDeployment, Hardware, PlanSetup
from nemo_dcr.tools.planner.estimate import make_plan, rank_shares
from nemo_dcr.tools.planner.presets import CPU_HOST, LOOPBACK
from nemo_dcr.refit.routing import assign_owners

SPECS = (MegatronSpec(), MegatronSpec(transformer_engine=True, moe_grouped_gemm=True))
LAYOUTS = [
    ("smollm2", ParallelLayout(tp=3, pp=2, dp=2), EngineDeployment(tp=3, replicas=2)),
    ("dense-tiny", ParallelLayout(tp=2, pp=2, vpp=2, dp=3), EngineDeployment(tp=2, dp=2)),
    ("qwen3-moe-tiny", ParallelLayout(tp=2, pp=2, ep=2, etp=1, dp=2), EngineDeployment(tp=2, dp=2, ep=4)),
    ("deepseek-tiny", ParallelLayout(tp=2, pp=2, ep=4, etp=1, dp=2), EngineDeployment(tp=2, ep=1)),
    ("deepseek-tiny", ParallelLayout(tp=2, pp=4, ep=2, etp=2, dp=2), EngineDeployment(tp=4, dp=1, ep=4)),
]


def _fig(density: float) -> F.Figures:
    return F.default_figures(density=density)


def _by_type(model: str) -> dict[str, int]:
    """Independent count: canonical elements per layer type straight from the canonical shapes."""
    dims = model_dims(model)
    out: dict[str, int] = {}
    for name, shape in canonical_shapes(dims.family, dims).items():
        out[layer_type(name)] = out.get(layer_type(name), 0) + math.prod(shape)
    return out


def _setup(trainer, engine) -> PlanSetup:
    return PlanSetup(trainer, engine, links=LOOPBACK, hardware=replace(CPU_HOST, gpus_per_node=4),
                     placement="cluster")


@pytest.mark.parametrize("spec", SPECS, ids=["local", "te"])
@pytest.mark.parametrize("model,trainer,engine", LAYOUTS, ids=[f"{m}-{t.describe()}" for m, t, _ in LAYOUTS])
def test_every_canonical_element_captured_once_and_held_by_each_replica(model, trainer, engine, spec):
    dims, want = model_dims(model), _by_type(model)
    sh = rank_shares(dims, _setup(trainer, engine), spec)
    got: dict[str, int] = {}
    for s in sh.trainers:
        for k, v in s.canonical.items():
            got[k] = got.get(k, 0) + v
    assert got == want
    per_replica: dict[str, int] = {}
    for s in sh.engines:
        for k, v in s.canonical.items():
            per_replica[k] = per_replica.get(k, 0) + v
    copies = {k: 0 for k in want}
    for n, kind, c in zip(sh.table.numel, sh.table.kind, sh.table.copies):
        copies[kind] += int(n) * int(c)
    assert {k: v // engine.replicas for k, v in per_replica.items()} == copies
    assert all(v % engine.replicas == 0 for v in per_replica.values())
    assert sum(s.scanned for s in sh.trainers) >= sum(want.values())  # vocabulary padding is scanned too


def test_ranks_that_differ_in_data_parallel_rank_scan_the_same_amount():
    sh = rank_shares(model_dims("qwen3-moe-tiny"), _setup(ParallelLayout(tp=2, ep=2, dp=4), EngineDeployment()), SPECS[0])
    by_class: dict[tuple, set[int]] = {}
    for s in sh.trainers:
        key = (s.coords["pp_rank"], s.coords["tp_rank"], s.coords["etp_rank"])
        by_class.setdefault(key, set()).add(s.scanned)
    assert all(max(v) - min(v) <= 64 for v in by_class.values())  # the even split differs by <= 1 per param


@pytest.mark.parametrize("density", [0.001, 0.03, 1.0])
def test_changes_add_up_to_density_times_params_on_every_side(density):
    trainer, engine = ParallelLayout(tp=3, pp=2, dp=2), EngineDeployment(tp=3, replicas=2)
    plan = make_plan("smollm2", model_dims("smollm2"), _setup(trainer, engine), _fig(density), spec=MegatronSpec())
    total = density * plan.params
    assert sum(c.changes for c in plan.trainers) == pytest.approx(total, rel=1e-9)
    assert sum(c.owned_changes for c in plan.trainers) == pytest.approx(total, rel=1e-9)
    assert plan.changed == pytest.approx(total, rel=1e-9)
    assert sum(c.owned_elements for c in plan.trainers) == plan.params
    held = sum(c.changes for c in plan.engines)
    assert held >= engine.replicas * total  # TP-replicated norms are held by every TP rank
    assert plan.refit_seconds == pytest.approx(sum(p.seconds for p in plan.path))


def test_owners_are_assign_owners_and_each_tensor_has_one():
    dims = model_dims("deepseek-tiny")
    setup = _setup(ParallelLayout(tp=2, pp=2, ep=2, dp=2), EngineDeployment())
    sh = rank_shares(dims, setup, SPECS[0])
    shapes = canonical_shapes(dims.family, dims)
    want = assign_owners({n: math.prod(s) for n, s in shapes.items()}, setup.trainer.world_size)
    assert dict(zip(sh.table.names, sh.table.owner.tolist())) == want
    assert sorted(sh.table.names) == sorted(shapes)


def test_assign_owners_matches_its_definition():
    rng = random.Random(3)
    for world in (1, 2, 5, 16):
        sizes = {f"t{i}": rng.choice([1, 7, 7, 300, 4096]) for i in range(300)}
        load, want = [0] * world, {}
        for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
            rank = min(range(world), key=lambda r: (load[r], r))
            want[name] = rank
            load[rank] += sizes[name]
        assert assign_owners(sizes, world) == want


@pytest.mark.parametrize("model,published", [("kimi-k2", 1.04e12), ("deepseek-v3", 671e9),
                                             ("qwen3-235b-a22b", 235e9), ("llama3-70b", 70.6e9)])
def test_hf_configs_give_the_published_parameter_counts(model, published):
    dims = dims_from_hf_config(HF_CONFIGS[model])
    params = sum(math.prod(s) for s in canonical_shapes(dims.family, dims).values())
    assert params == pytest.approx(published, rel=0.015)  # model cards round (Kimi-K2: "1T", 1.04T)


def test_hf_config_refusals_name_the_field():
    kimi = HF_CONFIGS["kimi-k2"]
    with pytest.raises(LayoutError, match="moe_layer_freq"):
        dims_from_hf_config({**kimi, "moe_layer_freq": 2})
    with pytest.raises(LayoutError, match="known: deepseek_v3"):
        dims_from_hf_config({**kimi, "model_type": "mamba"})
    with pytest.raises(LayoutError, match="kv_lora_rank"):
        dims_from_hf_config({k: v for k, v in kimi.items() if k != "kv_lora_rank"})
    wrapped = dims_from_hf_config({"model_type": "kimi_k25", "text_config": kimi})
    assert wrapped == dims_from_hf_config(kimi)


def test_codec_table_takes_the_nearest_measured_density():
    table = F.CodecTable((F.CodecPoint("mlp", 0.002, {"dcr": 0.7}, "a"), F.CodecPoint("mlp", 0.03, {"dcr": 0.9}, "b")),
                         30.0, "test")
    assert table.bytes_per_changed("mlp", 0.003)[0] == 0.7
    assert table.bytes_per_changed("experts", 0.02)[0] == 0.9  # experts use the mlp points
    with pytest.raises(F.FiguresError, match="norms"):
        table.bytes_per_changed("norms", 0.01)


def test_densities_from_telemetry_average_delta_steps(tmp_path):
    lines = [{"mode": "delta", "density_by_layer_type": {"mlp": 0.01, "attention": 0.02}},
             {"mode": "resync", "density_by_layer_type": {"mlp": 1.0}},
             {"mode": "delta", "density_by_layer_type": {"mlp": 0.03, "attention": 0.04}}]
    (tmp_path / "telemetry.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dens, _ = F.densities_from_file(tmp_path)
    assert dens == pytest.approx({"mlp": 0.02, "attention": 0.03})


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["plan", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_cli_json_has_the_promised_keys_and_a_row_per_rank(tmp_path):
    png = tmp_path / "t.png"
    rc, out, _ = _cli("--model", "qwen3-moe-tiny", "--tp", "2", "--ep", "2", "--dp", "2", "--engine-tp", "2",
                      "--density", "0.02", "--json", "--png", str(png))
    assert rc == 0
    d = json.loads(out)
    for key in ("model", "params", "changed", "payload_bytes", "refit_seconds", "dense_refit_seconds",
                "critical_path", "ranks", "preset", "assumptions", "export_then_diff_seconds", "what_it_takes"):
        assert key in d
    assert len(d["ranks"]) == 4 + 2
    assert d["trainer_layout"] == {"tp": 2, "pp": 1, "vpp": 1, "ep": 2, "etp": 1, "dp": 2, "cp": 1,
                                   "num_layers_in_first_pipeline_stage": None,
                                   "num_layers_in_last_pipeline_stage": None, "world_size": 4, "expert_dp": 2,
                                   "describe": "TP2 PP1 EP2 ETP1 DP2"}  # the ParallelLayout's sizes
    assert d["engine_layout"] == {"tp": 2, "ep": 1, "dp": 1, "replicas": 1, "world_size": 2,
                                  "describe": "TP2 DP1 EP1 x1 replicas"}
    assert d["changed"] == pytest.approx(0.02 * d["params"])
    assert png.stat().st_size > 1000


def test_cli_uneven_pipeline_flags_set_the_parallel_layout():
    rc, out, _ = _cli("--model", "dense-tiny", "--pp", "2", "--first-stage-layers", "1", "--last-stage-layers", "3",
                      "--density", "0.02", "--json")
    assert rc == 0
    t = json.loads(out)["trainer_layout"]
    assert (t["num_layers_in_first_pipeline_stage"], t["num_layers_in_last_pipeline_stage"]) == (1, 3)
    assert t["describe"] == "TP1 PP2(1/../3) EP1 ETP1 DP1"


def test_cli_refuses_bad_layouts_and_densities_naming_them():
    rc, _, err = _cli("--model", "smollm2", "--tp", "7")
    assert rc == 2 and "tp" in err
    rc, _, err = _cli("--model", "smollm2", "--density", "1.5")
    assert rc == 2 and "--density" in err
    rc, _, err = _cli("--model", "smollm2", "--density", "0.1", "--densities", "x.json")
    assert rc == 2 and "not both" in err
    rc, _, err = _cli("--model", "nope")
    assert rc == 2 and "kimi-k2" in err


def test_validate_compares_against_the_run(tmp_path):
    from nemo_dcr.tools.planner.validate import plan_for_run, validate

    lines = [{"mode": "delta", "density_by_layer_type": {"mlp": 0.004, "attention": 0.005, "embeddings": 0.01,
                                                          "norms": 0.001}}]
    (tmp_path / "telemetry.jsonl").write_text(json.dumps(lines[0]) + "\n")
    summary = {"model": "smollm2", "engine": "hf", "trainer_layout": {"tp": 3, "pp": 2}, "steps": 2,
               "delta_bytes_total": 1, "refit_seconds_delta": 1.0}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    plan, _ = plan_for_run(tmp_path, _fig(0.01))
    summary.update(delta_bytes_total=2 * plan.payload_bytes * 1.1, refit_seconds_delta=plan.refit_seconds * 1.9)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert validate(tmp_path, _fig(0.01))["ok"]
    summary.update(delta_bytes_total=2 * plan.payload_bytes * 1.3)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert not validate(tmp_path, _fig(0.01))["ok"]
    summary.update(engine="vllm")  # the main job's default engine is validated the same way
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert validate(tmp_path, _fig(0.01))["payload_bytes_per_step"]["predicted"] == plan.payload_bytes
    summary.update(engine="sglang")
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(F.FiguresError, match="sglang"):
        plan_for_run(tmp_path, _fig(0.01))


def test_calibration_document_round_trips(tmp_path):
    from nemo_dcr.tools.planner.calibrate import calibrate, write

    doc = calibrate(None, elements=1 << 16)
    k = F.Kernels.from_dict(doc["kernels"])
    assert all(getattr(k, f) > 0 for f in ("scan_gbps", "encode_per_s", "decode_per_s", "apply_per_s"))
    back = F.cpu_kernels(write(doc, tmp_path / "cpu.json"))
    assert replace(back, source=k.source) == k and doc["measured"] in back.source
    with pytest.raises(F.FiguresError, match="scan_gbps"):
        F.Kernels.from_dict({k: v for k, v in doc["kernels"].items() if k != "scan_gbps"})


def test_hardware_share_of_host_cores_slows_host_kernels():
    trainer, engine = ParallelLayout(tp=3, pp=2), EngineDeployment()
    fig = _fig(0.01)
    one = make_plan("smollm2", model_dims("smollm2"), _setup(trainer, engine), fig, spec=MegatronSpec())
    hw = replace(CPU_HOST, gpus_per_node=8, host_cores_per_node=12)
    many = make_plan("smollm2", model_dims("smollm2"), replace(_setup(trainer, engine), hardware=hw), fig,
                     spec=MegatronSpec(), shares=one.shares)
    assert many.trainers[0].seconds["encode"] < one.trainers[0].seconds["encode"]
    assert isinstance(Hardware().codec_device, str)
