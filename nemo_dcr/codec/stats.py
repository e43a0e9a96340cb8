"""Delta statistics: density by layer type, bytes per encoding and entropy estimates.

The two entropy estimates bound what a coder could reach on a tensor:
- *alike*: every element is the same Bernoulli(p) trial for "changed", and the folded ULP steps
  of changed elements are i.i.d. from their empirical distribution;
- *conditioned*: the same, but separately within each class (exponent of the old value), which
  the receiver knows.  Both use the empirical distributions of the tensor itself (a free model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..types import DtypeSpec
from .dcr.jit_bits import fold_steps

# (layer type, pattern) checked in order against canonical names.
LAYER_TYPES = (
    ("router", re.compile(r"mlp\.gate\.(weight|e_score_correction_bias)$|router")),
    ("shared_experts", re.compile(r"shared_expert")),
    ("experts", re.compile(r"experts\.")),
    ("norms", re.compile(r"norm")),
    ("embeddings", re.compile(r"embed|lm_head|output_layer|wte|wpe")),
    ("attention", re.compile(r"self_attn|attention|attn|linear_q|linear_kv|linear_proj")),
    ("mlp", re.compile(r"mlp|feed_forward|ffn")),
)


def layer_type(name: str) -> str:
    """Coarse layer type of a canonical tensor name (``other`` when nothing matches)."""
    for kind, pat in LAYER_TYPES:
        if pat.search(name):
            return kind
    return "other"


def _h2(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    return -(p * np.log2(p) + q * np.log2(q)) * ((p > 0) & (p < 1))


def _empirical_bits(symbols: np.ndarray) -> float:
    """n * H(empirical distribution of symbols), in bits."""
    if symbols.size == 0:
        return 0.0
    _, counts = np.unique(symbols, return_counts=True)
    p = counts / symbols.size
    return float(-(counts * np.log2(p)).sum())


@dataclass
class TensorStats:
    """Change statistics of one tensor (sizes in bits or bytes as named)."""

    name: str
    layer_type: str
    numel: int
    changed: int
    dense_bytes: int
    entropy_alike_bits: float
    entropy_cond_bits: float
    encoded_bytes: dict = field(default_factory=dict)

    @property
    def density(self) -> float:
        return self.changed / max(self.numel, 1)


def entropy_bits(base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec):
    """``(alike, conditioned)`` entropy estimates in bits for a change set."""
    n, m = base_bits.size, positions.size
    if m == 0:
        return 0.0, 0.0
    old = base_bits[positions]
    u = fold_steps(old, new_bits, spec.bits)
    alike = n * float(_h2(np.array(m / n))) + _empirical_bits(u)
    classes = spec.exponent(base_bits)
    sizes = np.bincount(classes, minlength=spec.n_exponents)
    ch_classes = classes[positions]
    changed = np.bincount(ch_classes, minlength=spec.n_exponents)
    live = sizes > 0
    cond = float((sizes[live] * _h2(changed[live] / sizes[live])).sum())
    order = np.argsort(ch_classes, kind="stable")
    cuts = np.flatnonzero(np.diff(ch_classes[order])) + 1
    for group in np.split(u[order], cuts):
        cond += _empirical_bits(group)
    return alike, cond


def summarize(stats: list[TensorStats]) -> dict:
    """Totals overall and per layer type (bytes per encoding, density, entropy per change)."""
    def agg(rows):
        changed = sum(r.changed for r in rows)
        numel = sum(r.numel for r in rows)
        encs = sorted({e for r in rows for e in r.encoded_bytes})
        out = {"tensors": len(rows), "numel": numel, "changed": changed,
               "density": changed / max(numel, 1), "dense_bytes": sum(r.dense_bytes for r in rows),
               "entropy_alike_bytes": sum(r.entropy_alike_bits for r in rows) / 8,
               "entropy_cond_bytes": sum(r.entropy_cond_bits for r in rows) / 8,
               "bytes": {e: sum(r.encoded_bytes.get(e, 0) for r in rows) for e in encs}}
        per = max(changed, 1)
        out["bytes_per_changed"] = {e: b / per for e, b in out["bytes"].items()}
        out["entropy_alike_per_changed"] = out["entropy_alike_bytes"] / per
        out["entropy_cond_per_changed"] = out["entropy_cond_bytes"] / per
        return out

    kinds = sorted({r.layer_type for r in stats})
    return {"total": agg(stats), "by_layer_type": {k: agg([r for r in stats if r.layer_type == k]) for k in kinds}}
