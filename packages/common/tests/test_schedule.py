"""The schedule fitted to short runs is torchtitan's own, step for step, said in one info line, not warnings."""

import logging

import pytest
import torch
from qwen3_titan_common.components.lr_scheduler import Qwen3LRSchedulers, fitted
from torchtitan.components.optimizer import LRSchedulersContainer


def _rates(config, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedulers = config.build(optimizers=[optimizer], training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedulers.step()
    return rates


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 30])
@pytest.mark.parametrize(("warmup", "decay"), [(3, 0.8), (50, 0.8), (0, 1.0), (2, None), (1, 0.5)])
def test_the_fitted_schedule_is_torchtitans_without_its_warnings(steps, warmup, decay, caplog):
    theirs = LRSchedulersContainer.Config(warmup_steps=warmup, decay_ratio=decay)
    ours = Qwen3LRSchedulers.Config(warmup_steps=warmup, decay_ratio=decay)
    expected = _rates(theirs, steps)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert _rates(ours, steps) == expected
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    fitted_lines = [r.getMessage() for r in caplog.records if "[schedule]" in r.getMessage()]
    assert len(fitted_lines) == (fitted(warmup, decay, steps) != (warmup, decay))


def test_what_fits_is_left_alone():
    assert fitted(3, 0.8, 30) == (3, 0.8)
    assert fitted(3, 0.8, 1) == (1, 0.0)
    assert fitted(3, 0.8, 5) == (3, 0.4)
