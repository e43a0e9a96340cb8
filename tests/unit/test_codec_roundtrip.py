"""Round-trip properties of the delta codec (docs/wire_format.md).

Every check compares integer views of tensors against an independent reference (the target
tensors themselves and a diff computed here with numpy), never against what the codec reports.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from nemo_dcr.codec import apply, decode, diff_tensors, encode, encode_deltas, inspect
from nemo_dcr.codec.errors import AuthenticationError, BaseChecksumMismatchError
from nemo_dcr.codec.payload import Identity
from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.checksum import tensor_checksum

# name -> (torch dtype, bits per element, exponent shift, exponent bits), from the spec (4.4)
DT = {
    "bf16": (torch.bfloat16, 16, 7, 8),
    "fp16": (torch.float16, 16, 10, 5),
    "fp32": (torch.float32, 32, 23, 8),
    "fp8_e4m3": (torch.float8_e4m3fn, 8, 3, 4),
    "fp8_e5m2": (torch.float8_e5m2, 8, 2, 5),
}
UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32}
TORCH_INT = {8: torch.uint8, 16: torch.int16, 32: torch.int32}
SIGNED = {8: np.uint8, 16: np.int16, 32: np.int32}
ENCODINGS = ("dcr", "reference", "raw")
PREAMBLE = struct.Struct("<4sHHQQ")

SETTINGS = settings(max_examples=45, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------- helpers


def ibits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer copy of a tensor's bits (independent of the codec's helpers)."""
    nbits = t.element_size() * 8
    return t.detach().contiguous().reshape(-1).view(TORCH_INT[nbits]).numpy().view(UINT[nbits]).copy()


def from_bits(arr: np.ndarray, dtype: str, shape) -> torch.Tensor:
    tdt, nbits, _, _ = DT[dtype]
    flat = np.ascontiguousarray(arr.reshape(-1), dtype=UINT[nbits]).view(SIGNED[nbits]).copy()
    return torch.from_numpy(flat).view(tdt).reshape(tuple(shape))


def special_bits(dtype: str) -> list[int]:
    """Zeros of both signs, smallest/largest subnormal, smallest normal, largest finite,
    infinities, NaNs with several payloads, of both signs (for every dtype, as raw bits)."""
    _, nbits, shift, ebits = DT[dtype]
    sign = 1 << (nbits - 1)
    mant = (1 << shift) - 1
    exp_all = ((1 << ebits) - 1) << shift
    pos = [0, 1, mant, 1 << shift, exp_all - 1, exp_all, exp_all | 1, exp_all | (1 << (shift - 1)),
           exp_all | mant, exp_all | (mant - 1), (exp_all >> 1) & exp_all]
    return sorted({v for p in pos for v in (p, p | sign)})


def clone_all(ts: dict) -> dict:
    return {k: v.clone() for k, v in ts.items()}


def expected_touched(base: dict, target: dict) -> dict:
    out = {}
    for k in base:
        n = int(np.count_nonzero(ibits(base[k]) != ibits(target[k])))
        if n:
            out[k] = n
    return out


def assert_bits_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and tuple(got[k].shape) == tuple(want[k].shape), k
        g, w = ibits(got[k]), ibits(want[k])
        if not np.array_equal(g, w):
            bad = np.flatnonzero(g != w)
            raise AssertionError(f"{k}: {bad.size} elements differ, first at {bad[:5]}: "
                                 f"got {g[bad[:5]]} want {w[bad[:5]]}")


def mutate(base: np.ndarray, mask: np.ndarray, kind: np.ndarray, step: np.ndarray, rnd: np.ndarray,
           specials: list[int], nbits: int) -> np.ndarray:
    """New bits: at ``mask``, a small ULP step (+/- 1..4, wrapping), an arbitrary bit flip, or a
    special value; every masked element is guaranteed to change."""
    mod = 1 << nbits
    b = base.astype(np.int64)
    sp = np.array(specials, dtype=np.int64)
    new = np.where(kind == 0, (b + step) % mod,
          np.where(kind == 1, (b - step) % mod,
          np.where(kind == 2, b ^ np.where(rnd == 0, 1, rnd.astype(np.int64)),
                   sp[rnd.astype(np.int64) % sp.size])))
    new = np.where(mask, new, b)
    same = mask & (new == b)
    new = np.where(same, b ^ (1 << (nbits - 1)), new)  # e.g. a special equal to old: flip the sign
    return new.astype(UINT[nbits])


# ----------------------------------------------------------------------------- strategies

shapes = st.one_of(
    st.just(()),
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5),
    st.tuples(st.sampled_from([0, 1, 2, 3, 7, 64, 129, 300])),
)


@st.composite
def tensor_pairs(draw, dtype=None):
    """(dtype, base bits, target bits, shape): any bit pattern, any density incl. 0 and 100%."""
    dtype = dtype or draw(st.sampled_from(sorted(DT)))
    _, nbits, _, _ = DT[dtype]
    shape = draw(shapes)
    n = int(np.prod(shape)) if shape else 1
    specials = special_bits(dtype)
    elems = st.one_of(st.sampled_from(specials), st.integers(0, (1 << nbits) - 1))
    base = draw(hnp.arrays(UINT[nbits], n, elements=elems))
    mode = draw(st.sampled_from(["none", "all", "random", "sparse"]))
    if mode == "none":
        mask = np.zeros(n, bool)
    elif mode == "all":
        mask = np.ones(n, bool)
    elif mode == "random":
        mask = draw(hnp.arrays(np.bool_, n))
    else:
        idx = draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=3)) if n else []
        mask = np.zeros(n, bool)
        mask[idx] = True
    kind = draw(hnp.arrays(np.int64, n, elements=st.integers(0, 3)))
    step = draw(hnp.arrays(np.int64, n, elements=st.integers(1, 4)))
    rnd = draw(hnp.arrays(UINT[nbits], n))
    target = mutate(base, mask, kind, step, rnd, specials, nbits)
    return dtype, base, target, shape


@st.composite
def tensor_sets(draw, dtype=None, max_tensors=3):
    pairs = draw(st.lists(tensor_pairs(dtype), min_size=1, max_size=max_tensors))
    names = draw(st.lists(st.text("abcxyz._0123456789", min_size=1, max_size=12), min_size=len(pairs),
                          max_size=len(pairs), unique=True))
    base = {nm: from_bits(b, d, s) for nm, (d, b, _, s) in zip(names, pairs)}
    target = {nm: from_bits(t, d, s) for nm, (d, _, t, s) in zip(names, pairs)}
    return base, target


# ----------------------------------------------------------------------------- properties


def check_roundtrip(base: dict, target: dict, encoding: str, key: bytes | None = None,
                    identity: Identity = Identity()) -> bytes:
    base_snapshot = {k: ibits(v) for k, v in base.items()}
    target_snapshot = {k: ibits(v) for k, v in target.items()}
    payload = encode(base, target, identity, encoding=encoding, key=key)
    # the encoder must not touch its inputs
    for k in base:
        assert np.array_equal(ibits(base[k]), base_snapshot[k])
        assert np.array_equal(ibits(target[k]), target_snapshot[k])

    # decode: validates, reports exactly the changed elements, writes nothing
    receiver = clone_all(base)
    dec = decode(payload, receiver, key=key)
    for k in base:
        assert np.array_equal(ibits(receiver[k]), base_snapshot[k]), f"decode modified {k}"
    by_name = {d.name: d for d in dec.deltas}
    assert set(by_name) == set(base)
    for k in base:
        want_pos = np.flatnonzero(base_snapshot[k] != target_snapshot[k])
        d = by_name[k]
        assert np.array_equal(np.asarray(d.positions, dtype=np.int64), want_pos), k
        assert np.array_equal(np.asarray(d.new_bits), target_snapshot[k][want_pos]), k
        assert np.array_equal(np.asarray(d.old_bits), base_snapshot[k][want_pos]), k

    # apply: bit-identical to the target, with the right counts
    touched = apply(receiver, payload, key=key)
    assert touched == expected_touched(base, target)
    assert_bits_equal(receiver, target)

    # sizes: preamble lengths add up and no record is larger than its dense tensor
    magic, version, flags, h_len, h_raw = PREAMBLE.unpack_from(payload)
    assert (magic, version, flags) == (b"NDCR", 1, 1 if key is not None else 0)
    header = inspect(payload, key=key)
    lengths = {r.name: r for r in header.records}
    assert len(payload) == PREAMBLE.size + h_len + sum(r.length for r in header.records) + (32 if key else 0)
    dense = 0
    for k, t in base.items():
        r = lengths[k]
        nbytes = t.numel() * t.element_size()
        dense += nbytes
        assert r.length <= nbytes, f"{k}: record of {r.length} bytes for a {nbytes}-byte tensor"
        assert r.changed == int(np.count_nonzero(base_snapshot[k] != target_snapshot[k]))
        if r.changed == 0:
            assert r.encoding == "same" and r.length == 0
        else:
            assert r.encoding in (encoding, "raw")
    assert len(payload) <= dense + PREAMBLE.size + h_len + (32 if key else 0)
    return payload


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dtype", sorted(DT))
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_roundtrip_each_dtype_and_encoding(dtype, encoding, data):
    base, target = data.draw(tensor_sets(dtype=dtype, max_tensors=2))
    check_roundtrip(base, target, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
@SETTINGS
@given(tensors=tensor_sets())
def test_roundtrip_mixed_dtypes(encoding, tensors):
    base, target = tensors
    check_roundtrip(base, target, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tensors=tensor_sets(max_tensors=2), key=st.binary(min_size=16, max_size=64),
       other=st.binary(min_size=16, max_size=64))
def test_roundtrip_with_hmac_key(encoding, tensors, key, other):
    assume(other != key)
    base, target = tensors
    payload = check_roundtrip(base, target, encoding, key=key,
                              identity=Identity("model/x", "run-7", 3, 4))
    assert inspect(payload, key=key).base_version == 3
    receiver = clone_all(base)
    for bad_key in (other, None):
        with pytest.raises(AuthenticationError):
            apply(receiver, payload, key=bad_key)
        assert_bits_equal(receiver, base)


@st.composite
def realistic_pairs(draw):
    """Weight-like tensors (few exponents) of 1000-3000 elements with a sparse, mostly-ULP change set,
    so the sparse encodings (not the raw fallback) are what gets exercised. Returns (base, target,
    sparse_expected)."""
    dtype = draw(st.sampled_from(sorted(DT)))
    tdt, nbits, _, _ = DT[dtype]
    n = draw(st.integers(1000, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-3, 0.02, 1.0, 300.0]))
    base_bits = ibits((torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * scale).to(tdt))
    sp = special_bits(dtype)
    n_special = draw(st.integers(0, 8))
    if n_special:
        base_bits[rng.choice(n, n_special, replace=False)] = rng.choice(np.array(sp, UINT[nbits]), n_special)
    density = draw(st.sampled_from([0.0005, 0.002, 0.01, 0.02, 0.1, 0.4, 0.6, 0.9]))
    ulp_only = draw(st.booleans())
    mask = rng.random(n) < density
    mask[rng.integers(n)] = True
    kind = rng.integers(0, 2, n) if ulp_only else rng.integers(0, 4, n)
    target_bits = mutate(base_bits, mask, kind, rng.integers(1, 3, n), rng.integers(0, 1 << nbits, n), sp, nbits)
    shape = (n,) if n % 10 else (10, n // 10)
    return ({"w": from_bits(base_bits, dtype, shape)}, {"w": from_bits(target_bits, dtype, shape)},
            ulp_only and density <= 0.02)


@pytest.mark.parametrize("encoding", ["dcr", "reference"])
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=realistic_pairs())
def test_roundtrip_realistic_sparse(encoding, case):
    base, target, sparse_expected = case
    payload = check_roundtrip(base, target, encoding)
    (rec,) = inspect(payload).records
    if sparse_expected:
        assert rec.encoding == encoding, (rec.encoding, rec.length, rec.changed)


# seeded numpy tensors large enough that dcr (not the raw fallback) is chosen, across densities
# on both sides of 50% so the complement position coding is exercised too
@pytest.mark.parametrize("dtype", sorted(DT))
@pytest.mark.parametrize("density", [0.0005, 0.01, 0.2, 0.5, 0.7, 0.95])
@pytest.mark.parametrize("encoding", ["dcr", "reference"])
def test_sparse_encodings_are_used_and_exact(dtype, density, encoding):
    _, nbits, shift, _ = DT[dtype]
    seed = zlib.crc32(f"{dtype}/{density}/{encoding}".encode())
    rng = np.random.default_rng(seed)
    n = 4000
    # a realistic weight distribution (few exponents) plus some special values sprinkled in
    w = torch.randn(n, dtype=torch.float32, generator=torch.Generator().manual_seed(seed)) * 0.02
    base_bits = ibits(w.to(DT[dtype][0]))
    sp = np.array(special_bits(dtype), dtype=UINT[nbits])
    base_bits[rng.choice(n, 20, replace=False)] = rng.choice(sp, 20)
    mask = rng.random(n) < density
    if not mask.any():
        mask[rng.integers(n)] = True
    kind = np.where(rng.random(n) < 0.97, rng.integers(0, 2, n), rng.integers(2, 4, n))
    target_bits = mutate(base_bits, mask, kind, rng.integers(1, 3, n), rng.integers(0, 1 << nbits, n),
                         list(sp), nbits)
    base = {"w": from_bits(base_bits, dtype, (40, 100))}
    target = {"w": from_bits(target_bits, dtype, (40, 100))}
    payload = check_roundtrip(base, target, encoding)
    (rec,) = inspect(payload).records
    if encoding == "dcr" or density <= 0.2:
        # mostly +/-1..2 ULP steps: the sparse coding must beat the dense tensor
        assert rec.encoding == encoding, (rec.encoding, rec.length, n * nbits // 8)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dtype", sorted(DT))
def test_every_special_value_to_every_other(dtype, encoding):
    """Each special bit pattern changed into every other one (NaN payloads, -0/+0, +-Inf...)."""
    _, nbits, _, _ = DT[dtype]
    sp = special_bits(dtype)
    pairs = [(a, b) for a in sp for b in sp if a != b]
    base_bits = np.array([a for a, _ in pairs] + sp, dtype=UINT[nbits])
    target_bits = np.array([b for _, b in pairs] + sp, dtype=UINT[nbits])
    base = {"s": from_bits(base_bits, dtype, (base_bits.size,))}
    target = {"s": from_bits(target_bits, dtype, (base_bits.size,))}
    check_roundtrip(base, target, encoding)
    # -0.0 -> +0.0 alone, and NaN payload -> other NaN payload alone, in a bigger tensor
    zeros = np.zeros(256, UINT[nbits])
    zeros[::2] = 1 << (nbits - 1)
    t = zeros.copy()
    t[10] = 0
    check_roundtrip({"z": from_bits(zeros, dtype, (256,))}, {"z": from_bits(t, dtype, (256,))}, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_degenerate_shapes(encoding):
    """0-d, empty, 1-element tensors, changed and unchanged, in one payload."""
    base = {
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "scalar_same": torch.tensor(-0.0, dtype=torch.float32),
        "empty": torch.zeros(0, dtype=torch.float16),
        "empty2d": torch.zeros(3, 0, dtype=torch.float8_e4m3fn),
        "one": torch.tensor([float("nan")], dtype=torch.float32),
    }
    target = clone_all(base)
    target["scalar"] = torch.tensor(-1.5, dtype=torch.bfloat16)
    target["one"] = from_bits(np.array([0xFFC00001], np.uint32), "fp32", (1,))
    payload = check_roundtrip(base, target, encoding)
    recs = {r.name: r for r in inspect(payload).records}
    assert recs["scalar"].shape == () and recs["scalar"].numel == 1
    assert recs["empty2d"].shape == (3, 0) and recs["empty2d"].encoding == "same"


def test_identical_tensors_give_same_records_only():
    base = {"a": torch.randn(5, 7), "b": torch.randn(3).to(torch.bfloat16)}
    for encoding in ENCODINGS:
        payload = encode(base, clone_all(base), encoding=encoding)
        assert {r.encoding for r in inspect(payload).records} == {"same"}
        receiver = clone_all(base)
        assert apply(receiver, payload) == {}
        assert_bits_equal(receiver, base)


# ----------------------------------------------------------------------------- encode_deltas


def own_deltas(base: dict, target: dict) -> list[SparseDelta]:
    out = []
    for k, b in base.items():
        bb, tb = ibits(b), ibits(target[k])
        pos = np.flatnonzero(bb != tb).astype(np.int64)
        name = next(n for n, v in DT.items() if v[0] == b.dtype)
        out.append(SparseDelta(k, name, tuple(b.shape), pos, tb[pos], bb[pos]))
    return out


@pytest.mark.parametrize("encoding", ENCODINGS)
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tensors=tensor_sets())
def test_encode_deltas_with_precomputed_checksums(encoding, tensors):
    base, target = tensors
    deltas = own_deltas(base, target)
    bits = {k: ibits(v) for k, v in base.items()}
    checksums = {k: tensor_checksum(v) for k, v in bits.items()}
    ident = Identity("m", "r", 5, 9)
    with_ck = encode_deltas(deltas, bits, ident, encoding, base_checksums=checksums)
    without = encode_deltas(deltas, bits, ident, encoding)
    partial = encode_deltas(deltas, bits, ident, encoding, base_checksums=dict(list(checksums.items())[:1]))
    assert with_ck == without == partial == encode(base, target, ident, encoding)
    receiver = clone_all(base)
    assert apply(receiver, with_ck, base_checksums=checksums) == expected_touched(base, target)
    assert_bits_equal(receiver, target)

    # the precomputed checksums are really used: a wrong one is refused by the receiver
    first = next(iter(base))
    wrong = dict(checksums, **{first: (checksums[first] + 1) % 2**64})
    bad = encode_deltas(deltas, bits, ident, encoding, base_checksums=wrong)
    receiver = clone_all(base)
    with pytest.raises(BaseChecksumMismatchError):
        apply(receiver, bad)
    assert_bits_equal(receiver, base)
    # and so is a receiver's (wrong) cached checksum
    with pytest.raises(BaseChecksumMismatchError):
        apply(receiver, with_ck, base_checksums=wrong)
    assert_bits_equal(receiver, base)


def test_diff_tensors_matches_numpy():
    g = torch.Generator().manual_seed(1)
    base = {"a": torch.randn(17, 3, generator=g).to(torch.bfloat16), "b": torch.randn(9, generator=g)}
    target = clone_all(base)
    target["a"].view(torch.int16)[0, 0] ^= 1
    target["a"].view(torch.int16)[16, 2] ^= -32768  # sign flip
    for d in diff_tensors(base, target):
        want = np.flatnonzero(ibits(base[d.name]) != ibits(target[d.name]))
        assert np.array_equal(d.positions, want)
        assert np.array_equal(d.new_bits, ibits(target[d.name])[want])
    assert [d.nnz for d in diff_tensors(base, target)] == [2, 0]
