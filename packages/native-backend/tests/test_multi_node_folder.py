"""Two launchers of one multi-node job write one dump folder, as every cluster run does; another job is refused.

Both "nodes" are launchers on this host (``--nnodes 2 --node-rank 0|1``, one rank each, a c10d rendezvous on
localhost), with one ``--dump_folder``, as the README's Slurm example gives one ``/fsx/...`` folder to every
node. They must train and export; a second job into the same folder while the first runs must stop with
one line and exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from qwen3_titan_common.train.dump_lock import LOCK_NAME
from qwen3_titan_testing.processes import torchrun_worker

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(out: Path, node_rank: int, port: int, job: str, nnodes: int = 2) -> subprocess.Popen:
    command = [
        str(BIN / "train"), "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc", "1",
        "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", job,
        "--steps", "2", "--validator.no-enable", "--dump_folder", str(out),
    ]  # fmt: skip
    env = {
        **os.environ,
        "QWEN3_TITAN_DEVICE": "cpu",
        "QWEN3_TITAN_BACKEND": "native-backend",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_job_in_lock(out: Path, job: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((out / LOCK_NAME).read_text()).get("job") == job:
                return
        except (OSError, ValueError):
            pass
        assert all(p.poll() is None for p in procs), "a launcher of the job ended before it held the folder"
        time.sleep(0.2)
    raise AssertionError("the job never held the dump folder")


def _ranks(launchers: list[subprocess.Popen]) -> list[int]:
    return [pid for p in launchers if (pid := torchrun_worker(p.pid, 0)) is not None]


@pytest.mark.slow
def test_one_jobs_launchers_share_the_folder_and_another_job_is_refused(tmp_path):
    out = tmp_path / "shared-run"
    port = _free_port()
    # The job's rank 0 holds the folder once the two nodes met and its checks passed; the job's ranks are
    # then paused (SIGSTOP), so that a second job coming meanwhile is refused whatever the machine's speed;
    # then they go on and the job trains.
    nodes = [_launcher(out, 0, port, "job-a"), _launcher(out, 1, port, "job-a")]
    try:
        _wait_for_job_in_lock(out, "job-a", nodes)
        ranks = _ranks(nodes)
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        try:
            # A job's ranks check the folder once all its nodes met: here a one-node job.
            intruder = _launcher(out, 0, _free_port(), "job-b", nnodes=1)
            intruder_log, _ = intruder.communicate(timeout=300)
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert intruder.returncode == 2, intruder_log[-3000:]
    [line] = [x for x in intruder_log.splitlines() if "in use by another training run" in x]
    assert "job job-a" in line and "Traceback" not in intruder_log
    for node, log in zip(nodes, logs, strict=True):
        assert node.returncode == 0, log[-4000:]
    assert (out / "hf" / "step-2" / "config.json").is_file()
    assert (out / "checkpoint" / "step-2" / ".metadata").is_file()
