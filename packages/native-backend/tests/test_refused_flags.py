"""A flag torchtitan's parser (tyro) refuses, for this backend's configs: one line naming the flag as typed,
in the launcher's own parse and in a real rank (which records it in its error file like any other error)."""

import os
import sys

import pytest


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--training.stepz", "2"], "--training.stepz: not a flag of this config; perhaps you meant --training.steps"),
        (["--stpes", "3"], "--stpes: not a flag of this config; perhaps you meant --steps (= --training.steps)"),
        (["--metrics.log-frq", "2"], "--metrics.log-frq: not a flag of this config; perhaps you meant --metrics.log_freq"),
        (["--checkpoint.enable=True"], "--checkpoint.enable=True: not a flag of this config (booleans are written "
         "--section.name or --section.no-name, without =)"),
        (["--training.steps", "abc"], "--training.steps: expected an integer, got 'abc'"),
        (["--training.steps"], "--training.steps: expected a value after it"),
        (["--training.mixed_precision_param", "float8"],
         "--training.mixed_precision_param float8: expected one of bfloat16, float32"),
        (["--hf.max_shard_size", "5GB", "stray"], "stray: not a flag of this config"),
        (["--checkpoint.interval", "0"], "--checkpoint.interval: Checkpoint interval needs to be at least 1 step."),
    ],
    ids=["long", "short", "hyphens", "boolean", "integer", "no-value", "choice", "stray", "section-check"],
)  # fmt: skip
def test_a_flag_torchtitans_parser_refuses_is_one_line_naming_it_as_typed(flags, line, monkeypatch, capsys):
    """The config function has tyro raise a UserInputError instead of printing its box and exiting: a rank
    records it like any other error (its error file, one line), and the launcher's own parse says the same."""
    from qwen3_titan_common.errors import UserInputError
    from qwen3_titan_common.runtime.device_autoload import ensure_installed

    ensure_installed()
    from torchtitan.config import ConfigManager

    args = ["--module", "qwen3_titan_native", "--config", "debug", *flags]
    monkeypatch.setattr(sys, "argv", ["train", *args])
    with pytest.raises(UserInputError) as refused:
        ConfigManager().parse_args(args)
    assert str(refused.value) == line
    assert "╭" not in capsys.readouterr().err  # tyro printed no box


def test_a_refused_flag_in_a_real_rank_is_its_recorded_error(tmp_path, capfd):
    """Through torchrun and torchtitan's own entry point: the rank records tyro's refusal in its error file, the
    launcher's last line is that one line and the exit status is the user's (2); nothing was written."""
    from qwen3_titan_common.launcher.supervise import EXIT_INPUT, run_torchrun, torchrun_executable

    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu"}
    env.pop("QWEN3_TITAN_SHOW_TRACEBACK", None)
    command = [torchrun_executable(), "--nproc_per_node=1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
               "localhost:0", "--tee", "3", "-m", "torchtitan.train", "--module", "qwen3_titan_native", "--config",
               "debug", "--dump_folder", str(tmp_path / "out"), "--training.stepz", "2"]  # fmt: skip
    rc, summary = run_torchrun(command, env)
    err = capfd.readouterr().err
    assert (rc, summary) == (EXIT_INPUT, None)
    assert err.splitlines()[-1] == (
        "train: --training.stepz: not a flag of this config; perhaps you meant --training.steps"
    )
    assert not (tmp_path / "out").exists()
