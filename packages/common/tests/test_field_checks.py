"""The checks of torchtitan's own fields, written once as rules (``train.field_checks``): each names a field the
trainer's config has, and refuses in one line, flag and short form spelled from the field's path."""

from __future__ import annotations

import dataclasses
import math

import pytest
from qwen3_titan_common.assets import default_architecture
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
from qwen3_titan_common.train.config_functions import BackendConfigs
from qwen3_titan_common.train.field_checks import TORCHTITAN_FIELD_RULES, _values, check_torchtitan_fields


@pytest.fixture(scope="module")
def config():
    return BackendConfigs("fields", titan_qwen3_model_spec).tiny(default_architecture(), "debug")


def test_every_rule_names_a_field_the_trainer_config_has(config):
    """A rule whose path has a typo would read None, which a rule of an optional field lets pass: never checked."""
    for rule in TORCHTITAN_FIELD_RULES:
        found = list(_values(config, rule.path.split(".")))
        assert found, rule.path
        if rule.path.endswith((".lr", ".betas", ".eps", ".weight_decay", ".num_workers", ".log_freq")):
            assert all(value is not None for _, value in found), (rule.path, found)
        check = [flag for flag, _ in found]
        assert all(flag.startswith("--") and "*" not in flag for flag in check), check
    check_torchtitan_fields(config)  # the defaults are fine


def _with(config, section: str, **fields):
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **fields)})


@pytest.mark.parametrize(
    ("section", "fields", "line"),
    [
        ("training", {"steps": 0}, "--training.steps 0 (--steps): expected a positive integer"),
        ("training", {"max_norm": -math.inf}, "--training.max_norm -inf: expected a positive number, or inf"),
        ("training", {"max_norm": math.nan}, "--training.max_norm nan: expected a positive number"),
        (
            "lr_scheduler",
            {"decay_ratio": 1.5},
            "--lr_scheduler.decay_ratio 1.5 (--decay): expected a fraction",
        ),
        ("metrics", {"log_freq": 0}, "--metrics.log_freq 0: expected a positive integer"),
    ],
)
def test_a_value_no_one_means_is_named_with_its_short_form(config, section, fields, line):
    with pytest.raises(UserInputError) as refused:
        check_torchtitan_fields(_with(config, section, **fields))
    assert str(refused.value).startswith(line)


def test_each_param_group_is_named_by_its_index(config):
    groups = config.optimizer.param_groups
    second = dataclasses.replace(
        groups[0], optimizer_kwargs={**groups[0].optimizer_kwargs, "betas": (0.9, 1.0)}
    )
    with pytest.raises(
        UserInputError, match=r"^--optimizer\.param_groups\.1\.optimizer_kwargs\.betas \(0\.9, 1\.0\): "
    ):
        check_torchtitan_fields(_with(config, "optimizer", param_groups=[groups[0], second]))
