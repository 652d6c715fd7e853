"""What torchrun and its ranks leave in torchrun's ``--log-dir``, read by the launcher once torchrun returned.

Per rank, ``<run id>/attempt_<n>/<local rank>/``: its output (``stdout.log``, ``stderr.log``), torchelastic's
``error.json`` (a stopping rank's record, ``protocols.rank_errors``) and, from a node's first local rank, the
run record (``protocols.summary.RunRecord``: the run's folders, the last step logged, the summary); beside them
torchrun's own error file, a copy of the first failure's.

One failure records nothing, and is read from what printed it: a rank killed by a signal (torchrun's report on
its own stderr names the rank and the signal, :class:`TorchrunReport`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from qwen3_titan_common.protocols.rank_errors import USER_ERROR
from qwen3_titan_common.protocols.summary import RUN_FILE, RunRecord

ROOT_CAUSE_FILE = "root_cause.json"  # torchrun's own TORCHELASTIC_ERROR_FILE: the first failure's

# torchrun's report of a failure (torch.distributed.elastic's ChildFailedError table).
_ROOT_CAUSE = re.compile(r"^\s*Root Cause")
_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class TorchrunReport:
    """The first failure torchrun reports on its stderr: the rank and its exit code (negative: a signal)."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.exitcode: int | None = None
        self._in_root_cause = False

    def feed(self, line: str) -> None:
        if _ROOT_CAUSE.match(line):
            self._in_root_cause = True
        elif self._in_root_cause and (match := _CAUSE_RANK.match(line)):
            self.rank = int(match.group(1))
        elif self._in_root_cause and (match := _CAUSE_EXIT.match(line)):
            self.exitcode = int(match.group(1))
            self._in_root_cause = False


class RankFiles:
    def __init__(self, folder: Path):
        self.folder = folder

    def _all(self, name: str) -> list[Path]:
        """Every rank's ``name``, oldest first (a restarted run's attempts each have theirs)."""
        return sorted(self.folder.glob(f"*/attempt_*/*/{name}"), key=lambda p: p.stat().st_mtime)

    def run_record(self) -> RunRecord | None:
        found = self._all(RUN_FILE)
        return RunRecord.read(found[-1]) if found else None

    def root_cause(self) -> str | None:
        """The first failing rank's recorded message (torchrun's copy of its error file), or None. A rank's
        user error wins over another's internal one: its timestamp has whole seconds, a tie goes to rank 0."""
        messages = [recorded_message(self.folder / ROOT_CAUSE_FILE)] + [
            recorded_message(p) for p in self._all("error.json")
        ]
        found = [m for m in messages if m is not None]
        return next((m for m in found if m.startswith(USER_ERROR)), found[0] if found else None)

    def copy_to(self, destination: Path) -> bool:
        try:
            shutil.copytree(self.folder, destination, dirs_exist_ok=True)
        except OSError:
            return False  # a full disk: the temporary copy stays, and the run's last line says where
        return True


def recorded_message(path: Path) -> str | None:
    try:
        message = json.loads(path.read_text()).get("message")
    except (OSError, ValueError, AttributeError):
        return None
    message = message.get("message") if isinstance(message, dict) else message
    return message if isinstance(message, str) else None
