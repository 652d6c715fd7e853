"""The `train` console script's own path to a one-line error (dispatch, then the launcher).

Every bad input of docs/reliability.md is a case of test_reliability_launcher.py (the launcher in one
process) or test_reliability_ranks.py (real ranks); these run the installed script itself.
"""

import os
import subprocess
import sys
from pathlib import Path

from qwen3_titan_testing.edges import check_failure

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}


def test_unknown_backend(tmp_path):
    proc = subprocess.run(
        [TRAIN],
        cwd=tmp_path,
        env={**ENV, "QWEN3_TITAN_BACKEND": "jax-backend"},
        capture_output=True,
        text=True,
    )
    check_failure(proc.returncode, proc.stdout, proc.stderr, 2, "QWEN3_TITAN_BACKEND=jax-backend")
    assert list(tmp_path.iterdir()) == []


def test_console_script_stops_a_bad_flag_before_anything_is_written(tmp_path):
    proc = subprocess.run(
        [TRAIN, "--training.seq_len", "4096", "--dump_folder", str(tmp_path / "out")],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    check_failure(
        proc.returncode, proc.stdout, proc.stderr, 2, "--training.seq_len 4096", "max_position_embeddings"
    )
    assert list(tmp_path.iterdir()) == []
