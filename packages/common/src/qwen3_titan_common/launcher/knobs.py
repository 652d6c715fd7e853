"""The launcher's short flags for the knobs people reach for first, each one torchtitan field.

``train --lr 1e-4 --steps 200`` is ``train --optimizer.param_groups.0.optimizer_kwargs.lr 1e-4
--training.steps 200``: the launcher rewrites the short form into the torchtitan flag before anything runs,
so the ranks, ``--print-cmd`` and the upstream ``torchrun ... -m torchtitan.train`` form see only torchtitan's
own flags. One table, ``protocols.short_flags.KNOBS``; ``--print-cmd`` prints the rewriting it did.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.launcher.titan_flags import TitanFlags
from qwen3_titan_common.protocols.short_flags import KNOBS, Knob


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


def knob_flags(opts: argparse.Namespace, passthrough: list[str]) -> list[tuple[Knob, str]]:
    """(knob, value) for each short flag given; one given together with its long form is refused."""
    given = TitanFlags.read(passthrough)
    used = []
    for knob in KNOBS:
        value = getattr(opts, knob.dest, None)
        if value is None:
            continue
        if given.given(knob.field):
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
