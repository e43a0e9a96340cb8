"""The fuzz targets' oracles: valid seeds are accepted, and a decoder that silently changes a
result (simulated by patching the code under test) is caught by the independent reader."""

from __future__ import annotations

import dataclasses

import pytest

from tests.fuzz import targets


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_seeds_are_handled(name):
    run, seeds = targets.TARGETS[name]
    outcomes = [run(s) for s in seeds()]
    assert outcomes.count("accepted") >= 3 and set(outcomes) <= {"accepted", "refused"}


def test_a_decoder_writing_a_wrong_bit_is_caught(monkeypatch):
    real = targets.codec.apply

    def wrong(receiver, payload, key=None):
        out = real(receiver, payload, key)
        receiver["w.fp32"].view(-1)[3] += 1.0
        return out

    monkeypatch.setattr(targets.codec, "apply", wrong)
    with pytest.raises(targets.SilentChange):
        targets.run_payload(targets.payload_seeds()[0])


def test_a_refusal_that_wrote_is_caught(monkeypatch):
    def half(receiver, payload, key=None):
        receiver["w.bf16"].view(-1)[0] = 1.0
        raise targets.DeltaFormatError("refused after writing")

    monkeypatch.setattr(targets.codec, "apply", half)
    with pytest.raises(targets.SilentChange, match="wrote"):
        targets.run_payload(targets.payload_seeds()[0])


def test_a_header_parser_dropping_a_record_is_caught(monkeypatch):
    real = targets.codec_header.parse_header
    monkeypatch.setattr(targets.codec_header, "parse_header",
                        lambda comp, n: dataclasses.replace(real(comp, n), records=real(comp, n).records[1:]))
    with pytest.raises(targets.SilentChange):
        targets.run_header(targets.header_seeds()[0])


def test_an_envelope_delivered_altered_is_caught(monkeypatch):
    real = targets.Envelope.from_bytes
    monkeypatch.setattr(targets.Envelope, "from_bytes",
                        classmethod(lambda cls, data: dataclasses.replace(real(data), version=99)))
    with pytest.raises(targets.SilentChange):
        targets.run_envelope(targets.envelope_seeds()[0])
