"""Steps side by side: a few lanes take the next step from one queue, heaviest first.

Why: most of CI's time is single-rank training runs in subprocesses that use less than one core, so on a
two-core machine one step at a time leaves a core idle. Two lanes keep both busy; more would only make
the runs inside the tests compete for the same two cores.

The first lane's output reaches the terminal as it comes; every other lane's step is announced when it
starts and its output printed as one block when it ends, so no two steps' lines interleave. Results are
reported in the steps' given order, whichever lane ran them.
"""

from __future__ import annotations

import os
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools.ci.process import buffered, emit_block, say
from tools.ci.results import Result

DEFAULT_LANES = 2
SLOW_MARK = "mark.slow"


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[], list[Result]]
    weight: int  # higher starts first: the longest steps begin together, the short ones fill in after


def default_lanes() -> int:
    return max(1, min(DEFAULT_LANES, os.cpu_count() or 1))


def lane_threads(lanes: int, environ: dict[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for every process a lane starts: the machine's cores shared among the lanes.

    Why: torch sizes its thread pool to every core, so two lanes each running a one-rank training run put
    two threads on each core, and the runs spin-wait on each other in OpenMP's barriers: measured on this
    project's two-core CI machine, two concurrent 15-step runs of the embedded default took 54.6 s each with
    torch's default and 25.8 s with one thread each. A value the caller set is kept (torchrun's own
    multi-rank launches set 1 per rank either way).
    """
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // lanes))}


def slow_weight(folders: list[Path]) -> int:
    """How many ``mark.slow`` a step's test files hold: the tests that run real training, where the time goes."""
    return sum(
        path.read_text(errors="replace").count(SLOW_MARK)
        for folder in folders
        if folder.is_dir()
        for path in sorted(folder.rglob("test_*.py"))
    )


def _run_guarded(step: Step) -> list[Result]:
    # A step that raises still gets its line in the summary: one failure, naming what was raised.
    try:
        return step.run()
    except Exception as err:
        say(f"{step.name}: the step itself failed:\n{traceback.format_exc()}")
        return [Result(step.name, failed=1, notes=[f"{type(err).__name__}: {err}"])]


def _run_aside(step: Step) -> list[Result]:
    say(f"{step.name}: started beside another step; its output follows when it ends")
    with buffered() as lines:
        results = _run_guarded(step)
    emit_block(
        f"ci: ---- {step.name}: output ----\n"
        + "".join(lines)
        + f"ci: ---- {step.name}: end of output ----\n"
    )
    return results


def run_steps(steps: list[Step], lanes: int) -> list[Result]:
    """Runs every step, at most ``lanes`` at a time; returns their results in the steps' order."""
    todo: queue.SimpleQueue[Step] = queue.SimpleQueue()
    for step in sorted(steps, key=lambda s: -s.weight):  # stable: equal weights keep the given order
        todo.put(step)
    done: dict[str, list[Result]] = {}

    def lane(index: int) -> None:
        while True:
            try:
                step = todo.get_nowait()
            except queue.Empty:
                return
            done[step.name] = _run_guarded(step) if index == 0 else _run_aside(step)

    threads = [threading.Thread(target=lane, args=(i,), name=f"ci-lane-{i}") for i in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [result for step in steps for result in done[step.name]]
