"""The /proc helpers find what they claim, among real processes."""

import os
import subprocess
import sys
import time

import pytest
from qwen3_titan_testing.processes import descendants, kill, torchrun_worker, with_environment
from qwen3_titan_testing.slurm import slurm_conf

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_the_worker_is_found_below_the_launcher_and_not_its_own_children(tmp_path):
    # launcher (sh) -> worker (sh, LOCAL_RANK=1) -> a child of the worker (sleep, same environment)
    env = {**os.environ, "LOCAL_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0", "MARK": str(tmp_path)}
    worker_env = " ".join(
        f"{k}={v}" for k, v in env.items() if k in ("LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT")
    )
    launcher = subprocess.Popen(
        ["sh", "-c", f"env {worker_env} MARK={tmp_path} sh -c 'sleep 30; true' & wait"],
        env={k: v for k, v in env.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT", "MARK")},
    )
    try:
        assert _wait_for(lambda: len(descendants(launcher.pid)) == 2)
        worker = torchrun_worker(launcher.pid, local_rank=1)
        assert worker is not None and descendants(worker) and worker in descendants(launcher.pid)
        assert torchrun_worker(launcher.pid, local_rank=1, attempt=1) is None
        assert torchrun_worker(launcher.pid, local_rank=0) is None
        tagged = with_environment("MARK", str(tmp_path))
        assert set(tagged) == set(descendants(launcher.pid))  # worker and its child, not the launcher
        kill(tagged)
        assert launcher.wait(timeout=10) is not None
    finally:
        kill([launcher.pid, *descendants(launcher.pid)])


def test_slurm_conf_needs_neither_systemd_nor_cgroups(tmp_path):
    line = "NodeName=n1 CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=8000"
    conf = dict(
        row.split("=", 1) for row in slurm_conf(tmp_path, line, tmp_path / "sock").splitlines() if row
    )
    assert conf["ProctrackType"] == "proctrack/linuxproc" and conf["TaskPlugin"] == "task/none"
    assert conf["SlurmctldHost"] == "n1" and conf["AuthInfo"] == f"socket={tmp_path / 'sock'}"
    assert conf["StateSaveLocation"].startswith(str(tmp_path)) and conf["SlurmdSpoolDir"].startswith(
        str(tmp_path)
    )
