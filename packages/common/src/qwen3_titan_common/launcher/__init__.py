"""The ``train`` launcher around torchrun, and what crosses between it and the ranks: a rank's one-line
errors (``rank_errors``), the end-of-run summary (``summary``), the short flags both sides name
(``short_flags``); the in-process runs of a planned job (``dry_run``, ``layout_check``)."""
