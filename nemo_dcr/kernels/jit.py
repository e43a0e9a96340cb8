"""The one place compiled CPU kernels are declared: numba ``njit`` with an on-disk cache.

Every compiled kernel of the package is an ``@njit`` function from here: machine code is cached
next to the source (``__pycache__``, or numba's user-wide cache when that is read-only), so
only the first process after an install pays the compile time (measured in
``benchmarks/codec_speed.py``).  ``nogil`` lets callers run kernels on several threads.
Kernels work on numpy arrays only; torch CPU tensors reach them through zero-copy ``.numpy()``.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


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


def njit(fn=None, *, inline: bool = False):
    """Compile ``fn`` lazily per argument types, cached on disk, without the GIL.

    ``inline=True`` (as ``@njit(inline=True)``): numba inlines the function into each compiled
    caller, so small state-passing helpers (a bit writer's registers as a tuple) cost no call."""
    if fn is None:
        return lambda f: njit(f, inline=inline)
    return numba.njit(cache=True, nogil=True, inline="always" if inline else "never")(fn)


def _zero_bits(op: str, doc: str):
    """An intrinsic counting the zero bits at one end of a non-zero unsigned integer with LLVM's
    ``op`` (``cttz``, ``ctlz``: one instruction; undefined for 0)."""
    def impl(typingctx, x):
        if not isinstance(x, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], ir.Constant(ir.IntType(1), 1))

        return x(x), codegen

    impl.__name__ = impl.__qualname__ = op
    impl.__doc__ = doc
    return intrinsic(impl)


cttz = _zero_bits("cttz", "Trailing zero bits of a non-zero unsigned integer (one ``tzcnt``; undefined for 0).")
ctlz = _zero_bits("ctlz", "Leading zero bits of a non-zero unsigned integer (one ``lzcnt``; undefined for 0).")


AHEAD = 64
"""Iterations between a :func:`prefetch` and the load it serves (an in-order stream of loads)."""


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the cache line of ``arr[index]`` (a 1-D array) into all cache levels: a read that
    never faults (any index) and changes no result.  Issued :data:`AHEAD` iterations before a
    loop's load at a data-dependent address, it lets that cache miss overlap the work in between
    (measured in ``benchmarks/peer.py``: the ``dcr`` decoder's gather of old bits 4.5x faster)."""
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False,
                                       boundscheck=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, index), codegen
