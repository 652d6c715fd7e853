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


def test_the_traceback_switch_means_what_it_says(tmp_path, monkeypatch):
    """QWEN3_TITAN_SHOW_TRACEBACK is a switch like any: off for 0, false, no, off and empty, on for 1, true, yes
    and on, whatever the case; any other value is refused in one line before anything runs."""
    from qwen3_titan_common.launcher.rank_errors import show_tracebacks_asked

    for value, on in (("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False), ("false", False),
                      ("NO", False), ("off", False), ("", False)):  # fmt: skip
        monkeypatch.setenv("QWEN3_TITAN_SHOW_TRACEBACK", value)
        assert show_tracebacks_asked() is on, value
    refused = subprocess.run(
        [TRAIN],
        cwd=tmp_path,
        env={**ENV, "QWEN3_TITAN_SHOW_TRACEBACK": "maybe"},
        capture_output=True,
        text=True,
    )
    check_failure(refused.returncode, refused.stdout, refused.stderr, 2, "QWEN3_TITAN_SHOW_TRACEBACK='maybe'")
    assert list(tmp_path.iterdir()) == []
    # Off: a rank's user error is its one line, as with the switch unset (was: any value showed tracebacks).
    for value in ("0", "false"):
        proc = subprocess.run(
            [TRAIN, "--training.seq_len", "4096", "--dump_folder", str(tmp_path / "out")], cwd=tmp_path,
            env={**ENV, "QWEN3_TITAN_SHOW_TRACEBACK": value}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        check_failure(proc.returncode, proc.stdout, proc.stderr, 2, "--training.seq_len 4096")
