"""Preference training on the Qwen3-MoE kernel backend (reference kernels on the CPU), from the debug MoE model's
random weights (the policy is its own reference whatever they are): step 1 at ln 2, packed with the prompt shared
and one pair per row with LoRA, and expert parallelism over 2 ranks with fixed shapes (Trainium's default)
training what one rank trains."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.assets import default_pairs_path
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_common.train.tolerance import ModelBounds

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "nki-moe-backend"}
SEQ_LEN, BETA, STEPS = 256, 0.1, 3
PRINTED_LOSS, PRINTED_MARGIN = 0.5e-5, 0.5e-4
PAIRS = 64  # of the embedded set: the reference pass before step 1 reads every pair
FLAGS = [
    "--objective", "dpo", "--training.seq_len", str(SEQ_LEN), "--training.mixed_precision_param", "float32",
    "--debug.seed", "0", "--steps", str(STEPS),
]  # fmt: skip


def _train(out: Path, *flags: str) -> str:
    pairs = out.parent / "pairs.jsonl"
    if not pairs.exists():
        pairs.write_text("\n".join(default_pairs_path().read_text().splitlines()[:PAIRS]) + "\n")
    proc = subprocess.run(
        [TRAIN, *FLAGS, "--dataloader.dataset", str(pairs), *flags, "--out", str(out)], cwd=out.parent, env=ENV,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    return log


def _h_bound(export: Path, passes: int) -> float:
    """A pair's h between two computations (the bound's scale from the export, a few steps from the start)."""
    return ModelBounds.from_dir(export).log_ratio_atol(tokens=SEQ_LEN, seq_len=SEQ_LEN, passes=passes)


def _assert_starts_at_ln2(log: str, export: Path) -> None:
    # The reference pass and step 1 are a forward each; the loss moves by beta / 2 per unit of h at h = 0.
    h = _h_bound(export, passes=2)
    step = parse_step_lines(log)[0]
    assert step.step == 1 and abs(step.loss - math.log(2)) <= PRINTED_LOSS + BETA / 2 * h, step
    (line,) = [x for x in log.splitlines() if re.search(r"step:\s+1/", x)]
    assert abs(float(re.search(r"margin: (-?[0-9.]+)", line).group(1))) <= BETA * h + PRINTED_MARGIN, line


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo-moe") / "one-rank"
    return out, _train(out, "--batch-size", "8")


@pytest.mark.slow
def test_packed_starts_at_ln2(one_rank):
    out, log = one_rank
    assert "prompt computed once per pair" in log
    _assert_starts_at_ln2(log, out / "hf" / f"step-{STEPS}")


@pytest.mark.slow
def test_unpacked_with_lora_starts_at_ln2(tmp_path):
    out = tmp_path / "lora"
    log = _train(out, "--dataloader.no-packing", "--lora.rank", "4", "--lora.merge", "--steps", "1")
    assert "one pair per row" in log
    _assert_starts_at_ln2(log, out / "hf" / "step-1")


@pytest.mark.slow
def test_expert_parallel_trains_what_one_rank_trains(one_rank, tmp_path):
    """The same global batch of 8 rows over EP 2 (4 rows a rank): step k's loss within the rounding of 2k - 1
    forward passes, carried through h (the sigmoid loss moves by at most beta per unit of it)."""
    out, log = one_rank
    # With fixed shapes, as on Trainium: every token of the rows projected, the pairs in B x L / 2 slots.
    ep = _train(tmp_path / "ep", "--nproc", "2", "--parallelism.expert_parallel_degree", "2", "--batch-size", "4",
                "--checkpoint.no-enable", "--hf.no-export", "--dpo.fixed_shapes", "on")  # fmt: skip
    assert "[moe] expert parallel 2" in ep
    assert "fixed shapes (every token of the rows projected" in ep
    one, two = parse_step_lines(log), parse_step_lines(ep)
    assert [s.step for s in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two, strict=True):
        bound = 2 * PRINTED_LOSS + BETA * _h_bound(out / "hf" / f"step-{STEPS}", passes=2 * a.step - 1)
        assert abs(a.loss - b.loss) <= bound, (a, b, bound)
