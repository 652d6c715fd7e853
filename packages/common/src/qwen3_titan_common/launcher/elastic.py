"""``train --max-restarts N``: torchrun restarts the workers when one dies, and they resume.

torchrun's own fault tolerance: when any worker of a node exits non-zero (a kill -9 of one rank
included), its agent stops the node's other workers, joins the next round of the c10d rendezvous and
starts them all again, up to N times; every other node's agent sees the new round and restarts its
workers too. The restarted workers run the same command, so ``hf.start`` resumes them from the newest
complete step checkpoint in the dump folder: what a restart loses is the steps since that checkpoint.

Why the launcher also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default (torch >= 2.5) the
agent hosts one TCPStore for its workers' ``init_process_group`` and, in torch 2.14, keeps that same
server for every restart round (``DynamicRendezvousHandler`` caches it), while the workers'
``env://`` store no longer prefixes keys with the attempt ("we create a new TCPStore for every
retry", ``torch/distributed/rendezvous.py``). So a restarted worker can read a key its dead
predecessor wrote: gloo's per-rank address, and the peer that connects first dials a port nobody
listens on ("Gloo connectFullMesh failed ... Connection refused"), or waits for a peer that never
comes (a hang); NCCL's unique id travels through the same store under the same reused keys
(pytorch/pytorch#135712). With the variable set, each round's workers get a fresh store on a fresh
port, hosted by worker rank 0 (how torchrun worked before 2.5), so no key outlives its attempt, for
any process-group backend. The cost: the store is hosted by worker rank 0 and ends with it, as
before torch 2.5. A value the user exported wins.

Across nodes, all agents must name the same rendezvous: ``--rdzv-id`` (Slurm's job id by default)
and the c10d endpoint ``--rdzv-endpoint HOST:PORT``, hosted by the agent on HOST for the whole job,
so it survives worker restarts (not the loss of HOST's agent).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

FRESH_STORE_PER_RESTART = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_flags(max_restarts: int, rdzv_id: str | None) -> list[str]:
    flags = [f"--max-restarts={max_restarts}"] if max_restarts > 0 else []
    return flags + ([f"--rdzv-id={rdzv_id}"] if rdzv_id else [])


def restart_env_updates(max_restarts: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables torchrun needs for restarts that never meet a previous attempt's store keys."""
    env = os.environ if env is None else env
    if max_restarts < 1:
        return {}
    return {k: v for k, v in FRESH_STORE_PER_RESTART.items() if k not in env}
