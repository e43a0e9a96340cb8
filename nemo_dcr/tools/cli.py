"""``nemo-dcr`` command line: a thin dispatcher over :mod:`nemo_dcr.tools.commands`.

Each subcommand lives in its own module with ``register(subparsers)``, which adds a parser
and sets ``func`` (called with the parsed namespace, returns an exit code).  Modules are
imported lazily by name so that ``nemo-dcr inspect`` never imports megatron or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand name -> module under nemo_dcr.tools.commands
COMMANDS = {
    "diff": "checkpoint_cmds",
    "encode": "checkpoint_cmds",
    "apply": "checkpoint_cmds",
    "inspect": "checkpoint_cmds",
    "make-deltas": "make_deltas",
    "check-layout": "check_layout",
    "check-engine": "check_engine",
    "demo": "demo",
    "report": "report_cmd",
    "chaos": "chaos",
    "plan": "plan",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Parser with every subcommand (or just ``only``, to keep imports minimal)."""
    parser = argparse.ArgumentParser(
        prog="nemo-dcr", description="Bit-exact delta-compressed weight refit for RL post-training."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    registered = set()
    for name, module in COMMANDS.items():
        if (only is not None and name != only) or module in registered:
            continue
        registered.add(module)
        importlib.import_module(f"nemo_dcr.tools.commands.{module}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, TypeError) as exc:  # user errors: bad input, missing files, bad payloads
        if os.environ.get("NEMO_DCR_TRACEBACK"):
            raise
        print(f"nemo-dcr {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
