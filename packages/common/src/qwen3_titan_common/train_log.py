"""Reads torchtitan's per-step log lines back into numbers (tests, benchmarks)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eE]+|nan|inf).*?"
    r"memory:\s*(?P<mem>[0-9.]+)GiB.*?tps:\s*(?P<tps>[0-9,]+)"
)


@dataclass(frozen=True)
class StepLine:
    step: int
    loss: float
    memory_gib: float
    tokens_per_second: int


def parse_step_lines(log: str) -> list[StepLine]:
    steps = []
    for line in _ANSI.sub("", log).splitlines():
        match = _STEP.search(line)
        if match:
            steps.append(
                StepLine(
                    step=int(match["step"]),
                    loss=float(match["loss"]),
                    memory_gib=float(match["mem"]),
                    tokens_per_second=int(match["tps"].replace(",", "")),
                )
            )
    return steps
