"""The commands: ``train`` (plan, backend dispatch, torchrun supervision, dry run) and ``verify-checkpoint``."""
