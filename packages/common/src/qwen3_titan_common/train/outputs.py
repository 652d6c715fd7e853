"""Where a run writes: a default dump folder that names the backend, the config and the starting weights.

A config function's dump folder is ``./outputs/<backend>-<config>``. A run that starts from another
Hugging Face directory than the config's own (``--hf-model DIR``) and keeps that default writes to
``./outputs/<backend>-<config>-from-<DIR's name>`` instead, so that it neither resumes from nor overwrites the
plain run's checkpoints (a folder's step checkpoints win over ``--hf.model_dir``: ``hf.start``). An explicit
``--dump_folder`` is used as given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_STEP_DIR = re.compile(r"^step-\d+$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class OutputDefaults:
    """What the config function chose, to tell the user's choices from its defaults."""

    dump_folder: str
    model_dir: str | None = None


def model_dir_tag(model_dir: str) -> str:
    """A short name for a model directory: its name, or ``<run>-step-N`` for one of our exports
    (``<run>/hf/step-N``)."""
    path = Path(model_dir).expanduser().resolve()
    name = path.name
    if _STEP_DIR.match(name) and path.parent.name == "hf" and path.parent.parent.name:
        name = f"{path.parent.parent.name}-{name}"
    return _UNSAFE.sub("_", name).strip("._") or "model"


def run_dump_folder(dump_folder: str, model_dir: str | None, defaults: OutputDefaults | None) -> str:
    """The run's dump folder: the config's default, named after the starting weights when the run starts from
    another directory than the config's own; ``dump_folder`` unchanged otherwise."""
    if defaults is None or dump_folder != defaults.dump_folder or not model_dir:
        return dump_folder
    if defaults.model_dir and Path(model_dir).expanduser().resolve() == Path(defaults.model_dir).resolve():
        return dump_folder
    return f"{dump_folder}-from-{model_dir_tag(model_dir)}"
