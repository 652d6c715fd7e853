"""One-GPU training benchmark of our backends (issue 9 item 3): tok/s, TFLOP/s, MFU, peak memory.

    python3 tools/gpu_bench/bench.py              # the H200 run (see tools/gpu_bench/README.md)
    python3 tools/gpu_bench/bench.py --tiny       # CPU smoke test: tiny configs, seq 128
    python3 tools/gpu_bench/bench.py --list       # the parts, their caps, and exit

Each part is its own process under a time cap, and all of them share one deadline (``--budget``,
counted from start): a part starts only with at least its minimum left, and never runs past the
deadline. Parts, in priority order: Qwen3-1.7B (bf16 mixed precision, batch 2 x seq 4096, no
activation checkpointing) on native-backend and hf-v5-backend, compiled then eager; the
Qwen3-30B-A3B shape cut to 4 layers on nki-moe-backend's reference kernels, eager then compiled;
the same MoE shape in plain transformers (``hf_moe.py``). torchtitan runs go through ``tt_run.py``
(``torchtitan.train`` as rank 0 of a world of one) with ``--module``/``--config`` named directly:
our packages are on PYTHONPATH, not installed, so no entry point (``train``, recipe names) is used.

torchtitan rows: per-step tok/s from our step lines (``qwen3_titan_common.perf.train_log``), harmonic
mean over the steps after the warm-up ones. TFLOP/s and MFU: flops/token of our convention
(``qwen3_titan_common.perf.flops``: 6 x active matmul parameters + 12 * layers * heads * head_dim * seq,
no causal halving) x tok/s, against the device's dense bf16 peak (``perf.peaks``: 989 TFLOP/s on an
H200). Peak memory: ``torch.cuda.max_memory_allocated()`` over the run, as the anchors measured it.

Dependencies: the GPU image lacks torchtitan and its small dependencies; ``fetch_wheels.sh`` puts
them in ``<repo>/.whl``, which this script installs with ``pip --target`` into its work folder when
``torchtitan`` is not importable (``--wheels``). ``compat/`` goes first on PYTHONPATH: its
``sitecustomize`` applies the torch 2.11 polyfills before torchtitan imports and adds common's device
hook. Results: a table on stdout, and ``summary.txt``, ``gpu_bench.json`` and ``logs/`` in ``$OUT``
(else ``outputs/gpu_bench``).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SRC_DIRS = sorted(glob.glob(os.path.join(ROOT, "packages", "*", "src")))
sys.path[:0] = [d for d in SRC_DIRS if d not in sys.path]

# stdlib-only modules of common: the driver itself never imports torch.
from qwen3_titan_common.arch.published import published_architecture  # noqa: E402
from qwen3_titan_common.perf.flops import flops_breakdown  # noqa: E402
from qwen3_titan_common.perf.peaks import peak_flops  # noqa: E402
from qwen3_titan_common.perf.train_log import parse_step_lines  # noqa: E402

sys.path.insert(0, HERE)
import trace_summary  # noqa: E402

GIB = 2**30

# The anchor run (shared gpu-anchor harness, results-2026-11-29/summary.txt; H200, torch 2.11,
# transformers 5.17, torchtitan 0.3.0): tok/s, MFU %, peak allocated GiB.
ANCHOR_FLOPS_PER_TOKEN = {"1.7B": 13_142_022_144, "30B-A3B x4": 4_037_658_624}
ANCHORS: dict[str, tuple[str, float, float, float]] = {
    "B eager": ("tt eager", 29_095, 38.66, 60.27),
    "B compile": ("tt compile", 36_372, 48.33, 48.15),
    "A eager": ("hf eager", 25_088, 33.34, 67.36),
    "A compile-regional": ("hf layer.compile", 38_999, 51.82, 55.11),
    "D eager": ("tt MoE eager", 43_016, 17.56, 67.06),
    "D compile": ("tt MoE compile", 50_393, 20.57, 57.04),
    "C eager-bf16experts": ("hf MoE eager", 60_385, 24.65, 44.93),
    "C compile-regional": ("hf MoE layer.compile", 85_455, 34.89, 43.11),
}


@dataclass(frozen=True)
class Target:
    mfu_pct: float
    memory_gib: float | None  # max_memory_allocated, GiB
    memory_anchor: str


# Issue 9's targets. Memory: at or below the anchor's (torchtitan compiled 1.7B for native,
# transformers per-layer compile for hf-v5); none was set for the MoE rows.
TARGETS = {
    "native-backend": Target(55.0, 48.15, "B compile"),
    "hf-v5-backend": Target(52.0, 55.11, "A compile-regional"),
    "nki-moe-backend": Target(40.0, None, ""),
}


@dataclass(frozen=True)
class Part:
    id: str
    backend: str  # package name, or "transformers"
    label: str
    model: str  # "1.7B" | "30B-A3B x4"
    config: str  # torchtitan --config (hf part: unused)
    tiny_config: str
    flags: tuple[str, ...]
    cap_s: int
    min_s: int
    anchor: str
    module: str = ""  # torchtitan --module; "" = the transformers loop


NO_RESHARD = ("--parallelism.fsdp_reshard_after_forward", "never")
PARTS = (
    Part("native-compile", "native-backend", "native compile", "1.7B", "qwen3_1_7b", "debug",
         ("--compile.enable",), 110, 50, "B compile", "qwen3_titan_native"),
    Part("hf_v5-compile", "hf-v5-backend", "hf-v5 compile", "1.7B", "qwen3_1_7b", "debug",
         ("--compile.enable",), 110, 50, "A compile-regional", "qwen3_titan_hf_v5"),
    Part("nki_moe-eager", "nki-moe-backend", "nki-moe ref eager", "30B-A3B x4", "qwen3_30b_a3b_4layers",
         "debug_moe", ("--kernels", "reference"), 80, 40, "D eager", "qwen3_titan_nki_moe"),
    Part("hf_moe", "transformers", "transformers MoE", "30B-A3B x4", "", "", (), 80, 30,
         "C eager-bf16experts"),
    Part("nki_moe-compile", "nki-moe-backend", "nki-moe ref compile", "30B-A3B x4", "qwen3_30b_a3b_4layers",
         "debug_moe", ("--kernels", "reference", "--compile.enable"), 90, 50, "D compile", "qwen3_titan_nki_moe"),
    Part("native-eager", "native-backend", "native eager", "1.7B", "qwen3_1_7b", "debug", (), 70, 35,
         "B eager", "qwen3_titan_native"),
    Part("hf_v5-eager", "hf-v5-backend", "hf-v5 eager", "1.7B", "qwen3_1_7b", "debug", (), 70, 35,
         "A eager", "qwen3_titan_hf_v5"),
    # Variants, run when time is left: one rank needs no resharding after forward (the backward then
    # skips a second fp32 -> bf16 copy of every weight, for the bf16 weights' memory).
    Part("native-compile-noreshard", "native-backend", "native compile, no reshard", "1.7B", "qwen3_1_7b",
         "debug", ("--compile.enable", *NO_RESHARD), 80, 50, "B compile", "qwen3_titan_native"),
    Part("hf_v5-compile-noreshard", "hf-v5-backend", "hf-v5 compile, no reshard", "1.7B", "qwen3_1_7b",
         "debug", ("--compile.enable", *NO_RESHARD), 80, 50, "A compile-regional", "qwen3_titan_hf_v5"),
    Part("nki_moe-compile-noreshard", "nki-moe-backend", "nki-moe ref compile, no reshard", "30B-A3B x4",
         "qwen3_30b_a3b_4layers", "debug_moe", ("--kernels", "reference", "--compile.enable", *NO_RESHARD),
         90, 50, "D compile", "qwen3_titan_nki_moe"),
)  # fmt: skip

# Modules every run needs (the wheels), and each backend's config registry (our packages).
WHEEL_MODULES = ("torchtitan", "tyro", "torchdata", "datasets", "spmd_types", "torch_checkpointing")
REGISTRIES = {
    "native-backend": "qwen3_titan_native.config_registry",
    "hf-v5-backend": "qwen3_titan_hf_v5.config_registry",
    "nki-moe-backend": "qwen3_titan_nki_moe.config_registry",
}


@dataclass
class Mode:
    tiny: bool
    batch: int
    seq: int
    steps: int
    warmup_steps: int  # step lines before the steady ones
    steady_last: int  # the last steady step; the profiled steps come after it
    hf_warmup: int
    hf_steps: int
    cap_scale: float
    device: str  # "cuda" | "cpu"

    @classmethod
    def make(cls, tiny: bool, steps: int | None, device: str | None) -> Mode:
        if tiny:
            steps = steps or 6
            return cls(True, 2, 128, steps, 2, steps - 2, 1, 3, 4.0, device or "cpu")
        steps = steps or 18
        return cls(False, 2, 4096, steps, 5, steps - 4, 3, 10, 1.0, device or "cuda")

    @property
    def profile_freq(self) -> int:
        """torchtitan's profiler schedule (wait, 1 warm-up, 2 active): warm-up on step ``steps - 3``, trace
        steps ``steps - 2`` and ``steps - 1`` (written after the latter); the last step pays for the write."""
        return self.steps - 1


@dataclass
class Row:
    part: str
    backend: str
    label: str
    model: str
    status: str = "skipped"  # ok | partial | error | timeout | skipped
    note: str = ""
    tps: float | None = None
    flops_per_token: int | None = None
    tflops: float | None = None
    mfu_pct: float | None = None
    trainer_mfu_pct: float | None = None
    peak_allocated_gib: float | None = None
    logged_memory_gib: float | None = None  # torchtitan rows: max of the step lines (reserved / host RSS)
    first_step_s: float | None = None
    steady_steps: str = ""
    per_step_tps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    shims: list[str] = field(default_factory=list)
    cuda_graphs: str = ""
    extra: dict = field(default_factory=dict)
    anchor: str = ""
    seconds: float | None = None
    log: str = ""


def hmean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return len(values) / sum(1 / v for v in values) if values else None


# -- flops/token --------------------------------------------------------------


def real_architecture(model: str):
    if model == "1.7B":
        return published_architecture("Qwen3-1.7B")
    return published_architecture("Qwen3-30B-A3B").with_changes(num_hidden_layers=4)


def norm_weights(arch) -> int:
    """RMSNorm weights: per layer input/post-attention norms and q/k norms, plus the final norm."""
    return arch.num_hidden_layers * (2 * arch.hidden_size + 2 * arch.head_dim) + arch.hidden_size


def flops_check(seq: int) -> list[dict]:
    """Our flops/token for the two real shapes next to the anchor's, with the difference explained."""
    rows = []
    for model, anchor in ANCHOR_FLOPS_PER_TOKEN.items():
        arch = real_architecture(model)
        ours = flops_breakdown(arch, seq)
        diff = anchor - ours.per_token
        norms = norm_weights(arch)
        if diff == 0:
            why = "equal"
        elif diff == 6 * norms:
            why = (
                f"anchor counts the {norms:,} RMSNorm weights as matmul parameters (torchtitan's count); "
                f"ours leaves elementwise norms out: 6 x {norms:,} = {diff:,} FLOPs ({100 * diff / anchor:.4f}%)"
            )
        else:
            why = f"UNEXPLAINED difference of {diff:,} FLOPs/token"
        rows.append(
            dict(
                model=model,
                seq=seq,
                ours=ours.per_token,
                anchor=anchor,
                difference=diff,
                matmul_params=ours.matmul_params,
                attention_flops=ours.attention_flops,
                total_params=ours.total_params,
                explanation=why,
            )
        )
    return rows


# -- processes ----------------------------------------------------------------


class Clock:
    def __init__(self, budget_s: float):
        self.start = time.time()
        self.deadline = self.start + budget_s

    def left(self) -> float:
        return self.deadline - time.time()

    def elapsed(self) -> float:
        return time.time() - self.start


def say(clock: Clock, message: str) -> None:
    print(f"[gpu-bench +{clock.elapsed():4.0f}s] {message}", flush=True)


def run_capped(cmd: list[str], log_path: str, cap_s: float, env: dict) -> tuple[int, bool, float]:
    """(exit code, timed out, seconds); the process gets its own session so a timeout ends all of it."""
    started = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + f"\n# cap {cap_s:.0f}s\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            return proc.wait(timeout=max(1.0, cap_s)), False, time.time() - started
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            log.write(f"\n# gpu-bench: killed after {cap_s:.0f}s (cap)\n")
            return -9, True, time.time() - started


def trim_log(path: str, limit: int = 2_000_000) -> None:
    """Keep logs small enough to come back from the device machine: head and tail of long ones."""
    size = os.path.getsize(path)
    if size <= limit:
        return
    with open(path, "rb") as f:
        head = f.read(limit // 10)
        f.seek(size - (limit - limit // 10))
        tail = f.read()
    with open(path, "wb") as f:
        f.write(head + f"\n... [{size - len(head) - len(tail):,} bytes cut] ...\n".encode() + tail)


# -- setup ----------------------------------------------------------------------


def child_env(mode: Mode, work: str, site_dirs: list[str]) -> dict:
    env = dict(os.environ)
    path = [os.path.join(HERE, "compat"), *site_dirs, *SRC_DIRS]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        PYTHONUNBUFFERED="1",
        QWEN3_TITAN_DEVICE=mode.device,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=os.path.join(work, "hf_home"),
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"),
        TRITON_CACHE_DIR=os.path.join(work, "triton"),
    )
    return env


def python_ok(python: str, code: str, env: dict) -> bool:
    return subprocess.run([python, "-c", code], env=env, capture_output=True, cwd=ROOT).returncode == 0


def install_wheels(
    python: str, policy: str, wheel_dir: str, work: str, clock: Clock
) -> tuple[list[str], str]:
    """(site folders to put on PYTHONPATH, what was done)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    have = python_ok(python, f"import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in {WHEEL_MODULES!r}))", env)  # fmt: skip
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if policy == "never" or (policy == "auto" and have):
        return (
            [],
            "torchtitan & co. importable: no wheels installed"
            if have
            else "wheels not installed (--wheels never)",
        )
    if not wheels:
        raise SystemExit(
            f"gpu-bench: torchtitan is not importable and {wheel_dir} has no wheels: run "
            "`bash tools/gpu_bench/fetch_wheels.sh` on a machine with PyPI and carry .whl/"
        )
    site = os.path.join(work, "site")
    pip = [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    pip += ["--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target"]
    subprocess.run([*pip, site, *wheels], check=True, env=env)
    dirs, done = [site], f"installed {len(wheels)} wheels from {wheel_dir} into {site}"
    old_typing = (  # exit 0 = typing_extensions missing or older than 4.14 (typeguard needs 4.14)
        "import importlib.metadata as m, sys\n"
        "try:\n    v = tuple(int(x) for x in m.version('typing_extensions').split('.')[:2])\n"
        "except Exception:\n    v = (0, 0)\n"
        "sys.exit(v >= (4, 14))"
    )
    extra = sorted(glob.glob(os.path.join(wheel_dir, "extra", "typing_extensions-*.whl")))
    if extra and python_ok(python, old_typing, env):
        extra_site = os.path.join(work, "site_extra")
        subprocess.run([*pip, extra_site, *extra], check=True, env=env)
        dirs.insert(0, extra_site)
        done += "; typing_extensions from .whl/extra (the image's is older than 4.14)"
    say(clock, done)
    return dirs, done


def probe_env(python: str, env: dict, mode: Mode, logs: str, clock: Clock) -> dict:
    """Versions, device, needed shims; and which of our config registries import (saves failed runs)."""
    registries = "; ".join(
        f"r[{name!r}] = _try({module!r})"
        for name, module in {"torchtitan.trainer": "torchtitan.trainer", **REGISTRIES}.items()
    )
    code = (
        "import json, sys, traceback\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "import env_probe\n"
        f"info = env_probe.probe({0 if mode.tiny else 8192})\n"
        "def _try(m):\n"
        "    try:\n"
        "        __import__(m); return 'ok'\n"
        "    except BaseException as e:\n"
        "        traceback.print_exc(); return f'{type(e).__name__}: {str(e).strip()[:200]}'\n"
        "r = {}\n"
        f"{registries}\n"
        "info['imports'] = r\n"
        "print('ENV ' + json.dumps(info), flush=True)\n"
    )
    log = os.path.join(logs, "env.log")
    rc, timed_out, _ = run_capped([python, "-c", code], log, min(90 * mode.cap_scale, clock.left()), env)
    with open(log, errors="replace") as f:
        found = [line[4:] for line in f if line.startswith("ENV ")]
    if not found:
        return {"error": f"env probe failed (rc {rc}{', timed out' if timed_out else ''}); see logs/env.log"}
    return json.loads(found[-1])


# -- torchtitan rows ----------------------------------------------------------------

_FLOPS_LINE = re.compile(
    r"\[metrics\] [\d.]+ GFLOP per token: 6 x ([\d,]+) matmul parameters \+ ([\d,]+) attention"
)
_SHIM_LINE = re.compile(r"\[gpu-bench compat\] torch \S+: applied (.+)")
PROFILE_FOLDER = "profile"
_KERNEL_LINE = re.compile(r"\[kernels\] (\w+): (\w+) \(([^)]*)")
_ERROR_LINE = re.compile(r"^(?:\S*\.)?(\w*(?:Error|Exception)): (.+)$", re.M)


def titan_args(part: Part, mode: Mode, dump: str, no_cuda_graphs: bool) -> list[str]:
    args = ["--module", part.module, "--config", part.tiny_config if mode.tiny else part.config]
    args += ["--training.local_batch_size", str(mode.batch), "--training.seq_len", str(mode.seq)]
    args += ["--training.steps", str(mode.steps), "--checkpoint.no-enable", "--hf.no-export"]
    args += ["--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", "--dump_folder", dump]
    args += list(part.flags)
    args += ["--profiler.enable_profiling", "--profiler.profile_freq", str(mode.profile_freq)]
    args += ["--profiler.profiler_warmup", "1", "--profiler.profiler_active", "2"]
    args += ["--profiler.save_traces_folder", PROFILE_FOLDER]
    if no_cuda_graphs:
        args.append("--training.disable_cuda_graphs")
    return [*args, "activation-checkpoint:none"]  # tyro subcommand: no activation checkpointing


def parse_titan_run(row: Row, log_text: str, status: dict, mode: Mode) -> None:
    steps = parse_step_lines(log_text)
    row.per_step_tps = [s.tokens_per_second for s in steps]
    row.losses = [s.loss for s in steps]
    steady = [s for s in steps if mode.warmup_steps < s.step <= mode.steady_last]
    if steps and len(steady) < 2:
        steady = steps[len(steps) // 2 :]
        row.note = _join(row.note, "few steps: steady = second half")
    if steady:
        row.tps = hmean([s.tokens_per_second for s in steady])
        row.steady_steps = f"{steady[0].step}-{steady[-1].step}"
        mfus = [s.mfu_percent for s in steady]
        row.trainer_mfu_pct = hmean(mfus) if None not in mfus else None
        memory = [s.memory_gib for s in steady if s.memory_gib is not None]
        row.logged_memory_gib = max(memory) if memory else None
    if steps and steps[0].tokens_per_second:
        row.first_step_s = round(mode.batch * mode.seq / steps[0].tokens_per_second, 2)
    match = _FLOPS_LINE.search(log_text)
    if match:
        row.flops_per_token = 6 * int(match.group(1).replace(",", "")) + int(match.group(2).replace(",", ""))
    row.shims = sorted(
        {name.strip() for m in _SHIM_LINE.finditer(log_text) for name in m.group(1).split(",")}
    )
    kernels = {m.group(1): f"{m.group(2)} ({m.group(3)})" for m in _KERNEL_LINE.finditer(log_text)}
    if kernels:
        row.extra["kernels"] = kernels
    if "Compiling each TransformerBlock" in log_text or "--compile.enable" in log_text.split("\n", 1)[0]:
        row.extra["compile"] = "per-block torch.compile"
    if "CUDA graph capture is only supported" in log_text:
        row.cuda_graphs = "n/a"
    elif "--training.disable_cuda_graphs" in log_text.split("\n", 1)[0]:
        row.cuda_graphs = "off"
    else:
        row.cuda_graphs = "on"
    if status.get("peak_allocated_gib") is not None:
        row.peak_allocated_gib = status["peak_allocated_gib"]
    if status.get("shims"):
        row.shims = sorted(set(row.shims) | set(status["shims"]))


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _error_text(status: dict, log_text: str) -> str:
    if status.get("error"):
        return status["error"] + (f" @{status['where']}" if status.get("where") else "")
    found = _ERROR_LINE.findall(log_text)
    return f"{found[-1][0]}: {found[-1][1][:250]}" if found else ""


def run_titan_part(part: Part, mode: Mode, python: str, env: dict, work: str, logs: str, clock: Clock,
                   suffix: str = "", no_cuda_graphs: bool = False) -> Row:  # fmt: skip
    row = Row(part.id + suffix, part.backend, part.label + (" no-cudagraph" if suffix else ""),
              part.tiny_config if mode.tiny else part.model, anchor=part.anchor)  # fmt: skip
    cap = min(part.cap_s * mode.cap_scale, clock.left())
    status_path = os.path.join(work, f"{row.part}.status.json")
    log = os.path.join(logs, f"{row.part}.log")
    row.log = os.path.relpath(log, os.path.dirname(logs))
    args = titan_args(part, mode, os.path.join(work, "dump", row.part), no_cuda_graphs)
    say(clock, f"[{row.part}] torchtitan {' '.join(args)} (cap {cap:.0f}s, {clock.left():.0f}s left)")
    cmd = [python, os.path.join(HERE, "tt_run.py"), "--status", status_path, "--", *args]
    rc, timed_out, seconds = run_capped(cmd, log, cap, env)
    trim_log(log)
    row.seconds = round(seconds, 1)
    with open(log, errors="replace") as f:
        text = f.read()
    status = {}
    if os.path.exists(status_path):
        with open(status_path) as f:
            status = json.load(f)
    parse_titan_run(row, text, status, mode)
    attach_profile(row, os.path.join(work, "dump", row.part))
    if "Training starts" in text and "stage" not in status:
        status["stage"] = "train"
    row.extra["stage"] = status.get("stage", "setup")
    if rc == 0 and row.tps:
        row.status = "ok"
    elif row.tps and len(row.per_step_tps) >= mode.steps:
        row.status = "partial"  # every step logged, then the process failed or hung (teardown)
        row.note = _join(
            row.note, f"exit {rc} after the last step" + (" (killed at cap)" if timed_out else "")
        )
    elif timed_out:
        row.status = "timeout"
        row.note = _join(row.note, f"killed at the {cap:.0f}s cap after {len(row.per_step_tps)} step(s)")
    else:
        row.status = "error"
        row.note = _join(row.note, _error_text(status, text) or f"exit {rc}")
    return row


def attach_profile(row: Row, dump: str) -> None:
    """torchtitan's profiler trace of the run, summarised into ``row.extra["profile"]`` (trace kept in work)."""
    traces = sorted(glob.glob(os.path.join(dump, PROFILE_FOLDER, "iteration_*", "rank0_trace.json*")))
    if not traces:
        return
    try:
        row.extra["profile"] = trace_summary.summarise_file(traces[-1]).to_dict()
    except Exception as err:  # a damaged trace must not cost the row its figures
        row.extra["profile_error"] = f"{type(err).__name__}: {err}"


def profile_report(rows: list[Row]) -> list[str]:
    lines = ["## Profiles (torchtitan's profiler, the last two steps before the final one)", ""]
    for row in rows:
        found = row.extra.get("profile")
        if found:
            summary = trace_summary.TraceSummary(**{k: v for k, v in found.items() if k != "busy_pct"})
            lines += [*trace_summary.markdown(f"{row.label} ({row.model})", summary), ""]
        elif row.extra.get("profile_error"):
            lines += [f"#### {row.label}: profile unreadable: {row.extra['profile_error']}", ""]
    return lines


def titan_summary(row: Row, mode: Mode) -> str:
    if row.status in ("ok", "partial"):
        parts = [f"{row.tps:,.0f} tok/s (steps {row.steady_steps})"]
        if row.peak_allocated_gib is not None:
            parts.append(f"peak alloc {row.peak_allocated_gib:.2f} GiB")
        if row.logged_memory_gib is not None:
            parts.append(f"logged {row.logged_memory_gib:.2f} GiB")
        if row.first_step_s is not None:
            parts.append(f"1st step {row.first_step_s:.1f}s")
        parts.append(f"cuda graphs {row.cuda_graphs}")
        return f"[{row.part}] {row.status}: " + ", ".join(parts) + f" in {row.seconds:.0f}s"
    return f"[{row.part}] {row.status.upper()} after {row.seconds:.0f}s: {row.note}"


def retry_without_cuda_graphs(row: Row, mode: Mode) -> bool:
    """A training-time failure with CUDA graphs on is rerun once with them off (not OOM, not a timeout)."""
    return (
        mode.device == "cuda"
        and row.status == "error"
        and row.cuda_graphs == "on"
        and row.extra.get("stage") == "train"
        and "out of memory" not in row.note.lower()
    )


# -- transformers rows --------------------------------------------------------------


def moe_flops_per_token(mode: Mode) -> int:
    if mode.tiny:  # nki-moe's debug_moe, written out by hf_moe.py's record
        return 0
    return flops_breakdown(real_architecture("30B-A3B x4"), mode.seq).per_token


def run_hf_part(
    part: Part, mode: Mode, python: str, env: dict, work: str, logs: str, clock: Clock
) -> list[Row]:
    cap = min(part.cap_s * mode.cap_scale, clock.left())
    results = os.path.join(work, "hf_moe.jsonl")
    log = os.path.join(logs, f"{part.id}.log")
    cmd = [python, os.path.join(HERE, "hf_moe.py"), "--results", results, "--device", mode.device]
    cmd += ["--batch", str(mode.batch), "--seq", str(mode.seq), "--warmup", str(mode.hf_warmup)]
    cmd += ["--steps", str(mode.hf_steps), "--deadline", str(time.time() + cap - 5)]
    cmd += ["--min-phase-s", str(int(15 * mode.cap_scale)), "--phases", "eager,compile"]
    if mode.tiny:
        cmd.append("--tiny")
    say(clock, f"[{part.id}] {' '.join(cmd[2:])} (cap {cap:.0f}s, {clock.left():.0f}s left)")
    rc, timed_out, seconds = run_capped(cmd, log, cap, env)
    trim_log(log)
    records = []
    if os.path.exists(results):
        with open(results) as f:
            records = [json.loads(line) for line in f if line.strip()]
    rows = []
    for phase, anchor in (("eager", "C eager-bf16experts"), ("compile", "C compile-regional")):
        model = "debug_moe" if mode.tiny else part.model
        row = Row(f"{part.id}-{phase}", part.backend, f"{part.label} {phase}", model, anchor=anchor)
        row.log = os.path.relpath(log, os.path.dirname(logs))
        row.seconds = round(seconds, 1)
        record = next((r for r in records if r.get("phase") == phase), None)
        if record is None:
            row.status = "timeout" if timed_out else "error"
            row.note = (
                f"killed at the {cap:.0f}s cap" if timed_out else f"exit {rc}: {_error_text({}, _read(log))}"
            )
        else:
            row.status = record["status"]
            row.note = record.get("error", "")
            row.tps = record.get("tps")
            row.flops_per_token = record.get("flops_per_token") or moe_flops_per_token(mode) or None
            row.peak_allocated_gib = record.get("peak_allocated_gib")
            row.logged_memory_gib = record.get("peak_rss_gib")
            row.first_step_s = (record.get("warmup_s") or [None])[0]
            row.seconds = record.get("phase_s", row.seconds)
            row.losses = [record["final_loss"]] if "final_loss" in record else []
            row.extra = {k: record[k] for k in ("experts_impl", "params_dtype", "optimizer", "compile", "step_ms") if k in record}  # fmt: skip
        rows.append(row)
        say(clock, f"[{row.part}] {row.status}: " + (f"{row.tps:,.0f} tok/s" if row.tps else row.note))
    return rows


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


# -- report -------------------------------------------------------------------------


def finish_row(row: Row, peak: float | None) -> None:
    if row.tps and row.flops_per_token:
        row.tflops = round(row.flops_per_token * row.tps / 1e12, 4)
        if peak:
            row.mfu_pct = round(100 * row.flops_per_token * row.tps / peak, 3)
    if row.tps:
        row.tps = round(row.tps, 1)
    if row.trainer_mfu_pct is not None:
        row.trainer_mfu_pct = round(row.trainer_mfu_pct, 3)


def target_verdict(row: Row) -> str:
    target = TARGETS.get(row.backend)
    if target is None or row.status not in ("ok", "partial"):
        return ""
    out = []
    if row.mfu_pct is None:
        out.append("MFU n/a")
    elif row.mfu_pct >= target.mfu_pct:
        out.append(f"MFU>={target.mfu_pct:.0f} met")
    else:
        out.append(f"MFU -{target.mfu_pct - row.mfu_pct:.1f}pp")
    if target.memory_gib is not None and row.peak_allocated_gib is not None:
        over = row.peak_allocated_gib - target.memory_gib
        out.append(f"mem<={target.memory_gib:.1f} met" if over <= 0 else f"mem +{over:.1f}GiB")
    return ", ".join(out)


def fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(rows: list[Row], mode: Mode, peak: float | None, peak_row: str) -> list[str]:
    header = (
        "row",
        "status",
        "tok/s",
        "TFLOP/s",
        "MFU%",
        "peakGiB",
        "| anchor",
        "tok/s",
        "MFU%",
        "GiB",
        "x",
        "| target",
    )
    widths = (27, 8, 9, 9, 7, 8, 23, 8, 7, 7, 6, 0)
    lines = [
        f"== {'tiny CPU smoke test' if mode.tiny else 'one GPU'}: batch {mode.batch} x seq {mode.seq}, "
        f"bf16 mixed precision, no activation checkpointing ==",
        f"MFU = flops/token (ours) x tok/s / peak ({peak_row}); peakGiB = torch.cuda.max_memory_allocated"
        + (" (CPU: peak host RSS)" if mode.device == "cpu" else ""),
        "anchor = gpu-anchor run of 2026-11-29 (tt: upstream torchtitan 0.3.0 Trainer; hf: plain transformers"
        " loop); x = our tok/s / anchor's",
        "".join(h.ljust(w) if w else h for h, w in zip(header, widths, strict=True)),
    ]
    for row in rows:
        name, a_tps, a_mfu, a_mem = ANCHORS.get(row.anchor, ("", None, None, None))
        memory = row.peak_allocated_gib if row.peak_allocated_gib is not None else row.logged_memory_gib
        ratio = row.tps / a_tps if (row.tps and a_tps and not mode.tiny) else None
        cells = (
            row.label,
            row.status,
            fmt(row.tps, ",.0f"),
            fmt(row.tflops, ".1f" if not mode.tiny else ".4f"),
            fmt(row.mfu_pct, ".2f", "n/a" if row.tps else "-"),
            fmt(memory, ".2f"),
            f"| {name}",
            fmt(a_tps, ",.0f"),
            fmt(a_mfu, ".2f"),
            fmt(a_mem, ".2f"),
            fmt(ratio, ".2f"),
            "| " + (target_verdict(row) or (row.note[:90] if row.status not in ("ok", "partial") else "")),
        )
        lines.append("".join(c.ljust(w) if w else c for c, w in zip(cells, widths, strict=True)).rstrip())
    return lines


def targets_summary(rows: list[Row]) -> tuple[list[str], list[dict]]:
    lines, records = ["== targets (issue 9): each backend's best row =="], []
    for backend, target in TARGETS.items():
        done = [r for r in rows if r.backend == backend and r.status in ("ok", "partial") and r.tps]
        record: dict = {
            "backend": backend,
            "mfu_target_pct": target.mfu_pct,
            "memory_target_gib": target.memory_gib,
        }
        if not done:
            lines.append(f"{backend:16} no completed row: target not measured")
            record["verdict"] = "not measured"
            records.append(record)
            continue
        best = max(done, key=lambda r: (r.mfu_pct or 0, r.tps))
        record.update(best_row=best.label, mfu_pct=best.mfu_pct, peak_allocated_gib=best.peak_allocated_gib)
        if best.mfu_pct is None:
            mfu = f"MFU n/a on this device (target >= {target.mfu_pct:.0f}%)"
            record["mfu_verdict"] = "n/a"
        elif best.mfu_pct >= target.mfu_pct:
            mfu = f"MFU {best.mfu_pct:.2f}% >= {target.mfu_pct:.0f}%: MET"
            record["mfu_verdict"] = "met"
        else:
            short = target.mfu_pct - best.mfu_pct
            mfu = f"MFU {best.mfu_pct:.2f}% < {target.mfu_pct:.0f}%: MISSED by {short:.2f} pp"
            mfu += f" ({100 * short / target.mfu_pct:.0f}% short)"
            record["mfu_verdict"] = f"missed by {short:.2f} pp"
        mem = ""
        if target.memory_gib is not None:
            if best.peak_allocated_gib is None:
                mem = f"; memory n/a (target <= {target.memory_gib:.2f} GiB, anchor {target.memory_anchor})"
                record["memory_verdict"] = "n/a"
            elif best.peak_allocated_gib <= target.memory_gib:
                mem = f"; memory {best.peak_allocated_gib:.2f} <= {target.memory_gib:.2f} GiB: MET"
                record["memory_verdict"] = "met"
            else:
                over = best.peak_allocated_gib - target.memory_gib
                mem = f"; memory {best.peak_allocated_gib:.2f} > {target.memory_gib:.2f} GiB: MISSED by {over:.2f} GiB"
                record["memory_verdict"] = f"missed by {over:.2f} GiB"
        lines.append(f"{backend:16} best: {best.label}: {mfu}{mem}")
        records.append(record)
    return lines, records


# -- main ------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", default=env("GPU_BENCH_TINY") == "1",
                   help="tiny configs, seq 128, on the CPU unless --device cuda (GPU_BENCH_TINY=1)")  # fmt: skip
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda, or cpu with --tiny"
    )
    p.add_argument("--budget", type=float, default=float(env("GPU_BENCH_BUDGET", 0)) or None,
                   help="seconds for all parts together (default 380; --tiny: 1800)")  # fmt: skip
    p.add_argument("--only", default=env("GPU_BENCH_ONLY", ""), help="comma-separated part ids to run")
    p.add_argument("--skip", default=env("GPU_BENCH_SKIP", ""), help="comma-separated part ids to skip")
    p.add_argument("--steps", type=int, default=None, help="torchtitan steps per run (default 15; --tiny: 5)")
    p.add_argument("--out", default=env("OUT") or os.path.join(ROOT, "outputs", "gpu_bench"))
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu_bench_work"))
    p.add_argument("--python", default=sys.executable, help="interpreter for the runs (default: this one)")
    p.add_argument("--wheels", choices=["auto", "always", "never"], default="auto",
                   help="install .whl/ into the work folder: when torchtitan is missing (auto), always, never")  # fmt: skip
    p.add_argument("--wheel-dir", default=os.path.join(ROOT, ".whl"))
    p.add_argument("--list", action="store_true", help="print the parts and exit")
    return p.parse_args(argv)


def select_parts(opts) -> list[Part]:
    known = {p.id for p in PARTS}
    only = {x for x in opts.only.split(",") if x}
    skip = {x for x in opts.skip.split(",") if x}
    unknown = (only | skip) - known
    if unknown:
        raise SystemExit(
            f"gpu-bench: unknown part(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
        )
    if opts.only:  # in the order given: the first ones get the time
        by_id = {p.id: p for p in PARTS}
        return [by_id[x] for x in dict.fromkeys(opts.only.split(",")) if x and x not in skip]
    return [p for p in PARTS if p.id not in skip]


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    mode = Mode.make(opts.tiny, opts.steps, opts.device)
    budget = opts.budget or (1800.0 if mode.tiny else 380.0)
    parts = select_parts(opts)
    if opts.list:
        for p in parts:
            print(
                f"{p.id:16} cap {p.cap_s * mode.cap_scale:5.0f}s  min {p.min_s * mode.cap_scale:4.0f}s  {p.label}"
            )
        return 0
    clock = Clock(budget)
    out, work = os.path.abspath(opts.out), os.path.abspath(opts.work)
    logs = os.path.join(out, "logs")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.makedirs(logs, exist_ok=True)
    say(
        clock,
        f"mode {'tiny' if mode.tiny else 'full'} on {mode.device}; budget {budget:.0f}s; OUT {out}; python {opts.python}",
    )

    checks = flops_check(4096)
    print("== flops/token at seq 4096: ours (perf.flops) vs the anchor's (torchtitan's count) ==")
    for c in checks:
        print(f"  {c['model']:11} ours {c['ours']:,} = 6 x {c['matmul_params']:,} + {c['attention_flops']:,}; "
              f"anchor {c['anchor']:,}; {c['explanation']}")  # fmt: skip

    site_dirs, wheels_done = install_wheels(opts.python, opts.wheels, opts.wheel_dir, work, clock)
    env = child_env(mode, work, site_dirs)
    info = probe_env(opts.python, env, mode, logs, clock)
    imports = info.get("imports", {})
    say(clock, f"env: {info.get('device', '?')}, torch {info.get('versions', {}).get('torch', '?')}, "
               f"transformers {info.get('versions', {}).get('transformers', '?')}, shims needed: "
               f"{', '.join(info.get('shims_needed', [])) or 'none'}; imports: {imports or info.get('error')}")  # fmt: skip
    if mode.device == "cuda" and info.get("device_kind") != "cuda":
        say(clock, "no CUDA device: nothing to measure (use --tiny for the CPU smoke test)")
        return 2
    peak, peak_row = peak_flops(info.get("device_kind", mode.device), str(info.get("device", "")))

    rows: list[Row] = []
    cuda_graphs_off: set[str] = set()  # backends whose runs failed with CUDA graphs on
    for part in parts:
        blocked = ""
        if part.module:
            blocked = next((f"{m}: {e}" for m, e in imports.items()
                            if e != "ok" and m in ("torchtitan.trainer", REGISTRIES[part.backend])), "")  # fmt: skip
        left = clock.left()
        if blocked or left < part.min_s * mode.cap_scale:
            why = (
                f"not started: {blocked}"
                if blocked
                else f"not started: {left:.0f}s left < {part.min_s * mode.cap_scale:.0f}s"
            )
            rows.append(Row(part.id, part.backend, part.label, part.model, note=why, anchor=part.anchor))
            say(clock, f"[{part.id}] skipped ({why})")
            continue
        if not part.module:
            rows += run_hf_part(part, mode, opts.python, env, work, logs, clock)
            continue
        row = run_titan_part(part, mode, opts.python, env, work, logs, clock,
                             no_cuda_graphs=part.backend in cuda_graphs_off)  # fmt: skip
        if part.backend in cuda_graphs_off:
            row.label += " no-cudagraph"
        say(clock, titan_summary(row, mode))
        if retry_without_cuda_graphs(row, mode):
            cuda_graphs_off.add(part.backend)
            rows.append(row)
            if clock.left() >= part.min_s:
                say(clock, f"[{part.id}] failed in training with CUDA graphs on: once more without")
                row = run_titan_part(part, mode, opts.python, env, work, logs, clock, "-nocg", True)
                say(clock, titan_summary(row, mode))
            else:
                continue
        rows.append(row)

    for row in rows:
        if row.flops_per_token is None and not mode.tiny:
            row.flops_per_token = flops_breakdown(real_architecture(row.model), mode.seq).per_token
        finish_row(row, peak)
        if not mode.tiny and row.flops_per_token:
            expected = flops_breakdown(real_architecture(row.model), mode.seq).per_token
            if row.flops_per_token != expected:
                row.note = _join(row.note, f"trainer flops/token {row.flops_per_token:,} != {expected:,}")
        if row.trainer_mfu_pct is not None and row.mfu_pct and abs(row.trainer_mfu_pct - row.mfu_pct) > 0.05 * row.mfu_pct:  # fmt: skip
            row.note = _join(row.note, f"trainer's MFU {row.trainer_mfu_pct:.2f}% differs")

    lines = table(rows, mode, peak, peak_row or "n/a")
    target_lines, target_records = targets_summary(rows)
    shims_applied = sorted({s for r in rows for s in r.shims})
    env_line = (
        f"env: {info.get('device', '?')} | torch {info.get('versions', {}).get('torch', '?')} | transformers "
        f"{info.get('versions', {}).get('transformers', '?')} | torchtitan {info.get('versions', {}).get('torchtitan', '?')}"
        + (f" | bf16 8192^3 matmul {info['bf16_matmul_8192_tflops']} TFLOP/s" if "bf16_matmul_8192_tflops" in info else "")
        + f" | shims applied: {', '.join(shims_applied) or 'none'}"
    )  # fmt: skip
    notes = [f"  {r.label}: {r.note}" for r in rows if r.note and r.status in ("ok", "partial")]
    report = [
        "",
        env_line,
        *lines,
        *(["notes:", *notes] if notes else []),
        *target_lines,
        f"total wall {clock.elapsed():.0f}s of a {budget:.0f}s budget; logs and gpu_bench.json in {out}",
    ]
    print("\n".join(report), flush=True)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(report).lstrip("\n") + "\n")
    with open(os.path.join(out, "profiles.md"), "w") as f:
        f.write("\n".join(profile_report(rows)) + "\n")
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "tiny" if mode.tiny else "full",
        "shape": {"batch": mode.batch, "seq": mode.seq, "steps": mode.steps, "steady_after": mode.warmup_steps},
        "device": info.get("device"),
        "versions": info.get("versions"),
        "env": info,
        "wheels": wheels_done,
        "shims_needed": info.get("shims_needed"),
        "shims_applied": shims_applied,
        "peak_flops": peak,
        "peak_source": peak_row,
        "flops_check": checks,
        "rows": [asdict(r) for r in rows],
        "targets": target_records,
        "anchors": {k: dict(zip(("what", "tps", "mfu_pct", "peak_allocated_gib"), v, strict=True)) for k, v in ANCHORS.items()},
        "budget_s": budget,
        "wall_s": round(clock.elapsed(), 1),
    }  # fmt: skip
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if all(r.status in ("ok", "partial", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
