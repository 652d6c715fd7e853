"""`train --print-sbatch DEVICE`: the Slurm script for this command (run under a real Slurm in tests/test_slurm.py)."""

import os
import shlex
import shutil
import subprocess

import pytest
from qwen3_titan_common.launcher.launch import run
from qwen3_titan_common.launcher.plan import Backend
from qwen3_titan_common.runtime.neuron_env import NEURON_ENV_DEFAULTS

NATIVE = Backend(distribution="native-backend", module="qwen3_titan_native")


@pytest.fixture(autouse=True)
def _outside_a_job(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "MASTER_ADDR", "RDZV_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


def _script(capsys, argv: list[str]) -> str:
    assert run(NATIVE, argv) == 0
    return capsys.readouterr().out


def _srun_train_args(script: str) -> list[str]:
    """The words of the srun line, continuation lines joined, with the shell's own expansions left as text."""
    text = script.split("srun ", 1)[1].split(" &\n", 1)[0].replace("\\\n", " ")
    return shlex.split(text)


def test_trn2_script_runs_train_once_per_node_with_the_neuron_env(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = _script(
        capsys,
        ["--print-sbatch", "neuron", "--nnodes", "4", "--max-restarts", "2", "--training.steps", "50",
         "--dump_folder", "runs/a"],
    )  # fmt: skip
    assert script.startswith("#!/bin/bash\n")
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--exclusive", "--requeue", "--open-mode=append"):
        assert f"#SBATCH {directive}\n" in script
    assert f"#SBATCH --chdir={tmp_path}\n" in script  # relative paths (the dump folder) resolve here
    assert "export QWEN3_TITAN_BACKEND=native-backend\n" in script
    for name in NEURON_ENV_DEFAULTS:
        assert f"export {name}=${{{name}:-" in script  # the value exported before sbatch wins
    exports = [line for line in script.splitlines() if line.startswith("export ") and "NEURON" in line]
    printed = "; ".join(f'echo "{name}=${name}"' for name in NEURON_ENV_DEFAULTS)
    exported = subprocess.run(
        ["bash", "-c", "\n".join([*exports, printed])],
        env={"HOME": os.path.expanduser("~"), "PATH": os.environ["PATH"], "NEURON_LOGICAL_NC_CONFIG": "1"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    expected = {**NEURON_ENV_DEFAULTS, "NEURON_LOGICAL_NC_CONFIG": "1"}
    assert dict(line.split("=", 1) for line in exported.splitlines()) == expected
    args = _srun_train_args(script)
    assert args[:2] == ["--ntasks-per-node=1", "--cpus-per-task=$SLURM_CPUS_ON_NODE"]
    train = args.index("--kill-on-bad-exit=1") + 1
    assert args[train].endswith("train")
    assert args[train + 1 :] == [
        "--nnodes", "$SLURM_NNODES", "--rdzv-endpoint", "$head_node:$rdzv_port", "--rdzv-id", "$SLURM_JOB_ID",
        "--module", "qwen3_titan_native", "--config", "debug", "--max-restarts", "2",
        "--training.steps", "50", "--dump_folder", "runs/a",
    ]  # fmt: skip
    assert "--nproc" not in args  # each node's train counts its own NeuronCores


def test_cpu_and_cuda_scripts_carry_no_neuron_env(capsys):
    cpu = _script(capsys, ["--print-sbatch", "cpu", "--nproc", "2"])
    assert "export QWEN3_TITAN_DEVICE=cpu\n" in cpu and "NEURON_" not in cpu
    assert _srun_train_args(cpu)[-2:] == ["--nproc", "2"]
    cuda = _script(capsys, ["--print-sbatch", "cuda"])
    assert "NEURON_" not in cuda and "QWEN3_TITAN_DEVICE" not in cuda and "--gpus-per-node" in cuda


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash to parse the script")
def test_the_script_is_valid_bash(capsys, tmp_path):
    path = tmp_path / "job.sbatch"
    script = _script(capsys, ["--print-sbatch", "neuron", "--nnodes", "2", "--dump_folder", "my runs/$HOME"])
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert _srun_train_args(script)[-2:] == ["--dump_folder", "my runs/$HOME"]  # quoted, never expanded


def test_an_unknown_device_is_one_line(capsys):
    assert run(NATIVE, ["--print-sbatch", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --print-sbatch: invalid choice: 'tpu'" in err[0], err
