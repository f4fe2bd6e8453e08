"""Which rank processes the kernel's OOM killer ended (adapter: ``/dev/kmsg``).

A rank that outgrows its memory limit (the node's RAM, its container's or its Slurm job step's cgroup) gets
SIGKILL from the kernel, which logs it first::

    Memory cgroup out of memory: Killed process 5866 (python3) total-vm:229608kB, anon-rss:211200kB, ...
    Out of memory: Killed process 5866 (python3) ...

A SIGKILL alone cannot tell that apart from a node-level kill (an operator, a scheduler's timeout). The
agent opens the kernel log when it starts (from its end: older kills are not this job's), and on a rank's
SIGKILL exit reads what is new and looks for that pid. Reading ``/dev/kmsg`` needs root or CAP_SYSLOG (or
``kernel.dmesg_restrict = 0``); where it cannot be read the answer is "unknown" (``None``) and the exit is
classified from the signal as before.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time

log = logging.getLogger("keel.agent")

OOM_KILL_RE = re.compile(r"[Oo]ut of memory: Killed process (\d+) \(([^)]*)\)")
"""The kernel's OOM-kill line, system-wide ("Out of memory:") or in a memory cgroup ("Memory cgroup out of memory:")."""


def oom_killed_pids(lines: list[str]) -> set[int]:
    """The pids the kernel's OOM killer killed, according to kernel log ``lines`` (pure)."""
    return {int(m.group(1)) for line in lines if (m := OOM_KILL_RE.search(line))}


class KernelOomLog:
    """Tails ``/dev/kmsg`` (non-blocking) for OOM kills from the moment it is opened."""

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self.path = path
        self.killed: set[int] = set()
        self.fd: int | None = None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError as exc:
            self.fd = None
            log.info("kernel log %s unreadable (%s): a SIGKILLed rank cannot be told apart from an OOM kill", path, exc)

    @property
    def readable(self) -> bool:
        return self.fd is not None

    def _read_new(self) -> None:
        if self.fd is None:
            return
        lines = []
        while True:
            try:
                record = os.read(self.fd, 8192)  # one record per read
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records were overwritten before we read them: go on from here
                    continue
                log.warning("reading the kernel log %s: %s", self.path, exc)
                break
            if not record:
                break
            lines.append(record.decode(errors="replace"))
        self.killed |= oom_killed_pids(lines)

    def was_oom_killed(self, pid: int, wait_s: float = 0.3) -> bool | None:
        """Whether the kernel logged an OOM kill of ``pid``; None when the kernel log cannot be read.
        Waits up to ``wait_s`` for the line (the kernel logs it as it kills, but the record may trail)."""
        if self.fd is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            self._read_new()
            if pid in self.killed:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()
