"""The plugin's settings: the keys of ``policy.generation.refit_cfg["<selector>"]`` in NeMo-RL's config.

The keys are :class:`~nemo_dcr.config.DcrConfig`'s fields, with its names and units
(``bucket_size_mb``, ``reply_timeout_s``, ``engine_index``, ...), read by
:meth:`DcrConfig.from_mapping` (an unknown key or a wrong type is refused naming it).  NeMo-RL
builds the engine as ``DcrCheckpointEngine(bucket_size=..., **engine_kwargs)`` where
``engine_kwargs`` are every key of ``refit_cfg[<selector>]`` except
``update_weights_bucket_memory_ratio`` (NeMo-RL sizes ``bucket_size``, in bytes, from it), plus
``release_after_refit`` (NeMo-RL's own flag, always passed); :meth:`PluginOptions.parse` maps
those two here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from nemo_dcr.config.schema import ConfigError, DcrConfig

SELECTOR = "nemo_dcr.integrations.nemo_rl:DcrCheckpointEngine"
"""The ``policy.generation.refit_transport`` value that selects this plugin."""
PREFIX = f"refit_cfg['{SELECTOR}']"
"""How errors name the plugin's settings."""

FIXED = {
    "transport": ("store", "the policy and vLLM workers meet only in a shared folder (url), so payloads and "
                           "the policy workers' collectives travel over the store transport"),
    "engine_format": ("bf16", "the vLLM workers' live params are refitted as the canonical BF16 tensors"),
}
"""Settings the plugin fixes: key -> (value, why).  A user key asking for another value is refused."""
DEFAULTS = {"reply_timeout_s": 600.0}
"""The plugin's own defaults (a user key wins): the first sync of a session sends every tensor
through a shared folder.  ``bucket_size_mb`` defaults to NeMo-RL's ``bucket_size`` and
``telemetry_dir`` to ``url``."""


@dataclass(frozen=True)
class PluginOptions:
    """Settings of :class:`~nemo_dcr.integrations.nemo_rl.plugin.DcrCheckpointEngine`.

    Attributes:
        dcr: the refit's settings (``url``: the folder every policy and vLLM worker reads and
            writes, one job per url; ``key_file``: the HMAC key, the same on every worker;
            ``telemetry_dir``: policy rank 0 appends one JSON line per sync to its
            ``telemetry.jsonl``, None: not).
        release_after_refit: NeMo-RL's flag: it calls ``finalize()`` after every sync (nothing to
            release here).
    """

    dcr: DcrConfig
    release_after_refit: bool = False

    @classmethod
    def parse(cls, bucket_size: int, kwargs: Mapping[str, Any]) -> PluginOptions:
        """From NeMo-RL's constructor arguments.

        Raises:
            ConfigError: an unknown key, a wrong type, a value out of range or one that conflicts
                with :data:`FIXED` (named).
        """
        settings = dict(kwargs)
        release = settings.pop("release_after_refit", False)
        if not isinstance(release, bool):
            raise ConfigError(f"{PREFIX}.release_after_refit", f"must be bool, got {release!r}")
        for key, (value, why) in FIXED.items():
            if settings.get(key, value) != value:
                raise ConfigError(f"{PREFIX}.{key}", f"the NeMo-RL plugin uses {value!r}, got "
                                                     f"{settings[key]!r}: {why}")
        if "bucket_size_mb" not in settings and not bucket_size >= 1:
            raise ConfigError(f"{PREFIX}.bucket_size", f"NeMo-RL's bucket_size must be >= 1 byte, got {bucket_size}")
        derived = {**DEFAULTS, "bucket_size_mb": bucket_size / 2**20, "telemetry_dir": settings.get("url")}
        settings.update({k: v for k, v in derived.items() if k not in settings})  # the user's keys first
        settings.update({k: v for k, (v, _) in FIXED.items()})
        return cls(DcrConfig.from_mapping(settings, PREFIX), release)

    def session_config(self, folder: str) -> DcrConfig:
        """The ``dcr`` settings of one session's refit (its store transport in ``folder``)."""
        return replace(self.dcr, url=folder)
