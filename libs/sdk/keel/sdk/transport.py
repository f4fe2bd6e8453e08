"""The rank side of the node-local channel: fire-and-forget datagrams to the node agent.

One serialized ``keel.agent.v1.RankReport`` per datagram, sent with a non-blocking ``sendto`` on an
unconnected ``AF_UNIX``/``SOCK_DGRAM`` socket. When the agent is absent (no socket file, a stale socket
file nobody reads, or a full receive buffer) the datagram is dropped and counted: training never waits
for, and never fails because of, the agent. The next report carries the full state again.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading

__all__ = ["DatagramSender"]

_log = logging.getLogger("keel.sdk")


class DatagramSender:
    """Sends datagrams to the Unix socket at ``path``. Thread-safe; ``send`` never blocks or raises
    ``OSError``. ``close`` is idempotent; sends after it are dropped."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sent = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._logged_errnos: set[int] = set()
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def send(self, payload: bytes) -> bool:
        """Send one datagram. Returns ``False`` (and counts a drop) if it could not be handed to the kernel."""
        with self._lock:
            if self._sock is None:
                self.dropped += 1
                return False
            try:
                self._sock.sendto(payload, self.path)
            except OSError as exc:
                # ENOENT: no socket file; ECONNREFUSED: a file nobody is bound to; EAGAIN: the agent's
                # receive buffer is full. All mean "agent unavailable": drop, the next report repeats it.
                self.dropped += 1
                code = exc.errno if exc.errno is not None else -1
                if code not in self._logged_errnos:
                    self._logged_errnos.add(code)
                    _log.info(
                        "keel agent socket %s unavailable (%s); dropping reports until it is back",
                        self.path,
                        errno.errorcode.get(code, str(code)),
                    )
                return False
            self.sent += 1
            return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
