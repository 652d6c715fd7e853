"""The pieces behind "never overwrite": the dump-folder lock, the checkpoints' model record, and how a
rank that stops leaves its one-line error for the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from qwen3_titan_common.assets import debug_moe_architecture, default_architecture
from qwen3_titan_common.components.model_record import (
    RECORD_NAME,
    OtherModelError,
    check_model_record,
    model_record,
    write_model_record,
)
from qwen3_titan_common.train import dump_lock
from qwen3_titan_common.train.dump_lock import DumpFolderBusy, DumpFolderLock, lock_holder


def test_a_second_lock_names_the_holder_and_a_dead_holder_releases_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from qwen3_titan_common.train.dump_lock import DumpFolderLock; "
         f"lock = DumpFolderLock({str(tmp_path)!r}); lock.acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    assert lock_holder(tmp_path) == str(holder.pid)
    with pytest.raises(DumpFolderBusy, match=rf"in use by another training run \(PID {holder.pid}\)"):
        DumpFolderLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    assert lock_holder(tmp_path) is None
    lock = DumpFolderLock(tmp_path)
    lock.acquire()
    assert lock_holder(tmp_path) == str(os.getpid())  # held now, by this process
    lock.release()


def _job(monkeypatch, run_id: str, world: int = 4, local_world: int = 2) -> str | None:
    for name, value in [("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local_world), ("MASTER_ADDR", "node-0"),
                        ("MASTER_PORT", 29500), ("TORCHELASTIC_RUN_ID", run_id)]:  # fmt: skip
        monkeypatch.setenv(name, str(value))
    return dump_lock.job_identity()


def test_rank_0_of_one_job_rejoins_its_lock_and_another_run_is_refused(tmp_path, monkeypatch):
    # flock locks belong to open files, so two locks of one process conflict as two processes' do.
    monkeypatch.setattr(dump_lock, "JOIN_WAIT_SECONDS", 0.3)
    assert _job(monkeypatch, "4242", world=2, local_world=2) is None  # one node holds the folder alone
    other_job = _job(monkeypatch, "4243")
    job = _job(monkeypatch, "4242")
    first, second = DumpFolderLock(tmp_path, job), DumpFolderLock(tmp_path, job)
    first.acquire()
    second.acquire()  # the job's rank 0 restarted by torchrun on another node, the first one's host gone
    assert lock_holder(tmp_path) == str(os.getpid())
    with pytest.raises(DumpFolderBusy, match=r"in use by another training run \(PID \d+, job 4242\)"):
        DumpFolderLock(tmp_path, other_job).acquire()
    with pytest.raises(DumpFolderBusy, match="in use by another training run"):
        DumpFolderLock(tmp_path).acquire()  # a single-node run
    first.release()
    with pytest.raises(DumpFolderBusy):
        DumpFolderLock(tmp_path, other_job).acquire()  # the job holds it while any rank 0 of it does
    second.release()
    alone = DumpFolderLock(tmp_path)
    alone.acquire()
    with pytest.raises(DumpFolderBusy, match="in use by another training run"):
        DumpFolderLock(tmp_path, job).acquire()  # a multi-node job meets a single-node run
    alone.release()
    DumpFolderLock(tmp_path, other_job).acquire()


def test_the_model_record_refuses_another_model_and_accepts_the_same(tmp_path):
    ours = model_record("qwen3", default_architecture())
    write_model_record(tmp_path, ours)
    assert (tmp_path / RECORD_NAME).is_file()
    check_model_record(tmp_path, model_record("qwen3", default_architecture()), step=3, dump_folder="out")
    with pytest.raises(
        OtherModelError, match=r"step 3 .* another model .*moe.num_experts None there, 8 here"
    ):
        check_model_record(
            tmp_path, model_record("qwen3", debug_moe_architecture()), step=3, dump_folder="out"
        )


def test_checkpoints_without_a_record_are_not_judged(tmp_path):
    check_model_record(tmp_path, model_record("qwen3", default_architecture()), step=1, dump_folder="out")


def test_a_rank_that_stops_records_one_line_for_the_launcher_and_prints_no_traceback(tmp_path):
    rank_dir = tmp_path / "ranks" / "0"
    rank_dir.mkdir(parents=True)
    code = (
        "from qwen3_titan_common.errors import UserInputError\n"
        "from qwen3_titan_common.protocols.rank_errors import rank_errors\n"
        "from types import SimpleNamespace\n"
        "with rank_errors(lambda: SimpleNamespace(dump_folder='.', hf=None)):\n"
        "    raise UserInputError('d.jsonl:9: bad')\n"
    )
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(rank_dir / "error.json")}
    env.pop("QWEN3_TITAN_SHOW_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["[stopped] d.jsonl:9: bad"]  # the traceback is in the file only
    recorded = json.loads((rank_dir / "error.json").read_text())["message"]
    assert recorded["message"] == "UserInputError: d.jsonl:9: bad"
    assert "Traceback" in recorded["extraInfo"]["py_callstack"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["0", "error.json", "ranks"]

    # An internal error keeps its traceback, after the one line that says the rank stops.
    internal = code.replace("UserInputError('d.jsonl:9: bad')", "RuntimeError('boom')")
    proc = subprocess.run(
        [sys.executable, "-c", internal], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    lines = proc.stderr.splitlines()
    assert lines[0] == "[stopped] internal error: RuntimeError: boom" and lines[1].startswith("Traceback")
    assert json.loads((rank_dir / "error.json").read_text())["message"]["message"] == "RuntimeError: boom"


def test_out_of_memory_names_the_flags_that_shrink_a_rank(tmp_path, monkeypatch):
    import torch
    from qwen3_titan_common.protocols.rank_errors import translate

    monkeypatch.setenv("RANK", "3")
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 137438953472 bytes. Error code 12 (Cannot allocate memory)"
    )
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = cpu
    for error in (cpu, cuda, wrapped):
        line = str(translate(error, str(tmp_path)))
        assert line.startswith("out of memory in rank 3 (") and "\n" not in line, line
        assert "--training.local_batch_size (--batch-size)" in line and "train --dry-run" in line, line
    assert translate(RuntimeError("shape mismatch"), str(tmp_path)) is None
