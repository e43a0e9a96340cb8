"""Recipe config: defaults inheritance, key=value overrides, and refusals that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_dcr.config import ConfigError, DcrConfig
from nemo_dcr.tools.demo.recipe import RecipeConfig
from nemo_dcr.tools.demo.recipe_load import load_config, to_yaml

ROOT = Path(__file__).resolve().parents[2]
CFG = ROOT / "configs" / "grpo_smollm2_cpu.yaml"


def test_shipped_configs_load():
    cfg = load_config(CFG)
    assert (cfg.trainer.tp, cfg.trainer.pp, cfg.dcr.encoding) == (3, 2, "dcr")
    assert cfg.dcr.telemetry_dir == cfg.run.run_dir  # interpolation resolved
    ref = load_config(ROOT / "configs" / "grpo_smollm2_cpu_reference.yaml")
    assert ref.dcr.encoding == "reference" and ref.dcr.baseline == "file"
    assert ref.trainer.tp == 3  # inherited through two levels of defaults
    assert ref.dcr.baseline_dir == "runs/grpo_dcr_reference/baseline"


def test_overrides_win_and_parse_yaml_values():
    cfg = load_config(CFG, ["run.steps=7", "dcr.enabled=false", "trainer.lr=1e-5",
                            "dcr.key_file=null", "dcr.telemetry_encodings=[raw]"])
    assert cfg.run.steps == 7 and cfg.dcr.enabled is False and cfg.trainer.lr == 1e-5
    assert cfg.dcr.telemetry_encodings == ["raw"]


@pytest.mark.parametrize("override, key, text", [
    ("dcr.encodng=dcr", "dcr.encodng", "did you mean 'dcr.encoding'"),
    ("dcr.encoding=zip", "dcr.encoding", "must be one of"),
    ("trainer.tp=abc", "trainer.tp", "could not be converted"),
    ("dcr.transport=store", "dcr.url", "needs a url"),
    ("dcr.transport=file", "dcr.transport", "must be one of"),
    ("dcr.transport=nccl", "dcr.transport", "use gloo (TCP, also on GPU clusters) or store"),
    ("dcr.transport=cuda_ipc", "dcr.transport", "no CUDA IPC transport: use gloo"),
    ("dcr.reply_timeout_s=0", "dcr.reply_timeout_s", "must be > 0"),
    ("dcr.baseline=file", "dcr.baseline_dir", "needs a folder"),
    ("dcr.verify_steps=0", "dcr.verify_steps", ">= 1"),
    ("dcr.verify=sometimes", "dcr.verify", "must be one of ['full', 'sampled', 'incremental']"),
    ("task.group_size=1", "task.group_size", ">= 2"),
    ("engine.rank=6", "engine.rank", "world size"),
    ("dcr.transport=inprocess", "dcr.transport", "separate engine is reached over a gloo group"),
    ("trainer.ep=2", "trainer.ep", "dense model"),
    ("nosuch.key=1", "nosuch", "unknown key"),
    ("engine.kind=vllm engine.weights=fp8", "engine.weights", "transformers engine"),
    ("engine.weights=int4", "engine.weights", "must be one of"),
    ("dcr.engine_format=fp8", "dcr.engine_format", "set both alike"),
    ("dcr.fp8_granularity=row", "dcr.fp8_granularity", "must be one of"),
    ("dcr.fp8_block=[0,128]", "dcr.fp8_block", "two sizes"),
    ("dcr.fp8_block=[128]", "dcr.fp8_block", "two sizes"),
    ("dcr.fp8_keep=['']", "dcr.fp8_keep", "non-empty"),
])
def test_bad_values_are_refused_naming_the_key(override, key, text):
    with pytest.raises(ConfigError) as err:
        load_config(CFG, override.split())
    assert err.value.key == key and text in str(err.value) and str(err.value).startswith(key)


def test_fp8_weights_select_the_fp8_engine_format():
    from nemo_dcr.config.schema import FP8_GRANULARITIES
    from nemo_dcr.quant.fp8 import GRANULARITIES

    cfg = load_config(CFG, ["engine.kind=hf", "engine.placement=colocated", "engine.weights=fp8",
                            "dcr.fp8_keep=['*norm*']"])
    assert cfg.dcr.engine_format == "fp8" and cfg.dcr.fp8_block == [128, 128] and cfg.dcr.fp8_keep == ["*norm*"]
    default = load_config(CFG)
    assert default.dcr.engine_format == "bf16" and default.engine.kind == "vllm"  # engine.kind: auto
    auto = load_config(CFG, ["engine.weights=fp8"])
    assert (auto.engine.kind, auto.engine.placement, auto.dcr.engine_format) == ("hf", "separate", "fp8")
    assert "kind: hf" in to_yaml(auto)  # the run's config.yaml names the engine it ran
    assert FP8_GRANULARITIES == GRANULARITIES


@pytest.mark.parametrize("override", ["foo", "=1", "+dcr.x=1", "~dcr.url="])
def test_malformed_overrides(override):
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(CFG, [override])


def test_defaults_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: missing\n")
    with pytest.raises(ConfigError, match="no such config file 'missing'"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("defaults: c\n")
    (tmp_path / "c.yaml").write_text("defaults: b\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "b.yaml")
    (tmp_path / "d.yaml").write_text("dcr:\n  unknown_flag: 1\n")
    with pytest.raises(ConfigError, match="dcr.unknown_flag: unknown key"):
        load_config(tmp_path / "d.yaml")


def test_every_field_has_a_docstring():
    import ast
    import inspect

    from nemo_dcr.config import schema
    from nemo_dcr.tools.demo import recipe

    classes = [n for m in (schema, recipe) for n in ast.parse(inspect.getsource(m)).body
               if isinstance(n, ast.ClassDef) and n.name.endswith("Config")]
    assert {c.name for c in classes} >= {"DcrConfig", "RecipeConfig", "EngineConfig"}
    for cls in classes:
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                    f"{cls.name}.{node.target.id} has no docstring"


def test_defaults_and_yaml_round_trip(tmp_path):
    cfg = load_config(None)
    assert cfg == RecipeConfig() and isinstance(cfg.dcr, DcrConfig)
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(load_config(CFG, ["run.steps=2"])))
    assert load_config(path).run.steps == 2


def test_nemo_rl_recipe_snippet_turns_dcr_on(tmp_path):
    from omegaconf import OmegaConf

    node = OmegaConf.load(ROOT / "configs" / "nemo_rl" / "grpo_math_1B_megatron_dcr.yaml")
    gen = node.policy.generation
    assert gen.refit_transport == "nemo_dcr.integrations.nemo_rl:DcrCheckpointEngine" and not gen.colocated.enabled
    # the selector's block is the interpolation of refit_cfg.nemo_dcr (dotted overrides: docs/nemo_rl.md)
    assert OmegaConf.to_container(gen.refit_cfg)[gen.refit_transport] == "${policy.generation.refit_cfg.nemo_dcr}"
    scoped = OmegaConf.to_container(gen.refit_cfg.nemo_dcr)  # ${oc.env:...} left unresolved
    from nemo_dcr.integrations.nemo_rl import DcrCheckpointEngine

    kwargs = {k: v for k, v in scoped.items() if k != "update_weights_bucket_memory_ratio"}
    assert {"url", "key_file"} <= set(kwargs)
    (tmp_path / "key").write_bytes(b"k" * 32)  # the shared folder and key do not exist on this machine
    kwargs.update(url=str(tmp_path / "refit"), key_file=str(tmp_path / "key"))
    DcrCheckpointEngine(bucket_size=1 << 20, **kwargs)  # every key is accepted


def _float_fields():
    from dataclasses import fields

    for block in fields(RecipeConfig):
        for f in fields(block.default_factory()):
            if f.type == "float":
                yield f"{block.name}.{f.name}"


@pytest.mark.parametrize("value", ["nan", ".nan", "inf", "-inf", ".inf"])
@pytest.mark.parametrize("key", list(_float_fields()))
def test_nan_and_inf_are_refused_for_every_float_field(key, value):
    with pytest.raises(ConfigError) as err:
        load_config(CFG, [f"{key}={value}"])
    assert err.value.key == key and "finite" in str(err.value)


def test_there_are_float_fields_to_check():
    assert {"trainer.lr", "trainer.weight_decay", "engine.temperature", "dcr.bucket_size_mb"} <= set(_float_fields())


@pytest.mark.parametrize("text", ["run: {steps: 2\n", "run:\n  steps: 1\n bad: [\n", "\t- x: : :\n"])
def test_malformed_yaml_is_a_config_error(tmp_path, text):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize("override", ["trainer.lr=[1", "run.steps={a: ", "dcr.url='x"])
def test_unparsable_override_value_is_a_config_error(override):
    with pytest.raises(ConfigError) as err:
        load_config(CFG, [override])
    assert err.value.key == override.partition("=")[0]


def test_dcr_config_from_a_mapping():
    """The library's reader of a plain mapping (the NeMo-RL plugin's options): field names and units,
    ints taken for floats, sequences for lists, validated."""
    cfg = DcrConfig.from_mapping({"bucket_size_mb": 4, "telemetry_encodings": ("raw",), "url": None,
                                  "engine_index": False, "fp8_keep": None})
    assert (cfg.bucket_size_mb, cfg.telemetry_encodings, cfg.engine_index) == (4.0, ["raw"], False)
    assert isinstance(cfg.bucket_size_mb, float)
    assert DcrConfig.from_mapping({}) == DcrConfig()


@pytest.mark.parametrize("settings, key, text", [
    ({"encodng": "dcr"}, "x.encodng", "unknown key (did you mean 'encoding'?); known: enabled, encoding"),
    ({"enabled": 1}, "x.enabled", "must be bool, got int 1"),
    ({"verify_steps": True}, "x.verify_steps", "must be int, got bool"),
    ({"verify": "incremental", "verify_steps": -1}, "x.verify_steps", "must be >= 0"),
    ({"verify_block": 0}, "x.verify_block", "must be >= 1"),
    ({"bucket_size_mb": "3"}, "x.bucket_size_mb", "must be float, got str"),
    ({"fp8_block": [1, "a"]}, "x.fp8_block[1]", "must be int, got str"),
    ({"fp8_keep": "*norm*"}, "x.fp8_keep", "must be a list, got str"),
    ({"url": 3}, "x.url", "must be str, got int"),
    ({"reply_timeout_s": 0}, "x.reply_timeout_s", "must be > 0"),
    ({"transport": "store", "url": "/tmp/x"}, "x.key_file", "set a key file"),
])
def test_dcr_config_from_a_mapping_refuses_naming_the_key(settings, key, text):
    with pytest.raises(ConfigError) as err:
        DcrConfig.from_mapping(settings, "x")
    assert err.value.key == key and text in str(err.value)
