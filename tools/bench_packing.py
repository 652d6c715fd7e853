"""Benchmark: packed chat fine-tuning (both backends) vs one chat per row vs TRL's SFTTrainer, in trained tokens/s,
and per-document attention against causal attention in step time (CPU).

    uv run --with 'trl==1.16.0' python -m tools.bench_packing [--quick] [--json out.json]
    uv run python -m tools.bench_packing [--quick]   # without TRL (not in the lock): its row says how to add it

`--with` overlays TRL (and its own few dependencies) on the locked environment for that one command: torch
2.14.0, transformers 5.24.0, accelerate 1.15.0 and datasets 4.7.0 stay the locked ones (TRL's run prints
them); nothing is added to the lock. ~30 minutes on 2 cores (`--quick`: ~10).

The data: 400 synthetic chats (a system prompt, 1-3 user/assistant exchanges of words from a fixed list,
seeded), of lognormal total length (median ~300 tokens, 4x the median at the 99th percentile, clipped at
1,250), rendered and tokenized with the real Qwen3 tokenizer and its hybrid chat template
(qwen3_titan_testing.qwen3_tokenizer). The model: a Qwen3 of 42M parameters with the real vocabulary
(151,936 embedding rows, 39M of the parameters; hidden 256, 4 layers, 4/2 heads of 64, tied embeddings),
written by transformers' save_pretrained with the tokenizer beside it. Then, one after another, each in a
fresh process, fp32, seq_len 2048, on the CPU:
  (a) ours, packed (the default): `train --hf-model DIR --dataloader.dataset chats.jsonl`, 2 rows a step, with
      the native backend and (a') with the hf-v5 backend;
  (b) ours, `--dataloader.no-packing`: one chat per row, padded (native);
  (c) TRL's SFTTrainer on the same weights, token ids and trained mask (pre-tokenized `input_ids` and
      `assistant_masks` from our ChatTokenizer, EOS appended as our loader appends it), `packing=True`,
      `padding_free=True`, `max_length=2048`, 2 packed sequences a step (padding-free: one row of up to
      4,096 tokens), SDPA, no cache, no gradient checkpointing, no logging, saving or evaluation.
Trained tokens are counted by one rule on every side: the loss's targets whose label is not -100 (ours:
the labels of the run's batches, which are already shifted, replayed by building its dataloader in this
process and checked against the step line's trained share; TRL: labels[:, 1:] of each batch it trained,
which transformers shifts, counted by wrapping its collator). A step lasts from the end of the step before
to its own end (ours: between step-line timestamps; TRL: on_step_end to on_step_end), so data loading counts
on both sides; the first steps are warm-up and not timed. The table also gives each side's trained share
over a whole epoch and the tokens/s at it: the timed steps' few batches (with one chat per row, a couple of
dozen chats) make the measured share noisy, and step time does not depend on it.
TRL's documents must not attend to each other for the comparison to mean anything: with its collator's own
output (position_ids restarting per document, no attention_mask: transformers then builds a per-document
mask for SDPA), the logits of a packed row must equal those of each document run alone, within 1e-5.
Also: peak memory of one attention layer's forward+backward at seq 4096 (1 x 16 heads x 128, fp32) with plain
causal SDPA, SDPA under the dense document mask and our block-sparse attention (documents of 300 tokens), each
in a fresh process: peak RSS (VmHWM, reset just before the layer) over the RSS with its inputs allocated.
Then tools/bench_document_attention.py on the same chats: a training step of a real-width model with
per-document attention against the same step under causal attention, at seq 2048 and 4096 (`--quick`: 2048).
Targets: packed >= 3x one chat per row, and >= 2.5x TRL for each backend, in trained tokens/s; document step
time <= 0.8x causal. Absolute rates depend on the machine and its load (what other processes used just before
is printed); the ratios are what compares.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from qwen3_titan_common.perf.precision import describe_cpu

from tools import bench_document_attention
from tools.bench_chats import make_chats

ROOT = Path(__file__).resolve().parents[1]
TRL_PIN = "trl==1.16.0"
TRL_COMMAND = f"uv run --with '{TRL_PIN}' python -m tools.bench_packing"
SEQ_LEN = 2048
ROWS_PER_STEP = 2
LR = 1e-4
IGNORE = -100
# What `uv run --with trl` must leave at the lock's versions (the overlay resolves its own copies).
LOCKED_CHECKED = ("torch", "transformers", "accelerate", "datasets", "tokenizers", "numpy")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMPED_STEP = re.compile(r"(\d\d):(\d\d):(\d\d),(\d{3}) .*?step:\s*(\d+)\S*\s+loss:")
_TRAINED = re.compile(r"step:\s*(\d+)\S*\s+loss:.*?trained:\s*([0-9.]+)%")
MEMORY_SEQ = 4096
MEMORY_HEADS, MEMORY_HEAD_DIM = 16, 128
MEMORY_DOC = 300
TRL_TARGET = 2.5
# A TRL step takes about two of ours on a CPU, and the whole run should stay within ~10 minutes on 2 cores.
STEPS = {False: (10, 5, 2), True: (3, 2, 1)}  # (ours, TRL's, warm-up) by --quick
# The tiny model: the embedding (151,936 x 256) is ~39M of its ~42M parameters, as in the small Qwen3s.
MODEL = dict(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    intermediate_size=768, vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)  # fmt: skip

# -- the data and the model ------------------------------------------------------------------------------


def make_model(directory: Path, tokenizer_dir: Path) -> int:
    """The tiny Qwen3 as a Hugging Face directory (safetensors, tokenizer beside it); its parameter count."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**MODEL, dtype="float32", use_cache=False)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    return sum(p.numel() for p in model.parameters())


# -- ours ------------------------------------------------------------------------------------------------


BACKENDS = {"native": "qwen3_titan_native", "hf-v5": "qwen3_titan_hf_v5"}


def ours_command(
    model_dir: Path, data: Path, out: Path, steps: int, packing: bool, backend: str = "native"
) -> list[str]:
    return [
        sys.executable, "-m", "qwen3_titan_common.launcher.launch", "--module", BACKENDS[backend], "--hf-model", str(model_dir),
        "--dataloader.dataset", str(data), "--dataloader.held_out", "0",
        "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(ROWS_PER_STEP),
        "--training.steps", str(steps), "--lr", str(LR), "--warmup", "0",
        # fp32 like the others: by default torchtitan's FSDP computes in bf16 (mixed_precision_param).
        "--training.mixed_precision_param", "float32",
        # Only training steps: no validation, checkpoint, export or TensorBoard writes between them.
        "--validator.no-enable", "--checkpoint.no-enable", "--hf.no-export", "--metrics.no-enable-tensorboard",
        "--metrics.log_freq", "1", "--dump_folder", str(out),
        *([] if packing else ["--dataloader.no-packing"]),
    ]  # fmt: skip


def ours_trained_per_step(
    model_dir: Path, data: Path, packing: bool, steps: int | None
) -> list[tuple[int, int]]:
    """(tokens, trained tokens) of each of the first ``steps`` batches of the dataloader the run builds (same
    data, seed and order), replayed here: the run prints no labels. ``steps=None``: every batch of one epoch."""
    from qwen3_titan_common.data import ChatTemplateTokenizer, TextChatDataLoader

    counts = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's, not ours to fix
        config = TextChatDataLoader.Config(
            dataset=str(data), held_out=0.0, packing=packing, infinite=steps is not None
        )
        loader = config.build(
            dp_world_size=1,
            dp_rank=0,
            tokenizer=ChatTemplateTokenizer.Config().build(tokenizer_path=str(model_dir)),
            seq_len=SEQ_LEN,
            local_batch_size=ROWS_PER_STEP,
        )
        for _, labels in loader:
            counts.append((labels.numel(), int((labels != IGNORE).sum())))
            if len(counts) == steps:
                break
    return counts


def run_ours(
    model_dir: Path, data: Path, steps: int, warmup: int, packing: bool, backend: str = "native"
) -> dict:
    from qwen3_titan_common.perf.train_log import parse_step_lines

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run(
            ours_command(model_dir, data, Path(tmp) / "out", steps, packing, backend),
            env={**os.environ, "QWEN3_TITAN_DEVICE": "cpu"}, capture_output=True, text=True, cwd=tmp,
        )  # fmt: skip
        wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    lines = parse_step_lines(log)
    if proc.returncode != 0 or len(lines) < steps:
        raise RuntimeError(
            f"train ({backend}, packing={packing}) failed, exit {proc.returncode}:\n{log[-4000:]}"
        )
    counts = ours_trained_per_step(model_dir, data, packing, steps)
    # The step line's own trained share (rounded to a percent) says whether the replay saw the run's batches.
    printed = [float(m.group(2)) for m in _TRAINED.finditer(_ANSI.sub("", log))]
    replayed = [100 * t / n for n, t in counts]
    if printed and (
        len(printed) != steps or max(abs(a - b) for a, b in zip(printed, replayed, strict=False)) > 0.51
    ):
        raise RuntimeError(f"the replayed batches' trained shares {replayed} are not the run's {printed}")
    # log_freq 1: a step lasts from the previous step line to its own, to the millisecond of the log's
    # timestamps (tps is rounded to a whole token); the first one, from its tps.
    stamps = _step_stamps(log)
    seconds = [counts[0][0] / lines[0].tokens_per_second] + [
        (stamps[i] - stamps[i - 1]) % 86400 for i in range(2, steps + 1)
    ]
    epoch = ours_trained_per_step(model_dir, data, packing, None)
    return _summary(seconds, counts, warmup, epoch) | {
        "wall_s": round(wall, 1),
        "replay_checked": bool(printed),
        "peak_rss_gib": lines[-1].memory_gib,  # the step line's peak host RSS
    }


def _step_stamps(log: str) -> dict[int, float]:
    """Seconds (from midnight) at which each step line was logged."""
    stamps = {}
    for line in _ANSI.sub("", log).splitlines():
        found = _STAMPED_STEP.search(line)
        if found:
            h, m, sec, ms, step = (int(g) for g in found.groups())
            stamps[step] = 3600 * h + 60 * m + sec + ms / 1000
    return stamps


def _summary(
    seconds: list[float], counts: list[tuple[int, int]], warmup: int, epoch: list[tuple[int, int]]
) -> dict:
    """The timed steps' figures. ``epoch``: (tokens, trained) of every batch of one epoch, whose trained share
    does not depend on which few batches the timed steps happened to get."""
    timed, timed_counts = seconds[warmup:], counts[warmup : len(seconds)]
    tokens = sum(c[0] for c in timed_counts)
    trained = sum(c[1] for c in timed_counts)
    rates = sorted(c[0] / s for c, s in zip(timed_counts, timed, strict=True))
    trained_rates = sorted(c[1] / s for c, s in zip(timed_counts, timed, strict=True))
    epoch_share = sum(c[1] for c in epoch) / sum(c[0] for c in epoch)
    return {
        "step_seconds": seconds,  # every step, warm-up included
        "steps_timed": len(timed),
        "step_s_median": statistics.median(timed),
        "tokens_per_step": tokens / len(timed),
        "tps_median": statistics.median(rates),
        "tps_range": (rates[0], rates[-1]),
        "trained_share": trained / tokens,
        "trained_tps": trained / sum(timed),
        "trained_tps_range": (trained_rates[0], trained_rates[-1]),
        "epoch_trained_share": epoch_share,
        "epoch_trained_tps": epoch_share * tokens / sum(timed),
    }


# -- TRL -------------------------------------------------------------------------------------------------


def trl_version() -> str | None:
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def _isolation_check(model, collator, row: dict) -> dict:
    """Logits of a packed row, as TRL's collator makes it, against each of its documents run alone."""
    import torch

    batch = collator([row])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    lengths = list(row["seq_lengths"])
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        worst, start = 0.0, 0
        for length in lengths:
            alone = model(input_ids=batch["input_ids"][:, start : start + length]).logits[0]
            worst = max(worst, float((packed[start : start + length] - alone).abs().max()))
            start += length
        # The same positions with an all-ones attention_mask, which turns transformers' packed-sequence
        # detection off: the documents see each other, and the check has to notice.
        ids = batch["input_ids"]
        crossed = model(
            input_ids=ids, position_ids=batch["position_ids"], attention_mask=torch.ones_like(ids)
        ).logits[0]
        leak = float((crossed[lengths[0] :] - packed[lengths[0] :]).abs().max())
    return {
        "documents": len(lengths),
        "attention_mask_passed": "attention_mask" in batch,
        "position_ids_restart": int((batch["position_ids"][0] == 0).sum()),
        "max_abs_diff": worst,
        "cross_document_diff": leak,
        "isolated": worst <= 1e-5 and "attention_mask" not in batch,
    }


def trl_worker(config_file: str) -> None:
    """TRL's run, in a fresh process (as ours are); prints its figures as JSON on the last line."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cfg = json.loads(Path(config_file).read_text())
    docs = json.loads(Path(cfg["docs"]).read_text())
    model = AutoModelForCausalLM.from_pretrained(
        cfg["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    # transformers builds per-document masks from packed position_ids only without a cache.
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    dataset = datasets.Dataset.from_dict(
        {
            "input_ids": [d["ids"] for d in docs],
            "assistant_masks": [[int(t) for t in d["trained"]] for d in docs],
        }
    )
    args = SFTConfig(
        output_dir=cfg["out"], max_steps=cfg["steps"], per_device_train_batch_size=ROWS_PER_STEP,
        max_length=SEQ_LEN, packing=True, padding_free=True, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, save_strategy="no", eval_strategy="no", logging_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip

    class Timer(TrainerCallback):
        def __init__(self):
            self.begin, self.end = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())  # the first step's interval starts here

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

    timer = Timer()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer]
    )
    collator = trainer.data_collator
    # The packed row with the most documents: the most boundaries to leak across.
    fullest = max(
        range(len(trainer.train_dataset)), key=lambda i: len(trainer.train_dataset[i]["seq_lengths"])
    )
    isolation = _isolation_check(model, collator, trainer.train_dataset[fullest])
    counts: list[tuple[int, int]] = []

    def counting(examples):
        batch = collator(examples)
        # transformers shifts the labels: token t is predicted from t-1, so labels[:, 0] is never a target.
        counts.append((batch["input_ids"].numel(), int((batch["labels"][:, 1:] != IGNORE).sum())))
        return batch

    # TRL refuses a custom collator with padding-free; wrapping its own one after construction keeps it.
    trainer.data_collator = counting
    trainer.train()
    seconds = [b - a for a, b in itertools.pairwise(timer.end)]
    in_step = [e - b for b, e in zip(timer.begin, timer.end[1:], strict=True)]
    # The whole packed epoch, by the same rule, through the same collator one row at a time.
    epoch = []
    for row in trainer.train_dataset:
        labels = collator([row])["labels"]
        epoch.append((labels.numel(), int((labels[:, 1:] != IGNORE).sum())))
    result = _summary(seconds, counts[: len(seconds)], cfg["warmup"], epoch)
    result["in_step_share"] = sum(in_step[cfg["warmup"] :]) / sum(seconds[cfg["warmup"] :])
    import importlib.metadata

    versions = {name: importlib.metadata.version(name) for name in (*LOCKED_CHECKED, "trl")}
    result |= {"isolation": isolation, "versions": versions, "threads": torch.get_num_threads()}
    print(json.dumps(result | {"peak_rss_gib": _status_bytes("VmHWM") / 2**30}))


def off_lock(versions: dict[str, str]) -> dict[str, str]:
    """Those of ``versions`` (LOCKED_CHECKED's) that uv.lock does not pin; a local tag (+cu130) aside."""
    import tomllib

    locked: dict[str, set[str]] = {}
    for package in tomllib.loads((ROOT / "uv.lock").read_text())["package"]:
        locked.setdefault(package["name"], set()).add(package.get("version"))
    return {
        name: version
        for name, version in versions.items()
        if name in LOCKED_CHECKED and version.split("+")[0] not in locked.get(name, ())
    }


def run_trl(model_dir: Path, docs_file: Path, steps: int, warmup: int, work: Path) -> dict:
    config = work / "trl.json"
    config.write_text(
        json.dumps({"model": str(model_dir), "docs": str(docs_file), "out": str(work / "trl-out"),
                    "steps": steps, "warmup": warmup})
    )  # fmt: skip
    code = f"from tools import bench_packing as b; b.trl_worker({str(config)!r})"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed, exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {
        "wall_s": round(time.perf_counter() - start, 1)
    }


# -- attention memory ------------------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def attention_memory_worker(kind: str) -> None:
    """One attention layer's forward+backward at MEMORY_SEQ; prints its peak RSS over its inputs'.

    The peak is this process's VmHWM, reset to the current RSS just before the layer runs (writing 5 to
    /proc/self/clear_refs). Not ru_maxrss: a child starts with its parent's peak there, which would hide
    this one."""
    import torch
    import torch.nn.functional as F
    from qwen3_titan_common.models.attention import document_causal_mask
    from qwen3_titan_common.models.document_blocks import block_sparse_attention, document_blocks

    def layer(q, k, v, positions):
        if kind == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if kind == "document mask":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(positions))
        # Ours takes (batch, seq, heads, dim) and the block pairs its model builds once per forward.
        out = block_sparse_attention(*(t.transpose(1, 2) for t in (q, k, v)), document_blocks(positions))
        return out.transpose(1, 2)

    def inputs(seq: int):
        g = torch.Generator().manual_seed(0)
        qkv = [
            torch.randn(1, MEMORY_HEADS, seq, MEMORY_HEAD_DIM, generator=g, requires_grad=True)
            for _ in range(3)
        ]
        return *qkv, (torch.arange(seq) % MEMORY_DOC)[None]

    layer(*inputs(1024)).sum().backward()  # loads the kernels and thread pools outside the measurement
    q, k, v, positions = inputs(MEMORY_SEQ)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    layer(q, k, v, positions).sum().backward()
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    print(json.dumps({"peak_growth_bytes": peak - before, "seconds": seconds}))


def attention_memory(kind: str) -> dict:
    code = f"from tools import bench_packing as b; b.attention_memory_worker({kind!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- main ------------------------------------------------------------------------------------------------


def _others_busy(seconds: float = 2.0) -> float:
    """Share of the CPUs busy over ``seconds`` while this process sleeps: what other processes use (the
    load average would still count a run that has just ended)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "MISSED"


def _row(name: str, s: dict) -> str:
    return (
        f"| {name} | {s['tokens_per_step']:,.0f} | {s['tps_median']:,.0f} ({s['tps_range'][0]:,.0f}-"
        f"{s['tps_range'][1]:,.0f}) | {s['trained_share']:.1%} | {s['trained_tps']:,.1f} "
        f"({s['trained_tps_range'][0]:,.1f}-{s['trained_tps_range'][1]:,.1f}) | {s['epoch_trained_share']:.1%} | "
        f"{s['epoch_trained_tps']:,.1f} | {s['peak_rss_gib']:.1f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    full, quick = STEPS[False], STEPS[True]
    parser.add_argument(
        "--steps", type=int, default=None, help=f"steps of each of our runs (default {full[0]})"
    )
    parser.add_argument("--trl-steps", type=int, default=None, help=f"steps of TRL's run (default {full[1]})")
    parser.add_argument(
        "--warmup", type=int, default=None, help=f"first steps of every side, not timed (default {full[2]})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{quick[0]} steps of ours, {quick[1]} of TRL's, {quick[2]} not timed (a smoke run)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--ratio-layers",
        type=int,
        default=8,
        help="layers of the real-width model of the step-time comparison",
    )
    parser.add_argument(
        "--ratio-steps",
        type=int,
        default=None,
        help="steps of each step-time run, the first not timed (default 3)",
    )
    parser.add_argument(
        "--ratio-precision",
        nargs="+",
        default=["fp32"],
        choices=list(bench_document_attention.DTYPES),
        help="precision(s) of the step-time comparison: fp32, as the rest of this benchmark, and/or bf16, as a "
        "one-CPU-rank run computes on a CPU with bf16 GEMMs",
    )
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are
    steps, trl_steps, warmup = STEPS[args.quick]
    steps, trl_steps = args.steps or steps, args.trl_steps or trl_steps
    warmup = warmup if args.warmup is None else args.warmup
    if min(steps, trl_steps) <= warmup:
        parser.error("--steps and --trl-steps must exceed --warmup")
    figures: dict = {
        "steps": steps,
        "trl_steps": trl_steps,
        "warmup": warmup,
        "others_busy": _others_busy(),
    }
    version = trl_version()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        from qwen3_titan_testing.qwen3_tokenizer import qwen3_tokenizer_dir

        tokenizer_dir = qwen3_tokenizer_dir(work / "tokenizer")
        data = work / "chats.jsonl"
        docs = make_chats(data, tokenizer_dir)
        lengths = sorted(len(d["ids"]) for d in docs)
        c = figures["chats"] = {
            "n": len(docs), "median_tokens": statistics.median(lengths), "mean_tokens": sum(lengths) / len(lengths),
            "p90_tokens": lengths[int(0.9 * len(lengths))], "max_tokens": lengths[-1],
            "trained_share": sum(sum(d["trained"][1:]) for d in docs) / sum(lengths),
        }  # fmt: skip
        docs_file = work / "docs.json"
        docs_file.write_text(json.dumps(docs))
        model_dir = work / "model"
        figures["parameters"] = make_model(model_dir, tokenizer_dir)
        print(
            f"{c['n']} chats (Qwen3 tokenizer and hybrid template), tokens per chat: median {c['median_tokens']:.0f}, "
            f"mean {c['mean_tokens']:.0f}, p90 {c['p90_tokens']}, max {c['max_tokens']}; assistant (trained) "
            f"{c['trained_share']:.1%}. Qwen3 of {figures['parameters'] / 1e6:.1f}M parameters, fp32, seq_len "
            f"{SEQ_LEN}, {ROWS_PER_STEP} rows per step; {steps} steps of ours, {trl_steps} of TRL's, the first "
            f"{warmup} not timed",
            flush=True,
        )
        sides: dict[str, dict | None] = {}
        for name, backend, packing in (
            ("ours, packed", "native", True),
            ("ours (hf-v5), packed", "hf-v5", True),
            ("ours, one chat per row", "native", False),
        ):
            sides[name] = run_ours(model_dir, data, steps, warmup, packing=packing, backend=backend)
            print(f"  {name}: {sides[name]['wall_s']} s", flush=True)
        trl_error = None
        if version is not None:
            try:
                sides["TRL SFTTrainer"] = run_trl(model_dir, docs_file, trl_steps, warmup, work)
                print(f"  TRL {version}: {sides['TRL SFTTrainer']['wall_s']} s", flush=True)
            except RuntimeError as e:
                trl_error = str(e)
                print(trl_error, file=sys.stderr)
        memory = {kind: attention_memory(kind) for kind in ("causal", "document mask", "block-sparse")}
        print("step time, document vs causal attention (tools/bench_document_attention.py):", flush=True)
        seqs = [2048] if args.quick else [2048, 4096]
        ratio_steps = args.ratio_steps or (2 if args.quick else 3)
        step_ratios = [
            bench_document_attention.measure(
                data, tokenizer_dir, seqs, steps=ratio_steps, layers=args.ratio_layers, precision=precision
            )
            for precision in args.ratio_precision
        ]
    figures |= {"sides": sides, "attention_memory": memory, "document_vs_causal": step_ratios}

    print(
        f"\nCPU, {os.cpu_count()} cores ({figures['others_busy']:.0%} busy with other processes just before the "
        "start); per-step medians over the timed steps (min-max); trained tokens/s = trained tokens / time of "
        "the timed steps:"
    )
    if figures["others_busy"] > 0.2:
        print("  NOTE: other processes were using the CPUs when this started; the rates may be disturbed")
    print(
        "| side | tokens/step | tokens/s | trained share | trained tokens/s | epoch's trained share | "
        "tokens/s x epoch's share | peak RSS GiB |\n|---|---|---|---|---|---|---|---|"
    )
    packed, single = sides["ours, packed"], sides["ours, one chat per row"]
    trl = sides.get("TRL SFTTrainer")
    for name, side in sides.items():
        print(_row(name, side))
    if trl is None:
        why = (
            f"failed ({trl_error.splitlines()[0]})"
            if trl_error
            else f"not installed (run with: {TRL_COMMAND})"
        )
        print(f"| TRL SFTTrainer | {why} | | | | | | |")
    ratio = packed["trained_tps"] / single["trained_tps"]
    figures["packed_vs_one_per_row"] = ratio
    print(f"packed vs one chat per row, trained tokens/s: {ratio:.2f}x (target >= 3x): {_verdict(ratio, 3)}")
    if trl is None:
        why = "its run failed (stderr)" if trl_error else f"TRL not installed (run with: {TRL_COMMAND})"
        print(
            f"ours packed vs TRL SFTTrainer, trained tokens/s (target >= {TRL_TARGET}x): not measured, {why}"
        )
    else:
        iso = trl["isolation"]
        for name in ("ours, packed", "ours (hf-v5), packed"):
            ratio = sides[name]["trained_tps"] / trl["trained_tps"]
            figures[f"{name} vs trl"] = ratio
            print(
                f"{name} vs TRL {trl['versions']['trl']} SFTTrainer (packing, padding-free), trained tokens/s: "
                f"{ratio:.2f}x (target >= {TRL_TARGET}x): {_verdict(ratio, TRL_TARGET)}"
            )
        print(
            f"  TRL's documents isolated: {'yes' if iso['isolated'] else 'NO, so the comparison is not like for like'}"
            f" (its collator's row of {iso['documents']} documents, attention_mask passed: "
            f"{iso['attention_mask_passed']}; max |logit difference| against each document alone "
            f"{iso['max_abs_diff']:.1e}, 1e-5 allowed; with an all-ones attention_mask instead {iso['cross_document_diff']:.1e})"
        )
        changed = off_lock(trl["versions"])
        verdict = "the lock's" if not changed else f"NOT the lock's: {changed}"
        print(
            f"  TRL's run (and ours, the same interpreter): {trl['versions']}, {verdict}; {trl['threads']} torch threads; "
            f"{trl['in_step_share']:.1%} of its step time between on_step_begin and on_step_end"
        )
    others = [("one chat per row", single)] + ([("TRL", trl)] if trl else [])
    figures["at_epoch_share"] = {k: packed["epoch_trained_tps"] / v["epoch_trained_tps"] for k, v in others}
    print(
        "the same ratios at each side's trained share over a whole epoch (the timed steps' few batches "
        "aside): " + ", ".join(f"packed vs {k} {r:.2f}x" for k, r in figures["at_epoch_share"].items())
    )
    for kind, m in memory.items():
        what = "ours, block_sparse_attention" if kind == "block-sparse" else "F.scaled_dot_product_attention"
        print(
            f"attention forward+backward at seq {MEMORY_SEQ} (1 x {MEMORY_HEADS} heads x {MEMORY_HEAD_DIM}, fp32), "
            f"{kind} [{what}]: peak RSS over its inputs {m['peak_growth_bytes'] / 2**20:,.0f} MiB, {m['seconds']:.2f} s"
        )
    for step_ratio in step_ratios:
        print("\n".join(bench_document_attention.report(step_ratio)))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
