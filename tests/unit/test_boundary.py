"""Dependency boundary: the core never imports training/inference frameworks.

* Core packages (capture, layout, codec, transport, apply, verify) and ``nemo_dcr/checkpoint.py``
  must not import megatron, nemo_rl, vllm, sglang, transformers or safetensors anywhere (not even
  inside a function), nor ``nemo_dcr.adapters`` / ``nemo_dcr.commands``.
* Every other module outside ``nemo_dcr/adapters/`` (``cli.py``, ``commands/``, package
  ``__init__`` files) may import them, and ``nemo_dcr.adapters``, only lazily inside functions.
* Importing the codec and the checksum in a fresh interpreter leaves those frameworks out of
  ``sys.modules`` (checked with stub packages on the path, so an import would really register).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "nemo_dcr"
FORBIDDEN = ("megatron", "nemo_rl", "vllm", "sglang", "transformers", "safetensors")
CORE_DIRS = ("capture", "layout", "codec", "transport", "apply", "verify", "quant")
CORE_FILES = ("checkpoint.py",)
INTERNAL_FORBIDDEN_IN_CORE = ("nemo_dcr.adapters", "nemo_dcr.commands")


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["nemo_dcr", *parts])


def _package_of(rel: Path) -> str:
    mod = _module_name(rel)
    return mod if rel.name == "__init__.py" else mod.rpartition(".")[0]


def _resolve(node: ast.ImportFrom, package: str) -> list[str]:
    """Absolute module names an ``ImportFrom`` may load (the module and, for ``from x import y``, x.y)."""
    if node.level:
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return [mod] + [f"{mod}.{a.name}" for a in node.names if a.name != "*"]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _matches(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def imported_modules(tree: ast.AST, package: str):
    """Yield ``(module, lineno, lazy)`` for every import; ``lazy`` when inside a function body or
    an ``if TYPE_CHECKING:`` block. Also catches ``importlib.import_module("x")`` / ``__import__("x")``
    with a literal name."""

    def visit(node, lazy):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy = True
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, True)
            for child in node.orelse:
                yield from visit(child, lazy)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, lazy
        elif isinstance(node, ast.ImportFrom):
            for m in _resolve(node, package):
                yield m, node.lineno, lazy
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__"):
                yield node.args[0].value, node.lineno, lazy
        for child in ast.iter_child_nodes(node):
            yield from visit(child, lazy)

    yield from visit(tree, False)


def check_source(source: str, rel: Path) -> list[str]:
    """Boundary violations of one module at ``nemo_dcr/<rel>``."""
    parts = rel.parts
    if parts[0] == "adapters":
        return []
    core = (len(parts) > 1 and parts[0] in CORE_DIRS) or (len(parts) == 1 and parts[0] in CORE_FILES)
    tree = ast.parse(source, filename=str(rel))
    out = []
    for mod, line, lazy in imported_modules(tree, _package_of(rel)):
        framework = _matches(mod, FORBIDDEN)
        internal = _matches(mod, INTERNAL_FORBIDDEN_IN_CORE if core else ("nemo_dcr.adapters",))
        if core and (framework or internal):
            out.append(f"nemo_dcr/{rel}:{line}: core module imports {mod}")
        elif not core and not lazy and (framework or internal):
            out.append(f"nemo_dcr/{rel}:{line}: module-level import of {mod} (import it inside a function)")
    return out


def all_modules() -> list[Path]:
    return sorted(p.relative_to(PKG) for p in PKG.rglob("*.py"))


def test_checker_catches_violations():
    """The checker itself: each of these must be flagged, and the allowed forms must not be."""
    bad_core = {
        "codec/x.py": "import transformers\n",
        "verify/x.py": "from megatron.core import parallel_state\n",
        "layout/x.py": "def f():\n    import vllm.engine\n",
        "capture/x.py": "import importlib\nM = importlib.import_module('sglang')\n",
        "transport/x.py": "from ..adapters import megatron\n",
        "apply/x.py": "from nemo_dcr.commands import checkpoint_cmds\n",
        "checkpoint.py": "try:\n    import safetensors.torch\nexcept ImportError:\n    pass\n",
        "codec/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import nemo_rl\n",
        "codec/__init__.py": "from .. import adapters\n",
    }
    for rel, src in bad_core.items():
        assert check_source(src, Path(rel)), rel
    bad_outer = {
        "cli.py": "import transformers\n",
        "commands/x.py": "from nemo_dcr.adapters import hf\n",
        "commands/y.py": "from ..adapters.megatron import ModelPreset\n",
        "__init__.py": "class A:\n    import vllm\n",
    }
    for rel, src in bad_outer.items():
        assert check_source(src, Path(rel)), rel
    ok = {
        "commands/x.py": "def run():\n    from nemo_dcr.adapters import hf\n    import transformers\n",
        "cli.py": "import importlib\ndef f(m):\n    return importlib.import_module(f'nemo_dcr.commands.{m}')\n",
        "adapters/z.py": "import megatron.core\nimport transformers\n",
        "codec/z.py": "import numpy\nimport torch\nfrom ..verify.checksum import tensor_checksum\n",
        "commands/t.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import transformers\n",
    }
    for rel, src in ok.items():
        assert check_source(src, Path(rel)) == [], rel


def test_no_framework_imports_outside_adapters():
    mods = all_modules()
    names = {str(p) for p in mods}
    # the scan is not vacuous: the core modules are there
    for expected in ("codec/payload.py", "codec/dcr.py", "codec/header.py", "verify/checksum.py",
                     "capture/delta.py", "checkpoint.py", "cli.py"):
        assert expected in names, expected
    violations = []
    for rel in mods:
        violations += check_source((PKG / rel).read_text(encoding="utf-8"), rel)
    assert not violations, "\n".join(violations)


CORE_IMPORTS = ("nemo_dcr.codec", "nemo_dcr.verify.checksum", "nemo_dcr.codec.payload", "nemo_dcr.codec.dcr",
                "nemo_dcr.codec.reference", "nemo_dcr.codec.header", "nemo_dcr.quant", "nemo_dcr.cli")


def test_importing_core_loads_no_framework(tmp_path):
    # stub packages for every framework, first on the path: an import anywhere would succeed and
    # register in sys.modules (whether or not the real framework is installed)
    stubs = tmp_path / "stubs"
    for name in FORBIDDEN:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text("STUB = True\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stubs), str(ROOT)])
    script = textwrap.dedent(f"""
        import importlib, json, sys
        def loaded():
            return sorted(m for m in sys.modules if m.split('.')[0] in {list(FORBIDDEN)!r})
        after = {{}}
        for mod in {list(CORE_IMPORTS)!r}:
            importlib.import_module(mod)
            after[mod] = loaded()
        import transformers, megatron  # control: the stubs do register
        print(json.dumps({{"after": after, "control": loaded(), "stub": transformers.STUB}}))
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["control"] == ["megatron", "transformers"] and out["stub"] is True
    for mod, loaded in out["after"].items():
        assert loaded == [], f"importing {mod} loaded {loaded}"
