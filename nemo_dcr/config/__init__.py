"""Recipe configuration: typed blocks (``run``, ``trainer``, ``engine``, ``task``, ``dcr``).

Usage::

    from nemo_dcr.config import load_config
    cfg = load_config("configs/grpo_smollm2_cpu.yaml", ["run.steps=5", "dcr.encoding=reference"])
    cfg.dcr.encoding  # 'reference'

See :mod:`nemo_dcr.config.load` for the resolution order and ``configs/`` for the files.
"""

from nemo_dcr.config.load import build_config, load_config, load_yaml_tree, parse_overrides, to_dict, to_yaml
from nemo_dcr.config.schema import (
    BASELINES,
    ENCODINGS,
    TRANSPORTS,
    ConfigError,
    DcrConfig,
    EngineConfig,
    RecipeConfig,
    RunConfig,
    TaskConfig,
    TrainerConfig,
)

__all__ = [
    "BASELINES", "ENCODINGS", "TRANSPORTS", "ConfigError", "DcrConfig", "EngineConfig", "RecipeConfig",
    "RunConfig", "TaskConfig", "TrainerConfig", "build_config", "load_config", "load_yaml_tree",
    "parse_overrides", "to_dict", "to_yaml",
]
