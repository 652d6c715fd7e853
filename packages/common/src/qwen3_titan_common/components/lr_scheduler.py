"""The learning-rate schedule, fitted to runs shorter than its warmup.

torchtitan's ``LRSchedulersContainer`` shortens a warmup longer than the run, and then a decay that no longer
fits beside it, each with a warning. The config functions' defaults (a few warmup steps, decay over the last
80%) meet a ``--steps 1`` or ``--steps 3`` of a first try that way: two warnings on a run that does exactly
what was asked. This component makes the same fit before torchtitan sees the numbers (so the schedule is
torchtitan's, step for step) and says it in one info line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.tools.logging import logger


def fitted(warmup_steps: int, decay_ratio: float | None, total_steps: int) -> tuple[int, float | None]:
    """The warmup and decay ratio torchtitan ends up with for a run of ``total_steps``: the warmup cut to the
    run, the decay to what is left after it (the ratio given exactly, so that torchtitan's rounding keeps it)."""
    warmup = min(warmup_steps, total_steps)
    if decay_ratio is None:
        return warmup, None
    if warmup + round(total_steps * decay_ratio) > total_steps:
        return warmup, (total_steps - warmup) / total_steps
    return warmup, decay_ratio


class Qwen3LRSchedulers(LRSchedulersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        # pyrefly: ignore [bad-override]
        def build(self, *, optimizers, training_steps):
            total = self.total_steps if self.total_steps is not None else training_steps
            warmup, decay_ratio = fitted(int(self.warmup_steps), self.decay_ratio, total)
            if (warmup, decay_ratio) == (self.warmup_steps, self.decay_ratio):
                return LRSchedulersContainer.Config.build(
                    self, optimizers=optimizers, training_steps=training_steps
                )
            decay = total - warmup if decay_ratio is not None else 0
            logger.info(
                f"[schedule] {total} step(s): warmup {warmup} step(s) (--lr_scheduler.warmup_steps "
                f"{self.warmup_steps} is longer than the run), decay over the last {decay}"
            )
            short = dataclasses.replace(self, warmup_steps=warmup, decay_ratio=decay_ratio)
            return LRSchedulersContainer.Config.build(
                short, optimizers=optimizers, training_steps=training_steps
            )
