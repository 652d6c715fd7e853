"""`train --config NAME` and `train --module neuron_qwen3 --config NAME` pick the installed backend providing NAME.

Runs in the workspace environment, where every backend is installed (the case the launcher used to refuse).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.launcher.dispatch import choose_backend, installed_backends
from qwen3_titan_common.launcher.plan import read_command_line

TRAIN = str(Path(sys.executable).with_name("train"))


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.delenv("QWEN3_TITAN_BACKEND", raising=False)
    backends = installed_backends()
    assert set(backends) >= {"native-backend", "hf-v5-backend", "nki-moe-backend"}
    return backends


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--module", "neuron_qwen3", "--config", "v5_qwen3_4b"], "hf-v5-backend"),
        (["--module=neuron_qwen3", "--config=native_qwen3_4b"], "native-backend"),
        (["--module", "neuron_qwen3", "--config", "qwen3_nki_moe_config"], "nki-moe-backend"),
        (["--config", "v5_qwen3_4b"], "hf-v5-backend"),
        (["--config", "qwen3_8b", "--training.steps", "2"], "native-backend"),
        (["--config", "qwen3_30b_a3b_4layers"], "nki-moe-backend"),
        # A backend's own module still decides, whatever the config.
        (["--module", "qwen3_titan_hf_v5", "--config", "debug"], "hf-v5-backend"),
    ],
)
def test_the_config_name_picks_its_backend(installed, argv, expected):
    backend, why = choose_backend(installed, read_command_line(argv))
    assert backend is not None and backend.distribution == expected, why


def test_a_name_two_backends_provide_is_an_error_that_lists_them(installed):
    backend, why = choose_backend(installed, read_command_line(["--config", "debug_moe"]))
    assert backend is None
    assert (
        "--config debug_moe is provided by several installed backends (hf-v5-backend, nki-moe-backend)" in why
    )


def test_a_name_no_backend_provides_lists_what_they_do(installed):
    backend, why = choose_backend(installed, read_command_line(["--config", "qwen3_9000b"]))
    assert backend is None and "--config qwen3_9000b: no installed backend provides" in why
    assert "native-backend: debug, qwen3_0_6b" in why
    backend, why = choose_backend(
        installed, read_command_line(["--module", "neuron_qwen3", "--config", "debug"])
    )
    assert backend is None and "not a recipe name of neuron_qwen3" in why and "v5_qwen3_4b" in why


def test_the_recipes_form_runs_through_the_real_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "QWEN3_TITAN_BACKEND"}
    env["QWEN3_TITAN_DEVICE"] = "cpu"
    out = subprocess.run(
        [TRAIN, "--module", "neuron_qwen3", "--config", "v5_qwen3_4b", "--print-cmd"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "[train] backend: hf-v5-backend (--config v5_qwen3_4b is hf-v5-backend's)" in out.stderr
    # The recipe's module stays in the command: torchtitan resolves the name through neuron_qwen3.
    assert "-m torchtitan.train --module neuron_qwen3 --config v5_qwen3_4b" in out.stdout
