"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd for this host, in a temporary folder.

The distribution's packages (``slurmd slurmctld slurm-client munge``) are installed with apt-get when
missing; where that cannot happen (not root, no apt-get, no network) :class:`SlurmUnavailable` says why,
and the test skips with that reason. Nothing outside the folder is configured: the daemons get their own
slurm.conf, munge key and socket, state and spool directories, ports and logs; clients find them through
``SLURM_CONF``. Plugins that need neither systemd nor cgroups, so that it runs in a container:
``proctrack/linuxproc`` (tracks a job's processes by parentage, so torchrun's workers, each in its own
session, are still the job's), ``task/none``, no accounting.

:func:`one_node_slurm` stops every daemon it started, then any process still tagged with its marker
variable (job steps and the processes they started), by pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from qwen3_titan_testing.processes import kill, with_environment

PACKAGES = ["slurmd", "slurmctld", "slurm-client", "munge"]
PROGRAMS = ["munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel"]
MARKER = "QWEN3_TITAN_TEST_SLURM"
# Debian's policy-rc.d convention: exit 101 tells the packages' scripts not to start their services.
_NO_SERVICE_STARTS = "#!/bin/sh\n# Written by qwen3_titan_testing.slurm for one apt-get install.\nexit 101\n"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message is the reason."""


def _missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None]


def _apt_get(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=900)


def ensure_installed() -> None:
    """Install the distribution's Slurm and munge if a program is missing, without starting services."""
    if not _missing_programs():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(
            f"{', '.join(_missing_programs())} missing and not root: cannot apt-get install"
        )
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(_missing_programs())} missing and no apt-get to install them")
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text(_NO_SERVICE_STARTS)
        policy.chmod(0o755)
    try:
        install = ["install", "-y", "--no-install-recommends", *PACKAGES]
        result = _apt_get(*install)
        if result.returncode != 0:  # stale or absent package lists
            _apt_get("update")
            result = _apt_get(*install)
    finally:
        if ours:
            policy.unlink()
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:]
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {' '.join(last)}")
    if _missing_programs():
        raise SlurmUnavailable(
            f"installed {' '.join(PACKAGES)} but {', '.join(_missing_programs())} still missing"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line() -> str:
    """This host as slurmd sees it (``slurmd -C``): name, CPUs, sockets, cores, memory."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60).stdout
    line = next((x for x in out.splitlines() if x.startswith("NodeName=")), None)
    if line is None:
        raise SlurmUnavailable(f"`slurmd -C` printed no NodeName line: {out.strip()[:200]}")
    return line


def slurm_conf(root: Path, node_line: str, munge_socket: Path) -> str:
    node = node_line.split()[0].split("=", 1)[1]
    return "\n".join(
        [
            "ClusterName=qwen3titantest",
            f"SlurmctldHost={node}",
            "SlurmUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobRequeue=1",
            f"{node_line} State=UNKNOWN",
            f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@dataclass
class OneNodeSlurm:
    root: Path
    conf: Path
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    def command(self, *args: str, timeout: float = 60) -> str:
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    def sbatch(self, script: Path) -> str:
        return self.command("sbatch", "--parsable", str(script)).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        text = self.command("scontrol", "--oneliner", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout:.0f} s")
            time.sleep(1)

    def requeue_now(self, job_id: str, timeout: float = 120) -> None:
        """Requeue a running job and make it eligible at once (Slurm holds a requeued job ~2 minutes)."""
        self.command("scontrol", "requeue", job_id)
        self.wait_for_state(job_id, {"PENDING", "RUNNING"}, timeout)
        if self.job(job_id).get("JobState") == "PENDING":
            self.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def log_tail(self, lines: int = 20) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            parts.append(
                f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            )
        return "\n".join(parts)


def _start(cluster: OneNodeSlurm, name: str, args: list[str]) -> None:
    out = open(cluster.root / "log" / f"{name}.out", "w")
    cluster.daemons[name] = subprocess.Popen(args, env=cluster.env, stdout=out, stderr=subprocess.STDOUT)


def _wait_until_idle(cluster: OneNodeSlurm, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        for name, proc in cluster.daemons.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{cluster.log_tail()}")
        try:
            state = cluster.command("sinfo", "--noheader", "--format=%T").strip()
        except RuntimeError:
            state = "no controller yet"
        if state == "idle":
            return
        time.sleep(0.5)
    raise RuntimeError(f"the node is {state!r}, not idle, after {timeout:.0f} s\n{cluster.log_tail()}")


def _stop(cluster: OneNodeSlurm) -> None:
    try:
        subprocess.run(["scancel", "--full", "--user=root"], env=cluster.env, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    # slurmd before slurmctld before munged: each still has what it talks to while it shuts down.
    for name in ("slurmd", "slurmctld", "munged"):
        proc = cluster.daemons.get(name)
        if proc is None or proc.poll() is not None:
            continue
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # Job steps outlive slurmd by design; everything the cluster started carries the marker.
    kill(with_environment(MARKER, str(cluster.root)))


@contextmanager
def one_node_slurm(root: Path) -> Iterator[OneNodeSlurm]:
    """Start munged, slurmctld and slurmd for this host under ``root``; stop them all on exit."""
    ensure_installed()
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # munged refuses a key that others can read, and a socket folder others can write to.
    root.chmod(0o755)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    socket_path = root / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, _node_line(), socket_path))
    env = {**os.environ, "SLURM_CONF": str(conf), MARKER: str(root)}
    cluster = OneNodeSlurm(root=root, conf=conf, env=env)
    try:
        _start(cluster, "munged", [
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
            f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
            f"--seed-file={root / 'munged.seed'}",
        ])  # fmt: skip
        deadline = time.monotonic() + 30
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        _start(cluster, "slurmctld", ["slurmctld", "-D", "-f", str(conf)])
        _start(cluster, "slurmd", ["slurmd", "-D", "-f", str(conf)])
        _wait_until_idle(cluster)
        yield cluster
    finally:
        _stop(cluster)
