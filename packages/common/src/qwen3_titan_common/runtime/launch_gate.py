"""Ranks that import while the launcher checks, and start only once the checks passed.

The launcher's checks need the run's full config, so it imports torchtitan (seconds); so does every
rank. Done one after the other, a launch would pay that import twice on its way to the first step.
So the ``train`` launcher starts torchrun as soon as its cheap checks pass and runs the rest while the
ranks import; each rank then waits here, at the start of ``Qwen3Trainer.__init__`` after its own copy
of the same checks, before it takes a lock, writes a file or initialises distributed, until the
launcher says go. If a check fails, the launcher closes the gate and stops torchrun: the ranks have
written nothing.

The gate is a Unix stream socket (abstract on Linux: no file) named in the ranks' environment; a rank
connects and blocks until it reads ``go``, or the end of the stream when the launcher gave up. A run
started without the launcher (the upstream ``torchrun ... -m torchtitan.train``) has no gate.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from qwen3_titan_common.runtime.local_socket import socket_address, unique_socket_name

GATE_ENV = "QWEN3_TITAN_LAUNCH_GATE"
_GO = b"go"


class LaunchGate:
    """The launcher's end: created before torchrun starts, opened or closed once its checks are done."""

    def __init__(self) -> None:
        self.name = unique_socket_name("gate")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(socket_address(self.name))
        self._server.listen(64)
        self._waiting: list[socket.socket] = []
        self._state: bytes | None = None  # _GO once opened, b"" once closed
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def env(self) -> dict[str, str]:
        return {GATE_ENV: self.name}

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._state is None:
                    self._waiting.append(connection)
                    continue
            self._answer(connection, self._state)

    @staticmethod
    def _answer(connection: socket.socket, state: bytes) -> None:
        try:
            if state:
                connection.sendall(state)
        except OSError:
            pass  # that rank is gone already
        finally:
            connection.close()

    def _settle(self, state: bytes) -> None:
        with self._lock:
            if self._state is not None:
                return
            self._state, waiting, self._waiting = state, self._waiting, []
        for connection in waiting:
            self._answer(connection, state)

    def open(self) -> None:
        """Every rank, waiting now or arriving later, goes on."""
        self._settle(_GO)

    def close(self) -> None:
        """Every rank waiting now or later reads the end of the stream and exits."""
        self._settle(b"")
        self.shutdown()

    def shutdown(self) -> None:
        try:
            self._server.close()
        finally:
            address = socket_address(self.name)
            if not address.startswith("\0") and os.path.exists(address):
                os.unlink(address)


def wait_for_launcher() -> None:
    """A rank's end: return once the launcher's checks passed; exit if they failed. No launcher: return."""
    name = os.environ.get(GATE_ENV)
    if not name:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gate:
        try:
            gate.connect(socket_address(name))
            answer = gate.recv(len(_GO))
        except OSError:
            answer = b""
    if answer != _GO:
        # The launcher found a problem (and reports it) or is gone: stop before anything is written.
        sys.exit(1)
