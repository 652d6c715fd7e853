"""The real torchtitan Trainer trains on the user's own data, and resumes its data position."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines

TRAIN = str(Path(sys.executable).with_name("train"))
CPU_ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}


def _train(args, cwd):
    proc = subprocess.run([TRAIN, *args], cwd=cwd, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _chat_file(path, n=64):
    with open(path, "w") as f:
        for i in range(n):
            messages = [
                {"role": "user", "content": f"What is {i} times two?"},
                {"role": "assistant", "content": f"{i} times two is {2 * i}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.mark.slow
def test_trainer_trains_on_a_chat_jsonl(tmp_path):
    data = _chat_file(tmp_path / "chat.jsonl")
    log = _train(
        ["--training.steps", "3", "--checkpoint.no-enable", "--dump_folder", str(tmp_path / "out"),
         "--dataloader.dataset", str(data)],
        cwd=tmp_path,
    )  # fmt: skip
    steps = parse_step_lines(log)
    assert [s.step for s in steps] == [1, 2, 3]
    assert all(s.loss > 0 for s in steps)
    # 5% of the 64 records (3) are held out for validation, which training never reads.
    assert f"data: {data} less its 3 held-out records (1 file, 61 records, chat (detected))" in log


@pytest.mark.slow
def test_resumed_run_continues_with_the_next_batch(tmp_path):
    # Same seed, deterministic kernels: steps 3-4 after resuming from the step-2 checkpoint
    # reproduce the uninterrupted run's losses only if the data position was restored too.
    data = tmp_path / "text.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"Document {i}. " + "word " * (i % 50)}) + "\n" for i in range(300))
    )
    args = [
        "--training.steps", "4", "--checkpoint.interval", "2", "--dump_folder", str(tmp_path / "out"),
        "--dataloader.dataset", str(data), "--debug.seed", "0", "--debug.deterministic",
    ]  # fmt: skip
    uninterrupted = {s.step: s.loss for s in parse_step_lines(_train(args, cwd=tmp_path))}
    assert sorted(uninterrupted) == [1, 2, 3, 4]
    shutil.rmtree(tmp_path / "out" / "checkpoint" / "step-4")
    resumed = {s.step: s.loss for s in parse_step_lines(_train(args, cwd=tmp_path))}
    assert sorted(resumed) == [3, 4]
    assert resumed == {3: uninterrupted[3], 4: uninterrupted[4]}
