"""The ``dcr`` record coding (docs/wire_format.md section 4.4), conditioned on what the receiver holds.

Each element's *class* is the exponent of its base value, which the receiver already holds; the
encoder groups neighbouring classes into *groups* (runs of exponents), and within a group every
element has a rank (its place among the group's elements by class, then flat index).  Per group
the coder writes three sparse sets and one integer list, all as Rice codes: which ranks changed
(or, when most did, which did not), which changes step towards zero, and which step magnitudes
exceed the group's minimum and by how much; or, for a *literal group*, the new bits directly.
Adam moves weights by about ``lr`` per step, so how likely an element is to change, and by how
many ULPs, are both set by its exponent; conditioning on the group captures most of that.

One coder: :func:`encode_dcr` / :func:`decode_dcr`, compiled kernels on host arrays; with a kept
:class:`DcrIndex` (held per tensor in a :class:`DcrIndexes`) its cost follows the changes, without
one it makes one pass over the base.  Its independent oracles (a vectorized numpy coder, the same
on torch tensors, a group-by-group coder) live in the tests (``tests/oracles``).
"""

from .class_index import DcrIndex, DcrIndexes, MovedIndexes, StaleIndexError
from .jit_codec import decode_dcr, encode_dcr

__all__ = ["DcrIndex", "DcrIndexes", "MovedIndexes", "StaleIndexError", "decode_dcr", "encode_dcr"]
