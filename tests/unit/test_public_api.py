"""The public API says what it is: every root name resolves to what it names (never a subpackage),
and framework sources are registered whichever import path a caller takes."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import nemo_dcr

ROOT = Path(__file__).resolve().parents[2]


def test_no_root_name_is_a_subpackage():
    subpackages = {m.name for m in pkgutil.iter_modules(nemo_dcr.__path__)}
    assert not set(nemo_dcr.__all__) & subpackages, set(nemo_dcr.__all__) & subpackages


def test_root_names_survive_subpackage_imports():
    for sub in ("apply", "refit", "codec", "config", "verify", "capture", "transport"):
        importlib.import_module(f"nemo_dcr.{sub}")
    for name in nemo_dcr.__all__:
        value = getattr(nemo_dcr, name)
        assert not isinstance(value, type(sys)), f"nemo_dcr.{name} is a module"
        assert getattr(value, "__name__", name) == name, (name, value)


def test_megatron_source_registered_from_any_import_path():
    # a fresh interpreter that imports only nemo_dcr.refit: the entry point registers megatron-core
    code = ("from nemo_dcr.refit import source_for\n"
            "from nemo_dcr.refit import source as s\n"
            "try:\n    source_for(object())\nexcept TypeError as e:\n    print(e)\n"
            "print(sorted(f for f, _ in s._BUILDERS))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "megatron-core" in out.stdout.splitlines()[-1], out.stdout
    assert "no trainer source for a object" in out.stdout


def test_engine_process_api_is_public():
    from nemo_dcr.integrations.vllm import WORKER_EXTENSION

    for name in ("EngineServer", "engine_wiring", "colocated_wiring", "Engine", "TensorEngine"):
        assert name in nemo_dcr.__all__
    assert WORKER_EXTENSION.startswith("nemo_dcr.integrations.vllm.")
