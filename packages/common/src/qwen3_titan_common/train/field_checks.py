"""Values of torchtitan's own config fields that no one can mean, refused before anything is written: one rule
per field, written once, its flag spelled from the field's path and the launcher's short form beside it.

torchtitan 0.3.0 checks its config's types (through tyro) and some combinations of fields
(``Trainer.Config.__post_init__``), but takes these values as given: a negative learning rate trains gradient
ascent, a clip norm of 0 zeroes every gradient and a negative one reverses them, a negative warmup or a decay past
the run bends the schedule, a step count of 0 trains nothing. (Where torchtitan checks a field itself, as
``--checkpoint.interval``, no rule repeats it.) Each rule is a check of one field that its own
section's ``__post_init__`` could make upstream (docs/architecture.md proposes them); until then the checks every
rank runs apply them (``train.preflight.check_run``). Our own sections check their fields themselves, in their
``__post_init__`` (``--hf.*``, ``--moe.*``, ``--dpo.*``, ``--metrics.progress_seconds``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.protocols.short_flags import short_flag_of


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _integer(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def _positive_integer(value) -> bool:
    return _integer(value) and value >= 1


def _fraction(value) -> bool:
    return _number(value) and 0 <= value <= 1


@dataclass(frozen=True)
class FieldRule:
    path: str
    """The field's place in the trainer's config, dotted as its flag (``training.steps``); ``*`` stands for each
    item of a list (``optimizer.param_groups.*.optimizer_kwargs.lr``), and a dict's keys are read as fields."""
    fine: Callable[[Any], bool]
    expected: str
    unset_is_fine: bool = False
    """The field need not be there (an optimizer's keyword, a section of another trainer's config)."""

    def check(self, config) -> None:
        for flag, value in _values(config, self.path.split(".")):
            if value is None and self.unset_is_fine:
                continue
            if not self.fine(value):
                shown = tuple(value) if isinstance(value, list) else value
                short = short_flag_of(flag)
                raise UserInputError(
                    f"{flag} {shown}{f' ({short})' if short else ''}: expected {self.expected}"
                )


def _values(node, parts: list[str], seen: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(flag, value) of each field ``parts`` names below ``node``, ``seen`` the path to it; None where one is
    not there."""
    if not parts:
        yield "--" + ".".join(seen), node
        return
    head, rest = parts[0], parts[1:]
    if head == "*":
        for index, item in enumerate(node or ()):
            yield from _values(item, rest, (*seen, str(index)))
        return
    value = node.get(head) if isinstance(node, dict) else getattr(node, head, None)
    if value is None:
        yield "--" + ".".join((*seen, head, *rest)), None
        return
    yield from _values(value, rest, (*seen, head))


# In the order the checks fire: the optimizer and its schedule, the data loader, then the run's counts.
TORCHTITAN_FIELD_RULES: tuple[FieldRule, ...] = (
    FieldRule(
        "optimizer.param_groups.*.optimizer_kwargs.lr",
        lambda v: _number(v) and v >= 0,
        "a number >= 0 (0 moves no weight)",
        unset_is_fine=True,
    ),
    FieldRule(
        "optimizer.param_groups.*.optimizer_kwargs.weight_decay",
        lambda v: _number(v) and v >= 0,
        "a number >= 0",
        unset_is_fine=True,
    ),
    FieldRule(
        "optimizer.param_groups.*.optimizer_kwargs.eps",
        lambda v: _number(v) and v > 0,
        "a positive number",
        unset_is_fine=True,
    ),
    FieldRule(
        "optimizer.param_groups.*.optimizer_kwargs.betas",
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
        "two numbers in [0, 1)",
        unset_is_fine=True,
    ),
    FieldRule(
        "training.max_norm",
        lambda v: (_number(v) and v > 0) or v == math.inf,
        "a positive number, or inf for no clipping (gradients are scaled down to this norm; 0 would zero them and "
        "a negative number reverse them)",
    ),
    FieldRule(
        "lr_scheduler.warmup_steps",
        lambda v: _integer(v) and v >= 0,
        "an integer >= 0 (steps of linear warmup)",
    ),
    FieldRule(
        "lr_scheduler.decay_ratio", lambda v: v is None or _fraction(v), "a fraction in [0, 1] of the steps"
    ),
    FieldRule("lr_scheduler.min_lr_factor", _fraction, "a fraction in [0, 1] of the peak rate"),
    FieldRule(
        "dataloader.num_workers", lambda v: _integer(v) and v >= 0, "an integer >= 0", unset_is_fine=True
    ),
    FieldRule("metrics.log_freq", _positive_integer, "a positive integer", unset_is_fine=True),
    FieldRule("training.steps", _positive_integer, "a positive integer"),
    FieldRule("training.local_batch_size", _positive_integer, "a positive integer"),
    FieldRule("training.seq_len", _positive_integer, "a positive integer"),
)


def check_torchtitan_fields(config) -> None:
    """Refuse, in one line, the first of torchtitan's fields whose value no one can mean (``config``: the
    trainer's)."""
    for rule in TORCHTITAN_FIELD_RULES:
        rule.check(config)
