"""Preference-training runs shared by the backends' tests: the flags, and how far a loss may move by rounding."""

from __future__ import annotations

import math
import re
from pathlib import Path

from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_common.train.tolerance import ModelBounds

SEQ_LEN = 256
BETA = 0.1
PRINTED_LOSS = 0.5e-5  # a step line's loss has 5 decimals
PRINTED_MARGIN = 0.5e-4  # and its margin 4
PAIRS = 64  # of the embedded set: the reference pass before step 1 reads every pair
VALIDATION = ["--validator.enable", "--validator.freq", "2"]  # on the held-out 5% of the pairs
EXACT = ["--training.mixed_precision_param", "float32", "--debug.seed", "0", "--debug.deterministic"]
LORA = ["--lora.rank", "4", "--lora.alpha", "8"]


def dpo_flags(folder: Path) -> list[str]:
    """``--objective dpo`` on the first :data:`PAIRS` embedded pairs, written to ``folder``."""
    from qwen3_titan_common.assets import default_pairs_path

    path = folder / "pairs.jsonl"
    if not path.exists():
        lines = default_pairs_path().read_text().splitlines()[:PAIRS]
        path.write_text("\n".join(lines) + "\n")
    return ["--objective", "dpo", "--dataloader.dataset", str(path), "--training.seq_len", str(SEQ_LEN)]


def h_bound(model_dir: Path, passes: int) -> float:
    """How far one pair's h may move by rounding between two computations of it (rows packed or dealt
    differently): a completion pair holds at most a row of tokens."""
    return ModelBounds.from_dir(model_dir).log_ratio_atol(tokens=SEQ_LEN, seq_len=SEQ_LEN, passes=passes)


def ln2_bound(model_dir: Path) -> float:
    """Step 1's loss when the policy starts at the reference: ln 2, moved by beta / 2 per unit of h at h = 0
    (the reference pass and step 1 are a forward each), printed to 5 decimals."""
    return PRINTED_LOSS + BETA / 2 * h_bound(model_dir, passes=2)


def loss_bound(model_dir: Path, step: int) -> float:
    """Step ``step``'s loss in two layouts of one run: its logits carry 2k - 1 forward passes, and the sigmoid
    loss moves by at most beta per unit of h; both printed."""
    return 2 * PRINTED_LOSS + BETA * h_bound(model_dir, passes=2 * step - 1)


def held_out_pairs() -> int:
    """The pairs validation reads of :data:`PAIRS` (the default held-out share), the others training's."""
    from qwen3_titan_common.data.holdout import DEFAULT_HELD_OUT, held_out_count

    return held_out_count(PAIRS, DEFAULT_HELD_OUT)


def validation_bound(model_dir: Path, step: int) -> float:
    """Validation's loss after step ``step`` in two layouts of one run: its weights carry ``step`` updates
    (two passes each) and it adds a forward."""
    return loss_bound(model_dir, step + 1)


def rescored_bound(model_dir: Path) -> tuple[float, float]:
    """Loss and margin of the same weights and reference scored twice (validation's line, then ``eval --json``
    of the export): each h is two forward passes (the model's and the reference's) computed again; the
    sigmoid loss moves by at most beta per unit of h, and the line prints both figures rounded."""
    moved = BETA * h_bound(model_dir, passes=2)
    return PRINTED_LOSS + moved, PRINTED_MARGIN + moved


def assert_starts_at_ln2(log: str, model_dir: Path) -> None:
    steps = parse_step_lines(log)
    assert steps and steps[0].step == 1, log[-3000:]
    assert abs(steps[0].loss - math.log(2)) <= ln2_bound(model_dir), steps[0]
    # The margin is the mean of beta h: as near 0 as h is.
    (line,) = [x for x in log.splitlines() if re.search(r"step:\s+1/", x)]
    margin = float(re.search(r"margin: (-?[0-9.]+)", line).group(1))
    assert abs(margin) <= BETA * h_bound(model_dir, passes=2) + PRINTED_MARGIN, line
