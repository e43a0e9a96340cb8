"""A single plugin key overridden by a dotted path, as NeMo-RL's override parser applies it.

NeMo-RL's ``parse_hydra_overrides`` (``nemo_rl/utils/config.py`` at the target commit) puts the
config in struct mode, parses each override with Hydra's ``OverridesParser`` and applies it with
Hydra's ``ConfigLoaderImpl._apply_overrides_to_config``: ``key=v`` updates an existing key,
``+key=v`` adds a missing one, ``++key=v`` either, each through ``OmegaConf.update(..., merge=True)``;
``examples/run_grpo.py`` then resolves the config (``OmegaConf.to_container(resolve=True)``).
Hydra is not a dependency here: :func:`apply_override` stands in for its key grammar (a key is
``ID`` or a ``DOT_PATH`` of ``KEY_SPECIAL`` / unsigned ints, Hydra 1.3's ``OverrideLexer.g4``) and
that update, on the real OmegaConf and the overlay ``configs/nemo_rl/grpo_math_1B_megatron_dcr.yaml``.
The same overrides were run through NeMo-RL's real loader and parser (docs/nemo_rl.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from nemo_dcr.config import ConfigError
from nemo_dcr.integrations.nemo_rl import SELECTOR
from nemo_dcr.integrations.nemo_rl import driver

omegaconf = pytest.importorskip("omegaconf")
from omegaconf import OmegaConf  # noqa: E402

OVERLAY = Path(__file__).resolve().parents[2] / "configs" / "nemo_rl" / "grpo_math_1B_megatron_dcr.yaml"
_SEG = r"(?:[A-Za-z_$][A-Za-z0-9_\-$]*|0|[1-9](?:_?[0-9])*)"
HYDRA_KEY = re.compile(rf"^{_SEG}(?:\.{_SEG})*$")
"""Hydra 1.3's override key (``package``: ``ID | KEY_SPECIAL | DOT_PATH``), without ``@package``."""


def apply_override(cfg, override: str) -> None:
    """Apply one ``[+|++]key=value`` the way NeMo-RL's parser does (module docstring).

    Raises:
        ValueError: a key Hydra's grammar refuses, a plain key that does not exist, an add of one that does.
    """
    prefix = "++" if override.startswith("++") else "+" if override.startswith("+") else ""
    key, _, text = override[len(prefix):].partition("=")
    if not HYDRA_KEY.match(key):
        raise ValueError(f"{key!r} is not a Hydra override key")
    value = yaml.safe_load(text)
    exists = OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is not None
    if prefix == "" and not exists:
        raise ValueError(f"Could not override {key!r}: to append to your config use +{key}={text}")
    if prefix == "+" and exists:
        raise ValueError(f"Could not append to config. An item is already at {key!r}")
    OmegaConf.update(cfg, key, value, merge=True, force_add=bool(prefix))


def resolved(overrides, monkeypatch, tmp_path) -> dict:
    key = tmp_path / "hmac.key"
    key.write_bytes(b"nemo-rl-override-test-key-0123456789")
    monkeypatch.setenv("NEMO_DCR_KEY_FILE", str(key))
    monkeypatch.setenv("NEMO_DCR_REFIT_DIR", str(tmp_path / "refit"))
    cfg = OmegaConf.load(OVERLAY)
    del cfg["defaults"]  # NeMo-RL's base config: the driver reads only what the overlay sets
    OmegaConf.set_struct(cfg, True)
    for o in overrides:
        apply_override(cfg, o)
    return OmegaConf.to_container(cfg, resolve=True)


def test_a_single_plugin_key_is_overridden_by_its_dotted_path(monkeypatch, tmp_path):
    cfg = resolved([f"{driver.DOTTED}.reply_timeout_s=900", f"++{driver.DOTTED}.verify=full",
                    f"+{driver.DOTTED}.full_resync_interval=5"], monkeypatch, tmp_path)
    block = cfg["policy"]["generation"]["refit_cfg"][SELECTOR]
    assert (block["reply_timeout_s"], block["verify"], block["full_resync_interval"]) == (900, "full", 5)
    options = driver.check_config(cfg)
    assert (options.dcr.reply_timeout_s, options.dcr.verify, options.dcr.url) == (900, "full", str(tmp_path / "refit"))


def test_the_selector_block_itself_has_no_dotted_path():
    assert HYDRA_KEY.match(f"{driver.DOTTED}.reply_timeout_s")
    assert not HYDRA_KEY.match(f"policy.generation.refit_cfg.{SELECTOR}.reply_timeout_s")  # its ':'
    with pytest.raises(ValueError, match="not a Hydra override key"):
        apply_override(OmegaConf.create({}), f"policy.generation.refit_cfg.{SELECTOR}.url=/x")


def test_a_bad_dotted_override_is_refused_naming_the_key(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="to append to your config use"):  # struct mode, as in NeMo-RL
        resolved([f"{driver.DOTTED}.bogus=1"], monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match="bogus"):  # added: the driver refuses the unknown plugin key
        driver.check_config(resolved([f"++{driver.DOTTED}.bogus=1"], monkeypatch, tmp_path))


def test_a_dotted_override_that_nemo_rl_would_ignore_is_refused(monkeypatch, tmp_path):
    """Without the interpolation the selector's block keeps its own values: the override would be lost."""
    cfg = resolved([f"{driver.DOTTED}.reply_timeout_s=900"], monkeypatch, tmp_path)
    cfg["policy"]["generation"]["refit_cfg"][SELECTOR]["reply_timeout_s"] = 600
    with pytest.raises(ConfigError, match=r"refit_cfg.nemo_dcr.*differs .* in \['reply_timeout_s'\]"):
        driver.check_config(cfg)
