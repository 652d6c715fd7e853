"""torchtitan's flags as the launcher reads them: the command line passed through to the ranks, one reader.

The ranks parse these flags with torchtitan's parser (tyro, against the config function's schema). The
launcher decides a few things before any rank starts (which checkpoint directory to check, whether the job is
a conversion, whether the user chose a batch or activation checkpointing), and reads them here, in the one
form tyro accepts them in: ``_`` and ``-`` alike, ``--flag VALUE`` or ``--flag=VALUE``, the last one winning,
and subcommands (``activation-checkpoint:full``) apart.

Written by hand because the schema is what the launcher avoids loading (it imports torchtitan and builds the
config: seconds); without it, a token after a flag is that flag's value unless it is a flag or a subcommand
itself, which is how tyro reads every flag the launcher asks about (none of them takes several values).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qwen3_titan_common.protocols.short_flags import flag_spelling

_SUBCOMMAND = re.compile(r"[a-z][a-z0-9-]*:[a-z0-9-]+")


def is_subcommand(arg: str) -> bool:
    """``section:choice`` (``activation-checkpoint:full``): tyro's subcommand for a field of several kinds."""
    return bool(_SUBCOMMAND.fullmatch(arg))


@dataclass(frozen=True)
class TitanFlags:
    """The flags of one command line: each under tyro's spelling with its last value (None: given with none, a
    boolean switch), and its subcommands in order."""

    values: dict[str, str | None]
    subcommands: tuple[str, ...]

    @classmethod
    def read(cls, args: list[str]) -> TitanFlags:
        values: dict[str, str | None] = {}
        subcommands: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg.startswith("--"):
                name, equals, given = arg.partition("=")
                value: str | None = given if equals else None
                following = args[i + 1] if i + 1 < len(args) else ""
                if (
                    not equals
                    and following
                    and not following.startswith("--")
                    and not is_subcommand(following)
                ):
                    value, i = following, i + 1
                # Re-inserted, so that the order of the names is that of their last occurrence.
                values.pop(flag_spelling(name), None)
                values[flag_spelling(name)] = value
            elif is_subcommand(arg):
                subcommands.append(arg)
            i += 1
        return cls(values, tuple(subcommands))

    def given(self, flag: str) -> bool:
        """Whether ``flag`` (``--training.local_batch_size``) is on the command line, in any spelling."""
        return flag_spelling(flag) in self.values

    def value(self, flag: str) -> str | None:
        """The last value given to ``flag``, or None."""
        return self.values.get(flag_spelling(flag))

    def switched_on(self, flag: str) -> bool:
        """Whether the boolean ``flag`` (``--hf.to_dcp``) is on: given, and not turned off after it
        (``--hf.no-to_dcp``); the last of the two wins, as in tyro."""
        on = flag_spelling(flag)
        section, _, name = on.rpartition(".")
        off = f"{section}.no-{name}" if section else f"--no-{name.removeprefix('--')}"
        names = list(self.values)
        return on in self.values and (off not in self.values or names.index(on) > names.index(off))

    def names_section(self, section: str) -> bool:
        """Whether any flag of ``section`` (``--activation_checkpoint``) or its subcommand is given."""
        prefix = flag_spelling(section)
        subcommand = prefix.removeprefix("--") + ":"
        return any(name.startswith(prefix + ".") for name in self.values) or any(
            s.startswith(subcommand) for s in self.subcommands
        )


def before_subcommands(args: list[str], extra_flags: tuple[str, ...]) -> list[str]:
    """``args`` with ``extra_flags`` added before the first subcommand (``activation-checkpoint:full``): tyro
    applies the flags after a subcommand to that subcommand."""
    at = next((i for i, arg in enumerate(args) if is_subcommand(arg)), len(args))
    return [*args[:at], *extra_flags, *args[at:]]
