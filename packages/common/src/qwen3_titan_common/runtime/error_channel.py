"""A rank's one-line user error, sent straight to the launcher, needing no file and no terminal.

A rank's output reaches the user through torchrun, which writes it to files first (``--log-dir``) and
shows only rank 0's: a rank other than 0 that fails, or any rank on a disk that is full, would leave the
launcher nothing to read. So the launcher opens a Unix datagram socket (abstract, on Linux: no file at
all) and names it in the ranks' environment; a rank that stops on a ``UserInputError`` sends its message
there before it exits. Best effort on both ends: the launcher still reads the output when nothing came.
"""

from __future__ import annotations

import os
import socket

from qwen3_titan_common.runtime.local_socket import socket_address, unique_socket_name

CHANNEL_ENV = "QWEN3_TITAN_ERROR_CHANNEL"
_MAX_BYTES = 8192


class ErrorChannel:
    """The launcher's end: opened before torchrun starts, read after it exits."""

    def __init__(self) -> None:
        self.name = unique_socket_name("errors")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(socket_address(self.name))
        self._socket.setblocking(False)

    def env(self) -> dict[str, str]:
        return {CHANNEL_ENV: self.name}

    def messages(self) -> list[tuple[int, str]]:
        """(rank, message) in the order the ranks sent them."""
        found = []
        while True:
            try:
                data = self._socket.recv(_MAX_BYTES)
            except (BlockingIOError, OSError):
                return found
            rank, _, message = data.decode(errors="replace").partition(" ")
            found.append((int(rank) if rank.isdigit() else -1, message))

    def close(self) -> None:
        self._socket.close()
        address = socket_address(self.name)
        if not address.startswith("\0") and os.path.exists(address):
            os.unlink(address)


def report(message: str) -> None:
    """A rank's end: send ``message`` to the launcher, if one is listening; never fails."""
    name = os.environ.get(CHANNEL_ENV)
    if not name:
        return
    data = f"{os.environ.get('RANK', '-1')} {message}".encode()[:_MAX_BYTES]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(data, socket_address(name))
    except OSError:
        pass
