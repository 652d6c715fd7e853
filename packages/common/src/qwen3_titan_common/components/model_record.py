"""Which model a dump folder's step checkpoints hold, recorded beside them and compared before resuming.

torchtitan resumes from any ``step-N`` in the checkpoint folder; a checkpoint of another model (the
embedded default's, then ``--hf-model DIR``'s) then fails deep in DCP with a size mismatch. So the first
save writes ``<checkpoint folder>/qwen3-titan-model.json`` (the model spec's name and the architecture,
as config.json fields) and a run that would resume compares it with its own first. DCP's ``.metadata``
would say the same, but it is a pickle, and nothing here unpickles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.errors import UserInputError

RECORD_NAME = "qwen3-titan-model.json"


class OtherModelError(UserInputError):
    pass


def model_record(
    model_name: str,
    architecture: Qwen3Architecture,
    schedule: dict[str, Any] | None = None,
    data_position: str | None = None,
    lora=None,
    live_reference: bool = False,
) -> dict[str, Any]:
    """``schedule``: the run's config name and optimizer settings, which a resume may change (said, not
    refused: the model is the same); ``data_position``: what the data loader's saved position means;
    ``lora``: the run's ``--lora.*`` options, whose adapters its step checkpoints hold (None: every weight
    trains); ``live_reference``: its step checkpoints also hold the starting weights of a live preference
    reference (``--dpo.reference live``)."""
    record = {"model": model_name, "architecture": architecture.to_dict()}
    record["lora"] = (
        {"rank": lora.rank, "targets": sorted(lora.targets), "adapter": lora.adapter is not None}
        if lora is not None and lora.enabled
        else None
    )
    record["reference"] = "live" if live_reference else None
    if schedule is not None:
        record["schedule"] = schedule
    if data_position is not None:
        record["data_position"] = data_position
    # Through JSON, so a record compares equal to the same record read back (tuples become lists).
    return json.loads(json.dumps(record))


def schedule_of(config, world_size: int = 1) -> dict[str, Any]:
    """What of a run's config shapes how its steps update the weights, beyond the model: the config
    function, the rows of a step (sequence length, global batch: the same on any number of ranks), the
    learning-rate schedule and each parameter group's optimizer settings."""
    from qwen3_titan_common.models.layout import LayoutError, resolve_layout

    scheduler = config.lr_scheduler
    fields = ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")
    groups = getattr(config.optimizer, "param_groups", None) or ()
    training = config.training
    global_batch = getattr(training, "global_batch_size", -1)
    if not global_batch or global_batch < 1:
        try:
            layout = resolve_layout(config.parallelism, world_size)
            global_batch = training.local_batch_size * layout.dp_replicate * layout.dp_shard
        except LayoutError:
            global_batch = None  # preflight names the layout's fault
    return {
        "config": config.model_spec.flavor,
        "training.seq_len": training.seq_len,
        "training.global_batch_size": global_batch,
        **{f"lr_scheduler.{name}": getattr(scheduler, name, None) for name in fields},
        **{
            f"param_groups.{i}.{key}": value
            for i, group in enumerate(groups)
            for key, value in (getattr(group, "optimizer_kwargs", None) or {}).items()
            if isinstance(value, int | float | str | bool | tuple | list)
        },
    }


def schedule_changes(folder: Path, record: dict[str, Any]) -> list[str]:
    """How this run's schedule differs from the one its checkpoints were trained with (nothing when the
    record predates schedules or is unreadable: ``check_model_record`` judges the record itself)."""
    try:
        saved = json.loads((folder / RECORD_NAME).read_text()).get("schedule")
    except (OSError, ValueError, AttributeError):
        return []
    ours = record.get("schedule")
    if not isinstance(saved, dict) or not isinstance(ours, dict):
        return []
    # A key only one side records (a record written before it was recorded) is not a change.
    return [
        f"{key} {saved[key]} there, {ours[key]} here"
        for key in sorted(set(saved) & set(ours), key=lambda k: (k != "config", k))
        if saved[key] != ours[key]
    ]


def check_data_position(folder: Path, record: dict[str, Any], *, step: int) -> None:
    """Refuse to resume a data position of another meaning (one saved per rank, before every layout read one
    stream): the loader could not continue it. Checkpoints without a record are not judged."""
    from qwen3_titan_common.data.loader import PER_RANK_POSITION  # the loader's own words; torch only here

    ours = record.get("data_position")
    try:
        saved = json.loads((folder / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return  # no record, or check_model_record has named an unreadable one
    if ours is not None and isinstance(saved, dict) and saved.get("data_position") != ours:
        raise UserInputError(f"{folder}/step-{step}: {PER_RANK_POSITION}")


def write_model_record(folder: Path, record: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RECORD_NAME
    tmp = path.with_name(f".{RECORD_NAME}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


# The fields that tell two models apart at a glance, named first.
_FIRST = ("hidden_size", "num_hidden_layers", "moe.num_experts", "vocab_size", "num_attention_heads")


def _flat(fields: Any, prefix: str = "") -> dict[str, Any]:
    """Nested fields as dotted names (``moe.num_experts``), so a difference names one field."""
    if not isinstance(fields, dict):
        return {prefix.rstrip("."): fields} if prefix else {}
    found: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            found.update(_flat(value, f"{prefix}{key}."))
        elif value is not None:
            found[f"{prefix}{key}"] = value
    return found


def _differences(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    found = []
    if saved.get("model") != ours["model"]:
        found.append(f"model {saved.get('model')} there, {ours['model']} here")
    there, here = _flat(saved.get("architecture", {})), _flat(ours["architecture"])
    for key in sorted(
        set(there) | set(here), key=lambda k: (_FIRST.index(k) if k in _FIRST else len(_FIRST), k)
    ):
        if there.get(key) != here.get(key):
            found.append(f"{key} {there.get(key)} there, {here.get(key)} here")
    return found


def _lora_flags(lora: dict[str, Any]) -> str:
    if lora.get("adapter") and not lora.get("rank"):
        return "--lora.adapter DIR"
    return f"--lora.rank {lora.get('rank')} --lora.targets {','.join(lora.get('targets') or [])}"


def _check_adapters(
    saved: dict[str, Any], record: dict[str, Any], *, folder: Path, step: int, dump_folder: str
):
    """A LoRA run's step checkpoints hold its adapters (and the frozen base), a full run's every weight: one
    cannot resume the other (records written before this field are not judged)."""
    if "lora" not in saved or saved["lora"] == record.get("lora"):
        return
    there, here = saved["lora"], record.get("lora")
    where = f"--dump_folder {dump_folder}: its checkpoints (newest: step {step} in {folder})"
    if there and not here:
        raise OtherModelError(
            f"{where} hold LoRA adapters ({_lora_flags(there)}) beside frozen base weights, and this run trains "
            f"every weight: resume it with {_lora_flags(there)}, or pass a new --dump_folder"
        )
    if here and not there:
        raise OtherModelError(
            f"{where} are a full fine-tuning run's, and this run trains LoRA adapters: resume it without --lora.*, "
            "or pass a new --dump_folder"
        )
    raise OtherModelError(
        f"{where} hold LoRA adapters of {_lora_flags(there)}, not this run's {_lora_flags(here)}: resume with "
        f"{_lora_flags(there)}, or pass a new --dump_folder"
    )


def _check_reference(
    saved: dict[str, Any], record: dict[str, Any], *, folder: Path, step: int, dump_folder: str
):
    """A live preference reference's weights are in the step checkpoints of a run that started with it, and in
    no other's: one cannot resume the other (records written before this field are not judged)."""
    if "reference" not in saved or saved["reference"] == record.get("reference"):
        return
    where = f"--dump_folder {dump_folder}: its checkpoints (newest: step {step} in {folder})"
    if saved["reference"] == "live":
        raise OtherModelError(
            f"{where} hold the starting weights of a live preference reference, and this run keeps none (a "
            "precomputed reference, or not --objective dpo): resume it with --objective dpo --dpo.reference live, "
            "or pass a new --dump_folder"
        )
    raise OtherModelError(
        f"{where} hold no live reference's weights (the run started with --dpo.reference precomputed, or without "
        "--objective dpo), and this run asks for --dpo.reference live: resume it as it started, or pass a new "
        "--dump_folder"
    )


def check_model_record(folder: Path, record: dict[str, Any], *, step: int, dump_folder: str) -> None:
    """Refuse to resume from checkpoints of another model; checkpoints without a record are not judged."""
    path = folder / RECORD_NAME
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise OtherModelError(
            f"{path}: unreadable ({err}); it records which model the checkpoints hold"
        ) from None
    saved = saved if isinstance(saved, dict) else {}
    _check_adapters(saved, record, folder=folder, step=step, dump_folder=dump_folder)
    _check_reference(saved, record, folder=folder, step=step, dump_folder=dump_folder)
    differences = _differences(saved, record)
    if differences:
        shown = "; ".join(differences[:4]) + ("; ..." if len(differences) > 4 else "")
        raise OtherModelError(
            f"--dump_folder {dump_folder}: its checkpoints (newest: step {step} in {folder}) are of another model "
            f"than this run's ({shown}); pass a new --dump_folder, or delete {folder} to start over"
        )
