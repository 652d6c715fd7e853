"""One result per step (a package, the workspace tests, lint), and the closing summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from tools.ci.process import say


@dataclass
class Result:
    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    missing: set[str] = field(default_factory=set)

    def line(self) -> str:
        status = "FAILED" if self.failed else "ok"
        counts = f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"
        notes = list(self.notes)
        if self.missing:
            notes.append("missing modules: " + ", ".join(sorted(self.missing)))
        return f"{self.name:<18} {status:<6} {counts} in {self.seconds:.1f} s" + (
            f"  ({'; '.join(notes)})" if notes else ""
        )


def summarize(results: list[Result], seconds: float) -> int:
    """Prints one line per result, then ``N passed, N failed, N skipped``; returns the exit status."""
    print(flush=True)
    say(f"summary ({seconds:.0f} s)")
    for result in results:
        print(result.line(), flush=True)
    passed = sum(r.passed for r in results)
    failed = sum(r.failed for r in results)
    skipped = sum(r.skipped for r in results)
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    return 1 if failed else 0
