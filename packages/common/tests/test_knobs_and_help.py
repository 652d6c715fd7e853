"""The launcher's short flags reach the torchtitan fields they name; --print-cmd and --help show them."""

from __future__ import annotations

import pytest
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.launcher.knobs import KNOBS
from qwen3_titan_common.launcher.launch import run
from qwen3_titan_common.launcher.plan import Backend, plan_launch

REGISTRY = """
from qwen3_titan_common.assets import default_architecture as _arch
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec as _spec
from qwen3_titan_common.train.config_functions import BackendConfigs as _Configs

_CONFIGS = _Configs("knobs", _spec)


def debug():
    '''The embedded tiny model, built as every backend builds it.'''
    return _CONFIGS.tiny(_arch(), "debug")
"""

SHORT = [
    "--lr", "1.5e-4", "--warmup", "7", "--decay", "0.25", "--steps", "42", "--batch-size", "3",
    "--seq-len", "128", "--checkpoint-every", "11", "--out", "outputs/knob-run",
]  # fmt: skip


@pytest.fixture
def backend(tmp_path, monkeypatch):
    """A backend module whose config function is made by common's factory, as the real backends' are."""
    package = tmp_path / "knobs_backend"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text(REGISTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return Backend(distribution="knobs-backend", module="knobs_backend")


def _parsed(module: str, titan_args: list[str]):
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(["--module", module, "--config", "debug", *titan_args])


def test_every_short_flag_becomes_its_torchtitan_flag(backend):
    _, plan = plan_launch(backend, ["--nproc", "1", *SHORT, "--debug.seed", "3"])
    assert len(plan.knob_mapping) == len(KNOBS)
    pairs = dict(zip(plan.passthrough[::2], plan.passthrough[1::2], strict=True))
    assert pairs == {
        **{knob.field: value for knob, value in zip(KNOBS, SHORT[1::2], strict=True)},
        "--debug.seed": "3",
    }


@pytest.mark.slow
def test_every_short_flag_sets_its_torchtitan_field(backend):
    # torchtitan's own parser (tyro) on the rewritten flags: the fields the table names exist and take the values.
    _, plan = plan_launch(backend, ["--nproc", "1", *SHORT])
    config = _parsed(backend.module, plan.passthrough)
    assert config.optimizer.param_groups[0].optimizer_kwargs["lr"] == 1.5e-4
    assert config.lr_scheduler.warmup_steps == 7 and config.lr_scheduler.decay_ratio == 0.25
    assert config.training.steps == 42 and config.training.local_batch_size == 3
    assert config.training.seq_len == 128
    assert config.checkpoint.interval == 11 and config.dump_folder == "outputs/knob-run"
    # Not set, not changed: the config function's own values.
    default = _parsed(backend.module, [])
    assert default.optimizer.param_groups[0].optimizer_kwargs["lr"] == 3e-3
    assert default.training.steps == 30


def test_a_short_flag_and_its_long_form_together_are_refused(backend):
    with pytest.raises(UserInputError, match="--steps and --training.steps both given"):
        plan_launch(backend, ["--nproc", "1", "--steps", "5", "--training.steps=6"])
    with pytest.raises(UserInputError, match="--warmup and --lr_scheduler.warmup_steps both given"):
        plan_launch(backend, ["--nproc", "1", "--warmup", "5", "--lr-scheduler.warmup-steps", "6"])


def test_a_short_flag_of_the_wrong_type_is_named(backend, capsys):
    # One line and exit 2, as every launcher error, naming the flag and the value.
    assert run(backend, ["--nproc", "1", "--lr", "fast"]) == 2
    err = capsys.readouterr().err
    assert "argument --lr: invalid float value: 'fast'" in err
    assert len(err.strip().splitlines()) == 1


def test_print_cmd_shows_the_rewriting(backend, capsys):
    assert run(backend, ["--nproc", "1", "--lr", "2e-5", "--steps", "9", "--print-cmd"]) == 0
    out, err = capsys.readouterr()
    assert "# --lr 2e-5 -> --optimizer.param_groups.0.optimizer_kwargs.lr 2e-5" in err
    assert "# --steps 9 -> --training.steps 9" in err
    command = out.strip()
    assert command.endswith("--optimizer.param_groups.0.optimizer_kwargs.lr 2e-5 --training.steps 9")
    assert "--lr" not in command.split()


@pytest.mark.slow
def test_help_shows_the_launcher_then_the_configs_torchtitan_flags(backend, capsys):
    # torchtitan's own help of the chosen config (tyro): several seconds for a few hundred flags.
    assert run(backend, ["--help"]) == 0
    out = capsys.readouterr().out
    launcher, titan = out.split("torchtitan's flags for --module knobs_backend --config debug", 1)
    assert all(knob.flag in launcher and knob.field in launcher for knob in KNOBS)
    for section in ("training options", "optimizer.param-groups.0.optimizer-kwargs options", "hf options"):
        assert section in titan
    # Defaults are the config function's values, not torchtitan's.
    assert "(default: ./outputs/knobs-debug)" in titan
    assert "usage: train" in titan


def test_a_config_records_the_function_that_built_it():
    """A rank names its config function (errors, model cards) from its config, not from its command line."""
    from qwen3_titan_common.assets import default_architecture
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
    from qwen3_titan_common.train.config_functions import BackendConfigs

    configs = BackendConfigs("knobs", titan_qwen3_model_spec, module="knobs_backend")
    assert configs.tiny(default_architecture(), "debug").config_function == ("knobs_backend", "debug")
    unnamed = BackendConfigs(
        "knobs", titan_qwen3_model_spec
    )  # a user's own, without --module: said as "the config"
    assert unnamed.tiny(default_architecture(), "debug").config_function is None


# -- torchtitan's flags as the launcher reads them before any rank parses them (launcher.titan_flags) ----------

SPELLINGS = [
    [
        "--hf.model_dir=/models/a",
        "--training.local_batch_size",
        "4",
        "--hf.to-dcp",
        "activation-checkpoint:full",
    ],
    ["--hf.model-dir", "/models/a", "--training.local-batch-size=4", "--hf.to_dcp", "--hf.no-export"],
    [
        "--hf.model_dir",
        "/models/b",
        "--hf.model_dir=/models/a",
        "--hf.no-to_dcp",
        "--hf.to-dcp",
        "--training.local_batch_size=4",
    ],
]


@pytest.mark.parametrize("args", SPELLINGS, ids=["equals", "hyphens", "last-wins"])
def test_the_launcher_reads_torchtitans_flags_as_its_parser_does(backend, args):
    from qwen3_titan_common.launcher.titan_flags import TitanFlags

    flags, parsed = TitanFlags.read(args), _parsed(backend.module, args)
    assert flags.value("--hf.model_dir") == parsed.hf.model_dir == "/models/a"
    assert flags.given("--training.local_batch_size") and parsed.training.local_batch_size == 4
    assert flags.switched_on("--hf.to_dcp") and parsed.hf.to_dcp
    assert not flags.given("--training.global_batch_size")
    # A subcommand is no boolean's value, and names its section.
    assert flags.names_section("--activation_checkpoint") == ("activation-checkpoint:full" in args)


def test_a_switch_turned_off_after_it_is_off():
    from qwen3_titan_common.launcher.titan_flags import TitanFlags

    assert not TitanFlags.read(["--hf.to_dcp", "--hf.no-to-dcp"]).switched_on("--hf.to_dcp")
    assert not TitanFlags.read(["--hf.model_dir", "m"]).switched_on("--hf.to_dcp")
    assert TitanFlags.read(["--activation-checkpoint.mode", "full"]).names_section("--activation_checkpoint")
