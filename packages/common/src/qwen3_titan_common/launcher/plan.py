"""From ``train``'s command line to a torchrun launch plan, and the checks that need no rank.

The launcher owns a handful of flags (below); every other flag goes to torchtitan unchanged. The plan
is the upstream recipe's command::

    torchrun --nproc_per_node=<devices> --rdzv_backend c10d --rdzv_endpoint localhost:0 \
        --local-ranks-filter 0 --role rank --tee 3 \
        -m torchtitan.train --module <backend module> --config <name> [torchtitan flags]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.launcher.config_names import list_config_functions
from qwen3_titan_common.launcher.elastic import restart_env_updates, torchrun_flags
from qwen3_titan_common.launcher.knobs import add_knob_arguments, knob_flags, mapping_lines, titan_args
from qwen3_titan_common.launcher.titan_flags import TitanFlags
from qwen3_titan_common.perf.fit import memory_flag
from qwen3_titan_common.runtime.neuron_env import neuron_env_updates

# How long a node waits at the rendezvous for the others to join (torchrun's c10d join timeout).
RDZV_JOIN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Backend:
    """What a backend package tells the shared launcher about itself."""

    distribution: str  # e.g. "native-backend"
    module: str  # the torchtitan --module, e.g. "qwen3_titan_native"
    default_config: str = "debug"
    # "module:function" giving the ModelSpec this backend trains, for `eval --backend` (hf.eval_models).
    eval_model: str | None = None


class LaunchError(UserInputError):
    pass


@dataclass
class LaunchPlan:
    module: str
    config: str
    nproc_per_node: int
    nnodes: int
    node_rank: int
    rdzv_endpoint: str
    passthrough: list[str]
    env_updates: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    rdzv_id: str | None = None
    # The launcher's short flags and the torchtitan flags they became (launcher.knobs), for --print-cmd.
    knob_mapping: list[str] = field(default_factory=list)
    # The device kind found on this machine when the job runs here (no --nproc), else None.
    device_kind: str | None = None
    # The memory a rank has, stated (--memory-per-rank: GiB or a device; perf.fit), else None.
    memory_per_rank: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def job_device_kind(self) -> str:
        """The device kind of the job's ranks: a device named by --memory-per-rank; else, for a one-node job, this
        machine's (with --nproc too: its ranks run on this machine's devices); '' for a job on other nodes."""
        from qwen3_titan_common.perf.fit import NAMED_DEVICES

        if self.memory_per_rank and self.memory_per_rank.strip().lower() in NAMED_DEVICES:
            return "neuron" if self.memory_per_rank.strip().lower().startswith("trn") else "cuda"
        if self.device_kind:
            return self.device_kind
        if self.nnodes > 1:
            return ""
        from qwen3_titan_common.runtime.device import detect_device

        return detect_device().kind

    def torchrun_args(self) -> list[str]:
        args = [
            f"--nproc_per_node={self.nproc_per_node}",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            self.rdzv_endpoint,
        ]
        if self.nnodes > 1:
            args += [f"--nnodes={self.nnodes}", f"--node_rank={self.node_rank}"]
            # Stated, not torchrun's implicit default, so that the launcher's line says how long a node waits.
            args += ["--rdzv_conf", f"join_timeout={RDZV_JOIN_TIMEOUT_S}"]
        args += torchrun_flags(self.max_restarts, self.rdzv_id)
        args += ["--local-ranks-filter", "0", "--role", "rank", "--tee", "3"]
        return args

    def titan_args(self) -> list[str]:
        return ["--module", self.module, "--config", self.config, *self.passthrough]

    @property
    def flags(self) -> TitanFlags:
        """The torchtitan flags passed through, read as the ranks will read them (``launcher.titan_flags``)."""
        return TitanFlags.read(self.passthrough)

    def command(self) -> list[str]:
        return ["torchrun", *self.torchrun_args(), "-m", "torchtitan.train", *self.titan_args()]

    def shell_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_updates.items())
        return (env + " " if env else "") + shlex.join(self.command())


@dataclass(frozen=True)
class CommandLine:
    """``train``'s command line, parsed once (:func:`read_command_line`): the launcher's flags, and the rest,
    which go to torchtitan unchanged. ``opts.module`` and ``opts.config`` are None when not given (the
    backend, chosen from them, supplies its defaults)."""

    argv: list[str]
    opts: argparse.Namespace
    passthrough: list[str]


def read_command_line(argv: list[str]) -> CommandLine:
    opts, passthrough = launcher_parser().parse_known_args(argv)
    return CommandLine(list(argv), opts, passthrough)


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints its usage and then the error; the launcher's errors are one line."""

    def error(self, message: str):
        raise LaunchError(f"{message} (train --help lists the launcher's flags)")


def launcher_parser(backend: Backend | None = None) -> argparse.ArgumentParser:
    """The launcher's flags; ``backend`` (the chosen one) only words the help."""
    chosen = f"the {backend.distribution} (torchtitan --module {backend.module})" if backend else "a backend"
    p = _OneLineParser(
        prog="train",
        description=(
            f"Train Qwen3 with {chosen}. Flags not listed here go to torchtitan unchanged, e.g. --training.steps 5."
        ),
        allow_abbrev=False,
        # --help shows torchtitan's flags of the chosen config too (launcher.help).
        add_help=False,
    )
    p.add_argument(
        "-h", "--help", action="store_true", help="show the launcher's and torchtitan's flags and exit"
    )
    module, config = (backend.module, backend.default_config) if backend else ("the backend's",) * 2
    p.add_argument("--module", default=None, help=f"torchtitan module (default: {module})")
    p.add_argument("--config", default=None, help=f"config function (default: {config})")
    p.add_argument("--print-cmd", action="store_true", help="print the equivalent torchrun command and exit")
    p.add_argument(
        "--list-configs", action="store_true", help="list this backend's config functions and exit"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the parallel layout, sharding and memory on this machine with a fake process group",
    )
    p.add_argument(
        "--memory-per-rank", dest="memory_per_rank", default=None, metavar="GIB",
        help="the memory one rank has, to check the job against before it starts (a dry run, or a run here): "
        "GiB, or a device (trn2: a logical core at LNC=2, h100, h200); default: this machine's",
    )  # fmt: skip
    p.add_argument(
        "--check-layout", action="store_true",
        help="run this layout at 2 layers beside one rank on this machine, 3 steps, and compare their losses",
    )  # fmt: skip
    # torchrun's spellings are accepted too: its users type them.
    p.add_argument(
        "--nproc",
        "--nproc_per_node",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=None,
        help="ranks per node (default: the device count)",
    )
    p.add_argument("--nnodes", type=int, default=None, help="number of machines (default: 1, or Slurm's)")
    p.add_argument(
        "--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
        help="this machine's rank among --nnodes",
    )  # fmt: skip
    p.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None,
        help="HOST:PORT of the rendezvous, needed with --nnodes > 1",
    )  # fmt: skip
    p.add_argument(
        "--max-restarts", "--max_restarts", dest="max_restarts", default="0", metavar="N",
        help="torchrun restarts the workers up to N times when one fails; they resume from the newest "
        "complete checkpoint (docs/reliability.md)",
    )  # fmt: skip
    p.add_argument(
        "--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None,
        help="rendezvous id shared by all nodes of one job (default: $SLURM_JOB_ID)",
    )  # fmt: skip
    p.add_argument(
        "--print-sbatch", choices=("neuron", "cuda", "cpu"), default=None, metavar="DEVICE",
        help="print a Slurm batch script that runs this command on --nnodes nodes of DEVICE "
        "(neuron, cuda or cpu) and exit (examples/slurm/)",
    )  # fmt: skip
    p.add_argument(
        "--hf-model",
        default=None,
        metavar="DIR",
        help="start from this Hugging Face model directory (same as --hf.model_dir DIR)",
    )
    p.add_argument(
        "--show-traceback",
        action="store_true",
        help="show a failed rank's traceback and torchrun's report live (always kept in the run's log file)",
    )
    add_knob_arguments(p)
    return p


def _aliases(opts: argparse.Namespace) -> list[str]:
    """Launcher shorthands, turned into the torchtitan flags they stand for."""
    if opts.hf_model is None:
        return []
    path = Path(opts.hf_model).expanduser()
    # Ranks may start elsewhere (other nodes' working directories): pass an absolute path. A name that
    # is not here (a Hub id, hf://, s3://) keeps its form, so that the error about it shows what was typed.
    return ["--hf.model_dir", str(path.resolve()) if path.exists() else opts.hf_model]


def _cluster_default(flag_value, *env_names: str) -> str | None:
    if flag_value is not None:
        return str(flag_value)
    for name in env_names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _positive_int(value: str, flag: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"{flag}={value!r}: expected a positive integer") from None
    if number < 1:
        raise LaunchError(f"{flag}={number}: expected a positive integer")
    return number


def _count(value: str, flag: str) -> int:
    if not value.isdigit():
        raise LaunchError(f"{flag}={value!r}: expected 0 or a positive integer")
    return int(value)


def check_config_name(module: str, config: str) -> None:
    functions = list_config_functions(module)
    if functions is None:
        raise LaunchError(
            f"--module {module}: no such importable module (is its backend package installed in this environment?)"
        )
    names = [f.name for f in functions]
    if config not in names:
        raise LaunchError(
            f"--config {config}: not a config function of {module}; available: {', '.join(names)}"
        )
    if module == "neuron_qwen3":
        from neuron_qwen3.config_registry import missing_provider_message

        message = missing_provider_message(config)
        if message is not None:
            raise LaunchError(message)


def check_model_dir(flags: TitanFlags) -> None:
    """Check an explicitly named HF directory (and peft adapter) before starting ranks (headers only, no
    weights; imported only then: both modules import torch)."""
    for flag in ("--hf.model_dir", "--lora.adapter"):
        if (value := flags.value(flag)) is None:
            continue
        if flag == "--lora.adapter":
            from qwen3_titan_common.hf.adapter import open_adapter_dir as check
        else:
            from qwen3_titan_common.hf.start import open_checked_model_dir as check
        check(value)


def plan_launch(backend: Backend, line: CommandLine | list[str]) -> tuple[argparse.Namespace, LaunchPlan]:
    """The torchrun plan of ``line`` (or of a raw ``argv``, parsed here) for ``backend``."""
    if not isinstance(line, CommandLine):
        line = read_command_line(line)
    opts, passthrough = line.opts, line.passthrough
    knobs = knob_flags(opts, passthrough)
    nnodes = _positive_int(_cluster_default(opts.nnodes, "NNODES", "SLURM_NNODES") or "1", "--nnodes")
    node_rank = int(_cluster_default(opts.node_rank, "NODE_RANK", "SLURM_NODEID") or "0")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank={node_rank}: expected 0 <= node rank < --nnodes ({nnodes})")
    endpoint = _cluster_default(opts.rdzv_endpoint, "RDZV_ENDPOINT")
    if endpoint is None and os.environ.get("MASTER_ADDR") and nnodes > 1:
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}"
    if nnodes > 1 and endpoint is None and not (opts.dry_run or opts.print_sbatch or opts.check_layout):
        raise LaunchError(
            f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (a host every machine reaches), "
            "or MASTER_ADDR/MASTER_PORT in the environment"
        )
    max_restarts = _count(opts.max_restarts, "--max-restarts")
    device_kind = None
    if opts.nproc is not None:
        nproc = _positive_int(str(opts.nproc), "--nproc")
        env_updates = {}
    elif opts.print_sbatch:
        nproc, env_updates = 0, {}  # each node's own `train` counts its devices
    else:
        from qwen3_titan_common.runtime.device import detect_device

        device = detect_device()
        print(f"[train] {device.describe()}", file=sys.stderr)
        nproc, device_kind = device.count, device.kind
        env_updates = neuron_env_updates() if device.kind == "neuron" else {}
    plan = LaunchPlan(
        module=opts.module or backend.module,
        config=opts.config or backend.default_config,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=endpoint or "localhost:0",
        passthrough=[*_aliases(opts), *titan_args(knobs), *passthrough],
        env_updates={**env_updates, **restart_env_updates(max_restarts)},
        max_restarts=max_restarts,
        rdzv_id=_cluster_default(opts.rdzv_id, "SLURM_JOB_ID"),
        knob_mapping=mapping_lines(knobs),
        device_kind=device_kind if nnodes == 1 else None,
        memory_per_rank=memory_flag(
            opts.memory_per_rank,
            beside=[
                f for f in ("print_cmd", "print_sbatch", "check_layout", "list_configs") if getattr(opts, f)
            ],
        ),  # fmt: skip
    )
    return opts, plan
