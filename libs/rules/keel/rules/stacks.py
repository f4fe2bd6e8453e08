"""py-spy evidence: parse dumps, normalise frames into stable stack signatures, dedupe, chunk for events.

Pure: no I/O, no clocks. The adapter runs ``py-spy dump --pid P --json --nonblocking`` (``--native``
pauses the process and cannot be combined with ``--nonblocking``) and hands the output here.

py-spy's JSON (0.4.x) is a list of threads::

    [{"pid", "thread_id", "thread_name", "os_thread_id", "active", "owns_gil",
      "frames": [{"name", "filename", "module", "short_filename", "line", "locals", "is_entry", ...}],
      "process_info"}]

with frames innermost FIRST. ``parse_pyspy_json`` keeps that order in ``ThreadStack.frames``; a
signature (``signature``) is outermost-first, the way a traceback reads.

A normalised frame is ``"name (short_filename:line)"`` with volatile parts replaced so that the same
code in two processes (other pids, other temporary folders, other load addresses) gives the same
string: hex addresses become ``0x?``, ``/tmp/<dir>/`` becomes ``/tmp/*/``, ``pid 123`` / ``tid=123``
become ``pid N`` / ``tid=N``, ``/proc/<pid>/`` becomes ``/proc/*/``. Native frames (line 0) carry no
line. ``keep_lines=False`` drops every line number (a coarser grouping: same functions, any line).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["rank", "dataloader", "checkpoint", "other"]
ROLES: tuple[Role, ...] = ("rank", "dataloader", "checkpoint", "other")

SIGNATURE_HASH_LEN = 12
TRUNCATION_MARKER = "<truncated>"


class StackParseError(ValueError):
    """py-spy output that is not the JSON list of threads it prints (the message says where and why)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame as py-spy reports it. ``line`` is 0 for native frames without line information."""

    name: str
    filename: str
    short_filename: str
    line: int
    module: str | None = None
    is_entry: bool = False


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """One thread of one process; ``frames`` innermost first, as py-spy prints them."""

    pid: int
    thread_id: int
    os_thread_id: int | None
    thread_name: str | None
    active: bool
    owns_gil: bool
    frames: tuple[Frame, ...]

    @property
    def is_main(self) -> bool:
        """On Linux the main thread's OS id is the process id."""
        return self.os_thread_id == self.pid

    @property
    def outermost_first(self) -> tuple[Frame, ...]:
        return self.frames[::-1]


@dataclass(frozen=True, slots=True)
class ProcessStacks:
    """One process's threads, with its place in a rank's process tree.

    ``role`` is ``"rank"`` for the rank's main (training) process, else what the child does
    (``classify_role`` guesses it from the stacks). ``rank`` is the rank the process serves.
    """

    pid: int
    role: Role
    threads: tuple[ThreadStack, ...]
    rank: int | None = None
    parent_pid: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; known: {ROLES}")


@dataclass(frozen=True, slots=True)
class MissingEvidence:
    """A process that could not be seen: py-spy failed, the process vanished, or nothing arrived.

    A rank whose main process (``role == "rank"``) is missing is never counted healthy.
    """

    rank: int
    role: Role
    pid: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class StackCount:
    """A distinct signature and who carries it (``ranks`` holds ``None`` for processes of no rank)."""

    signature: tuple[str, ...]
    hash: str
    count: int
    pids: tuple[int, ...]
    ranks: tuple[int | None, ...]


# ------------------------------------------------------------------------------------------- parsing

_THREAD_FIELDS = {"pid": int, "thread_id": int, "frames": list}
_FRAME_FIELDS = {"name": str, "filename": str, "line": int}


def _check(obj: Mapping[str, Any], fields: Mapping[str, type], where: str) -> None:
    for key, kind in fields.items():
        if key not in obj:
            raise StackParseError(f"{where}: missing {key!r}")
        value = obj[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise StackParseError(f"{where}: {key!r} must be an integer, got {value!r}")
        if kind is not int and not isinstance(value, kind):
            raise StackParseError(f"{where}: {key!r} must be a {kind.__name__}, got {type(value).__name__}")


def _opt(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        what = "an integer" if kind is int else f"a {kind.__name__}"
        raise StackParseError(f"{where}: {key!r} must be {what} or null, got {value!r}")
    return value


def parse_frame(raw: Any, where: str = "frame") -> Frame:
    """One py-spy frame object; ``short_filename`` defaults to the file's base name."""
    if not isinstance(raw, dict):
        raise StackParseError(f"{where}: expected an object, got {type(raw).__name__}")
    _check(raw, _FRAME_FIELDS, where)
    short = _opt(raw, "short_filename", str, where)
    return Frame(
        name=raw["name"],
        filename=raw["filename"],
        short_filename=short if short is not None else raw["filename"].rsplit("/", 1)[-1],
        line=raw["line"],
        module=_opt(raw, "module", str, where),
        is_entry=bool(raw.get("is_entry", False)),
    )


def parse_threads(data: Any) -> list[ThreadStack]:
    """Already-decoded py-spy JSON (a list of thread objects) to ``ThreadStack``s."""
    if not isinstance(data, list):
        raise StackParseError(f"py-spy JSON must be a list of threads, got {type(data).__name__}")
    threads = []
    for i, raw in enumerate(data):
        where = f"thread {i}"
        if not isinstance(raw, dict):
            raise StackParseError(f"{where}: expected an object, got {type(raw).__name__}")
        _check(raw, _THREAD_FIELDS, where)
        frames = tuple(parse_frame(f, f"{where} frame {j}") for j, f in enumerate(raw["frames"]))
        threads.append(ThreadStack(
            pid=raw["pid"],
            thread_id=raw["thread_id"],
            os_thread_id=_opt(raw, "os_thread_id", int, where),
            thread_name=_opt(raw, "thread_name", str, where),
            active=bool(raw.get("active", False)),
            owns_gil=bool(raw.get("owns_gil", False)),
            frames=frames,
        ))
    pids = {t.pid for t in threads}
    if len(pids) > 1:
        raise StackParseError(f"one dump must describe one process, got pids {sorted(pids)}")
    return threads


def parse_pyspy_json(text: str) -> list[ThreadStack]:
    """Parse ``py-spy dump --pid P --json`` output. Raises ``StackParseError`` saying what is wrong.

    An empty list is valid (a process with no Python thread left); its signature is empty.
    """
    if not isinstance(text, str):
        raise StackParseError(f"expected py-spy's output as text, got {type(text).__name__}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        snippet = text[:80].replace("\n", " ")
        raise StackParseError(f"not JSON ({e.msg} at line {e.lineno} column {e.colno}): {snippet!r}") from None
    return parse_threads(data)


def process_from_pyspy(
    rank: int, role: Role, pid: int, returncode: int, stdout: str, stderr: str, parent_pid: int | None = None,
) -> ProcessStacks | MissingEvidence:
    """A py-spy run's outcome as evidence: its stacks, or why there are none.

    A non-zero exit (the process vanished, permission denied, ...) gives ``MissingEvidence`` with py-spy's
    first error line; so does output that does not parse (with the parse error). Never raises for what
    py-spy printed: a broken capture must show up as missing evidence, not as a healthy process.
    """
    if returncode != 0:
        first = next((ln.strip() for ln in stderr.splitlines() if ln.strip()), "no message")
        return MissingEvidence(rank, role, pid, f"py-spy failed (exit {returncode}): {first}")
    try:
        threads = parse_pyspy_json(stdout)
    except StackParseError as e:
        return MissingEvidence(rank, role, pid, f"py-spy output unreadable: {e}")
    return ProcessStacks(pid=pid, role=role, threads=tuple(threads), rank=rank, parent_pid=parent_pid)


def main_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The main thread (OS thread id == pid), else the first thread; ``None`` for no threads."""
    for t in threads:
        if t.is_main:
            return t
    return threads[0] if threads else None


_DATALOADER_FILE = "torch/utils/data/_utils/worker.py"
_ACTIVATION_CHECKPOINT_FILE = "torch/utils/checkpoint.py"  # recomputation in the rank itself, not a helper


def _is_checkpoint_file(short_filename: str) -> bool:
    if short_filename.endswith(_ACTIVATION_CHECKPOINT_FILE):
        return False
    base = short_filename.rsplit("/", 1)[-1]
    return "torch/distributed/checkpoint/" in short_filename or "checkpoint" in base or "ckpt" in base


def classify_role(threads: Sequence[ThreadStack]) -> Role:
    """Guess a child process's role from its stacks (forked children share the parent's command line).

    ``"dataloader"`` when a frame runs torch's DataLoader worker loop (``torch/utils/data/_utils/
    worker.py``), ``"checkpoint"`` when a frame's file is checkpoint code (``torch/distributed/
    checkpoint/``, or a file named ``*checkpoint*`` / ``*ckpt*`` other than activation checkpointing's
    ``torch/utils/checkpoint.py``), else ``"other"``. Never ``"rank"``: the main process is known by pid.
    """
    files = [f.short_filename for t in threads for f in t.frames]
    if any(f.endswith(_DATALOADER_FILE) for f in files):
        return "dataloader"
    if any(_is_checkpoint_file(f) for f in files):
        return "checkpoint"
    return "other"


# ------------------------------------------------------------------------------------- normalisation

_HEX = re.compile(r"0x[0-9a-fA-F]+")
_TMP = re.compile(r"/tmp/[^/\s:()]+/")
_PROC = re.compile(r"/proc/\d+/")
_PID = re.compile(r"\b(pid|tid|ppid)([ =:_-]?)\d+", re.IGNORECASE)


def scrub(text: str) -> str:
    """Replace the volatile parts of a frame's name or file (addresses, temp dirs, pids) by placeholders."""
    if "0x" in text:
        text = _HEX.sub("0x?", text)
    if "/tmp/" in text:
        text = _TMP.sub("/tmp/*/", text)
    if "/proc/" in text:
        text = _PROC.sub("/proc/*/", text)
    if "id" in text or "ID" in text or "Id" in text:
        text = _PID.sub(r"\1\2N", text)
    return text


def normalise_frame(frame: Frame, keep_lines: bool = True) -> str:
    """``"name (short_filename:line)"``, scrubbed; no ``:line`` for native frames or ``keep_lines=False``."""
    name, where = scrub(frame.name), scrub(frame.short_filename)
    if keep_lines and frame.line > 0:
        return f"{name} ({where}:{frame.line})"
    return f"{name} ({where})"


def normalise(frames: Sequence[Frame], keep_lines: bool = True) -> tuple[str, ...]:
    """Normalise ``frames`` in the order given (py-spy's: innermost first)."""
    return tuple(normalise_frame(f, keep_lines) for f in frames)


def signature(thread: ThreadStack | None, keep_lines: bool = True) -> tuple[str, ...]:
    """A thread's stack signature: its normalised frames, OUTERMOST first. ``()`` for no thread."""
    if thread is None:
        return ()
    return normalise(thread.frames[::-1], keep_lines)


def signature_hash(sig: Sequence[str]) -> str:
    """A short stable name for a signature: sha1 of the frames joined by newlines, 12 hex characters."""
    return hashlib.sha1("\n".join(sig).encode()).hexdigest()[:SIGNATURE_HASH_LEN]


@dataclass
class Signer:
    """Computes main-thread signatures with caches, so that 16k ranks of mostly equal stacks are cheap.

    Not frozen: it only memoises pure functions (a frame's normal form, a signature's hash); results
    are the same as ``signature`` / ``signature_hash``. One per aggregation.
    """

    keep_lines: bool = True
    _frames: dict[tuple[str, str, int], str] = field(default_factory=dict, init=False, repr=False)
    _hashes: dict[tuple[str, ...], str] = field(default_factory=dict, init=False, repr=False)

    def frame(self, f: Frame) -> str:
        key = (f.name, f.short_filename, f.line)
        text = self._frames.get(key)
        if text is None:
            text = self._frames[key] = normalise_frame(f, self.keep_lines)
        return text

    def sign(self, thread: ThreadStack | None) -> tuple[tuple[str, ...], str]:
        """(signature, hash) of ``thread``."""
        if thread is None:
            sig: tuple[str, ...] = ()
        else:
            frame = self.frame
            sig = tuple([frame(f) for f in reversed(thread.frames)])
        h = self._hashes.get(sig)
        if h is None:
            h = self._hashes[sig] = signature_hash(sig)
        return sig, h

    def process(self, proc: ProcessStacks) -> tuple[tuple[str, ...], str]:
        """(signature, hash) of ``proc``'s main thread."""
        return self.sign(main_thread(proc.threads))


def dedupe(processes: Iterable[ProcessStacks], keep_lines: bool = True) -> list[StackCount]:
    """Count identical main-thread signatures, with the pids and ranks that carry each.

    Sorted by count (largest first), then by hash, so the order is deterministic.
    """
    signer = Signer(keep_lines)
    groups: dict[str, tuple[tuple[str, ...], list[int], list[int | None]]] = {}
    for proc in processes:
        sig, h = signer.process(proc)
        entry = groups.get(h)
        if entry is None:
            entry = groups[h] = (sig, [], [])
        entry[1].append(proc.pid)
        entry[2].append(proc.rank)
    counts = [StackCount(sig, h, len(pids), tuple(pids), tuple(ranks)) for h, (sig, pids, ranks) in groups.items()]
    counts.sort(key=lambda c: (-c.count, c.hash))
    return counts


# ------------------------------------------------------------------------------------------ chunking


def encoded_size(obj: Any) -> int:
    """Bytes of ``json.dumps(obj)`` with the defaults (ASCII escapes, ``", "`` / ``": "``).

    An upper bound for the compact or UTF-8 encodings of the same value, so a part that fits here fits
    there too.
    """
    return len(json.dumps(obj).encode())


def _truncate(item: dict[str, Any], keep: int) -> dict[str, Any]:
    """``item`` with every frame list cut to its innermost ``keep`` frames plus a marker frame."""

    def cut(thread: dict[str, Any]) -> dict[str, Any]:
        frames = thread.get("frames")
        if not isinstance(frames, list) or len(frames) <= keep:
            return thread
        dropped = len(frames) - keep
        marker = {"name": f"{TRUNCATION_MARKER} {dropped} outer frames dropped", "filename": "",
                  "short_filename": "", "line": 0, "module": None, "locals": None, "is_entry": True}
        return {**thread, "frames": frames[:keep] + [marker], "truncated_frames": dropped}

    if isinstance(item.get("frames"), list):
        return cut(item)
    if isinstance(item.get("threads"), list):
        return {**item, "threads": [cut(t) if isinstance(t, dict) else t for t in item["threads"]]}
    return item


def _fit(item: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """Shrink one oversized item by truncating frames (binary search on how many to keep)."""
    lists = [item["frames"]] if isinstance(item.get("frames"), list) else [
        t["frames"] for t in item.get("threads", []) if isinstance(t, dict) and isinstance(t.get("frames"), list)]
    longest = max((len(f) for f in lists), default=0)
    budget = max_bytes - 2  # the part's own brackets
    if longest == 0 or encoded_size(_truncate(item, 0)) >= budget:
        raise ValueError(
            f"an item of {encoded_size(item)} bytes cannot fit in {max_bytes} bytes even with its frames "
            f"truncated; refusing to drop it silently"
        )
    lo, hi = 0, longest  # lo always fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if encoded_size(_truncate(item, mid)) < budget:
            lo = mid
        else:
            hi = mid - 1
    return _truncate(item, lo)


def chunk(items: Sequence[dict[str, Any]], max_bytes: int = 256 * 1024) -> list[list[dict[str, Any]]]:
    """Split JSON-able dicts into consecutive parts, each ``< max_bytes`` once ``json.dumps``-ed as a list.

    Order is kept and nothing is dropped. An item too large on its own (a thread dict with ``"frames"``
    or a process dict with ``"threads"``) is copied with its frames cut to the innermost N that fit and
    a marker frame ``"<truncated> K outer frames dropped"`` (and ``"truncated_frames": K``); the input is
    not modified. Raises ``ValueError`` when even zero frames do not fit (or for ``max_bytes`` < 16).
    """
    if max_bytes < 16:
        raise ValueError(f"max_bytes {max_bytes} is too small for any part")
    parts: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    size = 2  # "[" and "]"
    for item in items:
        n = encoded_size(item)
        if n + 2 >= max_bytes:
            item = _fit(item, max_bytes)
            n = encoded_size(item)
        extra = n + (2 if current else 0)  # ", " between items
        if current and size + extra >= max_bytes:
            parts.append(current)
            current, size, extra = [], 2, n
        current.append(item)
        size += extra
    if current:
        parts.append(current)
    return parts
