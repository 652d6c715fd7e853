"""Preference training (``--objective dpo``) through the real launcher on the embedded pairs.

Step 1 starts with the policy equal to the reference, so its loss is ln 2; validation scores the held-out
pairs against their own reference, and ``eval`` of the export scores them as the last validation did; a
resumed run reads both references the first run computed and trains on as the uninterrupted run does; FSDP,
tensor, context and pipeline parallelism over 2 ranks train what one rank trains, FSDP and pipeline parallelism
with the reference live (``--dpo.reference live``), which a resume on one rank reads back from the checkpoint,
tensor and context parallelism with fixed shapes (``--dpo.fixed_shapes on``, Neuron's default). (LoRA, and one pair per row: the nki-moe and
hf-v5 backends' tests; the objective and the data that do not agree, and bad pairs:
test_reliability_launcher.py and common's test_preference.py.)
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines, parse_validation_lines
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.preference import (
    EXACT,
    PAIRS,
    SEQ_LEN,
    VALIDATION,
    assert_starts_at_ln2,
    dpo_flags,
    held_out_pairs,
    loss_bound,
    rescored_bound,
    validation_bound,
)

TRAIN = str(Path(sys.executable).with_name("train"))
EVAL = str(Path(sys.executable).with_name("eval"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}


def _train(args, cwd):
    proc = subprocess.run([TRAIN, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    # Untied, so that pipeline stages can hold the two ends.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dpo") / "source", tied=False)


@pytest.fixture(scope="module")
def dpo_run(source):
    out = source.parent / "out"
    log = _train(
        [
            *dpo_flags(source.parent),
            "--hf-model",
            str(source),
            *EXACT,
            *VALIDATION,
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


def _two_ranks(source, name, layout, checkpoints=("--checkpoint.no-enable", "--hf.no-export")):
    """The run of ``dpo_run`` on 2 ranks laid out by ``layout`` (the same global batch of 8 rows)."""
    return _train(
        [
            *dpo_flags(source.parent),
            "--hf-model",
            str(source),
            *EXACT,
            *VALIDATION,
            "--nproc",
            "2",
            *layout,
            "--steps",
            "3",
            *checkpoints,
            "--out",
            str(source.parent / name),
        ],  # fmt: skip
        source.parent,
    )


def _assert_trains_what_one_rank_trains(source, one, two):
    steps_one, steps_two = parse_step_lines(one), parse_step_lines(two)
    assert [s.step for s in steps_two] == [1, 2, 3]
    for a, b in zip(steps_one, steps_two, strict=True):
        assert abs(a.loss - b.loss) <= loss_bound(source, a.step), (a, b)
    validations_one, validations_two = parse_validation_lines(one), parse_validation_lines(two)
    assert [v.step for v in validations_two] == [1, 2, 3]
    for a, b in zip(validations_one, validations_two, strict=True):
        assert abs(a.loss - b.loss) <= validation_bound(source, a.step), (a, b)


@pytest.mark.slow
def test_step_one_is_ln2_and_the_line_shows_the_pairs(source, dpo_run):
    out, log = dpo_run
    steps = parse_step_lines(log)
    assert [s.step for s in steps] == [1, 2, 3]
    assert_starts_at_ln2(log, source)
    assert steps[2].loss != steps[0].loss  # it trains
    assert "prompt computed once per pair" in log  # the block-sparse attention reads continuations
    trained = PAIRS - held_out_pairs()
    assert f"[dpo] reference log-probabilities of {trained} pairs computed by the starting model" in log
    assert f"[dpo] reference log-probabilities of {held_out_pairs()} held-out pairs computed" in log
    assert (out / "reference_logps.safetensors").is_file()
    assert (out / "reference_logps_validation.safetensors").is_file()
    card = (out / "hf" / "step-3" / "README.md").read_text()
    assert (
        "| objective | DPO on preference pairs: sigmoid loss, beta 0.1; reference: the starting model, precomputed "
        "before step 1 |" in card
    )
    assert "- dpo" in card  # the Hub's tag


@pytest.mark.slow
def test_validation_scores_held_out_pairs_and_eval_of_the_export_agrees(source, dpo_run):
    out, log = dpo_run
    validations = parse_validation_lines(log)
    assert [v.step for v in validations] == [1, 2, 3]
    assert all(v.perplexity is None and v.accuracy_percent is not None for v in validations)
    assert validations[0].loss != validations[2].loss
    proc = subprocess.run(
        [
            EVAL,
            str(out / "hf" / "step-3"),
            "--dataset",
            str(source.parent / "pairs.jsonl"),
            "--records",
            "held_out",
            "--reference",
            str(source),
            "--seq-len",
            str(SEQ_LEN),
            "--json",
        ],  # fmt: skip
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(proc.stdout)["results"]
    assert result["pairs"] == held_out_pairs()
    loss_atol, margin_atol = rescored_bound(source)
    assert abs(result["loss"] - validations[-1].loss) <= loss_atol, (result, validations[-1])
    assert abs(result["margin"] - validations[-1].margin) <= margin_atol, (result, validations[-1])


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
            *VALIDATION,
            "--steps",
            "3",
            "--out",
            str(resumed),
        ],
        out.parent,
    )
    assert f"reference log-probabilities of {PAIRS - held_out_pairs()} pairs read from" in again
    assert f"reference log-probabilities of {held_out_pairs()} held-out pairs read from" in again
    (straight,) = [s for s in parse_step_lines(log) if s.step == 3]
    (step,) = parse_step_lines(again)
    assert step.step == 3 and step.loss == straight.loss
    (validated,) = parse_validation_lines(again)
    assert validated == parse_validation_lines(log)[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        # Each rank holds half the vocabulary: the log-probabilities gather it chunk by chunk. With fixed shapes
        # (Neuron's default): every token of the rows projected, the pairs in B x L / 2 slots.
        ["--parallelism.tensor_parallel_degree", "2", "--dpo.fixed_shapes", "on"],
        # Each rank holds half of every row's tokens: a pair's sums add both ranks' shares.
        ["--parallelism.context_parallel_degree", "2"],
        ["--parallelism.context_parallel_degree", "2", "--dpo.fixed_shapes", "on"],
        # Each rank holds half the layers, the last stage the loss: 8 micro-batches of a row each, scored by the
        # live reference through the pipeline schedule before each step.
        ["--parallelism.pipeline_parallel_degree", "2", "--dpo.reference", "live"],
    ],
    ids=["tp-2-fixed", "cp-2", "cp-2-fixed", "pp-2-live"],
)
def test_two_ranks_train_what_one_rank_trains(source, dpo_run, layout):
    _, log = dpo_run
    two = _two_ranks(source, "-".join(layout).strip("-").replace(".", "_"), layout)
    assert ("fixed shapes (every token of the rows projected" in two) == ("--dpo.fixed_shapes" in layout)
    if "live" in layout:
        assert "[dpo] reference: live, the starting values of" in two
        assert f"of {PAIRS - held_out_pairs()} pairs computed" not in two  # no pass before step 1
    else:
        assert f"reference log-probabilities of {PAIRS - held_out_pairs()} pairs computed" in two
    _assert_trains_what_one_rank_trains(source, log, two)


@pytest.fixture(scope="module")
def live_fsdp_run(source):
    """``dpo_run`` with the reference live, on 2 ranks of 4 rows each (FSDP), checkpointed at step 2."""
    return _two_ranks(
        source, "live-fsdp-2", ["--batch-size", "4", "--dpo.reference", "live"], ["--checkpoint-every", "2"]
    )


@pytest.mark.slow
def test_live_reference_over_fsdp_trains_what_the_precomputed_one_does(source, dpo_run, live_fsdp_run):
    """The starting weights swapped in before each step score its pairs as the pass before step 1 did: the
    same losses within the bound of the layout (the pairs' mean over both ranks is one rank's)."""
    _, log = dpo_run
    assert "[dpo] reference: live, the starting values of" in live_fsdp_run
    assert not (source.parent / "live-fsdp-2" / "reference_logps.safetensors").exists()
    card = (source.parent / "live-fsdp-2" / "hf" / "step-3" / "README.md").read_text()
    assert "reference: the starting model, live (a frozen copy scores each step's pairs)" in card
    _assert_trains_what_one_rank_trains(source, log, live_fsdp_run)


@pytest.mark.slow
def test_live_reference_resumes_from_the_checkpoint_on_one_rank(source, live_fsdp_run):
    """The reference's weights come back from step 2's checkpoint (resharded onto one rank), not from the
    resumed weights: step 3 and its validation are the straight run's within the bound of the layout."""
    run = source.parent / "live-fsdp-2"
    resumed = source.parent / "live-resumed"
    shutil.copytree(run, resumed, ignore=shutil.ignore_patterns("step-3", "hf", "tb"))
    again = _train(
        [
            *dpo_flags(source.parent),
            "--hf-model",
            str(source),
            *EXACT,
            *VALIDATION,
            "--dpo.reference",
            "live",
            "--steps",
            "3",
            "--hf.no-export",
            "--out",
            str(resumed),
        ],  # fmt: skip
        source.parent,
    )
    assert "swapped in to score each step's pairs; read back from step 2's checkpoint" in again
    (straight,) = [s for s in parse_step_lines(live_fsdp_run) if s.step == 3]
    (step,) = parse_step_lines(again)
    assert step.step == 3 and abs(step.loss - straight.loss) <= loss_bound(source, 3), (step, straight)
    (validated,) = parse_validation_lines(again)
    assert abs(validated.loss - parse_validation_lines(live_fsdp_run)[-1].loss) <= validation_bound(source, 3)
