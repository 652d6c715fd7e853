"""What the dense CPU benchmarks share: a backend's tokens/s through `train`, and the plain
transformers training loop they are compared against (``tools.bench_native_cpu``, ``tools.bench_hf_v5_cpu``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(Path(sys.executable).with_name("train"))
QUIET = ["--checkpoint.no-enable", "--hf.no-export"]


def cpu_env(backend: str | None = None) -> dict[str, str]:
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu"}
    if backend:
        env["QWEN3_TITAN_BACKEND"] = backend
    return env


def trainer_tokens_per_second(backend: str, steps: int, extra: list[str]) -> float:
    """Median tokens/s of `train` (the embedded default) over the steps after the first quarter
    (warm-up and compilation)."""
    from qwen3_titan_common.perf.train_log import parse_step_lines

    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [TRAIN, "--training.steps", str(steps), *QUIET, "--dump_folder", tmp, *extra],
            env=cpu_env(backend), capture_output=True, text=True, cwd=tmp,
        )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{backend}: train failed\n{out.stderr[-3000:]}")
    lines = parse_step_lines(out.stdout + out.stderr)
    return statistics.median(s.tokens_per_second for s in lines[len(lines) // 4 :])


def transformers_loop(steps: int, autocast_bf16: bool) -> float:
    """A plain training loop: the `debug` config's architecture, batch, sequence and AdamW
    settings as transformers' Qwen3ForCausalLM with SDPA."""
    import torch
    from qwen3_titan_native.config_registry import debug
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = debug()
    source = dict(config.architecture.source)
    source.pop("architectures", None)
    model = Qwen3ForCausalLM(Qwen3Config(**source, attn_implementation="sdpa"))
    lr = config.optimizer.param_groups[0].optimizer_kwargs["lr"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    batch, seq = config.training.local_batch_size, config.training.seq_len
    tokens = torch.randint(
        0, source["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    rates = []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        rates.append(batch * seq / (time.perf_counter() - start))
    return statistics.median(rates[len(rates) // 4 :])


def transformers_loop_in_subprocess(steps: int, autocast_bf16: bool) -> float:
    """`transformers_loop` in a fresh process, so that no benchmark shares threads or caches."""
    code = (
        "import json; from tools import bench_dense_common as b; "
        f"print(json.dumps(b.transformers_loop({steps}, {autocast_bf16!r})))"
    )
    # From the repository root, where `python -c` finds `tools`.
    out = subprocess.run(
        [sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
