"""``nemo-dcr diff | encode | apply | inspect`` on safetensors checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from nemo_dcr import codec
from nemo_dcr.checkpoint import DTYPE_NAMES, atomic_write, load_checkpoint
from nemo_dcr.checkpoint_rewrite import rewrite_checkpoint
from nemo_dcr.codec.auth import read_key_file
from nemo_dcr.codec.stats import TensorStats, entropy_bits, layer_type, summarize
from nemo_dcr.types import DTYPES, bits_view, spec_of
from nemo_dcr.verify.checksum import tensor_checksum

ENCODINGS = ("dcr", "reference")


def _load(path: str):
    return load_checkpoint(path)


def _read_key(path: str | None) -> bytes | None:
    return None if path is None else read_key_file(path)


_CARRIED = {s.torch_dtype for s in DTYPES.values()}


def _split(tensors: dict) -> tuple[dict, dict]:
    """(tensors a delta carries: the float dtypes of the wire format, the others)."""
    carried = {n: t for n, t in tensors.items() if t.dtype in _CARRIED}
    return carried, {n: t for n, t in tensors.items() if n not in carried}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _float_pair(base: dict, target: dict) -> tuple[dict, dict]:
    """The tensors a delta carries; every other tensor (integer, bool, fp64, ...) must be identical
    in BASE and TARGET (a delta carries no record for it and ``apply`` copies it from BASE).

    Raises:
        ValueError: naming the first such tensor, its dtype, and how BASE and TARGET differ.
    """
    (fb, ob), (ft, ot) = _split(base), _split(target)
    for name in sorted(ob.keys() | ot.keys()):
        a, b = ob.get(name, base.get(name)), ot.get(name, target.get(name))
        if a is None or b is None or not _same(a.contiguous(), b.contiguous()):
            t = a if a is not None else b
            raise ValueError(
                f"tensor {name!r} ({DTYPE_NAMES.get(t.dtype, t.dtype)}) differs between BASE and TARGET "
                f"({_desc(a)} vs {_desc(b)}): deltas carry {', '.join(DTYPES)} tensors only; tensors of "
                f"other dtypes must be identical and are copied from BASE")
    return fb, ft


def _desc(t) -> str:
    return "absent" if t is None else f"{DTYPE_NAMES.get(t.dtype, t.dtype)}{list(t.shape)}"


def _identity(args) -> codec.Identity:
    return codec.Identity(model=args.model, run=args.run, base_version=args.base_version,
                          target_version=args.target_version)


def _add_identity(p) -> None:
    p.add_argument("--model", default="", help="model identity recorded in the header")
    p.add_argument("--run", default="", help="run identity recorded in the header")
    p.add_argument("--base-version", type=int, default=0, help="version the receiver holds (default 0)")
    p.add_argument("--target-version", type=int, default=1, help="version the delta produces (default 1)")


def register(sub) -> None:
    p = sub.add_parser("diff", help="density per tensor and layer type, bytes per encoding")
    p.add_argument("base"), p.add_argument("target")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--tensors", action="store_true", help="also list every tensor in the table")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("encode", help="write the delta that turns BASE into TARGET")
    p.add_argument("base"), p.add_argument("target")
    p.add_argument("-o", "--output", required=True, help="delta file to write")
    p.add_argument("--encoding", choices=ENCODINGS + ("raw",), default="dcr")
    p.add_argument("--key-file", help="HMAC-SHA256 key file (raw bytes, >= 16)")
    _add_identity(p)
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("apply", help="apply DELTA to BASE and write OUT (bit-identical to the target)")
    p.add_argument("base"), p.add_argument("delta")
    p.add_argument("-o", "--output", required=True,
                   help="checkpoint to write (file or folder, with BASE's files and metadata; other files in a "
                        "folder are kept, so OUT may be BASE itself)")
    p.add_argument("--key-file", help="HMAC-SHA256 key file the delta was authenticated with")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("inspect", help="print a delta's header and records")
    p.add_argument("delta")
    p.add_argument("--key-file", help="verify the MAC with this key")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)


def diff_stats(base, target) -> list[TensorStats]:
    """Per-tensor statistics of the change from ``base`` to ``target`` (both name -> tensor)."""
    deltas = codec.diff_tensors(base, target)
    bits = {n: bits_view(t.contiguous()) for n, t in base.items()}
    checksums = {n: tensor_checksum(b) for n, b in bits.items()}
    sizes = {}
    for enc in ENCODINGS:
        header = codec.inspect(codec.encode_deltas(deltas, bits, encoding=enc, base_checksums=checksums))
        for r in header.records:
            sizes.setdefault(r.name, {})[enc] = r.length
    out = []
    for d in deltas:
        spec = spec_of(d.dtype)
        alike, cond = entropy_bits(bits[d.name], d.positions, d.new_bits, spec)
        out.append(TensorStats(d.name, layer_type(d.name), d.numel, d.nnz, d.numel * spec.width,
                               alike, cond, sizes[d.name]))
    return out


def _table(summary: dict, stats: list[TensorStats], per_tensor: bool) -> str:
    head = f"{'group':<28}{'elements':>13}{'changed':>11}{'density':>9}" + "".join(
        f"{e + ' B/chg':>16}" for e in ENCODINGS) + f"{'H_alike':>9}{'H_cond':>9}"
    rows = [head]

    def line(label, s):
        bpc = s["bytes_per_changed"]
        return (f"{label:<28}{s['numel']:>13,}{s['changed']:>11,}{100 * s['density']:>8.3f}%"
                + "".join(f"{bpc.get(e, 0):>16.3f}" for e in ENCODINGS)
                + f"{s['entropy_alike_per_changed']:>9.3f}{s['entropy_cond_per_changed']:>9.3f}")

    for kind, s in summary["by_layer_type"].items():
        rows.append(line(kind, s))
    rows.append(line("TOTAL", summary["total"]))
    t = summary["total"]
    rows.append("bytes: dense {:,}".format(t["dense_bytes"]) + "".join(
        f", {e} {t['bytes'][e]:,}" + (f" ({t['dense_bytes'] / t['bytes'][e]:.0f}x smaller)" if t["bytes"][e] else "") for e in ENCODINGS))
    if per_tensor:
        rows.append("")
        rows += [f"{r.name:<60}{r.changed:>10,}/{r.numel:<12,}" + "".join(
            f"{e}={r.encoded_bytes.get(e, 0):<10,}" for e in ENCODINGS) for r in stats]
    return "\n".join(rows)


def cmd_diff(args) -> int:
    stats = diff_stats(*_float_pair(_load(args.base), _load(args.target)))
    summary = summarize(stats)
    if args.json:
        summary["tensors"] = [{"name": r.name, "layer_type": r.layer_type, "numel": r.numel,
                               "changed": r.changed, "density": r.density, "bytes": r.encoded_bytes,
                               "entropy_alike_bytes": r.entropy_alike_bits / 8,
                               "entropy_cond_bytes": r.entropy_cond_bits / 8} for r in stats]
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        print(_table(summary, stats, args.tensors))
    return 0


def cmd_encode(args) -> int:
    key = _read_key(args.key_file)
    if Path(args.output).is_dir():
        raise IsADirectoryError(21, "is a folder; encode writes one delta file", args.output)
    base, target = _float_pair(_load(args.base), _load(args.target))
    payload = codec.encode(base, target, _identity(args), args.encoding, key)
    atomic_write({Path(args.output): lambda f: f.write(payload)})
    header = codec.inspect(payload, key)
    changed = sum(r.changed for r in header.records)
    print(f"wrote {args.output}: {len(payload):,} bytes, {len(header.records)} tensors, "
          f"{changed:,} changed elements ({len(payload) / max(changed, 1):.3f} B per change)")
    return 0


def cmd_apply(args) -> int:
    """Apply a delta; writes only OUT's checkpoint files (see :mod:`nemo_dcr.checkpoint_rewrite`)."""
    key = _read_key(args.key_file)
    payload = Path(args.delta).read_bytes()
    out = Path(args.output).resolve()  # "a/b/.." is "a", as the filesystem sees it
    base = {n: t.clone() for n, t in _load(args.base).items()}
    floats, _ = _split(base)
    header = codec.inspect(payload, key, receiver=floats)  # a header BASE cannot justify is not parsed
    names = {r.name for r in header.records}
    if names != set(floats):
        raise codec.DeltaFormatError(f"delta covers {len(names)} tensors, base has {len(floats)}: "
                                     f"missing {sorted(set(floats) - names)[:5]}, extra {sorted(names - set(floats))[:5]}")
    touched = codec.apply(floats, payload, key)
    rewrite_checkpoint(base, args.base, out)
    print(f"wrote {out}: {len(base)} tensors, {sum(touched.values()):,} elements changed in {len(touched)} tensors "
          f"(version {header.base_version} -> {header.target_version})")
    return 0


def cmd_inspect(args) -> int:
    header = codec.inspect(Path(args.delta).read_bytes(), _read_key(args.key_file))
    if args.json:
        json.dump(header.to_json(), sys.stdout, indent=1)
        print()
        return 0
    print(f"model={header.model!r} run={header.run!r} versions {header.base_version} -> {header.target_version} "
          f"base_checksum={header.base_checksum} encodings={','.join(header.encodings)}")
    for r in header.records:
        print(f"  {r.name:<56} {r.dtype:<8} {str(list(r.shape)):<14} {r.encoding:<9} "
              f"changed={r.changed:<9,} bytes={r.length:<9,} crc={r.crc}")
    return 0
