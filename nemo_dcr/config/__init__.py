"""The library's configuration: :class:`DcrConfig` (the ``dcr:`` block) and :class:`ConfigError`.

Usage::

    from nemo_dcr.config import DcrConfig
    cfg = DcrConfig(encoding="dcr", transport="gloo")
    cfg.validate()            # ConfigError("dcr.transport: ...") names the first bad key
    cfg = DcrConfig.from_mapping({"encoding": "dcr", "bucket_size_mb": 64})  # validated; unknown keys refused
"""

from nemo_dcr.config.schema import BASELINES, ENCODINGS, TRANSPORTS, ConfigError, DcrConfig

__all__ = ["BASELINES", "ENCODINGS", "TRANSPORTS", "ConfigError", "DcrConfig"]
