"""Steps side by side: a few lanes, each running its share of the steps.

Why: most of CI's time is single-rank training runs in subprocesses that use less than one core, so on a
two-core machine one step at a time leaves a core idle. Two lanes keep both busy; more would only make
the runs inside the tests compete for the same two cores.

Which lane runs what: where every step's seconds were measured (``durations.json``, the summary's figures of
a clean-clone run), the steps are split so that the longest lane is as short as those figures allow (every
split is tried: there are a handful of steps). Taking the next step from one queue, heaviest first, leaves
the lane that frees first with the heaviest short step, and the run ends on a lane whose three steps add up
to a minute more than the other's (measured: 1,806 s where the best split of the same steps takes 1,760 s).
Without a figure for every step (a new package) the lanes take the next step from one queue, heaviest
first, by the count of slow tests.

The first lane's output reaches the terminal as it comes; every other lane's step is announced when it
starts and its output printed as one block when it ends, so no two steps' lines interleave. Results are
reported in the steps' given order, whichever lane ran them.
"""

from __future__ import annotations

import itertools
import json
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
DURATIONS = Path(__file__).with_name("durations.json")
_MOST_SPLITS = 100_000  # lanes ** steps tried at most; beyond it, the queue


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


def measured_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """Each step's seconds as last written down (none where the file is absent or unreadable)."""
    try:
        found = json.loads(path.read_text())
        return {str(name): float(seconds) for name, seconds in found.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def plan_lanes(steps: list[Step], lanes: int, seconds: dict[str, float]) -> list[list[Step]] | None:
    """``steps`` split over ``lanes`` with the shortest longest lane by ``seconds``, each lane's longest step
    first; None where a step has no figure or the splits are too many to try."""
    if lanes < 2 or not steps or any(step.name not in seconds for step in steps):
        return None
    if lanes ** len(steps) > _MOST_SPLITS:
        return None
    best: tuple[float, tuple[int, ...]] | None = None
    for split in itertools.product(range(lanes), repeat=len(steps)):
        loads = [0.0] * lanes
        for step, lane in zip(steps, split, strict=True):
            loads[lane] += seconds[step.name]
        if best is None or max(loads) < best[0]:
            best = (max(loads), split)
    assert best is not None
    planned: list[list[Step]] = [[] for _ in range(lanes)]
    for step, lane in zip(steps, best[1], strict=True):
        planned[lane].append(step)
    return [sorted(lane, key=lambda step: -seconds[step.name]) for lane in planned]


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


def run_steps(steps: list[Step], lanes: int, seconds: dict[str, float] | None = None) -> list[Result]:
    """Runs every step, at most ``lanes`` at a time (split by ``seconds`` where every step has a figure);
    returns their results in the steps' order."""
    planned = plan_lanes(steps, lanes, seconds or {})
    shared: queue.SimpleQueue[Step] = queue.SimpleQueue()
    for step in sorted(steps, key=lambda s: -s.weight):  # stable: equal weights keep the given order
        shared.put(step)
    own: list[queue.SimpleQueue[Step]] = []
    for steps_of_lane in planned or []:
        own.append(queue.SimpleQueue())
        for step in steps_of_lane:
            own[-1].put(step)
    done: dict[str, list[Result]] = {}

    def lane(index: int) -> None:
        todo = own[index] if planned else shared
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
