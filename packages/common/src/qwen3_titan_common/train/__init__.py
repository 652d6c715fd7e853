"""The training run: the trainer, its config, the checks before it starts, its parallel layout."""
