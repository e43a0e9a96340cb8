"""Cost bounds of decoding (docs/wire_format.md rule 3 and section 6).

* Header: a receiver refuses, before decompressing it, a header larger than the tensors it holds
  can justify (``header_limit``); every header a conforming encoder writes for those tensors fits.
* ``model`` and ``run`` are at most 256 characters (they are free text the receiver cannot bound).
* Memory: ``reference`` decode and a transactional apply need at most a small constant number of
  bytes per changed element (measured in a fresh process by ``benchmarks/memory.py``: peak RSS
  over the RSS before); the ``dcr`` decoder's figure is measured the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zstandard

from nemo_dcr import codec
from nemo_dcr.codec import header as hdr
from nemo_dcr.codec.errors import HeaderTooLargeError, MalformedHeaderError

ROOT = Path(__file__).resolve().parents[2]
DECODE_BYTES_PER_CHANGE = 16
"""Bound of ``reference`` decode: output 12 B (int64 position, new and old bits) + transients."""
DCR_DECODE_BYTES_PER_CHANGE = 28
"""Bound of ``dcr`` decode: the output 12 B + the parse (int64 rank and value, int16 class and
exponent reference per change) or the rebuild (int64 position and value, new and old bits)."""
APPLY_BYTES_PER_CHANGE = 20
"""Bound of ``TensorEngine.apply``: decode + 2 B of undo log + a read-back for verification."""
SLACK = 32 << 20
"""Constant allowance: decompression pieces, interpreter and allocator noise."""


def _tiny_same_records(n: int) -> bytes:
    """An unauthenticated payload of ``n`` tiny ``same`` records (a small, highly compressible header)."""
    crc = hashlib.blake2b(b"", digest_size=8).hexdigest()
    rec = {"dtype": "bf16", "shape": [1], "numel": 1, "encoding": "same", "changed": 0, "length": 0, "crc": crc,
           "base_checksum": "0" * 16, "target_checksum": "0" * 16, "params": {}}
    obj = {"format": hdr.FORMAT_NAME, "model": "", "run": "", "base_version": 0, "target_version": 1,
           "base_checksum": "0" * 16, "encodings": ["same"], "records": [dict(rec, name=f"t{i}") for i in range(n)]}
    raw = json.dumps(obj, separators=(",", ":")).encode()
    comp = zstandard.ZstdCompressor(level=19).compress(raw)
    return hdr.PREAMBLE.pack(hdr.MAGIC, hdr.FORMAT_VERSION, 0, len(comp), len(raw)) + comp


def test_receiver_refuses_a_header_its_tensors_cannot_justify_before_decompressing(monkeypatch):
    payload = _tiny_same_records(20_000)
    assert len(payload) < 50_000
    receiver = {"w": torch.zeros(4, dtype=torch.bfloat16)}

    def no_decompression(*args, **kwargs):
        raise AssertionError("the header was decompressed")

    monkeypatch.setattr(hdr, "decompress_exact", no_decompression)
    with pytest.raises(HeaderTooLargeError, match="1 tensors"):
        codec.decode(payload, receiver)
    with pytest.raises(HeaderTooLargeError):
        codec.apply(receiver, payload)


def test_resync_refuses_an_oversized_header_before_decompressing(monkeypatch):
    from nemo_dcr.apply import TensorEngine, apply_version

    engine = TensorEngine({"w": torch.zeros(4, dtype=torch.bfloat16)})
    monkeypatch.setattr(hdr, "decompress_exact", lambda *a, **k: pytest.fail("decompressed"))
    with pytest.raises(HeaderTooLargeError):
        apply_version(engine, {0: [_tiny_same_records(20_000)]}, resync=True)


def _tensors(names, shape=(3, 5)):
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n in names}


@pytest.mark.parametrize("encoding", ["reference", "dcr", "raw"])
def test_every_encoder_header_fits_the_receivers_limit(encoding):
    names = ["a" * 2000, "\U0001F600" * 300 + ".w", "\x01\"\\" * 100, "b", "model.layers.0.mlp.weight"]
    base = _tensors(names, shape=(1, 1, 1, 1, 1, 2, 3, 2))
    target = {n: (t.float() * 1.5 + 0.01).to(torch.bfloat16) for n, t in base.items()}
    ident = codec.Identity(model="m" * 256, run="\u00e9" * 256, base_version=2**62, target_version=2**63 - 1)
    payload = codec.encode(base, target, ident, encoding)
    _, _, raw_len = hdr.read_preamble(payload)
    assert raw_len <= codec.header_limit(base)
    copy = {n: t.clone() for n, t in base.items()}
    codec.apply(copy, payload)
    assert all(torch.equal(copy[n].view(torch.int16), target[n].view(torch.int16)) for n in names)


def test_the_limit_grows_with_what_the_receiver_holds():
    small = codec.header_limit({"w": None})
    assert codec.header_limit({"w": None, "v": None}) > small
    assert codec.header_limit({"w" * 100: None}) > small
    assert small < 64 << 10


@pytest.mark.parametrize("field", ["model", "run"])
def test_model_and_run_are_at_most_256_characters(field):
    base = _tensors(["w"])
    with pytest.raises(ValueError, match=field):
        codec.encode(base, base, codec.Identity(**{field: "x" * 257}))
    payload = codec.encode(base, base, codec.Identity(**{field: "x" * 256}))
    flags, h_len, h_raw = hdr.read_preamble(payload)
    obj = json.loads(zstandard.ZstdDecompressor().decompress(payload[24:24 + h_len]))
    obj[field] = "x" * 257
    raw = json.dumps(obj, separators=(",", ":")).encode()
    comp = zstandard.ZstdCompressor().compress(raw)
    bad = hdr.PREAMBLE.pack(hdr.MAGIC, 1, flags, len(comp), len(raw)) + comp + payload[24 + h_len:]
    with pytest.raises(MalformedHeaderError, match=field):
        codec.inspect(bad)


def _memory(kinds: str, numel: int) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--numel", str(numel),
                          "--only", kinds], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln.split(": ", 1) for ln in out.stdout.splitlines() if ": {" in ln and not ln.startswith("{")]
    return {k: json.loads(v) for k, v in lines}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc")
def test_reference_decode_and_apply_memory_is_a_small_constant_per_changed_element():
    numel = 8_000_000
    r = _memory("decode-reference,apply-reference", numel)
    assert r["decode-reference"]["peak_extra_bytes"] <= DECODE_BYTES_PER_CHANGE * numel + SLACK, r
    assert r["apply-reference"]["peak_extra_bytes"] <= APPLY_BYTES_PER_CHANGE * numel + SLACK, r


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc")
def test_dcr_decode_memory_is_a_small_constant_per_changed_element():
    numel = 8_000_000
    r = _memory("decode-dcr", numel)
    assert r["decode-dcr"]["peak_extra_bytes"] <= DCR_DECODE_BYTES_PER_CHANGE * numel + SLACK, r


def test_cli_apply_bounds_the_header_by_its_base(tmp_path, monkeypatch, capsys):
    from nemo_dcr.checkpoint import save_checkpoint
    from nemo_dcr.tools.cli import main

    save_checkpoint({"w": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "base.safetensors")
    (tmp_path / "d.ndcr").write_bytes(_tiny_same_records(20_000))
    monkeypatch.setattr(hdr, "decompress_exact", lambda *a, **k: pytest.fail("decompressed"))
    assert main(["apply", str(tmp_path / "base.safetensors"), str(tmp_path / "d.ndcr"), "-o", str(tmp_path / "o")]) == 2
    assert "HeaderTooLargeError" in capsys.readouterr().err and not (tmp_path / "o").exists()
