"""`train --max-restarts`: one of two CPU ranks is SIGKILLed, torchrun restarts both, the job carries on.

The restarted workers resume from the newest complete checkpoint (step 6: checkpoints every 3 steps,
the kill after step 7) and every step's loss equals an uninterrupted run's. Before the launcher gave
each restart a fresh TCPStore (qwen3_titan_common/launcher/elastic.py), about one restart in two failed in
gloo's connectFullMesh; `tools/bench_elastic_restarts.py` runs the 10-in-a-row check.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.processes import torchrun_worker

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {
    **os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend", "OMP_NUM_THREADS": "1",
}  # fmt: skip
STEPS, INTERVAL, KILL_AFTER = 8, 3, 7


def _command(dump: Path, *extra: str) -> list[str]:
    return [
        TRAIN, "--nproc", "2", *extra, "--training.steps", str(STEPS), "--checkpoint.interval", str(INTERVAL),
        "--hf.no-export", "--debug.seed", "0", "--debug.deterministic", "--dump_folder", str(dump),
    ]  # fmt: skip


def _kill_one_worker_after(command: list[str], cwd: Path, step: int) -> tuple[int, str]:
    """Run ``command``; SIGKILL local rank 1 (not the tree) once rank 0 logs ``step``; (exit code, log)."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, killed = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed is None and any(s.step == step for s in parse_step_lines(line)):
                killed = torchrun_worker(proc.pid, local_rank=1, attempt=0)
                assert killed is not None, "no worker with LOCAL_RANK=1 below the launcher"
                os.kill(killed, signal.SIGKILL)
        return proc.wait(timeout=900), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path):
    reference_run = subprocess.run(
        _command(tmp_path / "reference"), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900
    )
    assert reference_run.returncode == 0, reference_run.stdout[-3000:] + reference_run.stderr[-3000:]
    reference = {s.step: s.loss for s in parse_step_lines(reference_run.stdout + reference_run.stderr)}
    assert sorted(reference) == list(range(1, STEPS + 1))

    code, log = _kill_one_worker_after(
        _command(tmp_path / "elastic", "--max-restarts", "1"), tmp_path, KILL_AFTER
    )
    assert code == 0, log[-4000:]
    assert "--max-restarts=1" in log and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in log  # the launched command
    resumed_from = KILL_AFTER // INTERVAL * INTERVAL
    before, marker, after = log.partition(f"[start] resuming from step {resumed_from}")
    assert marker, log[-4000:]  # the restart resumed from the newest complete checkpoint
    first, second = parse_step_lines(before), parse_step_lines(after)
    assert first[-1].step == KILL_AFTER, [s.step for s in first]
    assert [s.step for s in second] == list(range(resumed_from + 1, STEPS + 1))
    for s in first + second:
        assert abs(s.loss - reference[s.step]) <= 1e-6, (s.step, s.loss, reference[s.step])
