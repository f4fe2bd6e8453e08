"""Kernel log: GPU XIDs from NVRM, hung tasks, machine checks, block-device I/O errors, the OOM killer.

Records are in ``/dev/kmsg`` format, one per line: ``<prio>,<seq>,<usec>,<flags>[,<more>];<message>``
(``6,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=…, GPU has fallen off the bus.``);
continuation lines (`` SUBSYSTEM=pci``) start with a space and are skipped. The probe remembers the
last ``seq`` and only looks at newer records.

Readers:

- ``DevKmsgReader``: the real ``/dev/kmsg``, opened non-blocking and seeked to the end at start
  (root, or ``CAP_SYSLOG`` with ``dmesg_restrict``), one record per ``read``.
- ``FileKmsgReader``: ``<root>/dev/kmsg`` as a regular, appended text file (overlay nodes, fixtures).
  Fault injection appends lines to it; a truncated file is read again from the start.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from .gpu import classify_xid, xid_name
from .observation import STATUS_RANK, Observation, finish, informational
from .policy import InspectorPolicy

_RECORD_RE = re.compile(r"^<?(\d+)>?,(\d+),(\d+),([^,;]*)(?:,[^;]*)?;(.*)$")


@dataclass(frozen=True)
class KmsgRecord:
    priority: int
    """syslog priority: facility × 8 + level."""
    seq: int
    usec: int
    flags: str
    message: str

    @property
    def level(self) -> int:
        return self.priority & 7


def parse_kmsg_line(line: str) -> KmsgRecord | None:
    """One record, ``None`` for a continuation or empty line. Raises ``ValueError`` when garbled."""
    if not line.strip() or line.startswith((" ", "\t")):
        return None
    match = _RECORD_RE.match(line.rstrip("\n"))
    if not match:
        raise ValueError(f"not a kmsg record: {line.strip()[:120]!r}")
    prio, seq, usec, flags, message = match.groups()
    return KmsgRecord(int(prio), int(seq), int(usec), flags, message)


class KmsgReader(Protocol):
    resets: int
    """Incremented when the log started over (a truncated file): sequence numbers restart."""

    def read_new(self) -> list[str]:
        """Lines appended since the last call (may include continuation lines)."""
        ...


class DevKmsgReader:
    """``/dev/kmsg``, non-blocking, from the end of the ring buffer at construction."""

    def __init__(self, path: Path = Path("/dev/kmsg")) -> None:
        self.path = Path(path)
        self.resets = 0
        self.overwritten = 0
        """How many times the reader fell behind and records were overwritten (EPIPE)."""
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self._fd, 0, os.SEEK_END)

    def read_new(self) -> list[str]:
        lines: list[str] = []
        while True:
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                return lines
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring buffer wrapped past us; the next read resyncs
                    self.overwritten += 1
                    continue
                raise
            if not chunk:
                return lines
            lines.extend(chunk.decode("utf-8", errors="replace").splitlines())

    def close(self) -> None:
        os.close(self._fd)


class FileKmsgReader:
    """A regular file of kmsg-format lines that only grows (overlay nodes, recorded fixtures)."""

    def __init__(self, path: Path, *, start_at_end: bool = False) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = ""
        self.resets = 0
        if start_at_end and self.path.exists():
            self._offset = self.path.stat().st_size

    def read_new(self) -> list[str]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:  # truncated or replaced: start over
            self._offset, self._partial = 0, ""
            self.resets += 1
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        self._offset += len(data)
        text = self._partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()  # an unterminated last line waits for its newline
        return lines


# -- classification of messages ---------------------------------------------------------------------

_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+),\s*(.*)")
_HUNG_RE = re.compile(r"INFO: task (.+):(\d+) blocked for more than (\d+) seconds")
_MCE_RE = re.compile(r"mce: \[Hardware Error\]|Machine check|Fatal machine check", re.IGNORECASE)
_MCE_CORRECTED_RE = re.compile(r"events logged|corrected", re.IGNORECASE)
_IO_RE = re.compile(r"(?:Buffer I/O error on dev|I/O error,? dev) ([\w\-]+)")
_IO_IGNORED_DEVICES = re.compile(r"^(sr\d+|fd\d+)$")  # optical and floppy drives on VMs: noise
_OOM_RE = re.compile(r"[Oo]ut of memory: Killed process (\d+) \(([^)]*)\)")  # system-wide or "Memory cgroup out of memory"


def classify_message(message: str, policy: InspectorPolicy) -> Observation | None:
    """The observation one kernel message carries, or ``None`` when it is not about health."""
    if m := _XID_RE.search(message):
        pci, xid, rest = m.group(1), int(m.group(2)), m.group(3)
        key = f"pci:{pci}"
        ev: dict[str, Any] = {"pci": pci, "xid": xid, "xid_name": xid_name(xid), "message": message[:300]}
        kind = classify_xid(xid, policy)
        if kind == "fatal":
            return Observation("gpu", "xid_kmsg", key, "failed", "high", True, f"NVRM XID {xid} on {pci}: {rest[:160]}", ev, new_events=1)
        if kind == "unknown":
            return Observation("gpu", "xid_kmsg", key, "degraded", "low", False, f"NVRM XID {xid} on {pci} (not classified as fatal)", ev, new_events=1)
        return Observation("gpu", "xid_kmsg", key, "healthy", "high", False, f"XID {xid} on {pci} ignored (application error, not a node fault)", ev, new_events=0)
    if m := _HUNG_RE.search(message):
        return Observation("kernel", "hung_task", "node", "degraded", "low", False,
                           f"kernel: task {m.group(1)}:{m.group(2)} blocked for more than {m.group(3)} s",
                           {"task": m.group(1), "pid": int(m.group(2)), "blocked_s": int(m.group(3))}, new_events=1)
    if _MCE_RE.search(message):
        if _MCE_CORRECTED_RE.search(message):
            return Observation("kernel", "machine_check_corrected", "node", "degraded", "low", False,
                               f"corrected machine check: {message[:160]}", {"message": message[:300]}, new_events=1)
        return Observation("kernel", "machine_check", "node", "failed", "high", True,
                           f"machine check: {message[:160]}", {"message": message[:300]}, new_events=1)
    if m := _IO_RE.search(message):
        dev = m.group(1)
        if _IO_IGNORED_DEVICES.match(dev):
            return None
        return Observation("disk", "io_error", dev, "failed", "high", True,
                           f"block I/O error on {dev}: {message[:160]}", {"device": dev, "message": message[:300]}, new_events=1)
    if m := _OOM_RE.search(message):
        return Observation("host", "oom_killer", "kmsg", "degraded", "low", False,
                           f"OOM killer killed {m.group(2)} (pid {m.group(1)})",
                           {"pid": int(m.group(1)), "process": m.group(2)}, new_events=1)
    return None


class KernelLogProbe:
    """Classifies new kernel records. Signals seen once get a healthy sample on later quiet reads, so
    they can recover after the hold time."""

    name = "kmsg"

    def __init__(self, reader: KmsgReader | None, policy: InspectorPolicy | None = None, *, unavailable_reason: str = "") -> None:
        self.reader = reader
        self.policy = policy or InspectorPolicy()
        self.last_seq = -1
        self._resets = 0
        self._known: dict[tuple[str, str, str], Observation] = {}
        self._unavailable_reason = unavailable_reason
        self._announced = False

    def collect(self) -> list[Observation]:
        if self.reader is None:
            if self._announced:
                return []
            self._announced = True
            return [informational("kernel", "kmsg", "node", f"kernel log not monitored: {self._unavailable_reason or 'no reader'}")]
        errors: list[str] = []
        try:
            lines = self.reader.read_new()
        except OSError as exc:
            return finish("kernel", "kmsg", [], [f"cannot read the kernel log: {exc}"])
        if self.reader.resets != self._resets:
            self._resets, self.last_seq = self.reader.resets, -1
        found: dict[tuple[str, str, str], Observation] = {}
        for line in lines:
            try:
                record = parse_kmsg_line(line)
            except ValueError as exc:
                errors.append(str(exc))
                continue
            if record is None:
                continue
            if record.seq <= self.last_seq:
                continue
            self.last_seq = record.seq
            obs = classify_message(record.message, self.policy)
            if obs is not None:
                obs = _with_seq(obs, record)
                found[obs.signal] = _merge(found.get(obs.signal), obs)
        out = list(found.values())
        for signal, previous in self._known.items():
            if signal not in found:
                out.append(Observation(previous.component, previous.check, previous.key, new_events=0))
        for obs in found.values():
            self._known.setdefault(obs.signal, obs)
        return finish("kernel", "kmsg", out, errors[:5] + ([f"... {len(errors) - 5} more"] if len(errors) > 5 else []))


def _with_seq(obs: Observation, record: KmsgRecord) -> Observation:
    return replace(obs, evidence={**obs.evidence, "seq": record.seq, "usec": record.usec})


def _merge(a: Observation | None, b: Observation) -> Observation:
    """Several records for one signal in one read: keep the most severe, count them all."""
    if a is None:
        return b
    worst = b if (STATUS_RANK[b.status], b.is_fatal) >= (STATUS_RANK[a.status], a.is_fatal) else a
    total = (a.new_events or 0) + (b.new_events or 0)
    return replace(worst, evidence={**worst.evidence, "records": total}, new_events=total)


def lines_in(records: Iterable[KmsgRecord]) -> list[str]:
    """Format records as kmsg lines (for fault injection and fixtures)."""
    return [f"{r.priority},{r.seq},{r.usec},{r.flags};{r.message}" for r in records]
