"""The driver's side: check the plugin's settings when NeMo-RL's config is loaded, then run NeMo-RL.

NeMo-RL builds the checkpoint engine only inside its workers, after the cluster, the vLLM
engines and the Megatron workers are up; a bad plugin key would surface there.  This launcher
runs in the driver process instead: it loads the config with NeMo-RL's own loader and override
parser (the same calls as ``examples/run_grpo.py``), checks the NeMo-RL seam
(:func:`.guard.check_seam`) and the plugin's settings (:func:`check_config`), and only then
runs NeMo-RL's script in the same process::

    python -m nemo_dcr.integrations.nemo_rl.driver examples/run_grpo.py --config <yaml> [overrides]
    python -m nemo_dcr.integrations.nemo_rl.driver --check-only examples/run_grpo.py --config <yaml> [overrides]

Exit 2 with the reason on a refused config (nothing of NeMo-RL started).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import Any, Mapping

from nemo_dcr.codec.auth import read_key_file
from nemo_dcr.config.schema import ConfigError

from .guard import SeamError, check_seam
from .names import WHAT
from .options import SELECTOR, PluginOptions

NEMO_RL_KEYS = ("update_weights_bucket_memory_ratio",)
"""Keys of ``refit_cfg[<selector>]`` that NeMo-RL reads itself and does not pass to the engine."""
CHECK_BUCKET = 1 << 20
"""NeMo-RL sizes ``bucket_size`` from the workers' GPU memory; the check stands in this value."""
DOTTED = "policy.generation.refit_cfg.nemo_dcr"
"""Where the plugin's settings live so that each is a dotted override NeMo-RL's parser accepts
(``policy.generation.refit_cfg.nemo_dcr.<key>=<value>``); the selector's block is the interpolation
``${policy.generation.refit_cfg.nemo_dcr}`` of it (a Hydra override key cannot hold the selector's
``.`` and ``:``)."""


def _get(cfg: Mapping, path: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def check_config(cfg: Mapping[str, Any]) -> PluginOptions:
    """The plugin's settings from NeMo-RL's resolved master config (a plain mapping).

    Raises:
        ConfigError: naming the config key: not selected, colocated, not vLLM, a missing or bad
            plugin key (:meth:`PluginOptions.parse`), an unreadable key file, or a feature whose
            weights the plugin refuses (FP8 rollout or KV cache, a drafter, MTP).
    """
    gen = _get(cfg, "policy.generation") or {}
    if gen.get("refit_transport") != SELECTOR:
        raise ConfigError("policy.generation.refit_transport", f"must be {SELECTOR!r} for nemo_dcr, got "
                                                               f"{gen.get('refit_transport')!r}")
    if gen.get("backend") != "vllm":
        raise ConfigError("policy.generation.backend", f"NeMo-RL's checkpoint engines serve vLLM, got "
                                                       f"{gen.get('backend')!r}")
    if _get(gen, "colocated.enabled", False):
        raise ConfigError("policy.generation.colocated.enabled", "NeMo-RL's checkpoint engines serve non-colocated "
                                                                 "vLLM only: set it to false")
    block = _get(gen, "refit_cfg", {}).get(SELECTOR) if isinstance(gen.get("refit_cfg"), Mapping) else None
    if not isinstance(block, Mapping):
        raise ConfigError(f"policy.generation.refit_cfg['{SELECTOR}']", "missing: NeMo-RL requires the plugin's block")
    node = _get(cfg, DOTTED)
    if node is not None and dict(node) != dict(block):
        differ = sorted(k for k in set(node) | set(block) if node.get(k, "<unset>") != block.get(k, "<unset>"))
        raise ConfigError(DOTTED, f"differs from refit_cfg['{SELECTOR}'] in {differ}: NeMo-RL reads only the "
                                  f"selector's block, so make that block ${{{DOTTED}}} (docs/nemo_rl.md)")
    options = PluginOptions.parse(CHECK_BUCKET, {k: v for k, v in block.items() if k not in NEMO_RL_KEYS})
    key = options.dcr.key_file
    if not Path(key).is_file():
        raise ConfigError(f"refit_cfg['{SELECTOR}'].key_file", f"{key} does not exist (every worker reads it; "
                                                               "recipes/nemo_rl/launch_grpo.sh creates one)")
    try:
        read_key_file(key)
    except ValueError as exc:
        raise ConfigError(f"refit_cfg['{SELECTOR}'].key_file", str(exc)) from None
    _refuse_features(cfg, gen)
    return options


def _refuse_features(cfg: Mapping, gen: Mapping) -> None:
    """Features whose weights NeMo-RL refits through paths the plugin does not take (.names)."""
    refused = {
        "policy.generation.vllm_cfg.kv_cache_dtype": (str(_get(gen, "vllm_cfg.kv_cache_dtype", "auto")).startswith(
            "fp8"), "an FP8 KV cache: NeMo-RL appends its k/v scales to the export and post-processes them"),
        "policy.generation.vllm_cfg.precision": (_get(gen, "vllm_cfg.precision") == "fp8",
                                                 "FP8 rollout weights: the plugin refits BF16 params"),
        "policy.draft.enabled": (bool(_get(cfg, "policy.draft.enabled", False)),
                                 "an Eagle3 drafter: NeMo-RL exports its draft.* weights to vLLM's drafter"),
        "policy.megatron_cfg.mtp_num_layers": (bool(_get(cfg, "policy.megatron_cfg.mtp_num_layers", 0)),
                                               "co-trained MTP layers: NeMo-RL feeds them to vLLM's MTP drafter"),
        "policy.generation.vllm_kwargs.speculative_config": (bool(_get(gen, "vllm_kwargs.speculative_config")),
                                                             "a speculative drafter in vLLM"),
        "policy.generation.quant_cfg": (bool(gen.get("quant_cfg")), "quantized rollout weights"),
    }
    for key, (bad, why) in refused.items():
        if bad:
            raise ConfigError(key, f"{why}; nemo_dcr does not refit these ({WHAT})")


def load_nemo_rl_config(config: str, overrides: list[str]) -> dict:
    """NeMo-RL's config as ``examples/run_grpo.py`` builds it (its loader, resolvers and parser)."""
    from omegaconf import OmegaConf
    from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers

    register_omegaconf_resolvers()
    cfg = load_config(config)
    if overrides:
        cfg = parse_hydra_overrides(cfg, overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def main(argv: list[str] | None = None) -> int:
    """Check, then run NeMo-RL's script in this process (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m nemo_dcr.integrations.nemo_rl.driver")
    parser.add_argument("--check-only", action="store_true", help="check and exit (0: fine, 2: refused)")
    parser.add_argument("script", help="NeMo-RL's entry script, e.g. examples/run_grpo.py")
    args, rest = parser.parse_known_args(argv)
    run = argparse.ArgumentParser(add_help=False)
    run.add_argument("--config", required=True)
    known, overrides = run.parse_known_args(rest)
    try:
        found = check_seam()
        options = check_config(load_nemo_rl_config(known.config, overrides))
    except (SeamError, ConfigError) as exc:
        print(f"[nemo-dcr] refused before starting NeMo-RL: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"[nemo-dcr] NeMo-RL {found.version} at {found.package} has the checkpoint-engine seam; plugin settings "
          f"checked (url {options.dcr.url}, encoding {options.dcr.encoding})", flush=True)
    if args.check_only:
        return 0
    sys.argv = [args.script, *rest]
    runpy.run_path(args.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
