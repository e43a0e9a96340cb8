"""The one place compiled CPU kernels are declared: numba ``njit`` with an on-disk cache.

Every compiled kernel of the package is an ``@njit`` function from here: machine code is cached
next to the source (``__pycache__``, or numba's user-wide cache when that is read-only), so
only the first process after an install pays the compile time (measured in
``benchmarks/codec_speed.py``).  ``nogil`` lets callers run kernels on several threads.
Kernels work on numpy arrays only; torch CPU tensors reach them through zero-copy ``.numpy()``.
"""

from __future__ import annotations

import numba


def _llvmlite_has_a_real_dict() -> None:
    """llvmlite's shared-library wrapper (``llvmlite.binding.ffi.lib``) has ``__slots__`` and a
    ``__getattr__`` that wraps any missing name as a C function, so ``vars(lib)`` returns a function
    wrapper instead of a dict.  Code that scans module attributes with ``vars()`` then fails: vLLM's
    Triton kernel override registration raises ``'_lib_fn_wrapper' object has no attribute 'get'``
    when numba was imported first.  Answering ``__dict__`` with an empty dict fixes that and changes
    nothing for llvmlite (it never looks the name up)."""
    try:
        from llvmlite.binding import ffi
    except ImportError:  # pragma: no cover - numba always brings llvmlite
        return
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


_llvmlite_has_a_real_dict()


def njit(fn):
    """Compile ``fn`` lazily per argument types, cached on disk, without the GIL."""
    return numba.njit(cache=True, nogil=True)(fn)
