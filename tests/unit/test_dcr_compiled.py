"""The compiled ``dcr`` coder and its kept class index against the independent references.

References (tests/oracles): the vectorized numpy coder (``encode_dcr_np``/``decode_dcr_np``, bytes
pinned by the golden tests), the group-by-group coder and, for the index, the numpy blocked ranks
(``encoder_sorted_pos_np``/``DecoderIndexNp``) and a fresh build on the new bits.  Cases:
random bits, Adam-like steps, adversarial values (NaN payloads, +-Inf, -0, subnormals, sign
flips), all-change, literal groups, block and superblock edges, real steps of the embedded model.
"""

from __future__ import annotations

import numpy as np
import pytest

from nemo_dcr.codec.dcr import DcrIndex, DcrIndexes, StaleIndexError, decode_dcr, encode_dcr
from nemo_dcr.codec.dcr.jit_bits import best_k, fold_steps
from nemo_dcr.codec.dcr.jit_decode import ERR, _bitmap_set
from nemo_dcr.codec.errors import MalformedRecordError
from nemo_dcr.types import DTYPES
from tests.oracles import decode_dcr_np, decode_dcr_per_group, encode_dcr_np, encode_dcr_per_group
from tests.oracles.bitio import ByteReader, best_rice_k
from tests.oracles.index import DecoderIndexNp, encoder_sorted_pos_np
from tests.oracles.keys import fold_steps as oracle_fold_steps
from tests.oracles.keys import signed_steps

SIZES = (1, 5, 4095, 4097, 65537, 150_001)


def _realistic(rng, spec, n):
    w = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1)).astype(np.float32).view(np.uint32)
    return w if spec.bits == 32 else (w >> (32 - spec.bits)).astype(spec.uint)


def _special(spec) -> np.ndarray:
    """Bit patterns of NaNs (payloads, both signs), +-Inf, +-0, subnormals, extremes of ``spec``."""
    e_all, sign = ((1 << spec.exp_bits) - 1) << spec.exp_shift, spec.sign_mask
    mant = (1 << spec.exp_shift) - 1
    vals = [0, sign, e_all, e_all | sign, e_all | 1, e_all | mant | sign, 1, mant, sign | 1, sign | mant,
            1 << spec.exp_shift, (e_all - (1 << spec.exp_shift)) | mant, sign | (e_all - (1 << spec.exp_shift))]
    return np.array(vals, dtype=np.uint64).astype(spec.uint)


def _case(rng, spec, n, density, mode):
    base = rng.integers(0, 1 << spec.bits, n, dtype=np.uint64).astype(spec.uint) if mode in ("random", "special") \
        else _realistic(rng, spec, n)
    sp = _special(spec)
    if mode == "special":
        base[rng.integers(0, n, max(1, n // 3))] = sp[rng.integers(0, sp.size, max(1, n // 3))]
    pos = np.sort(rng.choice(n, size=max(1, int(n * density)), replace=False)).astype(np.int64)
    if mode == "random":
        new = rng.integers(0, 1 << spec.bits, pos.size, dtype=np.uint64).astype(spec.uint)
    elif mode == "special":
        new = sp[rng.integers(0, sp.size, pos.size)]
    else:
        step = rng.integers(-3, 4, pos.size) * rng.integers(1, 40 if mode == "wide" else 2, pos.size)
        new = (base[pos].astype(np.int64) + step).astype(spec.uint)
    keep = new != base[pos]
    return base, pos[keep], new[keep]


def _check(spec, base, pos, new, index=None):
    ref = encode_dcr_np(base, pos, new, spec)
    assert encode_dcr(base, pos, new, spec) == ref
    index = DcrIndex.build(base, spec) if index is None else index
    assert encode_dcr(base, pos, new, spec, index) == ref
    for ix in (None, index):
        p, v, o = decode_dcr(ref, base, spec, "t", ix, with_old=True)
        assert np.array_equal(p, pos) and np.array_equal(v, new) and v.dtype == spec.uint
        assert np.array_equal(o, base[pos])
    return ref


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("mode", ["random", "ulp", "wide", "special"])
def test_compiled_bytes_equal_numpy(dtype, mode):
    spec, rng = DTYPES[dtype], np.random.default_rng([sorted(DTYPES).index(dtype), len(mode)])
    for n in SIZES:
        for density in (0.003, 0.05, 0.7, 1.0):
            base, pos, new = _case(rng, spec, n, density, mode)
            if pos.size:
                ref = _check(spec, base, pos, new)
                if n < 5000:
                    assert ref == encode_dcr_per_group(base, pos, new, spec)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_all_change_edges_and_literals(dtype):
    spec, rng = DTYPES[dtype], np.random.default_rng(7)
    n = 3 * 65536 + 5
    base = _realistic(rng, spec, n)
    new = base ^ np.array(1, spec.uint)  # every element, one ULP-ish step
    _check(spec, base, np.arange(n, dtype=np.int64), new)
    edges = np.array([0, 4095, 4096, 65535, 65536, n - 1], np.int64)
    _check(spec, base, edges, base[edges] ^ np.array(spec.sign_mask, spec.uint))  # sign flips: big steps
    # weights far below their update (one binade, random signs) get new values over six binades and
    # either sign: the steps are bimodal (crossing zero or not), so the coder picks a literal group
    bias = (1 << spec.exp_bits - 1) - 1
    e_old = max(1, bias - 30)
    sign = rng.integers(0, 2, n).astype(np.uint64) << (spec.bits - 1)
    tiny = (sign | (e_old << spec.exp_shift) | rng.integers(0, 1 << spec.exp_shift, n).astype(np.uint64)).astype(spec.uint)
    pos = np.sort(rng.choice(n, 5000, replace=False)).astype(np.int64)
    e_new = (bias - 3 + rng.integers(-3, 3, pos.size)).astype(np.uint64)
    lit = (rng.integers(0, 2, pos.size).astype(np.uint64) << (spec.bits - 1)) | (e_new << spec.exp_shift) | \
        rng.integers(0, 1 << spec.exp_shift, pos.size).astype(np.uint64)
    lit = lit.astype(spec.uint)
    keep = lit != tiny[pos]
    pos, lit = pos[keep], lit[keep]
    body = ByteReader(_check(spec, tiny, pos, lit))
    lo, groups, width, n, n_neg = (body.varint() for _ in range(5))
    if spec.exp_bits < 8:
        return  # too few binades below the update for the literal case
    assert (lo, groups, width, n) == (e_old, 1, 1, pos.size) and n_neg == n + 1  # one literal group


def _huge_rice_values(rng):
    """Rice values whose sums reach far beyond 2**53 (up to 2**72): uniform, heavy-tailed, with
    outliers, padded with zeros, and means next to 2**j - 1 (where a float mean can round across)."""
    for bits in (20, 32, 45, 52, 61):
        yield rng.integers(0, 1 << bits, 5000, dtype=np.int64)
        yield rng.integers(0, 1 << bits, 5000, dtype=np.int64) >> rng.integers(0, bits, 5000)
        v = rng.integers(0, 1 << (bits - 12), 5000, dtype=np.int64)
        v[rng.integers(0, v.size, 5)] = (1 << bits) - 1
        yield v
    for j in (30, 40, 50, 60):
        for delta in (-1, 0, 1):
            v = np.full(1 << 14, (1 << j) - 1, np.int64)
            v[0] += delta
            yield v


def test_rice_k_of_huge_sums_equals_the_oracle():
    """The compiled ``best_k`` (exact integer mean) picks what the oracle's float mean picks."""
    rng = np.random.default_rng(3)
    for v in _huge_rice_values(rng):
        want = best_rice_k(v.astype(np.uint64))[0]
        assert best_k(v, 0, v.size, v.size) == want
        padded = np.zeros(3 * v.size, np.int64)
        padded[1::3] = v  # zeros for the entries that hold none of the values
        assert best_k(padded, 1, padded.size, v.size) == want


def test_huge_rice_sums_encode_like_the_oracle():
    """A group whose step extras sum beyond 2**53: the compiled encoder alone, the oracle's bytes."""
    spec, rng = DTYPES["fp32"], np.random.default_rng(3)
    n = (1 << 21) + (1 << 19)
    base = (0xFF800000 | rng.integers(0, 1 << 23, n)).astype(np.uint32)  # -NaN payloads: one class
    new = (0x7F800000 | rng.integers(1, 1 << 23, n)).astype(np.uint32)  # +NaN payloads: steps ~2**32
    new[0] = base[0] ^ 1  # one step of one ULP: m_off = 0, so the extras are the whole steps
    pos = np.arange(n, dtype=np.int64)
    mag = np.abs(signed_steps(base, new, spec)) - 1
    assert int((mag[mag > mag.min()] - mag.min() - 1).sum()) >= 1 << 53
    _check(spec, base, pos, new)


def test_folded_steps_equal_the_oracle():
    """The steps the delta statistics count (``nemo_dcr.codec.stats``), special values included."""
    rng = np.random.default_rng(4)
    for spec in DTYPES.values():
        old, new = (np.concatenate([sp, rng.integers(0, 1 << spec.bits, 5000, dtype=np.uint64).astype(spec.uint)])
                    for sp in (_special(spec), _special(spec)[::-1]))
        old, new = old[old != new], new[old != new]
        assert np.array_equal(fold_steps(old, new, spec.bits), oracle_fold_steps(old, new, spec))


# ------------------------------------------------------------------------------------------ index
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_index_ranks_select_and_updates_match_references(dtype):
    spec, rng = DTYPES[dtype], np.random.default_rng(11)
    for n in SIZES:
        bits = _realistic(rng, spec, n) if n % 2 else rng.integers(0, 1 << spec.bits, n).astype(spec.uint)
        ix = DcrIndex.build(bits, spec)
        for density in (0.002, 0.3):  # shifted moves, then re-sorted blocks
            pos = np.sort(rng.choice(n, max(1, int(n * density)), replace=False)).astype(np.int64)
            hist, s = encoder_sorted_pos_np(bits, pos, spec)
            assert np.array_equal(ix.hist, hist) and np.array_equal(ix.ranks(pos, bits[pos]), s)
            assert np.array_equal(DecoderIndexNp(bits, spec).select(s), pos)
            new = bits.copy()
            new[pos] = rng.integers(0, 1 << spec.bits, pos.size).astype(spec.uint)
            ix.update(pos, bits[pos], new[pos])
            fresh = DcrIndex.build(new, spec)
            assert all(np.array_equal(a, b) for a, b in zip(ix.tables(), fresh.tables()))
            assert ix.checksum == fresh.checksum
            bits = new


@pytest.mark.parametrize("hint", ["found", "none", "stale", "garbage"])
def test_index_update_takes_found_entries_as_checked_hints(hint):
    """The entries :meth:`DcrIndex.ranks` found speed the next update; a stale or garbage one
    costs a search, never a wrong index, and a wrong old class is still refused."""
    spec, rng = DTYPES["bf16"], np.random.default_rng(23)
    n = 5 * 4096 + 77
    bits = _realistic(rng, spec, n)
    for density in (0.0003, 0.01, 0.3):  # shifted moves, then re-sorted blocks
        ix = DcrIndex.build(bits, spec)
        pos = np.sort(rng.choice(n, max(2, int(n * density)), replace=False)).astype(np.int64)
        ix.ranks(pos, bits[pos])
        local = pos & 4095
        assert np.array_equal(ix.order[(pos >> 12 << 12) + ix.found], local)  # where each one sits
        if hint == "none":
            ix.found = ix.found[:0]
        elif hint == "stale":  # the entries of another change set of the same size
            other = np.sort(rng.choice(n, pos.size, replace=False)).astype(np.int64)
            ix.ranks(other, bits[other])
        elif hint == "garbage":
            ix.found = rng.integers(0, 1 << 16, pos.size).astype(np.uint16)
        new = bits.copy()
        new[pos] = rng.integers(0, 1 << spec.bits, pos.size).astype(spec.uint)
        ix.update(pos, bits[pos], new[pos])
        assert ix.found.size == 0  # dropped by the update
        fresh = DcrIndex.build(new, spec)
        assert all(np.array_equal(a, b) for a, b in zip(ix.tables(), fresh.tables()))
        wrong = DcrIndex.build(bits, spec)
        wrong.ranks(pos, bits[pos])
        with pytest.raises(StaleIndexError):  # the hints name the entries, the old classes are wrong
            wrong.update(pos, new[pos], bits[pos])
        bits = new


def test_index_update_of_an_optimizer_step_matches_a_fresh_build():
    """A step as Adam makes it (a few ULPs at 1-5% of the elements): a few class moves per block
    with long unchanged stretches between them, which a block rewrite copies as slices."""
    rng = np.random.default_rng(5)
    for dtype in ("bf16", "fp32"):
        spec = DTYPES[dtype]
        bits = _realistic(rng, spec, 9 * 4096 + 301)
        ix = DcrIndex.build(bits, spec)
        for density in (0.01, 0.05, 0.05):
            pos = np.sort(rng.choice(bits.size, int(bits.size * density), replace=False)).astype(np.int64)
            ix.ranks(pos, bits[pos])
            new = bits.copy()
            new[pos] = (bits[pos].astype(np.int64) + rng.choice([-2, -1, 1, 2], pos.size) *
                        (1 << max(0, spec.bits - 16))).astype(spec.uint)
            moved = ix.update(pos, bits[pos], new[pos])
            assert moved == int(np.count_nonzero((bits[pos] >> spec.exp_shift) != (new[pos] >> spec.exp_shift)))
            fresh = DcrIndex.build(new, spec)
            assert all(np.array_equal(a, b) for a, b in zip(ix.tables(), fresh.tables()))
            bits = new


def test_index_memory_per_element():
    spec = DTYPES["bf16"]
    ix = DcrIndex.build(np.zeros(1 << 22, np.uint16), spec)
    assert ix.nbytes / ix.n < 2.3


def test_wrong_update_invalidates_the_index_and_indexes_rebuild():
    spec, rng = DTYPES["bf16"], np.random.default_rng(5)
    bits = _realistic(rng, spec, 10_000)
    ix = DcrIndex.build(bits, spec)
    pos = np.array([10, 20], np.int64)
    wrong_old = bits[pos] ^ np.array(1 << 10, np.uint16)  # another class than the index holds
    with pytest.raises(StaleIndexError):
        ix.update(pos, wrong_old, bits[pos])
    assert ix.checksum is None
    with pytest.raises(StaleIndexError):
        ix.update(pos, bits[pos], bits[pos])
    with pytest.raises(StaleIndexError):
        ix.ranks(pos[::-1], bits[pos[::-1]])  # positions must increase
    kept = DcrIndexes()
    first = kept.get("w", bits, spec, 123)
    assert kept.get("w", bits, spec, 123) is first and kept.builds == 1
    assert kept.get("w", bits, spec, 124) is not first and kept.builds == 2  # other bits: rebuilt


# ------------------------------------------------------------------------------------------ refusals
def _mutants(body: bytes, rng, count: int):
    for _ in range(count):
        b = bytearray(body)
        kind = rng.integers(0, 4)
        if kind == 0:
            i = rng.integers(0, len(b))
            b[i] ^= 1 << rng.integers(0, 8)
        elif kind == 1:
            b[rng.integers(0, len(b))] = rng.integers(0, 256)
        elif kind == 2:
            del b[rng.integers(0, len(b)) :]
        else:
            b.insert(rng.integers(0, len(b) + 1), rng.integers(0, 256))
        yield bytes(b)


def _outcome(fn):
    try:
        return fn()
    except MalformedRecordError as e:
        return str(e)


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "fp32"])
def test_mutated_bodies_compiled_agrees_with_numpy(dtype):
    spec, rng = DTYPES[dtype], np.random.default_rng(13)
    base, pos, new = _case(rng, spec, 3000, 0.05, "wide")
    body = encode_dcr_np(base, pos, new, spec)
    ix = DcrIndex.build(base, spec)
    refused = 0
    for m in _mutants(body, rng, 400):
        want = _outcome(lambda: decode_dcr_np(m, base, spec, "t"))
        for got in (_outcome(lambda: decode_dcr(m, base, spec, "t")), _outcome(lambda: decode_dcr(m, base, spec, "t", ix))):
            if isinstance(want, str):  # refused alike, the compiled coder naming the rule from its own table
                assert isinstance(got, str) and any(got.endswith(rule) for rule in ERR[1:]), got
            else:
                assert not isinstance(got, str) and all(np.array_equal(a, b) for a, b in zip(got, want))
        refused += isinstance(want, str)
    assert 100 < refused < 400  # both kinds of outcome were exercised


def test_per_group_decoder_agrees_on_a_compiled_body():
    spec, rng = DTYPES["fp16"], np.random.default_rng(17)
    base, pos, new = _case(rng, spec, 4000, 0.1, "ulp")
    p, v = decode_dcr_per_group(encode_dcr(base, pos, new, spec), base, spec, "t")
    assert np.array_equal(p, pos) and np.array_equal(v, new)


# ------------------------------------------------------------------------------------------ real steps
def test_real_steps_bytes_and_kept_index(real_checkpoints):
    from nemo_dcr.checkpoint import load_checkpoint
    from nemo_dcr.types import bits_view, spec_of

    steps = [load_checkpoint(d) for d in real_checkpoints]
    kept: dict[str, DcrIndex] = {}
    changed = 0
    for a, b in zip(steps, steps[1:]):
        for name in a:
            spec = spec_of(a[name].dtype)
            old, cur = bits_view(a[name].contiguous()), bits_view(b[name].contiguous())
            pos = np.flatnonzero(old != cur).astype(np.int64)
            ix = kept.setdefault(name, DcrIndex.build(old, spec))
            if pos.size:
                _check(spec, old, pos, cur[pos], ix)
                ix.update(pos, old[pos], cur[pos])
                changed += pos.size
            assert all(np.array_equal(x, y) for x, y in zip(ix.tables(), DcrIndex.build(cur, spec).tables()))
    assert changed > 100_000


@pytest.mark.parametrize("members", [[0, 1, 2, 3, 4, 5], [0, 2, 4, 5, 6, 7], [1, 3, 5, 6, 7, 8], [0, 1, 2]])
def test_bitmap_set_reads_members_and_writes_only_its_slots(members):
    """A ``k = 0`` coded set read as membership bits (the decoder's fast path): the members come out
    sorted, the next Q bit is the one after the last coded element, and nothing is written past the
    set's ``cnt`` slots, whichever side is coded (the members, or the elements not in the set)."""
    uni, cnt = 9, len(members)
    side = 2 * cnt <= uni
    coded = [x for x in range(uni) if (x in members) == side]
    bits = [int((x in members) == side) for x in range(coded[-1] + 1)]
    data = np.zeros(16, np.uint8)  # padded: the reader loads 8 bytes at any byte of the stream
    for i, b in enumerate(bits):
        data[i >> 3] |= b << (7 - (i & 7))
    out = np.full(cnt + 4, -7, np.int64)
    nxt = _bitmap_set(data, 0, len(bits), cnt, uni, side, out, 1)
    assert nxt == len(bits)
    assert out[1 : 1 + cnt].tolist() == members
    assert out[0] == -7 and out[1 + cnt :].tolist() == [-7] * 3
