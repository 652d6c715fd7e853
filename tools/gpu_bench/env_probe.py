"""What the benchmark runs on: versions, device, which compat shims this torch needs, a bf16 GEMM.

    python -m tools.gpu_bench.env_probe [--matmul N] [--imports MODULE,...]   # prints one line: ENV {json}

The GEMM (N x N x N in bf16, 10 timed repetitions) is a calibration figure: what this GPU sustains
on one large matmul, against the 989 TFLOP/s datasheet peak that MFU divides by. Skipped on CPU.
``--imports``: each module is imported and its outcome recorded under ``imports`` (``ok`` or the
error, traceback on stderr); the driver names torchtitan's trainer and our config registries, so a
part whose imports fail is reported without being started.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

from tools.gpu_bench.compat import shims

PACKAGES = (
    "torch",
    "transformers",
    "triton",
    "torchtitan",
    "torchdata",
    "datasets",
    "tyro",
    "spmd_types",
    "torch_checkpointing",
    "typing_extensions",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "numpy",
    "fsspec",
    "tensorboard",
)


def version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(name)
    except PackageNotFoundError:
        return "missing"


def matmul_tflops(torch, n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return round(10 * 2 * n**3 / (time.perf_counter() - start) / 1e12, 1)


def probe(matmul_n: int) -> dict:
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    info["versions"] = {name: version(name) for name in PACKAGES}
    import torch

    info["versions"]["torch"] = torch.__version__
    info["cuda_runtime"] = torch.version.cuda
    info["shims_needed"] = shims().missing()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            device_kind="cuda",
            device_count=torch.cuda.device_count(),
            device_memory_gib=round(props.total_memory / 2**30, 1),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
        )
        if matmul_n:
            info[f"bf16_matmul_{matmul_n}_tflops"] = matmul_tflops(torch, matmul_n)
        try:  # MFU's denominator: torchtitan's peak table, as the trainer's own metrics use it
            from torchtitan.tools.utils import get_peak_flops

            info["titan_peak_flops"] = get_peak_flops(info["device"])
        except Exception as err:
            info["titan_peak_flops_error"] = f"{type(err).__name__}: {err}"
        try:
            info["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            info["nvidia_smi"] = f"n/a ({type(err).__name__})"
    else:
        info.update(device="cpu", device_kind="cpu", cpu_count=os.cpu_count())
    return info


def try_import(module: str) -> str:
    try:
        __import__(module)
        return "ok"
    except BaseException as err:  # any failure (SystemExit included) only marks that module's parts
        traceback.print_exc()
        return f"{type(err).__name__}: {str(err).strip()[:200]}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matmul", type=int, default=8192, help="GEMM size for the calibration (0: skip)")
    parser.add_argument("--imports", default="", help="comma-separated modules to try importing")
    opts = parser.parse_args()
    info = probe(opts.matmul)
    if opts.imports:
        info["imports"] = {m: try_import(m) for m in opts.imports.split(",") if m}
    print("ENV " + json.dumps(info), flush=True)
