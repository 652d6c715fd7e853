"""docs/reliability.md, the rows only a rank can see: the real ``train`` command, real ranks.

Each asserts the exit code, one ``train:`` line naming the culprit, no traceback or torchrun report in
what the user sees, the full text kept in the run's log, and that the user's own files (data, model
directory) are unchanged; a run that started writes only its documented outputs into its dump folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.edges import changes, check_failure, on_small_filesystem, snapshot, unshare_available
from safetensors.torch import load_file, save_file

TRAIN = str(Path(sys.executable).with_name("train"))
# What a run that started may write into its dump folder (docs/reliability.md): its log and lock, and
# torchtitan's own outputs (TensorBoard, communication traces, complete step checkpoints).
RUN_OUTPUTS = ("logs", ".train.lock", "tb", "comm_traces", "checkpoint")
QUICK = ["--checkpoint.no-enable", "--hf.no-export"]
LR_FLAG = "--optimizer.param-groups.0.optimizer-kwargs.lr"  # torchtitan 0.3.0's flag for AdamW's lr
GOOD = json.dumps({"text": "A perfectly fine document with some words in it, and a few more."})

pytestmark = pytest.mark.slow


def _env(tag: str | None = None) -> dict[str, str]:
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    if tag:
        env["QWEN3_TITAN_TEST_TAG"] = tag  # finds every process of this run in /proc afterwards
    return env


def _allowed(dump: Path) -> tuple[Path, ...]:
    return (dump, *(dump / name for name in RUN_OUTPUTS))


def _fails(tmp_path: Path, args: list[str], code: int, *culprit: str, timeout: int = 900) -> str:
    dump = tmp_path / "out"
    before = snapshot(tmp_path)
    proc = subprocess.run(
        [TRAIN, *args, "--dump_folder", str(dump)], cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    failure = check_failure(proc.returncode, proc.stdout, proc.stderr, code, *culprit)
    assert changes(before, snapshot(tmp_path), allowed_under=_allowed(dump)) == []
    logs = list((dump / "logs").glob("train-*.log"))
    assert len(logs) == 1 and "Traceback" in logs[0].read_text(), "the full text belongs in the run's log"
    return failure.line


def _text_file(path: Path, bad_at: int, bad: str, lines: int = 160) -> Path:
    rows = [GOOD] * lines
    rows[bad_at - 1] = bad
    path.write_text("\n".join(rows) + "\n")
    return path


def test_bad_record_deep_in_the_file(tmp_path):
    # Beyond the first records the launcher reads: found by the loader inside the rank. With restarts
    # allowed, the error (which every restart would meet again) still ends the run at once.
    data = _text_file(tmp_path / "d.jsonl", 100, json.dumps({"body": "x"}))
    args = ["--dataloader.dataset", str(data), "--dataloader.no-shuffle", "--training.steps", "40",
            "--training.seq_len", "64", "--training.local_batch_size", "4", "--max-restarts", "2", *QUICK]  # fmt: skip
    _fails(tmp_path, args, 2, "d.jsonl:100", "field 'text' missing", "--dataloader.on_bad_record skip")
    (log,) = (tmp_path / "out" / "logs").glob("train-*.log")
    assert "--max-restarts=2" in log.read_text() and "restarted the ranks" not in log.read_text()


def test_bad_record_in_the_share_of_rank_1(tmp_path):
    # Rank 1's output is not shown on the terminal (torchrun --local-ranks-filter 0): its error comes
    # from its own log (torchrun --log-dir).
    data = _text_file(tmp_path / "d.jsonl", 100, json.dumps({"text": 7}))  # record 99: rank 1 of 2
    args = ["--nproc", "2", "--dataloader.dataset", str(data), "--dataloader.no-shuffle", "--training.steps",
            "40", "--training.seq_len", "64", "--training.local_batch_size", "4", *QUICK]  # fmt: skip
    _fails(tmp_path, args, 2, "d.jsonl:100", "field 'text' is a number")


def test_non_finite_weight_in_the_model_dir(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model")
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    _fails(
        tmp_path, ["--hf-model", str(model), *QUICK], 2, str(model), "layers.1.feed_forward.w2", "NaN or Inf"
    )


def test_loss_that_is_not_finite(tmp_path):
    args = [LR_FLAG, "1e30", "--lr_scheduler.warmup_steps", "0", "--training.steps", "8", *QUICK]
    _fails(tmp_path, args, 2, "the loss is not finite", LR_FLAG)


def test_checkpoints_of_another_model_in_the_readme_order(tmp_path):
    """README: `train` (the embedded default), then `train --hf-model DIR` into the same folder."""
    dump = tmp_path / "out"
    first = subprocess.run(
        [TRAIN, "--training.steps", "2", "--hf.no-export", "--dump_folder", str(dump)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    model = make_tiny_checkpoint(tmp_path / "model")
    before = snapshot(tmp_path)
    proc = subprocess.run(
        [TRAIN, "--hf-model", str(model), "--dump_folder", str(dump)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    check_failure(
        proc.returncode, proc.stdout, proc.stderr, 2, "its checkpoints (newest: step 2", "another model"
    )
    assert changes(before, snapshot(tmp_path)) == []


def test_checkpoint_purge_deletes_only_step_checkpoints(tmp_path):
    """--checkpoint.keep_latest_k deletes old step checkpoints and nothing else a name shares: a user's
    notes, a renamed copy of a real checkpoint (its .metadata inside), a file, a link to a user's folder."""
    dump = tmp_path / "out"
    folder = dump / "checkpoint"
    (folder / "step-1-notes").mkdir(parents=True)
    (folder / "step-1-notes" / "notes.txt").write_text("mine")
    (folder / "run-step-2.txt").write_text("mine too")
    kept_elsewhere = tmp_path / "mine"
    kept_elsewhere.mkdir()
    (kept_elsewhere / "data.txt").write_text("not a checkpoint")
    (folder / "step-0").symlink_to(kept_elsewhere, target_is_directory=True)
    args = ["--training.steps", "5", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2", "--hf.no-export"]  # fmt: skip

    def run() -> None:
        proc = subprocess.run(
            [TRAIN, *args, "--dump_folder", str(dump)], cwd=tmp_path, env=_env(), capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    run()
    shutil.copytree(folder / "step-5", folder / "step-3.bak")  # a real checkpoint, renamed by its user
    users = [tmp_path / "mine", *(folder / name for name in ("step-1-notes", "run-step-2.txt", "step-3.bak"))]
    before = snapshot(*users)
    args[1] = "9"
    run()  # resumes at step 5, saves 6 to 9, keeps the newest 2 of every step-N it wrote before or now
    assert changes(before, snapshot(*users)) == []
    steps = sorted(p.name for p in folder.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit())
    assert steps[-2:] == ["step-8", "step-9"] and "step-1" not in steps and "step-5" not in steps
    assert (folder / "step-0").is_symlink() and (folder / "step-1-notes" / "notes.txt").read_text() == "mine"
    (log,) = sorted((dump / "logs").glob("train-*.log"))[-1:]
    said = [line for line in log.read_text().splitlines() if "Checkpoint purge" in line]
    assert said and all(
        name in said[0] for name in ("step-0", "step-1-notes", "step-3.bak", "run-step-2.txt")
    )


def test_resume_from_a_folder_other_runs_left_or_damaged(tmp_path):
    """A renamed copy of a real checkpoint (step-9.bak, its .metadata inside) and a newer step cut short (an
    empty .metadata): the rerun resumes from the newest step that reads whole, says which it skipped and why,
    and torchtitan loads that same step (not the copy)."""
    dump = tmp_path / "out"
    folder = dump / "checkpoint"
    args = ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--checkpoint.interval", "1", "--hf.no-export", "--validator.no-enable"]  # fmt: skip

    def run(steps: str) -> str:
        args[1] = steps
        proc = subprocess.run(
            [TRAIN, *args, "--dump_folder", str(dump)], cwd=tmp_path, env=_env(), capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    run("2")
    shutil.copytree(folder / "step-2", folder / "step-9.bak")
    shutil.copytree(folder / "step-2", folder / "step-3")
    (folder / "step-3" / ".metadata").write_bytes(b"")
    said = run("3")
    assert "resuming from step 2 in" in said and "step-3 (its .metadata is empty" in said, said[-3000:]
    assert "Training starts at step 3" in said
    assert (folder / "step-3" / ".metadata").stat().st_size > 0  # written whole by the rerun


def _processes_tagged(tag: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"QWEN3_TITAN_TEST_TAG={tag}".encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def _start(tmp_path: Path, args: list[str], tag: str) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """The launcher in a session of its own (as a terminal runs it), its output read as it comes."""
    proc = subprocess.Popen(
        [TRAIN, *args, "--dump_folder", str(tmp_path / "out")], cwd=tmp_path, env=_env(tag),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    stepped = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if any(s.step >= 3 for s in parse_step_lines(line)):
                stepped.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, lines, stepped


def test_ctrl_c_during_training(tmp_path):
    tag = uuid.uuid4().hex
    args = ["--training.steps", "500", "--checkpoint.interval", "2", "--hf.no-export"]
    proc, lines, stepped = _start(tmp_path, args, tag)
    assert stepped.wait(600), "".join(lines)[-3000:]
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the foreground process group
    proc.wait(timeout=300)
    time.sleep(1)
    output = "".join(lines)
    failure = check_failure(
        proc.returncode, "", output, 130, "interrupted at step", "newest complete checkpoint: step"
    )
    assert failure.line.endswith("rerun the same command to resume")
    newest = int(failure.line.split("newest complete checkpoint: step ")[1].split()[0])
    assert newest >= 2 and (tmp_path / "out" / "checkpoint" / f"step-{newest}" / ".metadata").is_file()
    # The rank read it on its way out and left it in its record, so the launcher imported no torch for the line.
    (record,) = (tmp_path / "out" / "logs" / "ranks").glob("*/attempt_0/0/run.json")
    assert json.loads(record.read_text())["interrupted_with_checkpoint"] == newest
    assert _processes_tagged(tag) == [], "processes of the run outlived it"


def test_rank_killed_by_the_system(tmp_path):
    tag = uuid.uuid4().hex
    proc, lines, stepped = _start(tmp_path, ["--training.steps", "500", *QUICK], tag)
    assert stepped.wait(600), "".join(lines)[-3000:]
    ranks = [p for p in _processes_tagged(tag) if b"torchtitan.train" in Path(f"/proc/{p}/cmdline").read_bytes()
             and b"torchrun" not in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
    assert ranks, "no rank process found"
    os.kill(ranks[0], signal.SIGKILL)  # as the kernel's OOM killer does
    proc.wait(timeout=300)
    failure = check_failure(
        proc.returncode,
        "",
        "".join(lines),
        1,
        "rank 0 was killed by SIGKILL",
        "(--batch-size)",
        "the full log is in",
    )
    assert Path(failure.line.split("the full log is in ")[1].split(" (")[0]).is_file()


needs_unshare = pytest.mark.skipif(
    not unshare_available(), reason="needs unshare (user and mount namespaces)"
)


@needs_unshare
def test_dump_folder_on_a_read_only_file_system(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    command = on_small_filesystem(
        [TRAIN, "--dump_folder", str(mount / "out")], mount, size="1m", read_only=True
    )
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    check_failure(proc.returncode, proc.stdout, proc.stderr, 2, "--dump_folder", "read-only file system")


@needs_unshare
def test_checkpoint_folder_that_cannot_be_written_is_found_before_the_first_step(tmp_path):
    # The dump folder is writable; the checkpoint folder (absolute, elsewhere) is not: refused before any step,
    # not at the first save (a real-size config's step 200), and nothing written.
    mount = tmp_path / "ro"
    mount.mkdir()
    args = [TRAIN, "--dump_folder", str(tmp_path / "out"), "--checkpoint.folder", str(mount / "ckpt")]
    command = on_small_filesystem(args, mount, size="1m", read_only=True)
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    check_failure(
        proc.returncode, proc.stdout, proc.stderr, 2, "--checkpoint.folder", "read-only file system"
    )
    assert not (tmp_path / "out").exists()


@needs_unshare
def test_disk_too_small_for_the_first_checkpoint(tmp_path):
    # The embedded default's checkpoint is 55.6 MB on disk (53 MB once passed the old check, then filled up).
    mount = tmp_path / "small"
    mount.mkdir()
    command = on_small_filesystem([TRAIN, "--dump_folder", str(mount / "out")], mount, size="60m")
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    check_failure(
        proc.returncode, proc.stdout, proc.stderr, 2, str(mount / "out"), "not enough free disk space",
        "first step checkpoint", "GB free",
    )  # fmt: skip


@needs_unshare
def test_disk_filled_by_something_else_during_the_run(tmp_path):
    # The run starts with room; another writer fills the disk before the step-3 checkpoint.
    mount = tmp_path / "disk"
    mount.mkdir()
    dump = mount / "out"
    train = [
        TRAIN,
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "3",
        "--hf.no-export",
        "--dump_folder",
        str(dump),
    ]
    run, rc = tmp_path / "run.txt", tmp_path / "rc"  # outside the disk that fills up
    fill = (
        f"( {' '.join(train)} > {run} 2>&1; echo $? > {rc} ) & "
        f"until grep -qE 'step: +1[/ ]' {run} 2>/dev/null; do sleep 0.2; done; "
        f"dd if=/dev/zero of={mount}/filler bs=1M 2>/dev/null; wait; cat {run}; exit $(cat {rc})"
    )
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
               f"mount -t tmpfs -o size=150m tmpfs {mount} && {fill}"]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    check_failure(proc.returncode, "", proc.stdout + proc.stderr, 2, str(dump), "disk")


@needs_unshare
def test_checkpoint_onto_a_full_disk_is_named(tmp_path):
    """DCP wraps each rank's write error in a CheckpointException (a BaseException), and torch.save
    under it reports ENOSPC as `RuntimeError: ... unexpected pos`: the full disk is still named."""
    script = (
        "import torch, torch.distributed.checkpoint as dcp\n"
        "from qwen3_titan_common.protocols.rank_errors import translate\n"
        "try:\n"
        f"    dcp.save({{'w': torch.ones(4 * 1024 * 1024)}}, checkpoint_id={str(tmp_path / 'disk' / 'step-1')!r})\n"
        "except BaseException as err:  # CheckpointException is not an Exception\n"
        f"    print(translate(err, {str(tmp_path / 'disk')!r}))\n"
    )
    (tmp_path / "disk").mkdir()
    command = on_small_filesystem([sys.executable, "-c", script], tmp_path / "disk", size="8m")
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert "the disk filled up (No space left on device)" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert str(tmp_path / "disk") in proc.stdout


@needs_unshare
def test_export_onto_a_full_disk_is_named(tmp_path):
    script = (
        "import torch; from pathlib import Path; "
        "from qwen3_titan_common.hf.export import ExportSpec, export_hf_dir; "
        "from qwen3_titan_common.errors import UserInputError\n"
        f"spec = ExportSpec(out_dir=Path({str(tmp_path / 'disk' / 'step-1')!r}), config={{}}, dtype=torch.float32, "
        "shapes={'w': (10 * 1024 * 1024,)})\n"
        "try:\n"
        "    # 40 MB of tensors, told to need 1 byte: the free-space check passes, the write fills the disk\n"
        "    export_hf_dir(spec, [('w', torch.ones(10 * 1024 * 1024))], expected_bytes=1)\n"
        "except UserInputError as err:\n"
        "    print(err)\n"
    )
    (tmp_path / "disk").mkdir()
    command = on_small_filesystem([sys.executable, "-c", script], tmp_path / "disk", size="32m")
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert "the disk filled up while writing the export" in proc.stdout, proc.stdout + proc.stderr
    assert str(tmp_path / "disk" / "step-1") in proc.stdout
