"""Load recipe YAML with OmegaConf: ``defaults:`` inheritance, ``key=value`` overrides, checks.

Resolution order (later wins), as in NeMo-RL's ``load_config`` + ``parse_hydra_overrides``:

1. the dataclass defaults of :class:`~nemo_dcr.tools.demo.recipe.RecipeConfig`;
2. each file named in the YAML's ``defaults:`` (a string or a list; paths relative to the
   file, ``.yaml`` optional), themselves resolved recursively;
3. the file itself;
4. command-line overrides ``dotted.key=value`` (value parsed as YAML: ``dcr.enabled=false``,
   ``trainer.lr=1e-5``, ``dcr.url=null``).

Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the key,
with the closest known key when there is one.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from nemo_dcr.config.schema import ConfigError

from .recipe import RecipeConfig

DEFAULTS_KEY = "defaults"
MAX_DEPTH = 16


def _resolve_path(base_dir: Path, name: str) -> Path:
    path = (base_dir / name).resolve()
    if not path.suffix:
        path = path.with_suffix(".yaml")
    if not path.is_file():
        raise ConfigError(DEFAULTS_KEY, f"no such config file {name!r} (looked for {path})")
    return path


def load_yaml_tree(path: str | os.PathLike, _depth: int = 0) -> DictConfig:
    """One YAML file merged over its ``defaults:`` parents (not yet checked against the schema).

    Raises:
        ConfigError: missing parent, a cycle (depth above 16), or a malformed ``defaults:``.
    """
    if _depth > MAX_DEPTH:
        raise ConfigError(DEFAULTS_KEY, f"defaults nest deeper than {MAX_DEPTH} (a cycle?)")
    path = Path(path)
    try:
        node = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError("", f"no such config file {str(path)!r}") from None
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError("", f"{path}: not valid YAML: {_first_line(exc)}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError("", f"{path.name} must hold a mapping at the top level")
    parents = node.pop(DEFAULTS_KEY, None)
    if parents is None:
        return node
    if isinstance(parents, str):
        parents = [parents]
    if not all(isinstance(p, str) for p in parents):
        raise ConfigError(DEFAULTS_KEY, f"{path.name}: must be a file name or a list of them")
    merged = OmegaConf.create()
    for parent in parents:
        merged = OmegaConf.merge(merged, load_yaml_tree(_resolve_path(path.parent, parent), _depth + 1))
    return OmegaConf.merge(merged, node)


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``["a.b=1", "c=x"]`` -> a config; each item must be ``dotted.key=value``."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key or key.strip() != key or key.startswith(("+", "~")):
            raise ConfigError(key or item, f"override {item!r} must look like dotted.key=value")
    parts = []
    for item in overrides:  # one at a time, so that a value that is not YAML names its key
        try:
            parts.append(OmegaConf.from_dotlist([item]))
        except (yaml.YAMLError, OmegaConfBaseException) as exc:
            raise ConfigError(item.partition("=")[0], f"bad override {item!r}: {_first_line(exc)}") from None
    return OmegaConf.merge(*parts) if parts else OmegaConf.create()


def _first_line(exc: Exception) -> str:
    """A parser error in one line (YAML problems carry their line and column)."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or getattr(exc, "msg", None) or str(exc)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{str(what).splitlines()[0] if str(what) else type(exc).__name__}{where}"


def _known_keys(node, prefix: str = "") -> list[str]:
    out = []
    for key in node:
        full = f"{prefix}{key}"
        out.append(full)
        child = node[key]
        if isinstance(child, DictConfig):
            out += _known_keys(child, full + ".")
    return out


def _schema_error(exc: OmegaConfBaseException, schema: DictConfig) -> ConfigError:
    key = getattr(exc, "full_key", "") or ""
    if isinstance(exc, ConfigKeyError):
        close = difflib.get_close_matches(key, _known_keys(schema), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return ConfigError(key, f"unknown key{hint}")
    msg = str(getattr(exc, "msg", None) or exc).splitlines()[0]
    return ConfigError(key, msg)


def build_config(*layers: DictConfig) -> RecipeConfig:
    """Merge ``layers`` over the schema defaults, convert to dataclasses and validate."""
    schema = OmegaConf.structured(RecipeConfig)
    try:
        merged = OmegaConf.merge(schema, *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _schema_error(exc, schema) from None
    cfg.validate()
    return cfg


def load_config(path: str | os.PathLike | None = None,
                overrides: Sequence[str] = ()) -> RecipeConfig:
    """The validated :class:`RecipeConfig` of a YAML file plus ``key=value`` overrides.

    Args:
        path: recipe YAML (None: the schema defaults only).
        overrides: ``dotted.key=value`` strings, applied last.

    Raises:
        ConfigError: unknown key, wrong type, or a value out of range; names the key.
    """
    layers = [] if path is None else [load_yaml_tree(path)]
    return build_config(*layers, parse_overrides(overrides))


def to_yaml(cfg: RecipeConfig) -> str:
    """The resolved config as YAML (written next to every run's outputs)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg) -> dict:
    """A config dataclass (or any block of it) as a plain dict."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))
