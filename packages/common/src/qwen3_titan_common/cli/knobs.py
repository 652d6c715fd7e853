"""The launcher's short flags for the knobs people reach for first, each one torchtitan field.

``train --lr 1e-4 --steps 200`` is ``train --optimizer.param_groups.0.optimizer_kwargs.lr 1e-4
--training.steps 200``: the launcher rewrites the short form into the torchtitan flag before anything runs,
so the ranks, ``--print-cmd`` and the upstream ``torchrun ... -m torchtitan.train`` form see only torchtitan's
own flags. One table, :data:`KNOBS`; ``--print-cmd`` prints the rewriting it did.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from qwen3_titan_common.errors import UserInputError


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


def _as_typed(kind: Callable[[str], object]) -> Callable[[str], str]:
    """Checks the text is a ``kind`` (argparse says "invalid float value" otherwise) and keeps it as typed,
    so the torchtitan flag gets the user's spelling (``1e-4``, not ``0.0001``)."""

    def check(text: str) -> str:
        kind(text)
        return text

    check.__name__ = kind.__name__
    return check


def add_knob_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "short flags",
        "Each sets the torchtitan flag shown (--print-cmd prints the rewriting); the long form works too.",
    )
    for knob in KNOBS:
        group.add_argument(
            knob.flag,
            dest=knob.dest,
            type=_as_typed(knob.type),
            default=None,
            metavar=knob.metavar,
            help=f"{knob.help} (= {knob.field})",
        )


def _spelling(flag: str) -> str:
    """tyro reads ``_`` and ``-`` alike in flag names."""
    return flag.split("=", 1)[0].replace("_", "-")


def knob_flags(opts: argparse.Namespace, passthrough: list[str]) -> list[tuple[Knob, str]]:
    """(knob, value) for each short flag given; one given together with its long form is refused."""
    given = {_spelling(arg) for arg in passthrough if arg.startswith("--")}
    used = []
    for knob in KNOBS:
        value = getattr(opts, knob.dest, None)
        if value is None:
            continue
        if _spelling(knob.field) in given:
            raise UserInputError(
                f"{knob.flag} and {knob.field} both given: they set the same field, pass one"
            )
        used.append((knob, value))
    return used


def titan_args(used: list[tuple[Knob, str]]) -> list[str]:
    return [arg for knob, value in used for arg in (knob.field, value)]


def mapping_lines(used: list[tuple[Knob, str]]) -> list[str]:
    """What ``--print-cmd`` shows of the rewriting, one ``# --lr 1e-4 -> --optimizer... 1e-4`` per flag."""
    return [f"# {knob.flag} {value} -> {knob.field} {value}" for knob, value in used]
