"""Seeing, and stopping, every write an engine's ``load_weights`` makes into live tensors.

Probing an engine's placement runs the engine's own ``load_weights`` on probe tensors
(:mod:`nemo_dcr.apply.probe`).  A model file may write a parameter without its ``weight_loader``
(gpt-oss copies experts, biases and sinks with ``param.copy_``), so replacing the loaders is not
enough to keep live weights untouched, nor to learn where a tensor lands.  :class:`WriteGuard`
is a ``TorchDispatchMode``: while it is active, every mutating aten op whose written argument
lives in a protected storage (a live parameter or buffer) is *not executed* and is recorded
instead, naming the tensor it would have written.  Cost: a dictionary lookup per mutating op.

:func:`record_writes` runs ``load_weights`` once per canonical tensor with every loader replaced
by a recorder and the guard active, so it learns, without writing anything, which parameters
each canonical tensor reaches through a loader and which ones it writes directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Writes:
    """Where the engine's ``load_weights`` puts one canonical tensor (recorded, nothing written).

    Attributes:
        loader: engine params whose ``weight_loader`` it calls.
        direct: engine params (or ``buffer:`` names) it writes directly, bypassing ``weight_loader``.
    """

    loader: tuple[str, ...] = ()
    direct: tuple[str, ...] = ()

    @property
    def params(self) -> tuple[str, ...]:
        """Every param it writes, sorted."""
        return tuple(sorted(set(self.loader) | set(self.direct)))


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return None


class Protected:
    """Live tensors by storage: which named tensor a written view belongs to."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.by_storage: dict[int, list[tuple[int, int, str]]] = {}
        for name, t in tensors.items():
            key = _storage_key(t)
            if key is not None and t.numel():
                self.by_storage.setdefault(key, []).append((t.storage_offset(), t.numel(), name))

    def owner(self, t: torch.Tensor) -> str | None:
        """Name of the protected tensor ``t`` writes into (None: not protected)."""
        entries = self.by_storage.get(_storage_key(t)) if isinstance(t, torch.Tensor) else None
        if not entries:
            return None
        off = t.storage_offset()
        inside = [n for start, size, n in entries if start <= off < start + size]
        return (inside or [entries[0][2]])[0]


class WriteGuard(TorchDispatchMode):
    """Blocks and records mutating ops into protected tensors while active.

    Args:
        protected: the live tensors no op may write.

    Attributes:
        blocked: ``(label, tensor name, op)`` of every blocked write; ``label`` is what the caller
            set in :attr:`label` at the time (the canonical tensor being loaded).
    """

    def __init__(self, protected: Protected):
        super().__init__()
        self.protected = protected
        self.blocked: list[tuple[str, str, str]] = []
        self.label = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                owner = self.protected.owner(value) if isinstance(value, torch.Tensor) else None
                if owner is not None:
                    self.blocked.append((self.label, owner, str(func)))
                    return value if schema.returns else None
        return func(*args, **kwargs)


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every param (by name) and buffer (``buffer:<name>``) of ``model``: what probing protects."""
    out = {n: p.data for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return out


def record_writes(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]],
                  set_loader: Callable[[torch.nn.Parameter, Callable], Callable],
                  dtypes: Mapping[str, torch.dtype] | None = None,
                  failed: dict[str, str] | None = None) -> dict[str, Writes]:
    """Run ``model.load_weights`` on a zero tensor per canonical name, loaders replaced by recorders,
    under a :class:`WriteGuard`: nothing is written, every write is recorded.

    Args:
        model: module with ``load_weights(iterable of (name, tensor))`` (the vLLM contract).
        shapes: canonical name -> shape.
        set_loader: installs a loader on a param and returns the previous one.
        dtypes: canonical name -> dtype of the zero tensor (default bf16).
        failed: if given, collects ``name -> error`` for the names ``load_weights`` fails on
            (a param replaced after load, e.g. by a quantized kernel); else the first one raises.

    Raises:
        ValueError: ``load_weights`` failed on a canonical name (named, with the error).
    """
    params = dict(model.named_parameters())
    through: dict[str, set[str]] = {}
    current = [""]

    def recorder(pname: str):
        def record(*args, **kwargs):
            through.setdefault(current[0], set()).add(pname)
            return True  # MoE loaders are asked ``return_success=True``
        return record

    guard = WriteGuard(Protected(live_tensors(model)))
    saved = {p: set_loader(param, recorder(p)) for p, param in params.items()}
    try:
        with torch.no_grad(), guard:
            for name, shape in shapes.items():
                current[0] = guard.label = name
                zeros = torch.zeros(tuple(shape), dtype=(dtypes or {}).get(name, torch.bfloat16))
                try:
                    model.load_weights([(name, zeros)])
                except Exception as exc:
                    why = f"the engine's load_weights fails on it: {type(exc).__name__}: {str(exc)[:300]}"
                    if failed is None:
                        raise ValueError(f"{name}: {why}") from exc
                    failed[name] = why
    finally:
        for p, param in params.items():
            set_loader(param, saved[p])
    direct: dict[str, set[str]] = {}
    for label, owner, _ in guard.blocked:
        direct.setdefault(label, set()).add(owner)
    return {n: Writes(tuple(sorted(through.get(n, ()))), tuple(sorted(direct.get(n, ())))) for n in shapes}
