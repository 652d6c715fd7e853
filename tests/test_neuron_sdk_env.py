"""The Neuron SDK survives `uv` on a Trainium host, and its repository never enters the default lock or sync.

The SDK (torch-neuronx, neuronx-cc, nki) comes from the Neuron package repository, named `neuron` (explicit) in
the root pyproject.toml; the README installs it with `uv pip install --index neuron ...` after the locked sync.
Tested here without that repository: the workspace locks and syncs offline with the index configured, and an
environment holding an SDK (a fake distribution standing in for it: this machine has no Trainium) keeps it
through `uv sync --inexact` while a plain `uv sync` would remove it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from qwen3_titan_common.runtime.neuron_sdk import INSTALL, NEURON_SDK, missing_sdk_note

ROOT = Path(__file__).resolve().parent.parent
UV = shutil.which("uv")
needs_uv = pytest.mark.skipif(UV is None, reason="uv is not on PATH")


def _uv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # Offline: a command that needed the Neuron repository (or any index) would fail here.
    full_env = {**os.environ, "UV_OFFLINE": "1", **(env or {})}
    return subprocess.run([UV, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)


def test_the_neuron_index_is_named_explicit_and_used_by_no_locked_package():
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (neuron,) = [index for index in root["tool"]["uv"]["index"] if index["name"] == "neuron"]
    assert neuron["explicit"] is True and neuron["url"].startswith("https://")
    assert "pip.repos.neuron.amazonaws.com" not in (ROOT / "uv.lock").read_text()


@needs_uv
def test_the_workspace_locks_and_syncs_offline_with_the_index_configured():
    for args in (("lock", "--check"), ("sync", "--locked", "--dry-run")):
        done = _uv(*args)
        assert done.returncode == 0, f"uv {' '.join(args)}: {done.stderr}"


def _fake_sdk(venv: Path) -> None:
    """A distribution named torch-neuronx in ``venv``: what `uv pip install --index neuron ...` leaves."""
    (site,) = venv.glob("lib/python*/site-packages")
    info = site / "torch_neuronx-2.14.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.14.0\n")
    (info / "INSTALLER").write_text("uv\n")
    (info / "RECORD").write_text(
        "torch_neuronx-2.14.0.dist-info/METADATA,,\ntorch_neuronx-2.14.0.dist-info/RECORD,,\n"
    )


@needs_uv
def test_fake_neuron_sdk_survives_an_inexact_sync_and_not_a_plain_one(tmp_path):
    venv = tmp_path / "env"
    made = _uv("venv", "--python", sys.executable, str(venv))
    assert made.returncode == 0, made.stderr
    _fake_sdk(venv)
    env = {"UV_PROJECT_ENVIRONMENT": str(venv)}
    plain = _uv("sync", "--locked", "--dry-run", "--package", "native-backend", env=env)
    inexact = _uv("sync", "--locked", "--inexact", "--dry-run", "--package", "native-backend", env=env)
    assert plain.returncode == 0 and inexact.returncode == 0, plain.stderr + inexact.stderr
    assert "- torch-neuronx==2.14.0" in plain.stderr  # what the README warns about
    assert "torch-neuronx" not in inexact.stderr and "Would install" in inexact.stderr


def test_a_trainium_host_without_the_sdk_is_told_how_to_get_it_back(tmp_path):
    assert missing_sdk_note(str(tmp_path / "neuron[0-9]*")) is None  # no Neuron devices
    (tmp_path / "neuron0").touch()
    note = missing_sdk_note(str(tmp_path / "neuron[0-9]*"))
    assert note is not None and "uv pip install --index neuron torch-neuronx==2.14.3.* neuronx-cc nki" in note
    assert "uv sync --inexact" in note


def test_the_locked_torch_is_the_neuron_sdk_s_own():
    """One table (runtime/neuron_sdk.py) against the lock, the root constraint and the README's install line:
    installing the SDK must not swap the locked torch, and the next `uv run` must not swap it back."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (torch,) = [p for p in lock["package"] if p["name"] == "torch"]
    assert torch["version"] == NEURON_SDK.torch
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"torch=={NEURON_SDK.torch}" in root["tool"]["uv"]["constraint-dependencies"]
    assert NEURON_SDK.torch_neuronx.startswith(NEURON_SDK.torch.rpartition(".")[0] + ".")  # 2.14.x for 2.14
    readme = (ROOT / "README.md").read_text()
    assert f"`{INSTALL}`" in readme and f"({NEURON_SDK.torch}, " in readme
