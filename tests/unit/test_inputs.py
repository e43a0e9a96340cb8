"""Inputs to the public API are refused with the field named, before anything is encoded or summed:
dtype and signedness of bits, shapes, sortedness and range of positions, matching lengths."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr import codec
from nemo_dcr.types import DeltaInputError, SparseDelta
from nemo_dcr.verify.checksum import hash_sum, tensor_checksum, updated_checksum

POS = np.array([1, 4, 7], np.int64)
NEW = np.array([0x3F80, 0xBF80, 0x4000], np.uint16)
OLD = np.zeros(3, np.uint16)


def test_signed_new_bits_against_unsigned_old_bits_are_refused_naming_the_field():
    """The case a caller once got through: int16 new bits, uint16 old bits (the engine then refused
    the payload by its target checksum, and nobody said why)."""
    with pytest.raises(DeltaInputError, match=r"'w': new_bits are int16, expected uint16 .*'bf16'"):
        SparseDelta("w", "bf16", (10,), POS, NEW.view(np.int16), OLD)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="bfloat16"), r"dtype 'bfloat16' is not a wire dtype; known: bf16"),
    (dict(shape=[10]), r"shape must be a tuple of non-negative integers, got \[10\]"),
    (dict(shape=(-1,)), r"shape must be a tuple of non-negative integers"),
    (dict(shape=(2.5,)), r"shape must be a tuple"),
    (dict(positions=POS.astype(np.int32)), r"positions are int32, expected int64"),
    (dict(positions=POS.astype(np.uint64)), r"positions are uint64, expected int64"),
    (dict(positions=[1, 4, 7]), r"positions must be a 1-D numpy array, got list"),
    (dict(positions=POS.reshape(1, 3)), r"positions must be a 1-D numpy array, got a 2-D array"),
    (dict(new_bits=NEW.astype(np.uint32)), r"new_bits are uint32, expected uint16"),
    (dict(old_bits=OLD.view(np.int16)), r"old_bits are int16, expected uint16"),
    (dict(new_bits=NEW[:2]), r"lengths differ: positions 3, new_bits 2, old_bits 3"),
    (dict(old_bits=np.zeros(4, np.uint16)), r"lengths differ: positions 3, new_bits 3, old_bits 4"),
    (dict(dtype="fp32"), r"new_bits are uint16, expected uint32"),
])
def test_every_field_is_checked_at_construction(kwargs, match):
    fields = dict(name="w", dtype="bf16", shape=(10,), positions=POS, new_bits=NEW, old_bits=OLD) | kwargs
    with pytest.raises(DeltaInputError, match=match):
        SparseDelta(**fields)


@pytest.mark.parametrize("positions, match", [
    ([4, 1, 7], r"strictly increasing; positions\[1\] = 1 follows 4"),
    ([1, 4, 4], r"strictly increasing; positions\[2\] = 4 follows 4"),
    ([1, 4, 10], r"positions\[2\] = 10 is outside \[0, 10\) of shape \(10,\)"),
    ([-1, 4, 7], r"positions\[0\] = -1 is outside \[0, 10\)"),
])
def test_order_and_range_of_positions_are_checked_before_encoding(positions, match):
    d = SparseDelta("w", "bf16", (10,), np.array(positions, np.int64), NEW, OLD)
    with pytest.raises(DeltaInputError, match=match):
        d.validate()
    with pytest.raises(DeltaInputError, match=match):
        codec.encode_deltas([d], {"w": np.zeros(10, np.uint16)})


@pytest.mark.parametrize("base, match", [
    ({}, r"'w': no base bits of that tensor"),
    ({"w": np.zeros(10, np.int16)}, r"base bits are int16\[10\], the delta's dtype 'bf16' and shape \(10,\) need uint16\[10\]"),
    ({"w": np.zeros(12, np.uint16)}, r"base bits are uint16\[12\].*need uint16\[10\]"),
])
def test_encode_refuses_base_bits_that_do_not_fit_the_delta(base, match):
    with pytest.raises(DeltaInputError, match=match):
        codec.encode_deltas([SparseDelta("w", "bf16", (10,), POS, NEW, OLD)], base)


@pytest.mark.parametrize("encoding", ["dcr", "reference", "raw"])
def test_a_change_to_the_base_bits_is_refused_by_every_encoding(encoding):
    """A change that keeps its element's base bits: the dcr coder once looped on it (a zero step
    has no code), reference and raw made a payload every receiver refuses (wire rule 12)."""
    base = np.zeros(10, np.uint16)
    base[4] = 0xBF80
    d = SparseDelta("w", "bf16", (10,), POS, NEW)
    with pytest.raises(DeltaInputError, match=r"'w': the change at position 4 \(entry 1\) sets the element to its "
                                              r"base bits 0xbf80; every change must differ from the base"):
        codec.encode_deltas([d], {"w": base}, encoding=encoding)
    assert base[4] == 0xBF80 and not base[[1, 7]].any()


@pytest.mark.parametrize("encoding", ["dcr", "reference", "raw"])
def test_old_bits_read_from_the_base_encode_the_same_bytes_and_are_still_checked(encoding):
    """``old_from_base``: the caller read the old bits from the base (the sender mirror does), so
    the encoder takes them; the bytes are those of its own read, a delta without them is refused,
    and a no-op among them is refused as before."""
    rng = np.random.default_rng(3)
    base = rng.integers(0x3C00, 0x4000, 4096).astype(np.uint16)
    pos = np.sort(rng.choice(4096, 300, replace=False)).astype(np.int64)
    new = (base[pos] ^ rng.integers(1, 8, pos.size).astype(np.uint16)).astype(np.uint16)
    d = SparseDelta("w", "bf16", (4096,), pos, new, base[pos])
    own = codec.encode_deltas([SparseDelta("w", "bf16", (4096,), pos, new)], {"w": base}, encoding=encoding)
    assert codec.encode_deltas([d], {"w": base}, encoding=encoding, old_from_base=True) == own
    with pytest.raises(DeltaInputError, match=r"'w': old_from_base needs its old_bits"):
        codec.encode_deltas([SparseDelta("w", "bf16", (4096,), pos, new)], {"w": base}, old_from_base=True)
    same = SparseDelta("w", "bf16", (4096,), pos, np.where(np.arange(pos.size) == 5, base[pos], new), base[pos])
    with pytest.raises(DeltaInputError, match=rf"the change at position {pos[5]} \(entry 5\) sets the element"):
        codec.encode_deltas([same], {"w": base}, encoding=encoding, old_from_base=True)


def test_the_mirror_reads_old_bits_itself_for_deltas_not_from_its_changes():
    """``SenderMirror.encode(from_changes=False)`` (the FP8 mirror's quantized changes): old bits
    that are not the mirror's do not reach the coder; the payload is the one of the right ones."""
    import torch

    from nemo_dcr.codec import Identity
    from nemo_dcr.refit.mirror import SenderMirror

    rng = np.random.default_rng(4)
    bits = rng.integers(0x3C00, 0x4000, 4096).astype(np.uint16)
    pos = np.sort(rng.choice(4096, 200, replace=False)).astype(np.int64)
    new = (bits[pos] ^ np.uint16(3)).astype(np.uint16)

    def encoded(old, from_changes):
        mirror = SenderMirror({"w": ("bf16", (4096,))})
        mirror.reset({"w": torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)}, 0)
        d = SparseDelta("w", "bf16", (4096,), pos, new, old)
        return mirror.encode([d], Identity("m", "", 0, 1), "dcr", None, 1 << 20, from_changes=from_changes)

    right = encoded(bits[pos], True)
    assert encoded(np.zeros(pos.size, np.uint16), False) == right


def test_the_dcr_coder_refuses_a_change_that_keeps_its_old_bits():
    from nemo_dcr.codec.dcr import encode_dcr
    from nemo_dcr.types import spec_of

    base = np.zeros(10, np.uint16)
    with pytest.raises(ValueError, match=r"the change at position 7 \(entry 2\) keeps 0x0"):
        encode_dcr(base, POS, np.array([1, 2, 0], np.uint16), spec_of("bf16"))
    with pytest.raises(ValueError, match=r"the change at position 1 \(entry 0\) keeps 0x3f80"):
        encode_dcr(base, POS, NEW, spec_of("bf16"), None, NEW)


def test_a_valid_delta_encodes_and_validates():
    d = SparseDelta("w", "bf16", (2, 5), POS, NEW, OLD)
    assert d.validate() is d
    assert codec.inspect(codec.encode_deltas([d], {"w": np.zeros(10, np.uint16)})).records[0].changed == 3


def test_checksums_refuse_signed_bits():
    """A signed view hashes other values than the raw bits (int16 -1 is not 0xFFFF)."""
    with pytest.raises(TypeError, match=r"bits must be unsigned integers .* got int16"):
        tensor_checksum(NEW.view(np.int16))
    with pytest.raises(TypeError, match=r"bits must be unsigned integers"):
        hash_sum(POS, NEW.view(np.int16))
    with pytest.raises(TypeError, match=r"new bits must be unsigned integers .* got int16"):
        updated_checksum(0, POS, OLD, NEW.view(np.int16))
    assert tensor_checksum(NEW) == hash_sum(np.arange(3), NEW)
