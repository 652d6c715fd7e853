"""What the ranks and the launcher share, below both: the error records ranks write and the launcher reads
(``rank_errors``), the run's last lines (``summary``), and the short flags both name (``short_flags``)."""
