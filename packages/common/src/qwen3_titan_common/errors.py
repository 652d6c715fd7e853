"""The base class for mistakes in what the user gave us, and its subclass for checkpoints we will not read.

Every such error carries a one-line message that names the culprit (file, key,
flag) and what was expected. The ``train`` launcher recognises these when a rank
dies of one and repeats the message as its own last line, so the user reads one
line instead of a distributed traceback.
"""


class UserInputError(ValueError):
    pass


class CheckpointError(UserInputError):
    """A model directory or checkpoint we will not read; the message names the file and key."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its class name when it has none: what a one-line report quotes."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
