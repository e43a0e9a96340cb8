"""The group table of a ``dcr`` record body (docs/wire_format.md section 4.4): exponent range,
group widths and each group's counts and parameters, every field bounds-checked on read.
Shared by the vectorized decoder (:mod:`.decode`) and the group-by-group reference (:mod:`.per_group`)."""

from __future__ import annotations

from dataclasses import dataclass

from nemo_dcr.types import DtypeSpec
from . import bitio
from nemo_dcr.codec.errors import MalformedRecordError


@dataclass
class Group:
    n: int
    size: int
    n_neg: int = 0
    m_off: int = 0
    n_nz: int = 0
    k_val: int = 0
    lit: bool = False  # literal group: new bits coded directly (n_neg = n + 1 on the wire)
    e_ref: int = 0
    k_lit: int = 0
    k_item: int = 0  # Rice k of a literal value: k_lit + mantissa bits + 1


def read_groups(reader: bitio.ByteReader, spec: DtypeSpec, name: str):
    lo, n_groups = reader.varint(), reader.varint()
    if lo >= spec.n_exponents or not 1 <= n_groups <= spec.n_exponents:
        raise MalformedRecordError(f"group table lo={lo}, groups={n_groups} invalid for {spec.name}", name)
    widths = [reader.varint() for _ in range(n_groups)]
    if min(widths) < 1 or lo + sum(widths) > spec.n_exponents:
        raise MalformedRecordError(f"group widths {widths} from exponent {lo} exceed {spec.name}", name)
    return lo, widths


def read_group(reader: bitio.ByteReader, size: int, g: int, spec: DtypeSpec, name: str) -> Group:
    grp = Group(reader.varint(), size)
    if grp.n > size:
        raise MalformedRecordError(f"group {g}: {grp.n} changes but only {size} elements", name)
    if grp.n == 0:
        return grp
    grp.n_neg = reader.varint()
    if grp.n_neg == grp.n + 1:
        grp.lit, grp.n_neg, grp.e_ref, grp.k_lit = True, 0, reader.varint(), reader.byte()
        if grp.e_ref >= spec.n_exponents:
            raise MalformedRecordError(f"group {g}: literal reference exponent {grp.e_ref} invalid for {spec.name}", name)
        if grp.k_lit + spec.exp_shift + 1 > bitio.MAX_K:
            raise MalformedRecordError(f"group {g}: literal Rice parameter {grp.k_lit} too large", name)
        grp.k_item = grp.k_lit + spec.exp_shift + 1
        return grp
    grp.m_off, grp.n_nz = reader.varint(), reader.varint()
    if grp.n_neg > grp.n or grp.n_nz > grp.n:
        raise MalformedRecordError(f"group {g}: sign/magnitude counts exceed {grp.n} changes", name)
    if grp.m_off + 1 >= (1 << spec.bits):
        raise MalformedRecordError(f"group {g}: m_off {grp.m_off} puts steps beyond the {spec.bits}-bit key space", name)
    if grp.n_nz:
        grp.k_val = reader.byte()
        if grp.k_val > bitio.MAX_K:
            raise MalformedRecordError(f"group {g}: Rice parameter {grp.k_val} over {bitio.MAX_K}", name)
    return grp
