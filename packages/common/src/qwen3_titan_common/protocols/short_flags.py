"""The launcher's short flags (``--lr``, ``--steps``, ...) and the torchtitan field each stands for.

One table, read by the launcher (``launcher.knobs`` rewrites each short flag into its field before anything
runs) and by the checks and error messages of the ranks, which name a field's short flag beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def flag_spelling(flag: str) -> str:
    """A flag's name as tyro reads it: ``_`` and ``-`` alike, any ``=VALUE`` dropped."""
    return flag.split("=", 1)[0].replace("_", "-")


@dataclass(frozen=True)
class Knob:
    flag: str
    field: str  # the torchtitan flag it stands for
    type: Callable[[str], object]
    metavar: str
    help: str

    @property
    def dest(self) -> str:
        return "knob_" + self.flag.removeprefix("--").replace("-", "_")


KNOBS: tuple[Knob, ...] = (
    Knob(
        "--lr",
        # Every config function builds one catch-all AdamW group (torchtitan's default_adamw).
        "--optimizer.param_groups.0.optimizer_kwargs.lr",
        float,
        "LR",
        "peak learning rate, reached after the warmup",
    ),
    Knob("--warmup", "--lr_scheduler.warmup_steps", int, "STEPS", "steps of linear warmup from 0 to --lr"),
    Knob(
        "--decay",
        "--lr_scheduler.decay_ratio",
        float,
        "FRACTION",
        "fraction of the steps at the end spent decaying the learning rate (the rest after warmup holds it)",
    ),
    Knob("--steps", "--training.steps", int, "N", "training steps"),
    Knob("--batch-size", "--training.local_batch_size", int, "N", "sequences per rank and step"),
    Knob("--seq-len", "--training.seq_len", int, "TOKENS", "tokens per sequence"),
    Knob("--checkpoint-every", "--checkpoint.interval", int, "STEPS", "steps between step checkpoints"),
    Knob("--out", "--dump_folder", str, "DIR", "the run's folder: checkpoints, exports, TensorBoard"),
)


def short_flag_of(field: str) -> str | None:
    """The short flag standing for the torchtitan flag ``field`` (``--training.steps``), or None."""
    return next((knob.flag for knob in KNOBS if knob.field == field), None)
