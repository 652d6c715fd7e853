"""The README's commands, run in the order shown, in a fresh copy of the repository, as a new user would.

A copy of the working tree's files (tracked, and untracked ones git does not ignore) with no environment: the
first `uv run` installs the locked workspace from uv's cache, as it does on a fresh clone. Every `uv run`
command of the README's bash blocks runs as written, except two kinds, which cannot run here:

- the CI commands (`uv run python -m tools.ci ...`, `uv run pytest ...`): they run this test;
- the section "On a Trainium host": it needs Trainium2 devices and an 8 GB download.

The default run's output is also checked the way the README describes it: no warning line, step lines with
`step/total` and an ETA, and a summary at the end whose verify and load commands are then run as printed;
the two dry runs of the recipe's 4B config print the layout, precision and memory the README describes.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from qwen3_titan_common.components.model_record import RECORD_NAME
from qwen3_titan_common.perf.train_log import parse_step_lines

ROOT = Path(__file__).resolve().parent.parent
UV = shutil.which("uv")
NOT_HERE = ("On a Trainium host", "Tests and CI")
_FENCE = re.compile(r"```bash\n(.*?)```", re.DOTALL)
_WARNING = re.compile(r"warn", re.IGNORECASE)


def readme_commands(text: str) -> list[list[str]]:
    """Each command of the README's bash blocks, in order, outside the sections listed in NOT_HERE."""
    commands = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE):
        if section.startswith(NOT_HERE):
            continue
        for block in _FENCE.findall(section):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if not words or words[:2] != ["uv", "run"]:
                    continue
                if words[2:4] == ["python", "-m"] and words[4].startswith("tools.ci") or words[2] == "pytest":
                    continue
                commands.append(words)
    return commands


def _fresh_copy(target: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _user_env() -> dict[str, str]:
    """The environment of someone who just cloned: no project environment chosen, no backend forced, Python free
    to keep the bytecode it compiles (the README's note covers PYTHONDONTWRITEBYTECODE)."""
    drop = (
        "VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "QWEN3_TITAN_BACKEND", "PYTEST_CURRENT_TEST",
        "PYTHONDONTWRITEBYTECODE", "UV_COMPILE_BYTECODE",
    )  # fmt: skip
    # Offline: everything the lock names is in uv's cache on the machines that run this test.
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "UV_OFFLINE": "1"}


def _run(words: list[str], cwd: Path) -> tuple[str, str]:
    """Runs ``words`` (``... > FILE`` writes its output to FILE, as the shell would); (stdout, all output)."""
    target = None
    if ">" in words:
        words, target = words[: words.index(">")], words[words.index(">") + 1]
    done = subprocess.run(words, cwd=cwd, env=_user_env(), capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"{shlex.join(words)} exited {done.returncode}:\n{log[-4000:]}"
    # uv compiles no bytecode per run (it would re-check every file of the environment each time).
    assert "Bytecode compiled" not in log, f"{shlex.join(words)}: {log[:300]}"
    if target is not None:
        (cwd / target).write_text(done.stdout)
    return done.stdout, log


def test_readme_commands_are_found():
    commands = [shlex.join(c) for c in readme_commands((ROOT / "README.md").read_text())]
    assert commands[0] == "uv run --package native-backend train"
    assert any(c.startswith("uv run verify-checkpoint") for c in commands)
    # Nothing that needs Trainium or the 8 GB checkpoint: native_qwen3_4b only laid out or written into a script.
    assert not any("tools.ci" in c for c in commands)
    assert all("--dry-run" in c or "--print-sbatch" in c for c in commands if "native_qwen3_4b" in c)


@pytest.mark.slow
@pytest.mark.skipif(UV is None, reason="uv is not on PATH")
def test_readme_commands_in_order_on_a_fresh_copy(tmp_path):
    clone = tmp_path / "qwen3-titan"
    _fresh_copy(clone)
    commands = readme_commands((clone / "README.md").read_text())
    default_out, default_log = _run(commands[0], clone)

    warnings = [line for line in default_log.splitlines() if _WARNING.search(line)]
    assert warnings == [], "the default run printed warnings:\n" + "\n".join(warnings)
    steps = parse_step_lines(default_log)
    assert [s.step for s in steps] == list(range(1, 31)) and {s.total_steps for s in steps} == {30}
    assert steps[0].eta_seconds is None and all(s.eta_seconds is not None for s in steps[1:])
    summary = default_out.strip().splitlines()[-6:]
    assert [line.split(":")[0] for line in summary] == [
        "[train] done", "[train] checkpoint", "[train] export", "[train] resume", "[train] verify", "[train] load",
    ]  # fmt: skip
    assert "steps 1-30 of 30" in summary[0] and summary[2].endswith("outputs/native-debug/hf/step-30")
    card = (clone / "outputs/native-debug/hf/step-30/README.md").read_text()
    assert "torchtitan `--module qwen3_titan_native --config debug`" in card  # from the config, not argv
    for line in summary[4:]:  # verify and load, exactly as printed
        _run(shlex.split(line.split(":", 1)[1]), clone)

    printed = {shlex.join(words): _run(words, clone)[0] for words in commands[1:]}
    _check_the_layouts_printed(printed)
    # The --hf-model run had a folder of its own: the default run's checkpoints are untouched.
    # (beside them, the record of the model they hold: components.model_record)
    kept = sorted(p.name for p in (clone / "outputs/native-debug/checkpoint").iterdir())
    assert kept == sorted([RECORD_NAME, "step-30"])
    assert (clone / "outputs/native-debug-from-native-debug-step-30/hf/step-10/README.md").is_file()


def _check_the_layouts_printed(printed: dict[str, str]) -> None:
    """The README's two dry runs of the recipe's 4B config say what the README says they check."""
    (trn2,) = [out for command, out in printed.items() if "--memory-per-rank trn2" in command]
    # Planned for trn2: its 24 GiB per logical core, no host process or gloo copies counted, in trn2's precision
    # whatever this CPU computes in.
    assert "[dry-run] memory fits:" in trn2 and "(trn2: 24 GiB per logical core at LNC=2)" in trn2, trn2
    assert "+ process" not in trn2
    assert "[dry-run] precision: bf16 compute, fp32 master weights (torchtitan's default on neuron)" in trn2
    assert "64 ranks = dp_replicate 1 x dp_shard(FSDP) 64" in trn2
    # 4.02B parameters sharded 64 ways: about 63M per rank (plus FSDP padding).
    found = re.search(r"([0-9,]+) parameters, ([0-9,]+) on rank 0", trn2)
    total, per_rank = (int(g.replace(",", "")) for g in found.groups())
    assert 4.0e9 < total < 4.1e9 and total / 64 <= per_rank < total / 64 * 1.01
    (nodes,) = [out for command, out in printed.items() if "--nnodes 4" in command and "--dry-run" in command]
    assert "256 ranks = dp_replicate 1 x dp_shard(FSDP) 64 x context 1 x tensor 4" in nodes, nodes
