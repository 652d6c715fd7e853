"""The runs' environment: the wheels the GPU image lacks, the children's variables, the env probe."""

from __future__ import annotations

import glob
import json
import os
import subprocess

from tools.gpu_bench.capped import Clock, run_capped, say
from tools.gpu_bench.paths import COMPAT, ROOT, SRC_DIRS
from tools.gpu_bench.plan import REGISTRIES, Mode

# Modules every run needs: the wheels (fetch_wheels.sh).
WHEEL_MODULES = ("torchtitan", "tyro", "torchdata", "datasets", "spmd_types", "torch_checkpointing")


def child_env(mode: Mode, work: str, site_dirs: list[str]) -> dict:
    env = dict(os.environ)
    path = [COMPAT, *site_dirs, *SRC_DIRS]
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
    modules = ",".join(["torchtitan.trainer", *REGISTRIES.values()])
    cmd = [
        python,
        "-m",
        "tools.gpu_bench.env_probe",
        "--matmul",
        str(0 if mode.tiny else 8192),
        "--imports",
        modules,
    ]
    log = os.path.join(logs, "env.log")
    rc, timed_out, _ = run_capped(cmd, log, min(90 * mode.cap_scale, clock.left()), env)
    with open(log, errors="replace") as f:
        found = [line[4:] for line in f if line.startswith("ENV ")]
    if not found:
        return {"error": f"env probe failed (rc {rc}{', timed out' if timed_out else ''}); see logs/env.log"}
    return json.loads(found[-1])
