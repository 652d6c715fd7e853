"""The pieces behind "never overwrite": the dump-folder lock, the checkpoints' model record, and the
channel a rank's one-line error takes to the launcher."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from qwen3_titan_common.assets import debug_moe_architecture, default_architecture
from qwen3_titan_common.runtime import dump_lock
from qwen3_titan_common.runtime.dump_lock import DumpFolderBusy, DumpFolderLock, job_identity, lock_holder
from qwen3_titan_common.runtime.error_channel import CHANNEL_ENV, ErrorChannel
from qwen3_titan_common.train.model_record import (
    RECORD_NAME,
    OtherModelError,
    check_model_record,
    model_record,
    write_model_record,
)


def test_a_second_lock_names_the_holder_and_a_dead_holder_releases_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from qwen3_titan_common.runtime.dump_lock import DumpFolderLock; "
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


def test_launchers_of_one_job_share_the_lock_and_another_run_is_refused(tmp_path, monkeypatch):
    # flock locks belong to open files, so two locks of one process conflict as two processes' do.
    monkeypatch.setattr(dump_lock, "JOIN_WAIT_SECONDS", 0.3)
    job = job_identity(2, "node-0:29500", "4242")
    assert job_identity(1, "localhost:0", None) is None  # a single-node run holds the folder alone
    first, second = DumpFolderLock(tmp_path, job), DumpFolderLock(tmp_path, job)
    first.acquire()
    second.acquire()  # the job's launcher on the other node
    assert lock_holder(tmp_path) == str(os.getpid())
    other_job = job_identity(2, "node-0:29500", "4243")
    with pytest.raises(
        DumpFolderBusy, match=r"in use by another training run \(PID \d+, job node-0:29500/4242\)"
    ):
        DumpFolderLock(tmp_path, other_job).acquire()
    with pytest.raises(DumpFolderBusy, match="in use by another training run"):
        DumpFolderLock(tmp_path).acquire()  # a single-node run
    first.release()
    with pytest.raises(DumpFolderBusy):
        DumpFolderLock(tmp_path, other_job).acquire()  # the job holds it while any launcher of it does
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


def test_a_rank_error_reaches_the_launcher_without_any_file(tmp_path):
    channel = ErrorChannel()
    try:
        env = {**os.environ, **channel.env(), "RANK": "1"}
        subprocess.run(
            [sys.executable, "-c", "from qwen3_titan_common.runtime.error_channel import report; report('d.jsonl:9: bad')"],
            env=env, check=True, cwd=tmp_path,
        )  # fmt: skip
        assert channel.messages() == [(1, "d.jsonl:9: bad")]
        assert channel.messages() == []
    finally:
        channel.close()
    assert CHANNEL_ENV in channel.env() and list(tmp_path.iterdir()) == []
