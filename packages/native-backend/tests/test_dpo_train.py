"""Preference training (``--objective dpo``) through the real launcher on the embedded pairs.

Step 1 starts with the policy equal to the reference, so its loss is ln 2; a resumed run reads the reference
log-probabilities the first run computed and trains on as the uninterrupted run does; FSDP over 2 ranks trains
what one rank trains. (LoRA, and one pair per row: the nki-moe and hf-v5 backends' tests; the objective and the
data that do not agree, and bad pairs: test_reliability_launcher.py and common's test_preference.py.)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.preference import EXACT, PAIRS, assert_starts_at_ln2, dpo_flags, loss_bound

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}


def _train(args, cwd):
    proc = subprocess.run([TRAIN, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dpo") / "source")


@pytest.fixture(scope="module")
def dpo_run(source):
    out = source.parent / "out"
    log = _train(
        [
            *dpo_flags(source.parent),
            "--hf-model",
            str(source),
            *EXACT,
            "--steps",
            "3",
            "--checkpoint-every",
            "2",
            "--out",
            str(out),
        ],  # fmt: skip
        source.parent,
    )
    return out, log


@pytest.mark.slow
def test_step_one_is_ln2_and_the_line_shows_the_pairs(source, dpo_run):
    out, log = dpo_run
    steps = parse_step_lines(log)
    assert [s.step for s in steps] == [1, 2, 3]
    assert_starts_at_ln2(log, source)
    assert steps[2].loss != steps[0].loss  # it trains
    assert "prompt computed once per pair" in log  # the block-sparse attention reads continuations
    assert f"[dpo] reference log-probabilities of {PAIRS} pairs computed by the starting model" in log
    assert (out / "reference_logps.safetensors").is_file()
    card = (out / "hf" / "step-3" / "README.md").read_text()
    assert (
        "| objective | DPO on preference pairs: sigmoid loss, beta 0.1; reference: the starting model |"
        in card
    )
    assert "- dpo" in card  # the Hub's tag


@pytest.mark.slow
def test_resume_reads_the_reference_and_trains_as_the_straight_run(dpo_run):
    out, log = dpo_run
    resumed = out.parent / "resumed"
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("step-3", "hf", "tb"))
    again = _train(
        [
            *dpo_flags(out.parent),
            "--hf-model",
            str(out.parent / "source"),
            *EXACT,
            "--steps",
            "3",
            "--out",
            str(resumed),
        ],
        out.parent,
    )
    assert f"reference log-probabilities of {PAIRS} pairs read from" in again
    (straight,) = [s for s in parse_step_lines(log) if s.step == 3]
    (step,) = parse_step_lines(again)
    assert step.step == 3 and step.loss == straight.loss


@pytest.mark.slow
def test_fsdp_on_two_ranks_trains_what_one_rank_trains(source, dpo_run):
    """The same global batch of 8 rows, 4 on each rank: the pairs' mean over both ranks is one rank's."""
    _, log = dpo_run
    out = source.parent / "fsdp"
    fsdp = _train(
        [
            *dpo_flags(source.parent),
            "--hf-model",
            str(source),
            *EXACT,
            "--nproc",
            "2",
            "--batch-size",
            "4",
            "--steps",
            "3",
            "--checkpoint.no-enable",
            "--hf.no-export",
            "--out",
            str(out),
        ],  # fmt: skip
        source.parent,
    )
    assert f"reference log-probabilities of {PAIRS} pairs computed" in fsdp
    one, two = parse_step_lines(log), parse_step_lines(fsdp)
    assert [s.step for s in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        assert abs(a.loss - b.loss) <= loss_bound(source, a.step), (a, b)
