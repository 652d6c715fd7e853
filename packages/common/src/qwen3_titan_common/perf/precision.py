"""The precision a run computes in by default: bf16 where the device does it fast, fp32 elsewhere.

torchtitan's default (``--training.mixed_precision_param bfloat16``: fp32 master weights, FSDP2 casting
them to bf16 for forward and backward) is right on CUDA and Neuron. On a CPU it is right only where
torch's bf16 GEMM has instructions to run on: on x86, oneDNN's AVX512-BF16 and AMX-BF16 kernels. Without
them torch falls back to a reference loop (``cpublas_gemm_impl``), about 100x slower than fp32: a 2-core
AVX2 EPYC trains the default model at 90 tokens/s in bf16 and 2,400 in fp32, while on a Zen 4 with
AVX512-BF16 bf16 is the faster of the two (5,600 vs 4,100 tokens/s; ``tools/bench_cpu_precision.py``).
So the CPU's instruction set decides, read from ``/proc/cpuinfo``; ``ONEDNN_MAX_CPU_ISA`` below
AVX512_CORE_BF16 keeps oneDNN (hence torch) from those instructions and counts as their absence.
aarch64's bf16 instructions are not measured by this project, so aarch64 and macOS compute in fp32 unless
asked. The user's ``--training.mixed_precision_param`` always wins; asked for bf16 where it is slow, the
run says what that costs (:func:`precision_line`).

Every function takes what it reads as arguments (flags, machine, environment), so a test can feed it
either kind of CPU.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# x86 flags (as /proc/cpuinfo spells them) whose instructions oneDNN's bf16 GEMM uses, by name.
BF16_MATRIX_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}
# The vector instruction sets a benchmark line names, in order (what bounds an fp32 GEMM).
VECTOR_FLAGS = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_vnni": "AVX512-VNNI", "fma": "FMA"}
# ONEDNN_MAX_CPU_ISA values below which oneDNN does not use the bf16 dot-product instructions.
_ONEDNN_ISA_WITHOUT_BF16 = {
    "sse41",
    "avx",
    "avx2",
    "avx2_vnni",
    "avx2_vnni_2",
    "avx512_core",
    "avx512_core_vnni",
}
_X86 = {"x86_64", "amd64", "i386", "i686"}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags (x86 ``flags``, aarch64 ``Features``); empty where there is
    no ``/proc/cpuinfo`` (macOS)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


@dataclass(frozen=True)
class ComputePrecision:
    dtype: str  # a --training.mixed_precision_param value: "bfloat16" or "float32"
    reason: str  # why, for the run's precision line

    @property
    def short(self) -> str:
        return "bf16" if self.dtype == "bfloat16" else "fp32"


def cpu_compute_precision(
    flags: frozenset[str], machine: str, env: Mapping[str, str] = os.environ
) -> ComputePrecision:
    """bf16 where this CPU has bf16 matrix instructions that torch uses, fp32 elsewhere."""
    if machine.lower() not in _X86:
        return ComputePrecision(
            "float32", f"bf16 GEMM on this {machine} CPU is not measured by this project to beat fp32"
        )
    found = [name for flag, name in BF16_MATRIX_FLAGS.items() if flag in flags]
    if not found:
        return ComputePrecision("float32", "this CPU has no bf16 matrix instructions")
    cap = env.get("ONEDNN_MAX_CPU_ISA", "").strip()
    if cap.lower() in _ONEDNN_ISA_WITHOUT_BF16:
        return ComputePrecision(
            "float32", f"ONEDNN_MAX_CPU_ISA={cap} keeps torch from this CPU's {' and '.join(found)}"
        )
    return ComputePrecision("bfloat16", f"this CPU has {' and '.join(found)}")


def default_compute_precision(device_kind: str) -> ComputePrecision:
    """The run's default ``mixed_precision_param`` on ``device_kind`` (``runtime.device``'s kinds)."""
    if device_kind == "cpu":
        return cpu_compute_precision(cpu_flags(), platform.machine())
    return ComputePrecision("bfloat16", f"torchtitan's default on {device_kind}")


def bf16_gemm_slowdown(size: int = 128, repeats: int = 3) -> float:
    """How many times slower a ``size``-cubed bf16 GEMM is than fp32 on this CPU, measured now (best of
    ``repeats``; milliseconds even on the reference loop at the default size)."""
    import torch

    a_MK = torch.randn(size, size)
    b_KN = torch.randn(size, size)

    def best(dtype) -> float:
        x, y = a_MK.to(dtype), b_KN.to(dtype)
        x @ y
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - start)
        return min(times)

    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


def precision_line(asked: str, device_kind: str, default: ComputePrecision | None = None) -> str:
    """The run's one line on its compute precision (after ``[precision]``). ``asked``: the resolved
    ``mixed_precision_param``; ``default``: what this device would have chosen (detected when None)."""
    default = default or default_compute_precision(device_kind)
    compute = "bf16 compute, fp32 master weights" if asked == "bfloat16" else "fp32 compute"
    if asked == default.dtype:
        return f"{compute} ({default.reason})"
    if asked == "bfloat16" and device_kind == "cpu":
        return (
            f"{compute} as asked (--training.mixed_precision_param bfloat16), but {default.reason}: "
            f"a bf16 matrix product measures {bf16_gemm_slowdown():.0f}x slower than fp32 here, so expect "
            "steps many times slower than with the fp32 default"
        )
    return (
        f"{compute} as asked (--training.mixed_precision_param {asked}); "
        f"the default here is {default.short} ({default.reason})"
    )


def describe_cpu(
    flags: frozenset[str] | None = None, machine: str | None = None, env: Mapping[str, str] = os.environ
) -> str:
    """This CPU for a benchmark's figures: model, cores, the vector and bf16 instructions torch can use."""
    flags = cpu_flags() if flags is None else flags
    machine = machine or platform.machine()
    vector = [name for flag, name in VECTOR_FLAGS.items() if flag in flags]
    bf16 = [name for flag, name in BF16_MATRIX_FLAGS.items() if flag in flags]
    chosen = cpu_compute_precision(flags, machine, env)
    return (
        f"cpu: {_cpu_model()}, {machine}, {os.cpu_count()} cores; "
        f"{', '.join(vector) or 'no AVX2/AVX512'}; bf16 matrix: {', '.join(bf16) or 'none'}; "
        f"default compute {chosen.short} ({chosen.reason})"
    )


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown model"


def compute_autocast(dtype):
    """The context a model trained whole on one CPU rank (``models.fsdp_comms``) computes in: autocast to
    ``dtype`` (bf16), or nothing when ``dtype`` is None (fp32, or FSDP casting the weights itself)."""
    if dtype is None:
        return contextlib.nullcontext()
    import torch

    return torch.autocast("cpu", dtype=dtype)


def model_compute_dtype(model):
    """The autocast dtype ``models.fsdp_comms.parallelized_for_the_job`` gave ``model`` (None: none)."""
    return getattr(model, "compute_dtype", None)
