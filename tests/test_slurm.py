"""`train --print-sbatch`'s script under a real Slurm: it trains, exports, and a requeued job resumes.

A one-node cluster of this host (qwen3_titan_testing.slurm: the distribution's munged, slurmctld and
slurmd, installed when missing, stopped at the end) runs the generated script on the CPU with the
embedded default model. Once the job is past its first checkpoint it is requeued (`scontrol requeue`,
what Slurm also does on a node failure); the second run must resume from the newest complete checkpoint,
reproduce the first run's losses, finish and write the Hugging Face export.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.processes import with_environment
from qwen3_titan_testing.slurm import MARKER, SlurmUnavailable, ensure_installed, one_node_slurm

TRAIN = str(Path(sys.executable).with_name("train"))
STEPS, INTERVAL, REQUEUE_AFTER = 12, 4, 6
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def _write_script(workdir: Path) -> Path:
    env = {**os.environ, "QWEN3_TITAN_BACKEND": "native-backend"}
    command = [
        TRAIN, "--print-sbatch", "cpu", "--training.steps", str(STEPS), "--checkpoint.interval", str(INTERVAL),
        "--debug.seed", "0", "--debug.deterministic", "--dump_folder", "out",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    script = workdir / "train.sbatch"
    script.write_text(result.stdout)
    return script


# How long the job may go without writing a line before it counts as hung. The wait is on progress, not
# on a total: on a loaded machine the same steps take several times longer, and still arrive.
STALL_S = 600


def _wait_while_writing(cluster, job: str, log: Path, done) -> dict[str, str]:
    """Wait until ``done(fields, text)``; raise once the job ends without it or stops writing for STALL_S."""
    seen, last_change = None, time.monotonic()
    while True:
        fields = cluster.job(job)
        text = log.read_text(errors="replace") if log.exists() else ""
        if done(fields, text):
            return fields
        if fields.get("JobState") in ENDED:
            raise RuntimeError(f"job {job} ended {fields.get('JobState')} before it was expected to")
        now = (fields.get("JobState"), fields.get("Restarts"), len(text))
        if now != seen:
            seen, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > STALL_S:
            raise TimeoutError(f"job {job} wrote nothing to {log} for {STALL_S} s ({now[0]})")
        time.sleep(0.5)


def _past_step(step: int):
    return lambda fields, text: any(s.step >= step for s in parse_step_lines(text))


def _ended(fields: dict[str, str], text: str) -> bool:
    return fields.get("JobState") in ENDED


@pytest.mark.slow
def test_sbatch_script_trains_exports_and_resumes_when_requeued(tmp_path):
    try:
        ensure_installed()
    except SlurmUnavailable as reason:
        pytest.skip(f"no Slurm here: {reason}")
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = _write_script(workdir)

    with one_node_slurm(tmp_path / "slurm") as cluster:
        # One thread in both runs: the redone steps' losses are compared bit for bit, and a reduction
        # blocked over another thread count (the requeued job may get other CPUs) rounds differently.
        cluster.env["OMP_NUM_THREADS"] = "1"
        job = cluster.sbatch(script)
        log = workdir / f"slurm-qwen3-titan-debug-{job}.out"
        try:
            _wait_while_writing(cluster, job, log, _past_step(REQUEUE_AFTER))
            cluster.requeue_now(job)
            fields = _wait_while_writing(cluster, job, log, _ended)
        except (TimeoutError, RuntimeError) as err:
            text = log.read_text(errors="replace")[-4000:] if log.exists() else "(no job output)"
            pytest.fail(f"{err}\n{text}\n{cluster.log_tail()}")
    # Cleaned up: every daemon stopped, no process left that the cluster started.
    assert all(daemon.poll() is not None for daemon in cluster.daemons.values())
    assert set(cluster.daemons) == {"munged", "slurmctld", "slurmd"}
    assert not with_environment(MARKER, str(cluster.root))

    text = log.read_text(errors="replace")
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), text[
        -4000:
    ]

    first_run, marker, second_run = text.partition(f"[slurm] job {job} (restart 1)")
    assert marker and f"[slurm] job {job} (restart 0)" in first_run, text[-4000:]
    resumed = re.search(r"\[start\] resuming from step (\d+)", second_run)
    assert resumed, second_run[-4000:]
    resume_step = int(resumed.group(1))
    first, second = parse_step_lines(first_run), parse_step_lines(second_run)
    assert resume_step in range(INTERVAL, first[-1].step + 1, INTERVAL), (resume_step, first[-1].step)
    assert [s.step for s in second] == list(range(resume_step + 1, STEPS + 1))
    before = {s.step: s.loss for s in first}
    redone = [s for s in second if s.step in before]
    assert redone or resume_step == first[-1].step
    for s in redone:  # steps run twice, before and after the requeue, are the same steps
        assert abs(s.loss - before[s.step]) <= 1e-6, (s.step, s.loss, before[s.step])

    export = workdir / "out" / "hf" / f"step-{STEPS}"
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors")), text[-2000:]


# The example in examples/slurm/ is what --print-sbatch writes on a cluster whose shared storage is /fsx.
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "slurm" / "trn2-qwen3-4b.sbatch"
EXAMPLE_ARGV = [
    "--print-sbatch", "neuron", "--nnodes", "2", "--config", "native_qwen3_4b",
    "--hf-model", "/fsx/models/Qwen3-4B-Instruct-2507", "--max-restarts", "2",
    "--checkpoint.interval", "100", "--dump_folder", "/fsx/runs/qwen3-4b",
]  # fmt: skip


def test_the_trn2_example_is_what_print_sbatch_writes():
    import shlex

    from qwen3_titan_common.launcher.plan import Backend, plan_launch
    from qwen3_titan_common.launcher.sbatch import SbatchJob, render_sbatch

    _, plan = plan_launch(Backend("native-backend", "qwen3_titan_native"), EXAMPLE_ARGV)
    job = SbatchJob(
        backend="native-backend", device="neuron", train="/fsx/qwen3-titan/.venv/bin/train",
        workdir=Path("/fsx/runs"), plan=plan, nproc=None, command=shlex.join(["train", *EXAMPLE_ARGV]),
    )  # fmt: skip
    assert EXAMPLE.read_text() == render_sbatch(job), (
        f"regenerate {EXAMPLE.name}: see examples/slurm/README.md"
    )
