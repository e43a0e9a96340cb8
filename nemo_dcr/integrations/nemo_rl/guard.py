"""Version guard: the NeMo-RL in use must have the checkpoint-engine seam.

The seam (``policy.generation.refit_transport: "module:Class"``, ``refit_cfg[<selector>]``,
``create_checkpoint_engine``, ``CheckpointEngineWeightSynchronizer``) arrived in NVIDIA-NeMo/RL
commit ``aa8bfb2e8`` (2026-07-21, #2608) and is in no release yet (v0.7.0 lacks it).  On a
NeMo-RL without it the overlay still loads, ``refit_transport`` is ignored and nemo_dcr is
silently never used, so :func:`check_seam` is called where a user can still be told: when the
config is loaded in the driver (:mod:`.driver`, before Ray starts) and again in every worker's
``prepare()`` (a worker environment may hold another NeMo-RL than the driver's).  It reads the
installed NeMo-RL's files; nothing of NeMo-RL is imported.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

SEAM_COMMIT = "aa8bfb2e8"
"""The NVIDIA-NeMo/RL commit that added the checkpoint-engine seam (2026-07-21, #2608)."""
TESTED_COMMIT = "7ea279abf"
"""The NVIDIA-NeMo/RL commit the plugin is tested against (docs/nemo_rl.md)."""
SEAM = {
    "weight_sync/checkpoint_engine_config.py": "def checkpoint_engine_refit_config",
    "weight_sync/checkpoint_engine_weight_synchronizer.py": "class CheckpointEngineWeightSynchronizer",
    "utils/checkpoint_engines/base.py": "def create_checkpoint_engine",
    "models/generation/vllm/config.py": "class VllmCheckpointEnginePluginConfig",
}
"""Files of the ``nemo_rl`` package and what each must define for the plugin to be driven."""


class SeamError(RuntimeError):
    """The NeMo-RL in use cannot drive the plugin (names what is missing and what is needed)."""


@dataclass(frozen=True)
class NemoRl:
    """An installed NeMo-RL, as read from its files.

    Attributes:
        package: the ``nemo_rl`` package folder.
        version: ``MAJOR.MINOR.PATCH`` from ``package_info.py`` (None: not found).
        missing: seam files or definitions not found (empty: the seam is there).
    """

    package: Path
    version: str | None
    missing: tuple[str, ...]


def find_nemo_rl(package: str | Path | None = None) -> NemoRl | None:
    """Read the NeMo-RL at ``package`` (the ``nemo_rl`` folder or a checkout holding it; default:
    the importable one).  None when there is none."""
    if package is None:
        spec = importlib.util.find_spec("nemo_rl")
        if spec is None or not spec.submodule_search_locations:
            return None
        folder = Path(list(spec.submodule_search_locations)[0])
    else:
        folder = Path(package)
        folder = folder / "nemo_rl" if (folder / "nemo_rl").is_dir() else folder
        if not folder.is_dir():
            return None
    missing = []
    for rel, needle in SEAM.items():
        path = folder / rel
        if not path.is_file() or needle not in path.read_text(errors="replace"):
            missing.append(f"nemo_rl/{rel} ({needle})")
    return NemoRl(folder, _version(folder), tuple(missing))


def _version(folder: Path) -> str | None:
    info = folder / "package_info.py"
    if not info.is_file():
        return None
    found = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", info.read_text(), re.M))
    return ".".join(found[k] for k in ("MAJOR", "MINOR", "PATCH")) if len(found) == 3 else None


def check_seam(package: str | Path | None = None, required: bool = True) -> NemoRl | None:
    """Refuse a NeMo-RL without the checkpoint-engine seam.

    Args:
        package: where NeMo-RL is (default: the importable ``nemo_rl``).
        required: a missing NeMo-RL is refused too (the driver); False: allowed (a worker driven
            by something else, e.g. a test's stand-in).

    Raises:
        SeamError: naming the files missing, the version found and the commit needed.
    """
    found = find_nemo_rl(package)
    if found is None:
        if required:
            raise SeamError(f"no NeMo-RL found{f' at {package}' if package else ' (nemo_rl is not importable)'}: "
                            f"nemo_dcr's checkpoint engine needs NVIDIA-NeMo/RL at or after commit {SEAM_COMMIT} "
                            f"(tested at {TESTED_COMMIT})")
        return None
    if found.missing:
        raise SeamError(f"NeMo-RL {found.version or '(unknown version)'} at {found.package} has no checkpoint-engine "
                        f"seam (missing {', '.join(found.missing)}): policy.generation.refit_transport would be "
                        f"ignored and nemo_dcr never used; it needs NVIDIA-NeMo/RL at or after commit {SEAM_COMMIT} "
                        f"(2026-07-21, #2608; no release has it, v0.7.0 does not), tested at {TESTED_COMMIT}")
    return found
