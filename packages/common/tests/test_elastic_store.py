"""Why `--max-restarts` needs a fresh store per restart, shown deterministically on torch's own torchrun.

Two workers; in attempt 0 they form a gloo group, then rank 1 exits 1 and torchrun restarts both. In
attempt 1 each reports the store it was given. With torch 2.14's default (one TCPStore shared across
restarts) the keys attempt 0's group wrote are still there for attempt 1 to read: the cause of the
"Gloo connectFullMesh failed ... Connection refused" restarts. With the launcher's environment
(`restart_env_updates`) attempt 1 gets a store on a new port that no earlier attempt used, and its group
forms. Should a torch release stop reusing the store, the first test fails: the workaround can go.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.launcher.elastic import restart_env_updates

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
WORKER = """
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
shared = os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
if attempt == 0:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.barrier()
    print("REPORT " + json.dumps({"attempt": 0, "rank": rank, "port": port}), flush=True)
    if rank == 1:
        sys.exit(1)
    time.sleep(120)  # until torchrun stops it for the restart
report = {"attempt": 1, "rank": rank, "port": port, "shared": shared, "keys_before_init": None, "group": False}
if shared:  # the agent serves this store: read what is in it before this attempt writes anything
    if rank == 1:
        store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=30))
        report["keys_before_init"] = sorted(store.list_keys())
else:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.barrier()
    report["group"] = True
    dist.destroy_process_group()
print("REPORT " + json.dumps(report), flush=True)
"""


def _restart_once(tmp_path: Path, env_updates: dict[str, str]) -> tuple[int, list[dict]]:
    """(attempt 0's store port, attempt 1's reports)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1", **env_updates)
    proc = subprocess.run(
        [TORCHRUN, "--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
         "--max-restarts=1", str(script)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the two ranks share torchrun's stdout, so one line may hold both ranks' reports
    reports = [json.loads(match) for match in re.findall(r"REPORT (\{[^{}]*\})", proc.stdout)]
    first = {r["port"] for r in reports if r["attempt"] == 0}
    second = [r for r in reports if r["attempt"] == 1]
    assert len(first) == 1 and sorted(r["rank"] for r in second) == [0, 1], proc.stdout[-3000:]
    return first.pop(), second


@pytest.mark.slow
def test_torchrun_by_default_hands_a_restart_the_previous_attempts_keys(tmp_path):
    first_port, reports = _restart_once(tmp_path, {})
    assert all(r["shared"] and r["port"] == first_port for r in reports), (first_port, reports)
    reader = next(r for r in reports if r["rank"] == 1)
    assert reader["keys_before_init"], reports
    # gloo's per-rank entries of the default group, written by the dead attempt's ranks 0 and 1
    assert {key.rsplit("/", 1)[-1] for key in reader["keys_before_init"]} >= {"0", "1"}, reader


@pytest.mark.slow
def test_with_the_launchers_environment_each_restart_gets_a_fresh_store(tmp_path):
    env_updates = restart_env_updates(1, {})
    assert env_updates
    first_port, reports = _restart_once(tmp_path, env_updates)
    assert all(not r["shared"] and r["port"] != first_port and r["group"] for r in reports), (
        first_port,
        reports,
    )
