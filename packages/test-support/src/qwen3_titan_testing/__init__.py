"""What the packages' tests share: tiny real Hugging Face checkpoints, written by transformers itself
(``checkpoints``); a real one-node Slurm cluster (``slurm``); the processes a test started (``processes``).

A package of its own, listed in each package's ``test`` dependency group, so that nothing a test needs
ships in the runtime packages.
"""
