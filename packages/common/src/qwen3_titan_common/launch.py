"""The ``train`` console script behind every backend.

``train [launcher flags] [torchtitan flags]`` runs

    torchrun --nproc_per_node=<devices> --rdzv_backend c10d --rdzv_endpoint localhost:0 \
        --local-ranks-filter 0 --role rank --tee 3 \
        -m torchtitan.train --module <backend module> --config <name> [torchtitan flags]

which is the upstream recipe's command; every flag the launcher does not own is
passed to torchtitan unchanged. ``--print-cmd`` prints that command instead of
running it, ``--list-configs`` lists the backend's config functions, ``--dry-run``
checks a layout of any size on this machine with torchtitan's fake process group.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qwen3_titan_common.config_names import list_config_functions
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.neuron_env import neuron_env_updates


@dataclass(frozen=True)
class Backend:
    """What a backend package tells the shared launcher about itself."""

    distribution: str  # e.g. "native-backend"
    module: str  # the torchtitan --module, e.g. "qwen3_titan_native"
    default_config: str = "debug"
    # Backend-specific checks before any rank starts: argv -> one-line error, or None.
    preflight: Callable[[list[str]], str | None] | None = None


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

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

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
        args += ["--local-ranks-filter", "0", "--role", "rank", "--tee", "3"]
        return args

    def titan_args(self) -> list[str]:
        return ["--module", self.module, "--config", self.config, *self.passthrough]

    def command(self) -> list[str]:
        return ["torchrun", *self.torchrun_args(), "-m", "torchtitan.train", *self.titan_args()]

    def shell_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_updates.items())
        return (env + " " if env else "") + shlex.join(self.command())


def _parser(backend: Backend) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train",
        description=(
            f"Train Qwen3 with the {backend.distribution} (torchtitan --module {backend.module}). "
            "Flags not listed here go to torchtitan unchanged, e.g. --training.steps 5."
        ),
        allow_abbrev=False,
    )
    p.add_argument("--module", default=backend.module, help=f"torchtitan module (default: {backend.module})")
    p.add_argument(
        "--config",
        default=backend.default_config,
        help=f"config function (default: {backend.default_config})",
    )
    p.add_argument("--print-cmd", action="store_true", help="print the equivalent torchrun command and exit")
    p.add_argument(
        "--list-configs", action="store_true", help="list this backend's config functions and exit"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the parallel layout, sharding and memory on this machine with a fake process group",
    )
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
        "--hf-model",
        default=None,
        metavar="DIR",
        help="start from this Hugging Face model directory (same as --hf.model_dir DIR)",
    )
    return p


def _aliases(opts: argparse.Namespace) -> list[str]:
    """Launcher shorthands, turned into the torchtitan flags they stand for."""
    if opts.hf_model is None:
        return []
    # Ranks may start elsewhere (other nodes' working directories): pass an absolute path.
    return ["--hf.model_dir", str(Path(opts.hf_model).expanduser().resolve())]


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


def _check_config_name(module: str, config: str) -> None:
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
        from neuron_qwen3.config_registry import missing_provider

        package = missing_provider(config)
        if package is not None:
            raise LaunchError(
                f"--config {config} is provided by the '{package}' package, which is not installed in this "
                f"environment: run `uv sync --package {package}` (or `uv run --package {package} train ...`)"
            )


def _check_model_dir(titan_args: list[str]) -> None:
    """Check an explicitly named HF directory before starting ranks (headers only, no weights)."""
    for flag in ("--hf.model_dir", "--hf.model-dir"):
        if flag in titan_args and titan_args.index(flag) + 1 < len(titan_args):
            from qwen3_titan_common.hf.start import open_checked_model_dir

            open_checked_model_dir(titan_args[titan_args.index(flag) + 1])


def plan_launch(backend: Backend, argv: list[str]) -> tuple[argparse.Namespace, LaunchPlan]:
    opts, passthrough = _parser(backend).parse_known_args(argv)
    nnodes = _positive_int(_cluster_default(opts.nnodes, "NNODES", "SLURM_NNODES") or "1", "--nnodes")
    node_rank = int(_cluster_default(opts.node_rank, "NODE_RANK", "SLURM_NODEID") or "0")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank={node_rank}: expected 0 <= node rank < --nnodes ({nnodes})")
    endpoint = _cluster_default(opts.rdzv_endpoint, "RDZV_ENDPOINT")
    if endpoint is None and os.environ.get("MASTER_ADDR") and nnodes > 1:
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}"
    if nnodes > 1 and endpoint is None and not opts.dry_run:
        raise LaunchError(
            f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (a host every machine reaches), "
            "or MASTER_ADDR/MASTER_PORT in the environment"
        )
    if opts.nproc is not None:
        nproc = _positive_int(str(opts.nproc), "--nproc")
        env_updates = {}
    else:
        from qwen3_titan_common.device import detect_device

        device = detect_device()
        print(f"[train] {device.describe()}", file=sys.stderr)
        nproc = device.count
        env_updates = neuron_env_updates() if device.kind == "neuron" else {}
    plan = LaunchPlan(
        module=opts.module,
        config=opts.config,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=endpoint or "localhost:0",
        passthrough=[*_aliases(opts), *passthrough],
        env_updates=env_updates,
    )
    return opts, plan


def _torchrun_executable() -> str:
    beside_python = Path(sys.executable).with_name("torchrun")
    return str(beside_python) if beside_python.exists() else "torchrun"


def _list_configs(module: str) -> int:
    functions = list_config_functions(module)
    if functions is None:
        print(f"train: --module {module}: no such importable module", file=sys.stderr)
        return 2
    width = max(len(f.name) for f in functions)
    for f in functions:
        print(f"{f.name:<{width}}  {f.summary}")
    return 0


def run(backend: Backend, argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, plan = plan_launch(backend, argv)
        if opts.list_configs:
            return _list_configs(plan.module)
        _check_config_name(plan.module, plan.config)
        _check_model_dir(plan.passthrough)
        if backend.preflight is not None and not opts.print_cmd:
            problem = backend.preflight(argv)
            if problem is not None:
                raise LaunchError(problem)
        if opts.dry_run:
            from qwen3_titan_common.dry_run import dry_run

            return dry_run(plan)
    except UserInputError as err:
        print(f"train: {err}", file=sys.stderr)
        return 2
    if opts.print_cmd:
        print(plan.shell_line())
        return 0
    command = plan.command()
    command[0] = _torchrun_executable()
    print(f"[train] {plan.shell_line()}", file=sys.stderr, flush=True)
    return run_and_summarise(command, {**os.environ, **plan.env_updates})


# A rank that dies of one of our input errors prints `qwen3_titan_...XxxError: message`
# at the end of its traceback; torchrun then adds its own report. We repeat the message
# as the launcher's last line, so the culprit is the line a user reads.
_USER_ERROR_LINE = re.compile(r"(?:^|[\s:])(?:qwen3_titan_[\w.]*|neuron_qwen3[\w.]*)\.(\w*Error): (.+)$")


class _ErrorSummary:
    """Finds the user-facing error in a failed run's output.

    Two shapes: a rank that dies of one of our input errors ends its traceback with
    ``qwen3_titan_...XxxError: message``; torchtitan's CLI parser (tyro) draws a box
    (``╭─ ... │ message │ ... ╰─``) whose text, up to its ``───`` rule, is the message.
    """

    def __init__(self) -> None:
        self.message: str | None = None
        self._box: list[str] | None = None

    def feed(self, line: str) -> None:
        text = re.sub(r"^\[rank\d+\]:", "", line.rstrip("\n"))
        if "╭─" in text:
            self._box = []
            return
        if self._box is not None:
            inner = text.strip().strip("│").strip()
            if "╰" in text or inner.startswith("───"):
                if self._box:
                    self.message = " ".join(self._box)
                self._box = None
                return
            if inner:
                self._box.append(inner)
            return
        match = _USER_ERROR_LINE.search(text)
        if match:
            self.message = match.group(2)


def run_and_summarise(command: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
    previous = signal.signal(signal.SIGTERM, forward)
    summary = _ErrorSummary()
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()  # keep the log live when it goes to a pipe or a file
            summary.feed(line)
        returncode = proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached torchrun too (same process group): let it shut the ranks down.
        returncode = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    sys.stdout.flush()
    if returncode != 0 and summary.message is not None:
        print(f"train: {summary.message}", file=sys.stderr)
        return 2
    return returncode


def main_for(backend: Backend):
    """A ``main`` bound to one backend (``python -m <backend package>.launch``)."""

    def main() -> None:
        sys.exit(run(backend))

    return main


# -- the shared `train` console script ------------------------------------------
#
# Every backend installs a console script named `train`; in one workspace
# environment they would overwrite each other (uv installs whichever synced last).
# So they all point at this one dispatcher, and the backend is chosen here.

BACKENDS_GROUP = "qwen3_titan.backends"
BACKEND_ENV = "QWEN3_TITAN_BACKEND"


def installed_backends() -> dict[str, Backend]:
    from importlib.metadata import entry_points

    found = {}
    for entry in entry_points(group=BACKENDS_GROUP):
        backend = entry.load()
        found[backend.distribution] = backend
    return dict(sorted(found.items()))


def _uv_parent_package() -> str | None:
    """The NAME of `uv run --package NAME train`, read from the parent process."""
    ppid = os.getppid()
    try:
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes()
        args = [a.decode() for a in raw.split(b"\0") if a]
    except OSError:
        try:  # macOS and other systems without /proc
            out = subprocess.run(["ps", "-o", "command=", "-p", str(ppid)], capture_output=True, text=True)
            args = out.stdout.split()
        except OSError:
            return None
    # args[0] is uv itself, or an interpreter running a uv wrapper script.
    if not any(Path(a).name in ("uv", "uv.exe") for a in args[:2]) or "run" not in args:
        return None
    for i, arg in enumerate(args):
        if arg == "--package" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--package="):
            return arg.split("=", 1)[1]
    return None


def choose_backend(installed: dict[str, Backend], argv: list[str]) -> tuple[Backend | None, str]:
    """(backend, how it was chosen) or (None, why none could be)."""
    from_env = os.environ.get(BACKEND_ENV)
    if from_env:
        if from_env in installed:
            return installed[from_env], f"{BACKEND_ENV}={from_env}"
        known = ", ".join(installed) or "none"
        return None, f"{BACKEND_ENV}={from_env}: not an installed backend (installed: {known})"
    from_uv = _uv_parent_package()
    if from_uv in installed:
        return installed[from_uv], f"uv run --package {from_uv}"
    modules = {b.module: b for b in installed.values()}
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--module" and i + 1 < len(argv) else None
        if arg.startswith("--module="):
            value = arg.split("=", 1)[1]
        if value in modules:
            return modules[value], f"--module {value}"
    if len(installed) == 1:
        only = next(iter(installed.values()))
        return only, f"the only backend installed, {only.distribution}"
    if not installed:
        return None, "no backend package is installed: `uv run --package native-backend train`"
    names = ", ".join(installed)
    return None, (
        f"several backends are installed ({names}): choose one with `uv run --package NAME train`, "
        f"{BACKEND_ENV}=NAME, or --module"
    )


def main() -> None:
    argv = sys.argv[1:]
    backend, why = choose_backend(installed_backends(), argv)
    if backend is None:
        print(f"train: {why}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(backend, argv))
