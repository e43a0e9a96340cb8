"""What the chaos processes share: one work folder, append-only logs that survive a SIGKILL, and
the out-of-band fault switches.

Every process appends what it saw as JSON lines and flushes each line (a process killed mid-line
leaves at most one torn last line, which readers skip): trainer rank 0 one row per refit
(``rows.jsonl``), the engine process its server's events and its rollouts (``engine.jsonl``),
the supervisor every process it saw die and start (``supervisor.jsonl``).  Faults that act
inside another process are armed through files (:meth:`Workdir.arm` / :meth:`Workdir.take`): the
file names the refit and the parameters, the process that acts removes it when it fires.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workdir:
    """The chaos run's folder and the names in it."""

    root: str

    def path(self, *parts: str) -> Path:
        return Path(self.root, *parts)

    @property
    def hf(self) -> Path:
        """The engine's initial weights (an HF folder every engine start loads)."""
        return self.path("hf")

    @property
    def checks(self) -> Path:
        """Dense exports handed to the engine for comparison, and its answers."""
        return self.path("checks")

    @property
    def store(self) -> Path:
        """The store transport's folder (a tmpfs of its own when ``disk-full`` is among the faults)."""
        return self.path("store")

    def refit_store(self, generation: int) -> str:
        """The gloo rendezvous file of one generation of the refit group (trainers + engine)."""
        return str(self.path(f"refit_store.{generation}"))

    def append(self, log: str, row: dict[str, Any]) -> None:
        """Append one JSON line to ``log`` and flush it to the OS (it survives a SIGKILL)."""
        with open(self.path(log), "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def read(self, log: str) -> list[dict]:
        """Every whole line of ``log`` (a torn last line of a killed writer is skipped)."""
        try:
            lines = self.path(log).read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def publish(self, name: str, value: dict[str, Any]) -> None:
        """Write ``name`` atomically (a reader sees the old value or the new one)."""
        target = self.path(name)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, target)

    def look(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.path(name).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def arm(self, fault: str, **params) -> None:
        """Arm ``fault`` for the process that acts on it (``params`` travel with it)."""
        self.publish(f"arm.{fault}", dict(params, armed_at=time.time()))

    def take(self, fault: str) -> dict[str, Any] | None:
        """The armed ``fault``'s parameters, disarming it (None: not armed)."""
        got = self.look(f"arm.{fault}")
        if got is not None:
            try:
                self.path(f"arm.{fault}").unlink()
            except FileNotFoundError:
                return None
        return got

    def armed(self, fault: str) -> dict[str, Any] | None:
        """The armed ``fault``'s parameters, left armed."""
        return self.look(f"arm.{fault}")
