"""The package's structure, read from the source (every import, lazy ones included):

* **Layers.** Each part of ``nemo_dcr`` has a layer (:data:`LAYERS`); a module may import only
  its own part or parts of a lower layer, never a higher one and never a sibling of the same layer,
  not even inside a function (``importlib.import_module`` with a literal name counts too).
* **No cycles** between modules (a module importing its own ancestor package is Python's implicit
  parent import and does not count).
* **Library apart from tools.** ``nemo_dcr.tools`` (the demo recipe, chaos, the planner, the run
  report, the CLI and the megatron CPU scaffolding) sits above every library part; no library
  module imports it, not even lazily.
* **Frameworks.** megatron, nemo_rl, vllm, sglang and transformers are imported only by
  ``nemo_dcr.integrations``; the layers below it do not import them at all, the layers above
  only inside functions.  ``safetensors`` is no framework but a core dependency: the checkpoint
  module reads and writes files with it.
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

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "nemo_dcr"
FORBIDDEN = ("megatron", "nemo_rl", "vllm", "sglang", "transformers")
LAYERS = {
    "types": 0,
    "kernels": 1,
    "verify": 2,
    "codec": 3, "layout": 3, "transport": 3, "config": 3, "telemetry": 3,
    "capture": 4, "checkpoint": 4,
    "checkpoint_rewrite": 5,
    "apply": 5, "quant": 5,
    "refit": 6,
    "integrations.megatron": 7, "integrations.hf": 7, "integrations.vllm": 7,
    "integrations.nemo_rl": 7.5,  # runs inside NeMo-RL's vLLM workers: uses the vLLM integration's loader helpers
    "integrations": 7,
    "": 8,  # the package root: the library's public API
    # the tools (never imported by the library, see test_library_never_imports_the_tools)
    "tools": 9,
    "tools.megatron": 9,  # CPU scaffolding: GPTModel building, the CPU shim, fp32-master stepping, dense copies
    "tools.run_report": 10, "tools.demo": 10, "tools.chaos": 10, "tools.planner": 10,
    "tools.commands": 11,
    "tools.cli": 12,
}
"""Part of the package -> layer.  ``integrations.X`` are separate parts of one layer."""
FRAMEWORK_FREE_BELOW = LAYERS["integrations"]


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["nemo_dcr", *parts])


def part_of(module: str) -> str:
    """The :data:`LAYERS` key of a ``nemo_dcr`` module (longest matching prefix)."""
    rest = module[len("nemo_dcr"):].lstrip(".")
    best = ""
    for key in LAYERS:
        if key and (rest == key or rest.startswith(key + ".")) and len(key) > len(best):
            best = key
    if not best and rest:
        raise KeyError(f"{module}: no layer assigned (add its part to LAYERS)")
    return best


def _resolve(node: ast.ImportFrom, package: str) -> list[str]:
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


def imported_modules(tree: ast.AST, package: str):
    """Yield ``(module, lineno, lazy)`` for every import; ``lazy`` inside a function body or an
    ``if TYPE_CHECKING:`` block.  Also ``importlib.import_module("x")`` / ``__import__("x")``."""

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


def _matches(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def sources() -> dict[str, tuple[Path, str]]:
    """Module name -> (relative path, source) of every module of the package."""
    return {module_name(p.relative_to(PKG)): (p.relative_to(PKG), p.read_text(encoding="utf-8"))
            for p in sorted(PKG.rglob("*.py"))}


def _target(name: str, modules) -> str | None:
    """The module an imported name loads (longest module prefix), None outside the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def check_module(module: str, rel: Path, source: str, modules) -> list[str]:
    """Layer and framework violations of one module (``modules``: every module name)."""
    package = module if rel.name == "__init__.py" else module.rpartition(".")[0]
    mine = part_of(module)
    out = []
    for name, line, lazy in imported_modules(ast.parse(source, filename=str(rel)), package):
        where = f"nemo_dcr/{rel}:{line}"
        if _matches(name, FORBIDDEN):
            if LAYERS[mine] < FRAMEWORK_FREE_BELOW:
                out.append(f"{where}: {mine or 'root'} (layer {LAYERS[mine]}) imports the framework {name}")
            elif LAYERS[mine] > FRAMEWORK_FREE_BELOW and not lazy:
                out.append(f"{where}: module-level import of {name} (import it inside a function)")
            continue
        target = _target(name, modules) if name.startswith("nemo_dcr") else None
        if target is None or module.startswith(target + ".") or target == module:
            continue  # outside the package, or its own ancestor (Python's implicit parent import)
        theirs = part_of(target)
        if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
            out.append(f"{where}: {mine or 'root'} (layer {LAYERS[mine]}) imports {target} "
                       f"({theirs or 'root'}, layer {LAYERS[theirs]})")
    return out


def import_graph(srcs) -> dict[str, set[str]]:
    """Module -> modules of the package it imports (lazily or not; ancestors left out)."""
    graph: dict[str, set[str]] = {}
    for module, (rel, source) in srcs.items():
        package = module if rel.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for name, _, _ in imported_modules(ast.parse(source), package):
            target = _target(name, srcs) if name.startswith("nemo_dcr") else None
            if target and target != module and not module.startswith(target + "."):
                edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_checker_catches_violations():
    """The checker itself: each of these must be flagged, and the allowed forms must not be."""
    mods = {"nemo_dcr.codec", "nemo_dcr.codec.x", "nemo_dcr.refit", "nemo_dcr.refit.delta_refit",
            "nemo_dcr.integrations.megatron", "nemo_dcr.tools.commands.x", "nemo_dcr.layout", "nemo_dcr.types",
            "nemo_dcr.integrations.hf"}
    bad = [
        ("nemo_dcr.codec.x", "codec/x.py", "import transformers\n"),
        ("nemo_dcr.codec.x", "codec/x.py", "def f():\n    from nemo_dcr.refit import delta_refit\n"),
        ("nemo_dcr.layout.y", "layout/y.py", "from ..codec import x\n"),
        ("nemo_dcr.refit.z", "refit/z.py", "import importlib\nM = importlib.import_module('nemo_dcr.integrations.megatron')\n"),
        ("nemo_dcr.refit.z", "refit/z.py", "def f():\n    import vllm.engine\n"),
        ("nemo_dcr.integrations.hf.a", "integrations/hf/a.py", "from nemo_dcr.integrations.megatron import x\n"),
        ("nemo_dcr.tools.commands.b", "commands/b.py", "import transformers\n"),
        ("nemo_dcr.types", "types.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nemo_dcr import codec\n"),
    ]
    for mod, rel, src in bad:
        assert check_module(mod, Path(rel), src, mods), (rel, src)
    ok = {
        ("nemo_dcr.tools.commands.x", "commands/x.py"): "def run():\n    from nemo_dcr.integrations import hf\n    import transformers\n",
        ("nemo_dcr.integrations.megatron.s", "integrations/megatron/s.py"): "import megatron.core\nfrom nemo_dcr.refit import x\n",
        ("nemo_dcr.codec.z", "codec/z.py"): "import numpy\nfrom ..types import spec_of\nfrom . import x\n",
        ("nemo_dcr.codec.dcr.e", "codec/dcr/e.py"): "from .. import bitio\n",
    }
    for (mod, rel), src in ok.items():
        assert check_module(mod, Path(rel), src, mods | {"nemo_dcr.codec.bitio"}) == [], (rel, src)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_import_respects_the_layers():
    srcs = sources()
    for expected in ("nemo_dcr.codec.payload", "nemo_dcr.codec.dcr.jit_encode", "nemo_dcr.refit.delta_refit",
                     "nemo_dcr.types", "nemo_dcr.checkpoint", "nemo_dcr.tools.cli", "nemo_dcr.integrations.megatron.source"):
        assert expected in srcs, expected  # the scan is not vacuous
    violations = [v for m, (rel, src) in srcs.items() for v in check_module(m, rel, src, srcs)]
    assert not violations, "\n".join(violations)


def test_library_never_imports_the_tools():
    srcs = sources()
    assert any(m.startswith("nemo_dcr.tools.") for m in srcs)  # the scan is not vacuous
    bad = []
    for module, (rel, source) in srcs.items():
        if module == "nemo_dcr.tools" or module.startswith("nemo_dcr.tools."):
            continue
        package = module if rel.name == "__init__.py" else module.rpartition(".")[0]
        for name, line, _ in imported_modules(ast.parse(source), package):
            if name == "nemo_dcr.tools" or name.startswith("nemo_dcr.tools."):
                bad.append(f"nemo_dcr/{rel}:{line}: the library imports the tool {name}")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    found = cycles(import_graph(sources()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


CORE_IMPORTS = ("nemo_dcr.codec", "nemo_dcr.verify.checksum", "nemo_dcr.codec.payload", "nemo_dcr.codec.dcr",
                "nemo_dcr.refit", "nemo_dcr.tools.cli")


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

