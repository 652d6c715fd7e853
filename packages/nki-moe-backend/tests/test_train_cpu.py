"""debug_moe trains on CPU with the reference kernels, through the real launcher."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.assets import default_architecture
from qwen3_titan_common.perf.train_log import parse_step_lines

# The shared `train` script, choosing this backend as `uv run --package nki-moe-backend train` does.
TRAIN = str(Path(sys.executable).with_name("train"))
CPU_ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "nki-moe-backend"}


def train(args, cwd, expect_failure: bool = False):
    """The command's output; it must exit 0, or (``expect_failure``) refuse with a user error's exit 2."""
    proc = subprocess.run([TRAIN, *args], cwd=cwd, env=CPU_ENV, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == (2 if expect_failure else 0), log[-4000:]
    return log


@pytest.mark.slow
def test_debug_moe_loss_falls_with_reference_kernels(tmp_path):
    log = train(
        ["--training.steps", "12", "--dump_folder", str(tmp_path / "out"), "--checkpoint.no-enable"], tmp_path
    )
    steps = parse_step_lines(log)
    assert [s.step for s in steps] == list(range(1, 13))
    # Random init predicts the vocabulary nearly uniformly: the first loss is about ln(vocab), as the HF round
    # trip's test bounds it.
    assert abs(steps[0].loss - math.log(default_architecture().vocab_size)) < 0.5
    assert min(s.loss for s in steps[-3:]) < steps[0].loss - 1.0
    # Whether the peak levels off over a long run is measured by `tools/bench_memory.py --growth`: over twelve
    # steps the host RSS's high-water mark moves with glibc's heap as much as a leak would.
    for op in ("grouped_swiglu", "rope_hf", "rms_norm"):
        assert f"[kernels] {op}: reference (QWEN3_TITAN_DEVICE=cpu" in log
    assert "Applied 11 override(s)" in log
    # The run ends with an HF export through torchtitan's state-dict adapter: stock MoE keys.
    exported = list((tmp_path / "out" / "hf").glob("step-12/*.safetensors"))
    assert exported


@pytest.mark.slow
def test_recipe_config_lays_out_on_64_ranks(tmp_path):
    # Qwen3-30B-A3B on a trn2.48xlarge's 64 logical cores, built on the meta device here.
    log = train(["--dry-run", "--nproc", "64", "--config", "qwen3_nki_moe_config"], tmp_path)
    assert "64 ranks = dp_replicate 1 x dp_shard(FSDP) 64" in log
    assert "30,532,122,624 parameters" in log
    # Expert parallel 8 at 32k tokens on trn2: each rank holds an eighth of the experts, then FSDP shards over the
    # rest (30.5B / 64). The step is tracked through the fixed-capacity exchange, whose shapes do not depend on
    # the routing (as on Neuron), at the model's first 2 and 4 layers, extrapolated to its 48; a row of 32,768
    # tokens does not fit one rank, and the line names the context-parallel degree that does.
    log = train(
        [
            "--dry-run",
            "--nproc",
            "64",
            "--config",
            "qwen3_nki_moe_config",
            "--parallelism.expert_parallel_degree",
            "8",
            "--seq-len",
            "32768",
            "--memory-per-rank",
            "trn2",
        ],
        tmp_path,
        expect_failure=True,
    )
    assert "expert parallel 8" in log and "30,532,122,624 parameters, 477,064,416 on rank 0" in log
    assert (
        "torch's memory tracker over a fake step, steady state; its first 2 and 4 layers tracked, extrapolated per "
        "layer to its 48, the expert exchange at 2x a balanced load per expert" in log
    )
    assert "rule of thumb" not in log
    assert re.search(
        r"does not fit, .*fits by the same estimate: --parallelism.context_parallel_degree \d+", log
    )
