"""Naming the launcher's local sockets (the launch gate, the error channel) so its ranks can find them."""

from __future__ import annotations

import os
import sys
import tempfile
import uuid


def unique_socket_name(kind: str) -> str:
    """A name no other launcher on this machine uses: the kind, this process and a random tail."""
    return f"qwen3-titan-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def socket_address(name: str) -> str:
    """Where the Unix socket called ``name`` lives: Linux's abstract namespace (nothing on disk to clean
    up after a SIGKILL), else a file in the temporary folder."""
    if sys.platform.startswith("linux"):
        return "\0" + name
    return os.path.join(tempfile.gettempdir(), name)
