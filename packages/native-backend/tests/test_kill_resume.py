"""Killed mid-run, the same command carries on as if nothing happened: the same steps, the same losses, and
validation at the same steps (1, every 4, the last) with the same losses."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines, parse_validation_lines
from qwen3_titan_testing.processes import descendants, kill

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
STEPS, INTERVAL = 8, 4  # checkpoints and validations every 4 steps


def _command(dump: Path, extra: list[str]) -> list[str]:
    return [
        TRAIN, "--training.steps", str(STEPS), "--checkpoint.interval", str(INTERVAL), "--hf.no-export",
        "--validator.freq", str(INTERVAL),
        "--debug.seed", "0", "--debug.deterministic", "--dump_folder", str(dump), *extra,
    ]  # fmt: skip


def _run(dump: Path, cwd: Path, extra: list[str]) -> str:
    proc = subprocess.run(
        _command(dump, extra), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _run_until_step(dump: Path, cwd: Path, kill_after: int, extra: list[str]) -> str:
    """Start the command and SIGKILL its whole process tree once step `kill_after` is logged."""
    proc = subprocess.Popen(
        _command(dump, extra), cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:
        seen.append(line)
        steps = parse_step_lines(line)
        if steps and steps[0].step == kill_after:
            # torchrun starts each rank in its own session: killing the launcher's group is not enough.
            kill([proc.pid, *descendants(proc.pid)])
            break
    proc.wait()
    return "".join(seen)


LORA = ["--lora.rank", "8", "--lora.dropout", "0.1"]


@pytest.fixture(scope="module")
def reference_logs(tmp_path_factory):
    """The uninterrupted run of each flag set, run once for every kill point of that set."""

    @functools.cache
    def log_of(extra: tuple[str, ...]) -> str:
        tmp = tmp_path_factory.mktemp("reference")
        return _run(tmp / "reference", tmp, list(extra))

    return lambda extra: log_of(tuple(extra))


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "kill_after"), [(LORA, 7)], ids=["lora-resumes-step-4"])
def test_sigkill_then_rerun_reproduces_every_step(tmp_path, reference_logs, extra, kill_after):
    # A LoRA run resumes its adapters and their optimizer state; its dropout (the only random draw of a
    # debug run) draws from the saved RNG. Step 4 is checkpointed and then validated: resumed from it, the
    # run does not validate step 4 again, so step 5 matches only if validation left the random generators
    # untouched. (A full fine-tuning run's resume from a killed rank: test_elastic_restart.py.)
    reference_log = reference_logs(extra)
    reference = {s.step: s.loss for s in parse_step_lines(reference_log)}
    assert sorted(reference) == list(range(1, STEPS + 1))
    validated = {v.step: v.loss for v in parse_validation_lines(reference_log)}
    assert sorted(validated) == [1, INTERVAL, STEPS]

    dump = tmp_path / "killed"
    first = parse_step_lines(_run_until_step(dump, tmp_path, kill_after, extra))
    assert first[-1].step == kill_after
    assert not (dump / "checkpoint" / f"step-{STEPS}").exists(), "the kill came after the run had finished"
    # A checkpoint cut short (no DCP .metadata) must never be picked up.
    partial = dump / "checkpoint" / f"step-{STEPS - 1}"
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "__0_0.distcp").write_bytes(b"half a checkpoint")

    saved = range(INTERVAL, STEPS, INTERVAL)
    complete = [step for step in saved if (dump / "checkpoint" / f"step-{step}" / ".metadata").is_file()]
    # Step N's line is logged before step N's checkpoint is written; a kill after step N+1's line
    # always finds it complete (the kill points are never a checkpoint step).
    assert complete == [step for step in saved if step < kill_after], (kill_after, complete)
    resumed_from = complete[-1]

    second_log = _run(dump, tmp_path, extra)
    second = parse_step_lines(second_log)
    assert f"[start] resuming from step {resumed_from}" in second_log
    assert [s.step for s in second] == list(range(resumed_from + 1, STEPS + 1))
    print(f"killed after step {kill_after}, resumed from step {resumed_from}")
    for s in first + second:
        assert abs(s.loss - reference[s.step]) <= 1e-6, (s.step, s.loss, reference[s.step])
    # The resumed run keeps the schedule: it validates at the reference's steps after its start, no others.
    resumed_validations = parse_validation_lines(second_log)
    assert [v.step for v in resumed_validations] == [step for step in validated if step > resumed_from]
    for v in resumed_validations:
        assert abs(v.loss - validated[v.step]) <= 1e-6, (v.step, v.loss, validated[v.step])
