"""Validation while training and ``eval`` of the export agree, on every backend, through the real launcher.

Runs are fp32 end to end and deterministic, so the two must give the same loss on the same held-out rows:
the validation line of the last step and ``eval`` of that step's export, through the backend's own model.
"""

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines, parse_validation_lines
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint

BIN = Path(sys.executable).parent
EXACT = ["--training.mixed_precision_param", "float32", "--debug.seed", "0", "--debug.deterministic"]
# The debug configs' validation: 3 batches of 8 x 256 (RunShape.validation_batches) is eval's --max-batches 3.
EVAL_SHAPE = ["--seq-len", "256", "--batch-size", "8", "--max-batches", "3"]
EVAL_TOKENS, EVAL_SEQ_LEN = 3 * 8 * 256, 256
# The validation line prints val_loss with 5 decimals and val_ppl with 2: each printed value is off by half a unit.
PRINTED_LOSS, PRINTED_PPL = 0.5e-5, 0.005


def _loss_bound(loss: float, model_dir: Path) -> float:
    """Two fp32 evaluations of one model on the eval rows: the derived bound (see the tolerance module)."""
    return ModelBounds.from_dir(model_dir).loss_atol(loss, tokens=EVAL_TOKENS, seq_len=EVAL_SEQ_LEN)


def _env(backend: str) -> dict[str, str]:
    return {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": backend, "OMP_NUM_THREADS": "1"}


def _run(command: list[str], cwd: Path, backend: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=cwd, env=_env(backend), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train(backend: str, *args, cwd: Path) -> str:
    proc = _run([str(BIN / "train"), *map(str, args)], cwd, backend)
    return proc.stdout + proc.stderr


def _eval(backend: str, *args, cwd: Path) -> dict:
    return json.loads(_run([str(BIN / "eval"), *map(str, args), "--json"], cwd, backend).stdout)


STEPS = 12
VALIDATED = ["--training.steps", STEPS, "--validator.freq", 5, "--checkpoint.no-enable", *EXACT]


@pytest.fixture(scope="module")
def validated_run(tmp_path_factory):
    """A backend's run of 12 steps validated at steps 1, 5, 10 and 12, exported: (its dump folder, its log),
    run once for every test that reads it."""

    @functools.cache
    def run(backend: str, config: str) -> tuple[Path, str]:
        out = tmp_path_factory.mktemp(backend) / "out"
        return out, _train(backend, "--config", config, *VALIDATED, "--dump_folder", out, cwd=out.parent)

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "config"),
    [("native-backend", "debug"), ("hf-v5-backend", "debug"), ("nki-moe-backend", "debug_moe")],
)
def test_eval_of_the_export_equals_the_last_validation(validated_run, tmp_path, backend, config):
    steps = STEPS
    out, log = validated_run(backend, config)
    validations = parse_validation_lines(log)
    assert [v.step for v in validations] == [1, 5, 10, 12]
    # exp of the printed loss is off by exp(loss) x its rounding (to first order), the printed perplexity by its own.
    for v in validations:
        assert abs(v.perplexity - math.exp(v.loss)) <= PRINTED_PPL + 2 * math.exp(v.loss) * PRINTED_LOSS, v
    assert validations[-1].loss < validations[0].loss
    assert "[validation] the held-out 5% of the embedded corpus" in log
    report = _eval(
        backend,
        out / "hf" / f"step-{steps}",
        "--backend",
        backend,
        "--random-init",
        *EVAL_SHAPE,
        cwd=tmp_path,
    )
    trained, random_init = report["results"]
    print(f"{backend}: validation at step {steps} {validations[-1].loss:.5f}, eval {trained['loss']:.5f}, "
          f"random init {random_init['loss']:.5f}, ln(vocab) {report['ln_vocab']:.4f}")  # fmt: skip
    assert report["model"] == backend
    assert trained["tokens"] == 3 * 8 * 256  # three full batches of held-out text
    export = out / "hf" / f"step-{steps}"
    assert abs(trained["loss"] - validations[-1].loss) <= _loss_bound(trained["loss"], export) + PRINTED_LOSS
    assert abs(random_init["loss"] - report["ln_vocab"]) < 0.3
    assert trained["loss"] < random_init["loss"] - 1.0


@pytest.mark.slow
def test_validation_leaves_training_unchanged(validated_run, tmp_path):
    _, with_validation = validated_run("native-backend", "debug")
    without = _train(
        "native-backend", *VALIDATED, "--validator.no-enable", "--hf.no-export", "--dump_folder", tmp_path / "b",
        cwd=tmp_path,
    )  # fmt: skip
    assert [v.step for v in parse_validation_lines(with_validation)] == [1, 5, 10, 12]
    assert not parse_validation_lines(without)
    # The held-out part stays out of training either way, and validating consumes no training data.
    losses = [[s.loss for s in parse_step_lines(log)] for log in (with_validation, without)]
    assert len(losses[0]) == STEPS and losses[0] == losses[1]


@pytest.mark.slow
def test_two_rank_validation_equals_one_rank_and_eval(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "source")
    # A learning rate of 0: step 1 leaves the weights as loaded, so every run validates the same model.
    common = [
        "--hf-model", source, "--training.steps", 1, "--optimizer.param-groups.0.optimizer-kwargs.lr", 0,
        "--checkpoint.no-enable", "--hf.no-export", *EXACT,
    ]  # fmt: skip
    one = _train(
        "native-backend",
        *common,
        "--training.local_batch_size",
        8,
        "--dump_folder",
        tmp_path / "one",
        cwd=tmp_path,
    )
    two = _train(
        "native-backend", "--nproc_per_node", 2, *common, "--training.local_batch_size", 4,
        "--dump_folder", tmp_path / "two", cwd=tmp_path,
    )  # fmt: skip
    assert "dp_shard=2" in two
    # --checkpoint.no-enable with --hf-model: the weights load through the checkpoint manager, no step is saved.
    assert not (tmp_path / "one" / "checkpoint").exists() and not (tmp_path / "two" / "checkpoint").exists()
    assert "resume:     no step checkpoint (--checkpoint.no-enable)" in one
    assert " WARNING " not in one and "[schedule] 1 step(s): warmup 1 step(s)" in one  # a 1-step run, fitted
    (single,), (double,) = parse_validation_lines(one), parse_validation_lines(two)
    assert single.step == double.step == 1
    report = _eval("native-backend", source, *EVAL_SHAPE, cwd=tmp_path)
    print(
        f"validation: 1 rank {single.loss:.5f}, 2 ranks {double.loss:.5f}; eval {report['results'][0]['loss']:.5f}"
    )
    # Learning rate 0: every side is one fp32 evaluation of the source on the same rows, split another way.
    bound = _loss_bound(single.loss, source)
    assert abs(single.loss - double.loss) <= bound + 2 * PRINTED_LOSS
    assert abs(report["results"][0]["loss"] - single.loss) <= bound + PRINTED_LOSS
