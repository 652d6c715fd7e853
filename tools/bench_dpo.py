"""Preference training against TRL's DPOTrainer: the same losses, and the pairs trained per second (CPU, fp32).

    uv run --with 'trl==1.16.0' python -m tools.bench_dpo [--quick] [--json out.json]

`--with` overlays TRL on the locked environment for that one command (torch, transformers, accelerate and
datasets stay the locked ones; TRL's run prints them); TRL is never a dependency. ~10 minutes on 2 cores.

Part 1, agreement. A tiny Qwen3 (the embedded 4,096-token tokenizer, hidden 64, 2 layers, tied embeddings,
written by transformers' save_pretrained) and the first 12 pairs of the embedded preference set
(``default-pairs``, strings), in file order, 4 pairs a step, 3 steps, fp32, AdamW (lr 1e-4, betas 0.9/0.95,
no weight decay, constant rate, gradient norm clipped at 1): ours one pair per row
(``--dataloader.no-packing``, the layout the peers use) and packed with the prompt shared (which puts other
pairs in a step, so only its step 1 compares), and TRL's DPOTrainer on the same directory, its sampler
sequential. Both sides tokenize a string pair by the same rule (TRL's: the prompt and prompt + completion,
the completion starting where they diverge, EOS appended). Per step: the loss (TRL's unrounded, from its
compute_loss), the accuracy and the margin, sigmoid and IPO. The bound is the project's rule
(``train.tolerance``): step k's logits carry 2k - 1 forward passes of rounding, a pair's h a row of
log-probabilities, the loss beta (sigmoid) or 2 |h - 1/(2 beta)| (IPO) per unit of h.

Part 2, speed. The benchmark model of ``tools.bench_packing`` (42M parameters, the real Qwen3 vocabulary and
tokenizer) and 256 pairs of ``default-pairs`` tokenized with it; each side in a fresh process, steps timed
after warm-up: ours packed (the default: the prompt once per pair, several pairs a row of 1,024), 2 rows a
step, with the reference precomputed before step 1 and again live (``--dpo.reference live``: scored in each
step, as TRL's is); TRL with its defaults (pairs padded to the longest of the batch, a frozen reference model), 8
pairs a step. Pairs trained per second over the timed steps, and peak RSS (ours: the rank's, from its step line;
TRL's process VmHWM). Target: ours >= 2x TRL's pairs/s, peak memory no higher.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qwen3_titan_common.perf.precision import describe_cpu

from tools.bench_packing import (
    LOCKED_CHECKED,
    ROOT,
    _status_bytes,
    _step_stamps,
    make_model,
    off_lock,
    trl_version,
)

TRL_PIN = "trl==1.16.0"
TRL_COMMAND = f"uv run --with '{TRL_PIN}' python -m tools.bench_dpo"
LR = 1e-4
BETA = 0.1
AGREE_PAIRS, AGREE_BATCH, AGREE_STEPS, AGREE_SEQ = 12, 4, 3, 256
SPEED_PAIRS, SPEED_SEQ, SPEED_ROWS, TRL_PAIRS = 256, 1024, 2, 8
SPEED_STEPS = {False: (10, 3), True: (5, 2)}  # (steps, warm-up) by --quick
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=4096, max_position_embeddings=4096, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip
OURS_OPTIMIZER = [
    "--lr", str(LR), "--warmup", "0", "--decay", "0",
    "--optimizer.param_groups.0.optimizer_kwargs.weight_decay", "0",
]  # fmt: skip


def pairs_file(path: Path, count: int) -> Path:
    from qwen3_titan_common.assets import default_pairs_path

    lines = default_pairs_path().read_text().splitlines()[:count]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_model(directory: Path) -> Path:
    import torch
    from qwen3_titan_common.assets import default_tokenizer_dir
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    torch.manual_seed(0)
    config = Qwen3Config(
        **TINY, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, use_cache=False
    )
    Qwen3ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


# -- ours ------------------------------------------------------------------------------------------------


def run_ours(model_dir: Path, data: Path, out: Path, flags: list[str]) -> tuple[str, dict[str, list[float]]]:
    command = [
        sys.executable, "-m", "qwen3_titan_common.launcher.launch", "--module", "qwen3_titan_native",
        "--hf-model", str(model_dir), "--objective", "dpo", "--dataloader.dataset", str(data),
        "--dataloader.held_out", "0", "--dataloader.no-shuffle", "--training.mixed_precision_param", "float32",
        "--validator.no-enable", "--checkpoint.no-enable", "--hf.no-export", "--metrics.log_freq", "1",
        "--dump_folder", str(out), *OURS_OPTIMIZER, *flags,
    ]  # fmt: skip
    proc = subprocess.run(
        command,
        env={**os.environ, "QWEN3_TITAN_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        cwd=out.parent,
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ours failed, exit {proc.returncode}:\n{log[-4000:]}")
    from qwen3_titan_testing.narrow_moe import tensorboard_scalars

    return log, tensorboard_scalars(out / "tb")


# -- TRL -------------------------------------------------------------------------------------------------


def trl_worker(config_file: str) -> None:
    """TRL's run, in a fresh process; prints its figures as JSON on the last line."""
    import datasets
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cfg = json.loads(Path(config_file).read_text())
    records = [json.loads(line) for line in Path(cfg["data"]).read_text().splitlines()]
    dataset = datasets.Dataset.from_list(records)
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    args = DPOConfig(
        output_dir=cfg["out"], max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch"],
        beta=BETA, loss_type=[cfg["loss_type"]], max_length=None, use_cpu=True, bf16=False, fp16=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, save_strategy="no", eval_strategy="no",
        logging_steps=1, report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip

    class Ordered(DPOTrainer):
        """The pairs in file order, as ours reads them with --dataloader.no-shuffle; each step's loss unrounded."""

        losses: list[float] = []

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            value = loss[0] if isinstance(loss, tuple) else loss
            self.losses.append(float(value.detach()))
            return loss

    class Timer(TrainerCallback):
        def __init__(self):
            self.end: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

    timer = Timer()
    trainer = Ordered(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer]
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "rewards/accuracies" in entry]
    import importlib.metadata

    print(
        json.dumps(
            {
                "loss": trainer.losses,
                "accuracy": [entry["rewards/accuracies"] for entry in logs],
                "margin": [entry["rewards/margins"] for entry in logs],
                "step_seconds": [b - a for a, b in zip(timer.end, timer.end[1:], strict=False)],
                "peak_rss_gib": _status_bytes("VmHWM") / 2**30,
                "versions": {name: importlib.metadata.version(name) for name in (*LOCKED_CHECKED, "trl")},
                "threads": torch.get_num_threads(),
            }
        )
    )


def run_trl(model_dir: Path, data: Path, work: Path, **settings) -> dict:
    config = work / f"trl-{time.monotonic_ns()}.json"
    config.write_text(
        json.dumps({"model": str(model_dir), "data": str(data), "out": str(work / "trl-out"), **settings})
    )
    code = f"from tools import bench_dpo as b; b.trl_worker({str(config)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed, exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- part 1: agreement -----------------------------------------------------------------------------------


def h_bound(model_dir: Path, passes: int) -> float:
    from qwen3_titan_common.train.tolerance import ModelBounds

    return ModelBounds.from_dir(model_dir).log_ratio_atol(tokens=AGREE_SEQ, seq_len=AGREE_SEQ, passes=passes)


def agreement(work: Path) -> list[dict]:
    model_dir = tiny_model(work / "tiny")
    data = pairs_file(work / "agree.jsonl", AGREE_PAIRS)
    rows = []
    for loss_type in ("sigmoid", "ipo"):
        flags = [
            "--dpo.loss_type",
            loss_type,
            "--training.seq_len",
            str(AGREE_SEQ),
            "--steps",
            str(AGREE_STEPS),
        ]
        _, one = run_ours(
            model_dir,
            data,
            work / f"ours-{loss_type}",
            [*flags, "--dataloader.no-packing", "--batch-size", str(AGREE_BATCH)],
        )
        _, packed = run_ours(model_dir, data, work / f"packed-{loss_type}", [*flags, "--batch-size", "1"])
        trl = run_trl(model_dir, data, work, steps=AGREE_STEPS, batch=AGREE_BATCH, loss_type=loss_type)
        for step in range(1, AGREE_STEPS + 1):
            h = h_bound(model_dir, 2 * step - 1)
            ours_loss = one["loss_metrics/global_avg_loss"][step - 1]
            slope = BETA if loss_type == "sigmoid" else 2 * abs(math.sqrt(ours_loss)) + 2 * h
            row = {
                "loss_type": loss_type,
                "step": step,
                "ours": ours_loss,
                "trl": trl["loss"][step - 1],
                "bound": slope * 2 * h,
                "ours_accuracy": one["dpo/accuracy"][step - 1],
                "trl_accuracy": trl["accuracy"][step - 1],
                "ours_margin": one["dpo/margin"][step - 1],
                "trl_margin": trl["margin"][step - 1],
                "margin_bound": BETA * 2 * h,
            }
            if step == 1:
                row["packed"] = packed["loss_metrics/global_avg_loss"][0]
            rows.append(row)
    return rows


# -- part 2: speed ---------------------------------------------------------------------------------------


def speed(work: Path, quick: bool) -> dict:
    from qwen3_titan_testing.qwen3_tokenizer import qwen3_tokenizer_dir

    steps, warmup = SPEED_STEPS[quick]
    model_dir = work / "model"
    model_dir.mkdir()
    parameters = make_model(model_dir, qwen3_tokenizer_dir(work / "qwen3-tokenizer"))
    data = pairs_file(work / "speed.jsonl", SPEED_PAIRS)
    ours = _ours_speed(model_dir, data, work / "ours-speed", steps, warmup, [])
    # Like TRL's default, a reference that scores each step's pairs in the step (ours: the starting weights
    # swapped in), where the precomputed one scored them all before step 1, outside the timed steps.
    ours_live = _ours_speed(model_dir, data, work / "ours-live", steps, warmup, ["--dpo.reference", "live"])
    trl = run_trl(model_dir, data, work, steps=steps, batch=TRL_PAIRS, loss_type="sigmoid")
    timed = trl["step_seconds"][warmup:steps]
    trl_row = {
        "pairs_per_step": TRL_PAIRS,
        "pairs_per_s": TRL_PAIRS * len(timed) / sum(timed),
        "step_s": sum(timed) / len(timed),
        "peak_rss_gib": trl["peak_rss_gib"],
        "versions": trl["versions"],
    }
    return {
        "parameters": parameters,
        "ours": ours,
        "ours_live": ours_live,
        "trl": trl_row,
        "ratio": ours["pairs_per_s"] / trl_row["pairs_per_s"],
        "ratio_live": ours_live["pairs_per_s"] / trl_row["pairs_per_s"],
    }


def _ours_speed(model_dir: Path, data: Path, out: Path, steps: int, warmup: int, flags: list[str]) -> dict:
    from qwen3_titan_common.perf.train_log import parse_step_lines

    log, scalars = run_ours(
        model_dir, data, out,
        ["--training.seq_len", str(SPEED_SEQ), "--batch-size", str(SPEED_ROWS), "--steps", str(steps), *flags],
    )  # fmt: skip
    stamps = _step_stamps(log)
    seconds = [(stamps[i] - stamps[i - 1]) % 86400 for i in range(warmup + 1, steps + 1)]
    pairs = scalars["dpo/pairs"][warmup:steps]
    return {
        "pairs_per_step": sum(pairs) / len(pairs),
        "pairs_per_s": sum(pairs) / sum(seconds),
        "step_s": sum(seconds) / len(seconds),
        "peak_rss_gib": parse_step_lines(log)[-1].memory_gib,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    if trl_version() is None:
        print(f"TRL is not installed here; run: {TRL_COMMAND}", file=sys.stderr)
        return 2
    print(f"CPU: {describe_cpu()}; TRL {trl_version()}")
    work = Path(tempfile.mkdtemp(prefix="bench-dpo-"))
    try:
        rows = agreement(work)
        print("\nPart 1: per-step loss, accuracy and margin, ours (one pair per row) vs TRL's DPOTrainer")
        print(
            f"{'loss':8} {'step':>4} {'ours':>10} {'TRL':>10} {'|diff|':>9} {'bound':>9}  acc ours/TRL  margin ours/TRL"
        )
        agree = True
        for r in rows:
            diff = abs(r["ours"] - r["trl"])
            within = diff <= r["bound"] and abs(r["ours_margin"] - r["trl_margin"]) <= r["margin_bound"]
            agree &= within
            print(
                f"{r['loss_type']:8} {r['step']:4} {r['ours']:10.6f} {r['trl']:10.6f} {diff:9.2e} {r['bound']:9.2e}  "
                f"{r['ours_accuracy']:.2f}/{r['trl_accuracy']:.2f}    {r['ours_margin']:+.5f}/{r['trl_margin']:+.5f}"
                + ("" if within else "  OUTSIDE THE BOUND")
                + (f"  (packed, prompt shared: {r['packed']:.6f})" if "packed" in r else "")
            )
        result = speed(work, args.quick)
        ours, ours_live, trl = result["ours"], result["ours_live"], result["trl"]
        print(
            f"\nPart 2: {result['parameters'] / 1e6:.0f}M-parameter model, fp32; TRL's versions {trl['versions']}"
        )
        print(f"{'':34} {'pairs/step':>10} {'step s':>8} {'pairs/s':>8} {'peak RSS':>9}")
        for name, row in (
            ("ours, packed, prompt shared", ours),
            ("ours, the same, live reference", ours_live),
            ("TRL DPOTrainer (padded)", trl),
        ):
            print(
                f"{name:34} {row['pairs_per_step']:10.1f} {row['step_s']:8.2f} {row['pairs_per_s']:8.2f} "
                f"{row['peak_rss_gib']:8.2f}G"
            )
        print(
            f"ours / TRL pairs per second: {result['ratio']:.2f} (target >= 2; with the live reference "
            f"{result['ratio_live']:.2f}); peak RSS {ours['peak_rss_gib']:.2f} (live {ours_live['peak_rss_gib']:.2f}) "
            f"vs {trl['peak_rss_gib']:.2f} GiB (target: no higher)"
        )
        off = off_lock(trl["versions"])
        if off:
            print(f"warning: TRL's run used versions the lock does not pin: {off}")
        if args.json:
            args.json.write_text(json.dumps({"agreement": rows, "speed": result}, indent=1))
        return 0 if agree else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
