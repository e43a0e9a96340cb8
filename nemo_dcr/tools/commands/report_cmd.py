"""``nemo-dcr report RUN_DIR``: PNG plots (density, bytes, phase times) and a markdown table.

Example::

    nemo-dcr report runs/grpo_dcr            # writes density.png bytes.png times.png report.md

Reads ``RUN_DIR/telemetry.jsonl`` (written by ``nemo-dcr demo`` or any loop using
:class:`nemo_dcr.telemetry.TelemetryWriter`).
"""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    """Add the ``report`` parser."""
    p = subparsers.add_parser("report", help="plots and a summary table of a run's telemetry",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="folder with telemetry.jsonl (or the file)")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR)")
    p.add_argument("--no-plots", action="store_true", help="only the markdown table")
    p.add_argument("--json", action="store_true", help="print the totals as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the report and print the table (or the totals as JSON)."""
    from nemo_dcr.tools.run_report import write_report

    result = write_report(args.run_dir, args.out, plots=not args.no_plots)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    md = [f for f in result["files"] if f.endswith(".md")][0]
    with open(md) as f:
        print(f.read())
    print("wrote " + ", ".join(result["files"]))
    return 0
