import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = str(Path(sys.executable).with_name("train"))


def _dry_run(*args):
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    return subprocess.run([TRAIN, "--dry-run", *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_64_rank_layout_of_the_recipe_4b_config():
    proc = _dry_run("--nproc", "64", "--config", "native_qwen3_4b")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "64 ranks = dp_replicate 1 x dp_shard(FSDP) 64" in proc.stdout
    # 4.02B parameters sharded 64 ways: about 63M per rank (plus FSDP padding).
    found = re.search(r"([0-9,]+) parameters, ([0-9,]+) on rank 0", proc.stdout)
    total, per_rank = (int(g.replace(",", "")) for g in found.groups())
    assert 4.0e9 < total < 4.1e9
    assert total / 64 <= per_rank < total / 64 * 1.01


@pytest.mark.slow
def test_256_ranks_with_tensor_parallel_4():
    proc = _dry_run(
        "--nproc",
        "64",
        "--nnodes",
        "4",
        "--config",
        "native_qwen3_4b",
        "--parallelism.tensor_parallel_degree",
        "4",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "256 ranks = dp_replicate 1 x dp_shard(FSDP) 64 x context 1 x tensor 4" in proc.stdout


def test_degrees_that_do_not_multiply_fail_with_one_line():
    proc = _dry_run(
        "--nproc", "64", "--config", "native_qwen3_4b", "--parallelism.data_parallel_shard_degree", "8"
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train: parallel degrees do not multiply to the rank count")
    assert "dp_shard 8" in last and "expected 64 ranks" in last
