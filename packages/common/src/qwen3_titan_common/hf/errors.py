from qwen3_titan_common.errors import UserInputError


class CheckpointError(UserInputError):
    """A model directory or checkpoint we will not read; the message names the file and key."""
