"""Phase progress, the step line's step/total and ETA, the end-of-run summary, and where outputs go."""

from __future__ import annotations

import json
import time
from pathlib import Path

from qwen3_titan_common.perf.progress import Phase, format_duration
from qwen3_titan_common.perf.run_progress import RunProgress
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_common.protocols.summary import RunSummary, report, summary_lines, with_steps
from qwen3_titan_common.train.outputs import OutputDefaults, model_dir_tag, run_dump_folder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_phase_is_silent_for_5_s_then_reports_every_5_s_and_its_end():
    clock, lines = Clock(), []
    with Phase("export to d", total=8e9, unit="B", log=lines.append, clock=clock) as phase:
        clock.now += 4
        phase.advance(2e9)
        assert lines == []  # most phases end within 5 s: nothing to say
        clock.now += 2
        phase.advance(2e9)
        clock.now += 1
        phase.advance(1e9)  # within 5 s of the last line
        clock.now += 5
        phase.advance(1e9)
    assert lines == [
        "[progress] export to d: 4.00 GB of 8.00 GB (50%), 6s, about 6s left",
        "[progress] export to d: 6.00 GB of 8.00 GB (75%), 12s, about 4s left",
        "[progress] export to d: done in 12s",
    ]


def test_a_short_phase_says_nothing():
    clock, lines = Clock(), []
    with Phase("indexing f", total=10, log=lines.append, clock=clock) as phase:
        clock.now += 1
        phase.advance(10)
    assert lines == []


def test_a_phase_of_unknown_length_beats_from_a_thread():
    lines = []
    with Phase("loading the checkpoint", log=lines.append, quiet_seconds=0.05, every_seconds=0.05):
        deadline = time.monotonic() + 5
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert lines[0].startswith("[progress] loading the checkpoint: ") and lines[0].endswith(" so far")
    assert lines[-1].startswith("[progress] loading the checkpoint: done in")


def test_durations_read_as_people_write_them():
    assert [format_duration(s) for s in (4.4, 65, 3600 * 2 + 7 * 60 + 59)] == ["4s", "1m05s", "2h07m"]


def test_eta_comes_from_the_steps_after_the_first():
    progress = RunProgress(total_steps=30)
    progress.record(1, 8.3, tokens=2048, seconds=20.0, memory_gib=1.1)  # compile, warm-up
    assert progress.eta_seconds() is None
    progress.record(2, 8.1, tokens=2048, seconds=0.5, memory_gib=1.3)
    progress.record(4, 7.9, tokens=4096, seconds=1.0, memory_gib=1.2)
    assert progress.eta_seconds() == 26 * 0.5
    assert progress.tokens_per_second() == 6144 / 1.5
    assert (progress.first_loss, progress.final_loss, progress.peak_memory_gib) == (8.3, 7.9, 1.3)
    assert progress.tokens == 8192 and progress.steps_done == 4


def test_the_step_line_parser_reads_total_and_eta():
    log = (
        "[rank0]: step:  9/30  loss:  7.61039  grad_norm:  2.0994  tps: 4,212  tflops: 0.12  mfu: n/a  "
        "memory: 1.27GiB (host RSS)  eta: 1m05s\n"
        "[rank0]: step:  1/30  loss:  8.34918  grad_norm:  3.6290  tps: 102  tflops: 0.00  mfu: n/a  "
        "memory: 1.18GiB (host RSS)  eta: --\n"
    )
    first, second = parse_step_lines(log)
    assert (first.step, first.total_steps, first.eta_seconds, first.loss) == (9, 30, 65, 7.61039)
    assert (second.step, second.eta_seconds) == (1, None)


SUMMARY = RunSummary(
    first_step=1, last_step=30, total_steps=30, tokens=61440, train_seconds=12.0, tokens_per_second=5120.0,
    first_loss=8.349, final_loss=5.871, peak_memory_gib=1.27, memory_source="host RSS",
    checkpoint="/runs/o/checkpoint/step-30", export="/runs/o/hf/step-30",
)  # fmt: skip


def test_the_summary_says_how_it_went_and_what_comes_next():
    command = ["uv", "run", "--package", "native-backend", "train", "--training.steps", "30", "--lr", "1e-3"]
    lines = summary_lines(SUMMARY, command=command, python=["uv", "run", "python"], wall_seconds=75)
    assert lines[0] == (
        "done: steps 1-30 of 30 in 1m15s; 61,440 tokens, 5,120 tokens/s; loss 8.349 -> 5.871; "
        "peak memory 1.27GiB (host RSS)"
    )
    assert "checkpoint: /runs/o/checkpoint/step-30" in lines and "export:     /runs/o/hf/step-30" in lines
    resume = next(line for line in lines if line.startswith("resume:"))
    assert "uv run --package native-backend train --lr 1e-3 --steps 60   (from step 30" in resume
    assert "verify:     uv run verify-checkpoint /runs/o/hf/step-30" in lines
    load = next(line for line in lines if line.startswith("load:"))
    assert (
        load.startswith("load:       uv run python -c ") and 'from_pretrained("/runs/o/hf/step-30")' in load
    )


def test_the_summary_of_several_ranks_says_all_ranks_and_one_ranks_tokens_per_second():
    import dataclasses

    (done, *_) = summary_lines(dataclasses.replace(SUMMARY, ranks=2))
    assert "61,440 tokens, 5,120 tokens/s over 2 ranks (2,560 per rank, the step lines' tps);" in done


def test_the_summary_without_checkpoints_says_a_rerun_starts_over(tmp_path):
    import dataclasses

    lines = summary_lines(dataclasses.replace(SUMMARY, checkpoint=None, export=None))
    assert any("a rerun starts over" in line for line in lines)
    assert not any(line.startswith(("verify:", "load:")) for line in lines)


def test_with_steps_replaces_every_spelling():
    assert with_steps(["train", "--steps=5", "--training.steps", "7", "--training_steps", "--x"], 10) == [
        "train", "--training_steps", "--x", "--steps", "10",
    ]  # fmt: skip


def test_a_run_from_another_model_dir_gets_its_own_default_folder(tmp_path):
    defaults = OutputDefaults("./outputs/native-debug")
    model = tmp_path / "Qwen3-0.6B"
    assert (
        run_dump_folder("./outputs/native-debug", str(model), defaults)
        == "./outputs/native-debug-from-Qwen3-0.6B"
    )
    # Our own export names the run it came from.
    export = tmp_path / "outputs" / "native-debug" / "hf" / "step-30"
    assert model_dir_tag(str(export)) == "native-debug-step-30"
    # An explicit folder, no model dir, or the config's own model dir: unchanged.
    assert run_dump_folder("/mine", str(model), defaults) == "/mine"
    assert run_dump_folder("./outputs/native-debug", None, defaults) == "./outputs/native-debug"
    recipe = OutputDefaults("./outputs/native-native_qwen3_4b", str(model))
    assert run_dump_folder(recipe.dump_folder, str(Path(model)), recipe) == recipe.dump_folder


def test_the_run_record_is_what_the_launcher_reads_after_torchrun(tmp_path, monkeypatch):
    """A node's first local rank rewrites one file as the run goes (folders, the last step, the summary);
    its other ranks, and a rank the launcher did not start (its config names no launcher command), write none."""
    from qwen3_titan_common.protocols.summary import RUN_FILE, LauncherOptions, RunRecord, RunSummary

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    launched = LauncherOptions(command="train --steps 30")
    record = RunRecord.of_rank(launched, dump_folder="out", checkpoint_folder="out/checkpoint")
    assert record.folder == tmp_path
    assert RunRecord.read(tmp_path / RUN_FILE) is None  # none yet
    record.save()
    assert RunRecord.read(tmp_path / RUN_FILE) == record
    # Where it is written is not part of it.
    assert set(json.loads((tmp_path / RUN_FILE).read_text())) == {
        "dump_folder",
        "checkpoint_folder",
        "last_step",
        "summary",
        "interrupted_with_checkpoint",
    }
    record.last_step = 27
    record.summary = RunSummary(
        first_step=1, last_step=27, total_steps=30, tokens=10, train_seconds=1.0, tokens_per_second=10.0,
        first_loss=8.0, final_loss=7.0, peak_memory_gib=None, memory_source="host RSS", checkpoint=None, export=None,
    )  # fmt: skip
    record.save()
    assert RunRecord.read(tmp_path / RUN_FILE) == record
    lines = []
    report(record.summary, record, lines.append)
    assert lines == []  # the launcher prints it
    for other_rank, launcher in (("1", launched), ("0", LauncherOptions())):
        monkeypatch.setenv("LOCAL_RANK", other_rank)
        other = RunRecord.of_rank(launcher, dump_folder="out", checkpoint_folder="out/checkpoint")
        assert other.folder is None
        other.last_step = 28
        other.save()
        assert RunRecord.read(tmp_path / RUN_FILE).last_step == 27
    # A bare torchrun: the rank logs its summary itself.
    report(record.summary, other, lines.append)
    assert lines[0].startswith("[summary] done: steps 1-27 of 30")
