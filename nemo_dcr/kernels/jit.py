"""The one place compiled CPU kernels are declared: numba ``njit`` with an on-disk cache.

Every compiled kernel of the package is an ``@njit`` function from here: machine code is cached
next to the source (``__pycache__``, or numba's user-wide cache when that is read-only), so
only the first process after an install pays the compile time (measured in
``benchmarks/codec_speed.py``).  ``nogil`` lets callers run kernels on several threads.
Kernels work on numpy arrays only; torch CPU tensors reach them through zero-copy ``.numpy()``.
"""

from __future__ import annotations

import numba


def njit(fn):
    """Compile ``fn`` lazily per argument types, cached on disk, without the GIL."""
    return numba.njit(cache=True, nogil=True)(fn)
