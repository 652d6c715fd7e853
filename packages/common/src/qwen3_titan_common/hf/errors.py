class CheckpointError(ValueError):
    """A model directory or checkpoint we will not read; the message names the file and key."""
