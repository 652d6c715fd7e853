"""Reading a flag's value out of a command line, before (or without) any argument parser.

The launcher chooses a backend from ``--config`` before it knows which parser applies, and a rank
names its model card after the ``--module``/``--config`` it was started with; both read the raw argv.
"""

from __future__ import annotations


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag VALUE`` or ``flag=VALUE`` in ``argv`` (the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
