"""The slice a sampled check compares at one refit, and checksums over runs of elements.

A sampled check (``dcr.verify: sampled``, docs/refit.md "Verification") recomputes, on both sides
and from the live tensors, the checksums of a slice of every canonical tensor:

* every tensor's canonical flat index space is cut into blocks of :attr:`Sample.block` elements,
  and consecutive blocks into groups of :attr:`Sample.steps`;
* in each group a pseudo-random rotation, drawn from (seed, tensor name, group), gives each block
  one slice number in ``0 .. steps-1`` (a different one for every block of the group);
* refit ``step`` checks slice ``step % steps``.

So each refit checks about ``1/steps`` of every tensor at pseudo-random places (one block per
group, a different one each refit), and every element is checked exactly once in every ``steps``
consecutive refits: an element the capture missed or a write behind the refit's back is seen
within ``steps`` refits.  Trainer ranks and engine ranks select the same elements from the
canonical index alone, so no rank needs another's layout.

:func:`runs_checksum` is the one compiled loop both sides use: ``Σ h(canonical index, bits)`` over
runs ``bits[local + k * step]`` at canonical ``canon + k`` (``0 <= k < length``), restricted to a
sample's slice when given (without one: every element, a full scan over runs).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.jit import njit
from .checksum import _K_BITS, _K_IDX, MASK64, _mix, unsigned_bits

_K_SALT = np.uint64(0xC2B2AE3D27D4EB4F)


@dataclass(frozen=True)
class Sample:
    """Slice ``step % steps`` of every canonical tensor (see the module docstring).

    Attributes:
        step: the refit's number (1-based; any integer >= 0).
        steps: slices per cycle (``dcr.verify_steps``): every element is checked once in every
            ``steps`` consecutive refits.
        block: elements per block (``dcr.verify_block``).
        seed: seed of the rotations (``dcr.verify_seed``).
    """

    step: int
    steps: int
    block: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("step", 0), ("steps", 1), ("block", 1), ("seed", 0)):
            value = getattr(self, name)
            if type(value) is not int or not low <= value < 1 << 63:
                raise ValueError(f"Sample.{name} must be an integer in [{low}, 2**63), got {value!r}")

    @property
    def slice(self) -> int:
        """The slice number this refit checks."""
        return self.step % self.steps

    def salt(self, name: str) -> int:
        """The rotations' key for tensor ``name`` (from the seed and the name's CRC-32)."""
        return (self.seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) & MASK64

    def slice_of(self, name: str, index: np.ndarray) -> np.ndarray:
        """Slice number of each canonical flat ``index`` of tensor ``name`` (numpy reference of the
        selection the compiled loop makes; tests)."""
        block = np.asarray(index, np.int64) // self.block
        rot = _rotation_np(np.uint64(self.salt(name)), (block // self.steps).astype(np.uint64), self.steps)
        return ((block % self.steps) + rot) % self.steps

    def describe(self) -> str:
        return f"slice {self.slice} of {self.steps} (blocks of {self.block}, seed {self.seed})"

    def to_json(self) -> dict[str, int]:
        return {"step": self.step, "steps": self.steps, "block": self.block, "seed": self.seed}

    @classmethod
    def from_json(cls, obj: Any) -> "Sample":
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: not an object with exactly these four integer keys in range.
        """
        keys = ("step", "steps", "block", "seed")
        if not isinstance(obj, dict) or sorted(obj) != sorted(keys):
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"a sample is an object with keys {list(keys)}, got {got}")
        return cls(*(obj[k] for k in keys))


def _rotation_np(salt: np.uint64, group: np.ndarray, steps: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = salt ^ (group * _K_SALT)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x % np.uint64(steps)).astype(np.int64)


@njit
def _runs_sum(bits, local, canon, length, step, block, steps, phase, salt):
    total = np.uint64(0)
    for r in range(local.size):
        c0, n, l0, k = canon[r], length[r], local[r], step[r]
        end = c0 + n
        g = (c0 // block) // steps
        while g * steps * block < end:
            rot = np.int64(_mix(salt ^ (np.uint64(g) * _K_SALT)) % np.uint64(steps))
            b = g * steps + (phase - rot + steps) % steps  # the block of group g in slice ``phase``
            lo, hi = max(b * block, c0), min(b * block + block, end)
            for i in range(lo, hi):
                total += _mix(np.uint64(i) * _K_IDX ^ (np.uint64(bits[l0 + (i - c0) * k]) + np.uint64(1)) * _K_BITS)
            g += 1
    return total


def runs_checksum(bits: np.ndarray, local: np.ndarray, canon: np.ndarray, length: np.ndarray,
                  sample: Sample | None = None, name: str = "", step: np.ndarray | None = None) -> int:
    """``Σ h(canon[r] + k, bits[local[r] + k * step[r]])`` over every run ``r`` and
    ``0 <= k < length[r]`` (``step``: 1 for every run when not given; a transposed param's runs
    step by its row length), only over the elements in ``sample``'s slice of tensor ``name`` when
    given (mod 2**64).

    Cost: the selected elements plus one step per group of blocks a run spans (a sampled check
    reads about ``1/steps`` of the elements, a full one all of them).

    Raises:
        TypeError: ``bits`` are not unsigned integers.
        ValueError: run arrays of different lengths, or a run outside ``bits``.
    """
    bits = np.ascontiguousarray(unsigned_bits(bits))
    local, canon, length = (np.ascontiguousarray(a, np.int64).reshape(-1) for a in (local, canon, length))
    step = np.ones(local.size, np.int64) if step is None else np.ascontiguousarray(step, np.int64).reshape(-1)
    if not local.size == canon.size == length.size == step.size:
        raise ValueError(f"runs: {local.size} local starts, {canon.size} canonical starts, {length.size} lengths, "
                         f"{step.size} steps")
    last = local + np.maximum(length - 1, 0) * step  # each run's last local element
    if local.size and (int(length.min()) < 0 or int(local.min()) < 0 or int(canon.min()) < 0 or int(step.min()) < 1
                       or int(last[length > 0].max(initial=-1)) >= bits.size):
        raise ValueError(f"runs reach outside the {bits.size} elements given (or are negative)")
    if sample is None:
        return int(_runs_sum(bits, local, canon, length, step, np.int64(1 << 40), np.int64(1), np.int64(0),
                             np.uint64(0)))
    return int(_runs_sum(bits, local, canon, length, step, np.int64(sample.block), np.int64(sample.steps),
                         np.int64(sample.slice), np.uint64(sample.salt(name))))


def whole_checksum(bits: np.ndarray, sample: Sample | None = None, name: str = "") -> int:
    """:func:`runs_checksum` of a whole tensor's flat ``bits`` (one run from index 0)."""
    n = np.asarray(bits).size
    one = np.zeros(1, np.int64)
    return runs_checksum(bits, one, one, np.array([n], np.int64), sample, name)
