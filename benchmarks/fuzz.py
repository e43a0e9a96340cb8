"""Coverage-guided fuzzing of the payload decoder, the header parser and the store envelope.

Usage:
    python benchmarks/fuzz.py [--inputs N] [--targets payload,header,envelope] [--timeout-s S]
                              [--max-len B] [--json OUT]

Runs ``tests/fuzz/atheris_main.py`` (atheris: libFuzzer for Python, ``nemo_dcr`` instrumented)
for N inputs per target (default 1,000,000), one target after the other, from the seed corpus of
valid inputs, and prints per target: inputs run, edge coverage (``cov``) and features (``ft``)
as libFuzzer counts them, corpus size, crashes, hangs (an input running past ``--timeout-s``)
and silent changes (an accepted input whose result differs from the independent reader of
``tests/spec_reader.py``, or a refused one that wrote), wall seconds and inputs per second.
libFuzzer stops at the first crash, hang or silent change (its input is kept in the work
folder, printed), so each of those figures is 0 or 1, and a run that reaches N inputs had none.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "tests" / "fuzz" / "atheris_main.py"
TARGETS = ("payload", "header", "envelope")


def run_target(name: str, inputs: int, timeout_s: int, max_len: int, work: Path) -> dict:
    """Fuzz one target for ``inputs`` inputs; its figures parsed from libFuzzer's output."""
    corpus, artifacts = work / f"corpus-{name}", work / f"artifacts-{name}"
    artifacts.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(MAIN), name, "--seed-corpus", str(corpus), f"-runs={inputs}", f"-timeout={timeout_s}",
           f"-max_len={max_len}", "-rss_limit_mb=4096", "-print_final_stats=1", f"-artifact_prefix={artifacts}/"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    seconds = time.perf_counter() - t0
    return figures(name, proc.returncode, proc.stdout + proc.stderr, seconds, artifacts)


def figures(name: str, rc: int, log: str, seconds: float, artifacts: Path) -> dict:
    """Parse one libFuzzer run's output."""
    cov = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", log)
    done = re.search(r"stat::number_of_executed_units: (\d+)", log)
    ran = int(done.group(1)) if done else max([int(x) for x in re.findall(r"^#(\d+)", log, re.M)] or [0])
    silent = int("SilentChange" in log)
    hang = int("libFuzzer: timeout" in log)
    crash = int(rc != 0 and not silent and not hang)
    out = {"target": name, "inputs": ran, "cov": int(cov[-1][0]) if cov else 0, "ft": int(cov[-1][1]) if cov else 0,
           "corpus": int(cov[-1][2]) if cov else 0, "crashes": crash, "hangs": hang, "silent_changes": silent,
           "seconds": round(seconds, 1), "inputs_per_s": round(ran / seconds) if seconds else 0}
    if rc != 0:
        out["artifacts"] = sorted(str(p) for p in artifacts.iterdir())
        out["log_tail"] = log[-3000:]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=1_000_000, help="inputs per target")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--timeout-s", type=int, default=10, help="an input running longer is a hang")
    p.add_argument("--max-len", type=int, default=4096, help="largest input libFuzzer generates (bytes)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    names = [t for t in args.targets.split(",") if t]
    if set(names) - set(TARGETS):
        p.error(f"unknown targets {sorted(set(names) - set(TARGETS))}; known: {', '.join(TARGETS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = run_target(name, args.inputs, args.timeout_s, args.max_len, Path(tmp))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
            if "log_tail" in row:
                print(row["log_tail"], file=sys.stderr)
    total = {k: sum(r[k] for r in rows) for k in ("inputs", "crashes", "hangs", "silent_changes")}
    print(f"{'target':<10}{'inputs':>12}{'cov':>7}{'ft':>7}{'corpus':>8}{'crashes':>9}{'hangs':>7}"
          f"{'silent':>8}{'seconds':>9}{'inputs/s':>10}")
    for r in rows:
        print(f"{r['target']:<10}{r['inputs']:>12,}{r['cov']:>7}{r['ft']:>7}{r['corpus']:>8}{r['crashes']:>9}"
              f"{r['hangs']:>7}{r['silent_changes']:>8}{r['seconds']:>9}{r['inputs_per_s']:>10,}")
    print(f"{'total':<10}{total['inputs']:>12,}{'':>22}{total['crashes']:>9}{total['hangs']:>7}{total['silent_changes']:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps({"targets": rows, "total": total}, indent=1))
    return 0 if not (total["crashes"] or total["hangs"] or total["silent_changes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
