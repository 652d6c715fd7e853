"""Runs torchrun, streams its output, and turns a rank's input error into the launcher's last line."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path


def torchrun_executable() -> str:
    beside_python = Path(sys.executable).with_name("torchrun")
    return str(beside_python) if beside_python.exists() else "torchrun"


# A rank that dies of one of our input errors prints `qwen3_titan_...XxxError: message`
# at the end of its traceback; torchrun then adds its own report. We repeat the message
# as the launcher's last line, so the culprit is the line a user reads.
_USER_ERROR_LINE = re.compile(r"(?:^|[\s:])(?:qwen3_titan_[\w.]*|neuron_qwen3[\w.]*)\.(\w*Error): (.+)$")


class _ErrorSummary:
    """Finds the user-facing error in a failed run's output.

    Two shapes: a rank that dies of one of our input errors ends its traceback with
    ``qwen3_titan_...XxxError: message``; torchtitan's CLI parser (tyro) draws a box
    (``╭─ ... │ message │ ... ╰─``) whose text, up to its ``───`` rule, is the message.
    """

    def __init__(self) -> None:
        self.message: str | None = None
        self._box: list[str] | None = None

    def feed(self, line: str) -> None:
        text = re.sub(r"^\[rank\d+\]:", "", line.rstrip("\n"))
        if "╭─" in text:
            self._box = []
            return
        if self._box is not None:
            inner = text.strip().strip("│").strip()
            if "╰" in text or inner.startswith("───"):
                if self._box:
                    self.message = " ".join(self._box)
                self._box = None
                return
            if inner:
                self._box.append(inner)
            return
        match = _USER_ERROR_LINE.search(text)
        if match:
            self.message = match.group(2)


def run_and_summarise(command: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
    previous = signal.signal(signal.SIGTERM, forward)
    summary = _ErrorSummary()
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()  # keep the log live when it goes to a pipe or a file
            summary.feed(line)
        returncode = proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached torchrun too (same process group): let it shut the ranks down.
        returncode = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    sys.stdout.flush()
    if returncode != 0 and summary.message is not None:
        print(f"train: {summary.message}", file=sys.stderr)
        return 2
    return returncode
