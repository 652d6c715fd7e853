"""What a rehearsal rank tells the launcher: the lines it says, as it says them, and what it found.

A rehearsal is rank 0 of a planned job on torchtitan's fake process group, which the launcher starts as a child
process through torchtitan's own entry for ``--dry-run``, ``--check-layout``'s and ``--print-sbatch``'s checks
and a launch's fit check (``launcher.rehearse``); our trainer's config builds it in place of the trainer when its
``--rehearsal.mode`` is set (``train.rehearsal``). Its stdout is torchtitan's log, so what the user reads goes
through a file of its own instead: one JSON object per line, appended as the rank goes (a line to say, or the
result), which the launcher follows while the child runs. A refusal is the rank's torchelastic error file, as for
any rank. Nothing here imports torch: the launcher reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Said:
    line: str
    stderr: bool = False


@dataclass
class RehearsalReport:
    """The file a rehearsal rank appends to, and what the launcher has read of it so far."""

    path: Path
    result: dict | None = None
    _read_bytes: int = 0

    def say(self, line: str, *, stderr: bool = False) -> None:
        self._append({"say": line, "stderr": stderr})

    def found(self, **result) -> None:
        self._append({"result": result})

    def _append(self, event: dict) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps(event) + "\n")

    def read_new(self) -> list[Said]:
        """The lines said since the last read (a line still being written waits for the next); the result once
        it is written."""
        try:
            with open(self.path, "rb") as report:
                report.seek(self._read_bytes)
                data = report.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._read_bytes += len(complete)
        new = []
        for raw in complete.decode().splitlines():
            event = json.loads(raw)
            if "result" in event:
                self.result = event["result"]
            else:
                new.append(Said(event["say"], bool(event.get("stderr"))))
        return new
