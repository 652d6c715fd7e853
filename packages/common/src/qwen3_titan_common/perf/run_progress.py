"""What a run's logged steps add up to: the step line's ETA and the end-of-run summary's figures.

Fed by ``Qwen3Metrics`` at every logged step with the interval since the previous one (its tokens over all
ranks and its seconds). The first interval holds step 1's one-time costs (graph capture, compilation,
allocator warm-up), so the ETA and the mean throughput come from the intervals after it where there are any.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Logged losses kept for the summary (train --check-layout compares two runs' steps); a long run keeps its first.
KEPT_LOSSES = 1000


@dataclass
class RunProgress:
    total_steps: int
    first_step: int | None = None
    last_step: int | None = None
    first_loss: float | None = None
    final_loss: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    peak_memory_gib: float | None = None
    trained_tokens: float = 0.0  # tokens that carried loss, estimated from each interval's trained share
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of the first logged steps
    # A fixed-capacity expert exchange's routed assignments and those it dropped over capacity, over all ranks
    # (None where no such exchange runs).
    routed_assignments: int | None = None
    dropped_assignments: int = 0

    def record(
        self,
        step: int,
        loss: float,
        tokens: int,
        seconds: float,
        memory_gib: float | None,
        trained_share: float | None = None,
    ) -> None:
        if self.first_step is None:
            self.first_step, self.first_loss = step, loss
        else:
            self.steady_tokens += tokens
            self.steady_seconds += seconds
        self.last_step, self.final_loss = step, loss
        if len(self.losses) < KEPT_LOSSES:
            self.losses.append((step, loss))
        self.tokens += tokens
        self.seconds += seconds
        if trained_share is not None:
            self.trained_tokens += trained_share * tokens
        if memory_gib is not None and memory_gib >= 0:
            self.peak_memory_gib = max(memory_gib, self.peak_memory_gib or 0.0)

    @property
    def steps_done(self) -> int:
        """Steps this process trained (a resumed run starts after its checkpoint's step)."""
        if self.last_step is None or self.first_step is None:
            return 0
        return self.last_step - self.first_step + 1

    def seconds_per_step(self) -> float | None:
        if self.first_step is None or self.last_step is None or self.last_step == self.first_step:
            return None
        return self.steady_seconds / (self.last_step - self.first_step)

    def eta_seconds(self) -> float | None:
        """Seconds to the last step at the pace of the steps after the first; None before there is one."""
        per_step = self.seconds_per_step()
        if per_step is None or self.last_step is None:
            return None
        return max(0, self.total_steps - self.last_step) * per_step

    def record_dropped(self, dropped: int, routed: int) -> None:
        """One interval's dropped and routed assignments of a fixed-capacity expert exchange."""
        self.routed_assignments = (self.routed_assignments or 0) + routed
        self.dropped_assignments += dropped

    def dropped_share(self) -> float | None:
        """Share of the routed assignments dropped over an expert's capacity; None without a capacity."""
        return self.dropped_assignments / self.routed_assignments if self.routed_assignments else None

    def trained_share(self) -> float | None:
        """Share of the computed tokens that carried loss, over the logged steps."""
        return self.trained_tokens / self.tokens if self.tokens else None

    def tokens_per_second(self) -> float | None:
        if self.steady_seconds > 0:
            return self.steady_tokens / self.steady_seconds
        return self.tokens / self.seconds if self.seconds > 0 else None
