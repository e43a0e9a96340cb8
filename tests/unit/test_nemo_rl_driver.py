"""What the NeMo-RL plugin refuses before any worker runs: a NeMo-RL without the checkpoint-engine
seam (at config load in the driver and again in every worker's ``prepare()``), a bad plugin key
(at config load), and weights NeMo-RL refits through paths the plugin does not take (by name).

The NeMo-RL trees here are minimal fakes of its files (the guard reads files; it imports nothing
of NeMo-RL): one with the seam as at NVIDIA-NeMo/RL 7ea279ab, one like v0.7.0 without it.
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest

from nemo_dcr.config import ConfigError
from nemo_dcr.integrations.nemo_rl import SELECTOR, DcrCheckpointEngine
from nemo_dcr.integrations.nemo_rl import driver
from nemo_dcr.integrations.nemo_rl.guard import SEAM, SEAM_COMMIT, SeamError, check_seam, find_nemo_rl
from nemo_dcr.integrations.nemo_rl.names import UnsupportedWeights, refuse_unsupported, unsupported_names
from tests.standins.nemo_rl_standin import PolicyWorker, Synchronizer, initial_state, vllm_engines
from tests.standins.vllm_standin import StandinDims

D = StandinDims(hidden=32, heads=4, kv_heads=1, head_dim=8, ffn=64, vocab=100, pad_to=64, experts=4, moe_ffn=32)


def fake_nemo_rl(root, version: str, seam: bool):
    """A ``nemo_rl`` package folder under ``root`` with ``package_info.py`` and (``seam``) the files
    and definitions of the checkpoint-engine seam."""
    pkg = root / "nemo_rl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    major, minor, patch = version.split(".")
    (pkg / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\n")
    for rel, needle in SEAM.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{needle}(x):\n    pass\n" if seam else "class VllmConfig:\n    pass\n")
    return pkg


@pytest.fixture
def key_file(tmp_path):
    key = tmp_path / "hmac.key"
    key.write_bytes(b"nemo-rl-driver-test-key-0123456789")
    return str(key)


def master_config(tmp_path, key_file, **plugin) -> dict:
    """The part of NeMo-RL's resolved master config the driver reads."""
    block = {"update_weights_bucket_memory_ratio": 0.05, "url": str(tmp_path / "refit"), "key_file": key_file,
             **plugin}
    return {"policy": {"generation": {"backend": "vllm", "refit_transport": SELECTOR, "colocated": {"enabled": False},
                                      "vllm_cfg": {"precision": "bfloat16", "kv_cache_dtype": "auto"},
                                      "refit_cfg": {SELECTOR: block}},
                       "megatron_cfg": {"mtp_num_layers": 0}}}


def test_the_seam_is_found_at_the_tested_commit_and_refused_on_v070(tmp_path):
    good = find_nemo_rl(fake_nemo_rl(tmp_path / "good", "0.6.0", seam=True))
    assert good.version == "0.6.0" and good.missing == ()
    assert check_seam(tmp_path / "good").package == good.package
    fake_nemo_rl(tmp_path / "old", "0.7.0", seam=False)
    with pytest.raises(SeamError, match=rf"NeMo-RL 0\.7\.0 at .* has no checkpoint-engine seam \(missing "
                                        rf"nemo_rl/weight_sync/checkpoint_engine_config\.py .*refit_transport "
                                        rf"would be ignored.*at or after commit {SEAM_COMMIT}"):
        check_seam(tmp_path / "old")
    with pytest.raises(SeamError, match=rf"no NeMo-RL found at .*nowhere.*{SEAM_COMMIT}"):
        check_seam(tmp_path / "nowhere")
    assert check_seam(tmp_path / "nowhere", required=False) is None


def test_prepare_refuses_a_worker_environment_without_the_seam(tmp_path, key_file, monkeypatch):
    fake_nemo_rl(tmp_path / "env", "0.7.0", seam=False)
    monkeypatch.syspath_prepend(str(tmp_path / "env"))
    monkeypatch.delitem(sys.modules, "nemo_rl", raising=False)
    importlib.invalidate_caches()
    engine = DcrCheckpointEngine(1 << 20, url=str(tmp_path / "refit"), key_file=key_file)
    with pytest.raises(SeamError, match=rf"0\.7\.0 .*no checkpoint-engine seam.*{SEAM_COMMIT}"):
        engine.prepare()


def test_config_load_refuses_a_bad_plugin_key_naming_it(tmp_path, key_file):
    options = driver.check_config(master_config(tmp_path, key_file, reply_timeout_s=30))
    assert options.dcr.reply_timeout_s == 30.0 and options.dcr.url == str(tmp_path / "refit")
    where = rf"refit_cfg\['{SELECTOR}'\]"
    with pytest.raises(ConfigError, match=rf"^{where}\.bogus: unknown key"):
        driver.check_config(master_config(tmp_path, key_file, bogus=1))
    with pytest.raises(ConfigError, match=rf"^{where}\.key_file: .*does not exist"):
        driver.check_config(master_config(tmp_path, str(tmp_path / "missing.key")))
    cfg = master_config(tmp_path, key_file)
    cfg["policy"]["generation"]["colocated"]["enabled"] = True
    with pytest.raises(ConfigError, match=r"^policy\.generation\.colocated\.enabled: .*non-colocated"):
        driver.check_config(cfg)
    cfg = master_config(tmp_path, key_file)
    cfg["policy"]["generation"]["vllm_cfg"]["kv_cache_dtype"] = "fp8_e4m3"
    with pytest.raises(ConfigError, match=r"^policy\.generation\.vllm_cfg\.kv_cache_dtype: an FP8 KV cache"):
        driver.check_config(cfg)
    cfg = master_config(tmp_path, key_file)
    cfg["policy"]["megatron_cfg"]["mtp_num_layers"] = 1
    with pytest.raises(ConfigError, match=r"^policy\.megatron_cfg\.mtp_num_layers: co-trained MTP layers"):
        driver.check_config(cfg)


def test_the_driver_refuses_before_running_nemo_rl(tmp_path, key_file, monkeypatch, capsys):
    script = tmp_path / "run_grpo.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('yes')\n")
    argv = [str(script), "--config", "grpo.yaml", "++policy.max_total_sequence_length=512"]
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the driver hands NeMo-RL's script its argv
    monkeypatch.setattr(driver, "check_seam", lambda: check_seam(tmp_path / "nowhere"))
    assert driver.main(argv) == 2  # no NeMo-RL with the seam: refused, nothing started
    assert SEAM_COMMIT in capsys.readouterr().err and not (tmp_path / "ran").exists()
    fake_nemo_rl(tmp_path / "good", "0.6.0", seam=True)
    monkeypatch.setattr(driver, "check_seam", lambda: check_seam(tmp_path / "good"))
    seen = []
    monkeypatch.setattr(driver, "load_nemo_rl_config",
                        lambda config, overrides: seen.append((config, overrides)) or master_config(
                            tmp_path, key_file, bogus=1))
    assert driver.main(argv) == 2
    assert "bogus: unknown key" in capsys.readouterr().err and not (tmp_path / "ran").exists()
    assert seen == [("grpo.yaml", ["++policy.max_total_sequence_length=512"])]
    monkeypatch.setattr(driver, "load_nemo_rl_config", lambda config, overrides: master_config(tmp_path, key_file))
    assert driver.main(["--check-only", *argv]) == 0 and not (tmp_path / "ran").exists()
    assert "has the checkpoint-engine seam" in capsys.readouterr().out
    assert driver.main(argv) == 0 and (tmp_path / "ran").read_text() == "yes"  # checked, then run


def test_weights_refitted_through_other_paths_are_refused_by_name():
    names = ["model.norm.weight", "draft.fc.weight", "model.layers.0.self_attn.attn.k_scale", "mtp.layers.0.w"]
    found = unsupported_names(names)
    assert sorted(n for ns in found.values() for n in ns) == sorted(names[1:])
    with pytest.raises(UnsupportedWeights, match=r"drafter \(Eagle3\).*1 tensors \['draft\.fc\.weight'\]"):
        refuse_unsupported(names)
    refuse_unsupported(["model.norm.weight"])
    runner = SimpleNamespace(drafter=SimpleNamespace(model=object()),
                             vllm_config=SimpleNamespace(model_config=SimpleNamespace(
                                 architectures=["Gemma3ForConditionalGeneration"])))
    worker = SimpleNamespace(model_runner=runner, _uses_fp8_kv_cache=lambda: True)
    with pytest.raises(UnsupportedWeights, match=r"speculative drafter.*KV cache is FP8.*Gemma3ForConditional"):
        refuse_unsupported(["model.norm.weight"], worker)


def test_a_vllm_worker_given_fp8_kv_scales_refuses_at_startup(tmp_path, key_file):
    state = initial_state(D)
    state["model.layers.0.self_attn.attn.k_scale"] = state["model.norm.weight"][:1].clone()
    sync = Synchronizer([PolicyWorker(0, state)], vllm_engines(D, 1, 2), SELECTOR,
                        {"url": str(tmp_path / "refit"), "key_file": key_file})
    with pytest.raises(UnsupportedWeights, match=r"FP8 KV-cache scales.*k_scale"):
        sync.init_communicator()
