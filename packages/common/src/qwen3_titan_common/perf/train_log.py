"""Reads the per-step and validation log lines back into numbers (tests, benchmarks)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)(?:/(\d+))?\s+loss:\s*([-+0-9.eE]+|nan|inf)")
_ETA = re.compile(r"eta:\s*(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:\s|$)")
_VALIDATION = re.compile(
    r"validation\s+step:\s*(\d+)\s+val_loss:\s*([-+0-9.eE]+|nan|inf)\s+"
    r"(?:val_ppl:\s*([0-9,.]+|inf)|val_acc:\s*([0-9.]+)%\s+val_margin:\s*([-+0-9.]+))"
)
_FIELD = {
    "tps": re.compile(r"tps:\s*([0-9,]+)"),
    "tflops": re.compile(r"tflops:\s*([0-9,.]+)"),
    "memory": re.compile(r"memory:\s*([0-9.]+)GiB"),
    "mfu": re.compile(r"mfu:\s*([0-9.]+)%"),
    "trained": re.compile(r"trained:\s*([0-9.]+)%"),
}


@dataclass(frozen=True)
class StepLine:
    step: int
    loss: float
    tokens_per_second: int
    memory_gib: float | None
    tflops: float | None = None
    mfu_percent: float | None = None
    total_steps: int | None = None
    eta_seconds: int | None = None
    trained_percent: float | None = None  # share of the step's tokens that carried loss


def _field(name: str, line: str) -> float | None:
    match = _FIELD[name].search(line)
    return float(match.group(1).replace(",", "")) if match else None


def _eta(line: str) -> int | None:
    match = _ETA.search(line)
    if not match or not any(match.groups()):
        return None  # "eta: --": not known yet
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return 3600 * hours + 60 * minutes + seconds


def parse_step_lines(log: str) -> list[StepLine]:
    steps = []
    for line in _ANSI.sub("", log).splitlines():
        match = _STEP.search(line)
        tps = _field("tps", line)
        if match and tps is not None:
            steps.append(
                StepLine(
                    step=int(match.group(1)),
                    loss=float(match.group(3)),
                    tokens_per_second=int(tps),
                    memory_gib=_field("memory", line),
                    tflops=_field("tflops", line),
                    mfu_percent=_field("mfu", line),
                    trained_percent=_field("trained", line),
                    total_steps=int(match.group(2)) if match.group(2) else None,
                    eta_seconds=_eta(line),
                )
            )
    return steps


@dataclass(frozen=True)
class ValidationLine:
    step: int
    loss: float
    perplexity: float | None  # None under preference training, whose line has these two instead:
    accuracy_percent: float | None = None
    margin: float | None = None


def parse_validation_lines(log: str) -> list[ValidationLine]:
    found = []
    for line in _ANSI.sub("", log).splitlines():
        match = _VALIDATION.search(line)
        if match:
            step, loss, perplexity, accuracy, margin = match.groups()
            found.append(
                ValidationLine(
                    int(step),
                    float(loss),
                    float(perplexity.replace(",", "")) if perplexity else None,
                    float(accuracy) if accuracy else None,
                    float(margin) if margin else None,
                )
            )
    return found
