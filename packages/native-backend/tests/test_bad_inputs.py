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
    from qwen3_titan_common.protocols.rank_errors import show_tracebacks_asked

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


def test_a_node_waiting_for_the_others_says_what_where_and_until_when(tmp_path):
    import signal
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [TRAIN, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}", "--steps", "1",
         "--dump_folder", str(tmp_path / "out")],
        cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    started, lines = time.monotonic(), []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "waiting at" in line:
                said = time.monotonic() - started
            if "torchrun" in line and "--rdzv_conf" in line:
                break
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    (line,) = [line for line in lines if "waiting at" in line]
    assert line.startswith(f"[train] node 0 of 2: waiting at 127.0.0.1:{port} for all 2 nodes to join"), lines
    assert "gives up at" in line and "in 600 s" in line
    assert said < 30, said  # before torchrun starts waiting, not when it gives up
    assert any("--rdzv_conf join_timeout=600" in earlier for earlier in lines), lines
