"""The console scripts beside ``train``: ``eval``, ``verify-checkpoint``, ``preview-data`` and ``preview-rows``."""
