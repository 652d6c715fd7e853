"""The end of a run in a few lines: how it went, where its outputs are, and the commands that come next.

    [train] done: steps 1-30 of 30 in 41s; 245,760 tokens, 6,012 tokens/s, 100% of them trained; loss 8.349 -> 5.871; peak memory 1.27GiB (host RSS)
    [train] checkpoint: outputs/native-debug/checkpoint/step-30
    [train] export:     outputs/native-debug/hf/step-30
    [train] resume:     uv run --package native-backend train --steps 60   (from step 30; any --steps above 30)
    [train] verify:     uv run verify-checkpoint outputs/native-debug/hf/step-30
    [train] load:       uv run python -c "import transformers as t; ..."

Rank 0 builds a :class:`RunSummary` after the last step and export. Under the ``train`` launcher (which passes
the command the user typed as the config's ``--launcher.command``, :class:`LauncherOptions`) it goes into the
node's :class:`RunRecord`, the one file a rank leaves for the launcher beside its torchelastic error file, and the
launcher prints it after torchrun and every rank have finished, with the wall time; under a bare ``torchrun``
the rank logs the same lines itself. Nothing here imports torch: the launcher reads it.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qwen3_titan_common.protocols.short_flags import flag_spelling

RUN_FILE = "run.json"


@dataclass(frozen=True)
class RunSummary:
    first_step: int | None
    last_step: int | None
    total_steps: int
    tokens: int
    train_seconds: float
    tokens_per_second: float | None
    first_loss: float | None
    final_loss: float | None
    peak_memory_gib: float | None
    memory_source: str
    checkpoint: str | None  # the last step checkpoint's folder, None when checkpointing is off
    export: str | None  # the last Hugging Face export's folder, None without one
    trained_share: float | None = None  # share of the computed tokens that carried loss
    # A LoRA run: ``export`` is its adapter; the merged model (--lora.merge), the base model the adapter applies
    # to, and where its tokenizer is (the base's, else the run's own assets).
    merged: str | None = None
    base: str | None = None
    tokenizer: str | None = None
    last_logged_step: int | None = (
        None  # the loss figures' step, when the run trained past its last step line
    )
    dropped_share: float | None = (
        None  # a fixed-capacity expert exchange's dropped share of the routed assignments
    )
    losses: list[list[float]] | None = None  # [step, loss] of the logged steps (perf.run_progress keeps them)
    ranks: int = 1  # the job's ranks: tokens and tokens/s are all of theirs, a step line's tps one rank's
    converted: str | None = None  # --hf.to_dcp: the torchtitan checkpoint written, no step trained
    source: str | None = None  # ... from this Hugging Face directory


@dataclass(kw_only=True, slots=True)
class LauncherOptions:
    command: str = ""
    """The command the user typed, which the ``train`` launcher passes to its ranks: the exports' model cards
    repeat it, and a rank the launcher started leaves its summary for the launcher to print. Empty under a bare
    ``torchrun``."""


@dataclass
class RunRecord:
    """What a node's first local rank leaves for the ``train`` launcher, in one file beside its torchelastic
    error file, rewritten whole as the run goes: where the run writes (once its checks passed), the last step
    its metrics logged, the newest complete checkpoint of a run interrupted in its steps, and rank 0's summary
    at the end. The launcher reads it once, after torchrun returns
    (the log's folder, an interruption's step, the summary). Outside the launcher nothing is written."""

    dump_folder: str
    checkpoint_folder: str
    last_step: int | None = None
    summary: RunSummary | None = None
    interrupted_with_checkpoint: int | None = None
    """An interrupted run's newest complete step checkpoint, as the rank read it on its way out (-1: none), so
    that the launcher's last line names it without reading DCP's files itself (which imports torch). None:
    not read (the rank was not interrupted in its steps, or was killed before it could read)."""
    # Where this rank writes the record (not part of it): None when no launcher reads one.
    folder: Path | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of_rank(cls, launcher: LauncherOptions, dump_folder: str, checkpoint_folder: str) -> RunRecord:
        """This rank's record: written beside torchelastic's error file (which torchrun names for each rank) on a
        node's first local rank when the ``train`` launcher started the job."""
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        reads = bool(launcher.command and error_file) and os.environ.get("LOCAL_RANK", "0") == "0"
        return cls(dump_folder, checkpoint_folder, folder=Path(error_file).parent if reads else None)

    def save(self) -> None:
        """Atomically, so that the launcher reads a complete file or none; a file that cannot be written (its
        disk full) leaves the previous one: the run goes on, and its last line has less to say."""
        if self.folder is None:
            return
        fields = asdict(self)
        fields.pop("folder")
        partial = self.folder / (RUN_FILE + ".partial")
        try:
            partial.write_text(json.dumps(fields))
            partial.replace(self.folder / RUN_FILE)
        except OSError:
            pass

    @classmethod
    def read(cls, path: str | os.PathLike) -> RunRecord | None:
        try:
            fields = json.loads(Path(path).read_text())
            summary = fields.pop("summary", None)
            return cls(**fields, summary=RunSummary(**summary) if summary else None)
        except (OSError, ValueError, TypeError, AttributeError):
            return None


def _shown(path: str) -> str:
    """A path relative to the working directory when it lies under it (shorter to copy)."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _duration(seconds: float) -> str:
    from qwen3_titan_common.perf.progress import format_duration

    return format_duration(seconds)


def with_steps(command: list[str], steps: int) -> list[str]:
    """``command`` asking for ``steps`` training steps (its own --steps or --training.steps replaced)."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
            continue
        if flag_spelling(arg) in (flag_spelling("--steps"), flag_spelling("--training.steps")):
            skip = "=" not in arg
            continue
        out.append(arg)
    return [*out, "--steps", str(steps)]


def summary_lines(
    summary: RunSummary,
    *,
    command: list[str] | None = None,
    python: list[str] | None = None,
    wall_seconds: float | None = None,
) -> list[str]:
    """The summary's lines. ``command``: how the run was launched (the resume line repeats it);
    ``python``: how to run Python in this environment (``uv run python``)."""
    s = summary
    if s.converted:
        lines = [
            f"converted: {_shown(s.source or '?')} -> {_shown(s.converted)} (torchtitan checkpoint, weights only)"
        ]
        if command:
            rest = [arg for arg in command if flag_spelling(arg) != flag_spelling("--hf.to_dcp")]
            lines.append(f"train:     {shlex.join(rest)}   (starts from it: the same --out)")
        lines.append(
            f"elsewhere: --checkpoint.initial_load_path {_shown(s.converted)} --checkpoint.initial_load_model_only"
        )
        return lines
    if s.last_step is None:
        return ["done: no step was trained (the run had already reached --training.steps)"]
    took = _duration(wall_seconds if wall_seconds is not None else s.train_seconds)
    rate = f", {s.tokens_per_second:,.0f} tokens/s" if s.tokens_per_second else ""
    if rate and s.ranks > 1:
        rate += f" over {s.ranks} ranks ({s.tokens_per_second / s.ranks:,.0f} per rank, the step lines' tps)"
    if s.trained_share is not None:
        rate += f", {100 * s.trained_share:.0f}% of them trained"
    memory = f"; peak memory {s.peak_memory_gib:.2f}GiB ({s.memory_source})" if s.peak_memory_gib else ""
    loss = f"; loss {s.first_loss:.3f} -> {s.final_loss:.3f}" if s.first_loss is not None else ""
    if loss and s.last_logged_step is not None and s.last_logged_step != s.last_step:
        loss += f" (at step {s.last_logged_step}, the last step line)"
    lines = [
        f"done: steps {s.first_step}-{s.last_step} of {s.total_steps} in {took}; "
        f"{s.tokens:,} tokens{rate}{loss}{memory}"
    ]
    if s.checkpoint:
        lines.append(f"checkpoint: {_shown(s.checkpoint)}")
    if s.export and s.base:
        lines.append(f"adapter:    {_shown(s.export)}   (peft LoRA, on the base {_shown(s.base)})")
        if s.merged:
            lines.append(f"export:     {_shown(s.merged)}   (base + adapters merged)")
    elif s.export:
        lines.append(f"export:     {_shown(s.export)}")
    more = max(2 * s.last_step, s.last_step + 1)
    if not s.checkpoint:
        lines.append("resume:     no step checkpoint (--checkpoint.no-enable): a rerun starts over")
    elif command:
        lines.append(
            f"resume:     {shlex.join(with_steps(command, more))}   "
            f"(from step {s.last_step}; any --steps above {s.last_step})"
        )
    else:
        lines.append(f"resume:     the same command with --training.steps above {s.last_step}")
    if s.export:
        # What a user loads next: the merged model when there is one, else the export or the adapter.
        loaded = _shown(s.merged or s.export)
        adapter_only = bool(s.base) and not s.merged
        uv = python is not None and python[:2] == ["uv", "run"]
        verify = ["uv", "run", "verify-checkpoint"] if uv else ["verify-checkpoint"]
        lines.append(f"verify:     {shlex.join([*verify, loaded])}")
        where = json.dumps(loaded)  # a Python string literal in double quotes: one shell quoting level
        # transformers loads an adapter directory itself (through peft) on its base; the tokenizer is the base's.
        tokenizer = json.dumps(_shown(s.tokenizer or s.base)) if adapter_only else where
        code = (
            "import transformers as t; "
            f"m = t.AutoModelForCausalLM.from_pretrained({where}); "
            f"k = t.AutoTokenizer.from_pretrained({tokenizer}); "
            'print(type(m).__name__, m.num_parameters(), "parameters,", len(k), "tokens")'
        )
        lines.append(f"load:       {shlex.join([*(python or ['python']), '-c', code])}")
    return lines


def summary_of(trainer, export: str | os.PathLike | None) -> RunSummary:
    """The summary of a finished ``Qwen3Trainer`` (its metrics' ``RunProgress``, its checkpoint folder)."""
    metrics = trainer.metrics_processor
    progress = metrics.progress
    checkpointer = trainer.checkpointer
    checkpoint = None
    if checkpointer.enable and getattr(checkpointer, "save_steps", True) and progress.last_step is not None:
        checkpoint = str((Path(checkpointer.folder) / f"step-{trainer.step}").resolve())
    lora = getattr(checkpointer, "exports", None)
    lora_fields = {}
    if lora is not None and export:
        base = Path(lora.base)
        has_tokenizer = (base / "tokenizer.json").is_file() or (base / "vocab.json").is_file()
        lora_fields = {
            "merged": str(lora.merged.resolve()) if lora.merged else None,
            "base": str(base),
            "tokenizer": str(base) if has_tokenizer else str(Path(trainer.config.hf_assets_path).resolve()),
        }
    first = getattr(trainer, "first_trained_step", None)
    return RunSummary(
        # The steps trained, not the steps logged: a 2-step run that logs every 10th trained steps 1-2.
        first_step=first if first is not None else progress.first_step,
        last_step=trainer.step if first is not None else progress.last_step,
        last_logged_step=progress.last_step,
        total_steps=progress.total_steps,
        tokens=progress.tokens,
        train_seconds=progress.seconds,
        tokens_per_second=progress.tokens_per_second(),
        first_loss=progress.first_loss,
        final_loss=progress.final_loss,
        peak_memory_gib=progress.peak_memory_gib,
        memory_source=metrics.memory_source,
        checkpoint=checkpoint,
        export=str(Path(export).resolve()) if export else None,
        trained_share=progress.trained_share(),
        dropped_share=progress.dropped_share(),
        losses=[[step, loss] for step, loss in progress.losses],
        ranks=getattr(getattr(trainer, "parallel_dims", None), "world_size", 1),
        **lora_fields,
    )


def converted_summary(trainer, converted: str | os.PathLike) -> RunSummary:
    """The summary of ``--hf.to_dcp``: where the weights came from and the checkpoint written."""
    return RunSummary(
        first_step=None, last_step=None, total_steps=0, tokens=0, train_seconds=0.0, tokens_per_second=None,
        first_loss=None, final_loss=None, peak_memory_gib=None, memory_source="", checkpoint=None, export=None,
        converted=str(Path(converted).resolve()), source=trainer.config.hf.model_dir,
        ranks=getattr(getattr(trainer, "parallel_dims", None), "world_size", 1),
    )  # fmt: skip


def report(summary: RunSummary, record: RunRecord, log) -> None:
    """Into ``record`` for the launcher to print, when one reads it, else to ``log`` (one call per line)."""
    if record.folder is not None:
        record.summary = summary
        record.save()
        return
    for line in summary_lines(summary):
        log(f"[summary] {line}")
