"""What the bad-input tests assert about a failure: its exit code, one ``train:`` line naming the
culprit, no traceback or torchrun report, and no file created or changed outside the run's log.

Also a small file system for the disk and read-only cases: a tmpfs mounted in a private mount
namespace (``unshare``), so a test gets a real full or read-only disk without touching the host's
mounts; ``unshare --map-root-user`` lets an unprivileged user do it where user namespaces are on.
"""

from __future__ import annotations

import hashlib
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# What a user must never see for an input error: a Python traceback, torchrun's failure report.
FORBIDDEN = ("Traceback (most recent call last)", "ChildFailedError", "Root Cause (first observed failure)")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.stat().st_size < (1 << 22) else ""


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every file and directory under ``roots``: its kind, size, modification time and content digest."""
    found: dict[str, tuple] = {}
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        for path in [root, *root.rglob("*")]:
            stat = path.lstat()
            if path.is_dir():
                found[str(path)] = ("dir",)
            else:
                found[str(path)] = ("file", stat.st_size, stat.st_mtime_ns, _digest(path))
    return found


def changes(
    before: dict[str, tuple], after: dict[str, tuple], *, allowed_under: tuple[Path, ...] = ()
) -> list[str]:
    """Paths created, changed or deleted between two snapshots, except under ``allowed_under``."""
    allowed = tuple(str(Path(p)) for p in allowed_under)

    def ok(path: str) -> bool:
        return any(path == a or path.startswith(a + "/") for a in allowed)

    changed = [p for p in before.keys() & after.keys() if before[p] != after[p] and before[p][0] == "file"]
    created = [p for p in after.keys() - before.keys()]
    deleted = [p for p in before.keys() - after.keys()]
    return sorted(p for p in (*changed, *created, *deleted) if not ok(p))


@dataclass(frozen=True)
class Failure:
    returncode: int
    line: str  # the one line the user reads: the last of what the command wrote
    output: str  # everything it wrote, stdout and stderr


def check_failure(
    returncode: int, stdout: str, stderr: str, expected_code: int, *culprit: str, prefix: str = "train: "
) -> Failure:
    """Assert what every failure must look like; return its line for case-specific checks."""
    output = stdout + stderr
    for forbidden in FORBIDDEN:
        assert forbidden not in output, f"{forbidden!r} shown to the user:\n{output[-4000:]}"
    assert returncode == expected_code, f"exit {returncode}, expected {expected_code}:\n{output[-4000:]}"
    errors = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(errors) == 1, f"expected one {prefix!r} line, got {errors}:\n{output[-4000:]}"
    last = (stderr.strip() or stdout.strip()).splitlines()[-1]
    assert last == errors[0], f"the 'train:' line is not the last one:\n{output[-4000:]}"
    for fragment in culprit:
        assert fragment in last, f"{fragment!r} not in {last!r}"
    return Failure(returncode, last, output)


def unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, text=True
    )
    return probe.returncode == 0


def on_small_filesystem(
    command: list[str], mount_point: Path, *, size: str, read_only: bool = False, before: str = ""
) -> list[str]:
    """``command`` run with a fresh tmpfs of ``size`` (e.g. "60m") mounted at ``mount_point``,
    in a mount namespace of its own; ``before``: shell lines run there first (e.g. to fill it)."""
    options = f"size={size}" + (",ro" if read_only else "")
    script = (
        f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(mount_point))} && "
        + (f"{before} && " if before else "")
        + f"exec {shlex.join(command)}"
    )
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script]


def checks_in_process(backend, argv: list[str]) -> int:
    """What ``train ARGV`` checks before anything is written, in this process: the launcher's own
    checks (``launcher.launch.run`` up to torchrun), then rank 0's (``Qwen3Trainer.resolved_and_checked``, on the config
    torchtitan parses from the rank's command line), ending as the launcher ends an input error.

    torchtitan is imported once for many cases this way; the path from a rank's error through torchrun
    to the launcher's line is run end to end by the ``test_reliability_ranks`` and ``test_bad_inputs`` tests.
    """
    import os
    import sys

    from qwen3_titan_common.errors import UserInputError
    from qwen3_titan_common.launcher.launch import check_names, run, settle_before_torchrun
    from qwen3_titan_common.launcher.plan import plan_launch
    from qwen3_titan_common.train.dump_lock import hold_in_rank
    from qwen3_titan_common.train.rehearsal import rank0_environment
    from qwen3_titan_common.train.trainer import Qwen3Trainer

    from qwen3_titan_testing.fake_rank import parse_as_rank

    launcher_only = {"--print-cmd", "--list-configs", "--print-sbatch", "--dry-run", "-h", "--help"}
    if launcher_only & set(argv):
        return run(backend, argv)
    try:  # the launcher's own checks, as launcher.launch.run calls them up to starting torchrun
        _, plan = plan_launch(backend, argv)
        check_names(plan)
        settle_before_torchrun(plan)
    except UserInputError as err:
        print(f"train: {err}", file=sys.stderr)
        return 2
    # Rank 0 of the planned job: its command line and torchrun's variables.
    program, sys.argv = sys.argv, ["torchtitan/train.py", *plan.titan_args()]
    saved = dict(os.environ)
    os.environ.update(rank0_environment(plan.world_size, plan.nproc_per_node))
    try:
        config = parse_as_rank(plan)
        if isinstance(config, Qwen3Trainer.Config):
            _, config = Qwen3Trainer.resolved_and_checked(config)
            lock = hold_in_rank(config.dump_folder)  # what the rank does next
            if lock is not None:
                lock.release()
    except UserInputError as err:
        print(f"train: {err}", file=sys.stderr)
        return 2
    finally:
        sys.argv = program
        os.environ.clear()
        os.environ.update(saved)
    return 0
