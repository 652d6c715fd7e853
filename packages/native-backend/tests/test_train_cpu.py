"""The embedded default trains end to end through the real launcher and Trainer."""

import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.assets import default_architecture
from qwen3_titan_common.perf.train_log import parse_step_lines

TRAIN = str(Path(sys.executable).with_name("train"))
CPU_ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
DETERMINISTIC = ["--debug.seed", "0", "--debug.deterministic"]


def _train(args, cwd, env=CPU_ENV):
    proc = subprocess.run([TRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_default_config_trains_logs_and_checkpoints(tmp_path):
    log = _train(["--dump_folder", str(tmp_path / "out")], cwd=tmp_path)
    steps = parse_step_lines(log)
    assert [s.step for s in steps] == list(range(1, 31))
    # Random init predicts the vocabulary nearly uniformly: the first loss is about ln(vocab), as the HF round
    # trip's test bounds it.
    assert abs(steps[0].loss - math.log(default_architecture().vocab_size)) < 0.5
    assert steps[-1].loss < steps[0].loss - 1.5
    assert all(s.tokens_per_second > 0 and s.memory_gib > 0 for s in steps)
    assert "device: cpu x1" in log
    from qwen3_titan_common.perf.precision import default_compute_precision, precision_line

    assert f"[precision] {precision_line(default_compute_precision('cpu').dtype, 'cpu')}" in log
    checkpoint = tmp_path / "out" / "checkpoint" / "step-30"
    assert checkpoint.is_dir() and any(checkpoint.iterdir())


@pytest.mark.slow
def test_resuming_with_another_schedule_says_so_in_one_line(tmp_path):
    # The first run logs every 10th step: its summary counts the steps it trained, not the steps it logged.
    logged = ["--metrics.log_freq", "10"]
    first = _train(["--steps", "2", *logged, "--out", "out"], cwd=tmp_path)
    assert [s.step for s in parse_step_lines(first)] == [1]  # torchtitan logs step 1, then every 10th
    assert "[train] done: steps 1-2 of 2" in first and "(at step 1, the last step line)" in first
    (resume,) = [line for line in first.splitlines() if line.startswith("[train] resume:")]
    assert "--steps 4" in resume and "(from step 2; any --steps above 2)" in resume
    same = _train(["--steps", "3", *logged, "--out", "out"], cwd=tmp_path)
    assert "other settings" not in same  # only --steps changed: the same schedule, lengthened
    changed = ["--lr", "0.001", "--warmup", "1", "--seq-len", "128", "--batch-size", "4"]
    log = _train(["--steps", "4", *logged, *changed, "--out", "out"], cwd=tmp_path)
    (line,) = [x for x in log.splitlines() if "other settings" in x]
    assert "resuming step 3" in line and "param_groups.0.lr 0.003 there, 0.001 here" in line, line
    assert "lr_scheduler.warmup_steps 3 there, 1 here" in line and "apply from step 4" in line, line
    assert "training.seq_len 256 there, 128 here" in line, line
    assert "training.global_batch_size 8 there, 4 here" in line, line


@pytest.mark.slow
def test_printed_command_gives_the_same_run_as_train(tmp_path):
    common = ["--training.steps", "4", "--checkpoint.no-enable", *DETERMINISTIC]
    printed = subprocess.run(
        [TRAIN, "--print-cmd", *common, "--dump_folder", str(tmp_path / "b")],
        cwd=tmp_path, env=CPU_ENV, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    command = shlex.split(printed.strip())
    assert command[0] == "torchrun"
    env = {**CPU_ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{CPU_ENV['PATH']}"}
    by_hand = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    via_train = _train([*common, "--dump_folder", str(tmp_path / "b")], cwd=tmp_path)
    hand_losses = [s.loss for s in parse_step_lines(by_hand.stdout + by_hand.stderr)]
    train_losses = [s.loss for s in parse_step_lines(via_train)]
    assert len(hand_losses) == 4
    assert hand_losses == train_losses
    # torchrun ... -m torchtitan.train with no launcher: the device hook comes from the environment, and with no
    # launcher to print it the rank logs the summary itself.
    assert "[summary] done: steps 1-4 of 4" in by_hand.stdout + by_hand.stderr
    assert (
        "[summary] resume:     no step checkpoint (--checkpoint.no-enable): a rerun starts over"
        in by_hand.stdout + by_hand.stderr
    )


def test_config_functions_take_this_cpus_default_precision(monkeypatch):
    from qwen3_titan_common.perf.precision import cpu_compute_precision, cpu_flags
    from qwen3_titan_native.config_registry import debug

    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    expected = cpu_compute_precision(cpu_flags(), platform.machine())
    assert debug().training.mixed_precision_param == expected.dtype
    # oneDNN capped below its bf16 kernels: fp32 on every machine, whatever its flags.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert debug().training.mixed_precision_param == "float32"


@pytest.mark.slow
def test_a_cpu_without_bf16_instructions_trains_in_fp32_and_says_so(tmp_path):
    # ONEDNN_MAX_CPU_ISA=AVX2 keeps torch's bf16 GEMM off any bf16 instructions this CPU has: the slow kind.
    env = {**CPU_ENV, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    quiet = ["--checkpoint.no-enable", "--hf.no-export", "--validator.no-enable"]
    log = _train(["--steps", "2", *quiet, "--out", "out"], cwd=tmp_path, env=env)
    assert "[precision] fp32 compute (" in log  # the reason: units in common's test_precision.py
    assert [s.step for s in parse_step_lines(log)] == [1, 2]
