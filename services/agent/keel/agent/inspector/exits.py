"""Why a training process ended: ``classify_exit`` → ``(classification, error_type, reason)``.

Pure. Classes (``RankExited.classification``):

- ``success``: exit code 0 without a signal.
- ``infrastructure``: the machine or the fabric failed under the code: CUDA / NCCL / Gloo errors,
  ``Connection reset by peer``, process-group and store timeouts, CUDA out of memory, ``MemoryError``,
  ECC and I/O errors, ``SIGKILL`` (in practice the kernel OOM killer or a node-level kill), ``SIGBUS``.
- ``user_code``: an exception whose innermost frame is in the user's files (``user_paths``), not in
  torch or site-packages (``TypeError`` in ``train.py``), or a CUDA device-side assert (an index out
  of range in the user's model).
- ``unknown``: anything else (an exception raised inside a library without an infrastructure
  marker, a segfault, a non-zero exit without a traceback). ``stopped_by_agent`` is the agent's own
  knowledge and never comes from here.

Tracebacks are parsed properly: ``[rank3]:`` / ``[default0]:`` line prefixes are stripped, chained
exceptions ("The above exception was the direct cause…", "During handling…") are all read, and the
last exception of the last traceback decides; infrastructure markers anywhere in the chain win
(``ValueError`` raised from a caught ``NCCL error`` is still the fabric).
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

Classification = str  # "user_code" | "infrastructure" | "unknown" | "success"

_PREFIX_RE = re.compile(r"^\[(?:[A-Za-z_]*\d+|rank\d+)\]:\s?")
_FRAME_RE = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+))?\s*$')
_EXC_RE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
_CHAIN_MARKERS = ("The above exception was the direct cause", "During handling of the above exception")
_LIBRARY_RE = re.compile(r"(site-packages|dist-packages|/lib/python\d+\.\d+/|^<frozen |/torch/|^<)")

# Order matters: the first matching marker names the error. (error_type, pattern, classification)
_MARKERS: tuple[tuple[str, re.Pattern[str], str], ...] = tuple(
    (name, re.compile(pattern, re.MULTILINE | (re.IGNORECASE if ci else 0)), cls)
    for name, pattern, cls, ci in (
        ("CUDA device-side assert", r"device-side assert(ion)? triggered", "user_code", True),
        ("CUDA out of memory", r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation", "infrastructure", False),
        ("ECC error", r"\bECC error", "infrastructure", True),
        ("ProcessGroup timeout", r"Watchdog caught collective operation timeout|collective operation timeout|DistStoreError|DistNetworkError|Socket Timeout|Timed out initializing process group|ProcessGroup\w* .*timed? ?out", "infrastructure", False),
        ("NCCL error", r"NCCL error|nccl(System|Internal|UnhandledCuda|Remote|InvalidUsage)Error|NCCL communicator was aborted|DistBackendError|NCCL WARN", "infrastructure", False),
        ("Gloo connectFullMesh failed", r"connectFullMesh failed", "infrastructure", True),
        ("Connection reset by peer", r"Connection reset by peer", "infrastructure", False),
        ("Connection closed by peer", r"Connection closed by peer|Broken pipe|Connection refused", "infrastructure", False),
        ("CUDA error", r"CUDA error|CUDA driver error|cudaError\w+|CUDNN_STATUS_(INTERNAL_ERROR|EXECUTION_FAILED)|CUBLAS_STATUS_EXECUTION_FAILED", "infrastructure", False),
        ("MemoryError", r"(^|\b)MemoryError\b|ArrayMemoryError|Unable to allocate|Cannot allocate memory|\[Errno 12\]", "infrastructure", False),
        ("I/O error", r"Input/output error|Stale file handle|No space left on device|\[Errno (5|28|116)\]", "infrastructure", False),
        ("Bus error", r"^Bus error\b", "infrastructure", False),
        ("OOM killed", r"^Killed$|oom[- _]kill", "infrastructure", True),
    )
)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str = ""


@dataclass(frozen=True)
class RaisedException:
    type: str
    message: str
    frames: tuple[Frame, ...] = ()

    @property
    def innermost(self) -> Frame | None:
        return self.frames[-1] if self.frames else None


@dataclass(frozen=True)
class ParsedTraceback:
    """The last traceback in a text: its chain of exceptions, outermost cause first, final last."""

    chain: tuple[RaisedException, ...] = field(default_factory=tuple)

    @property
    def final(self) -> RaisedException | None:
        return self.chain[-1] if self.chain else None


def strip_prefixes(text: str) -> list[str]:
    return [_PREFIX_RE.sub("", line.rstrip("\r")) for line in text.splitlines()]


def parse_traceback(text: str) -> ParsedTraceback:
    """Read the last (possibly chained) Python traceback in ``text``."""
    lines = strip_prefixes(text)
    chains: list[list[RaisedException]] = []
    current: list[RaisedException] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("Traceback (most recent call last):"):
            frames: list[Frame] = []
            i += 1
            while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i].strip()):
                if m := _FRAME_RE.match(lines[i]):
                    frames.append(Frame(m["file"], int(m["line"]), (m["func"] or "").strip()))
                i += 1
            if i < len(lines) and (m := _EXC_RE.match(lines[i])):
                message = [m["msg"] or ""]
                i += 1
                while i < len(lines) and lines[i].strip() and not lines[i].startswith("Traceback (most recent call last):") \
                        and not lines[i].startswith(_CHAIN_MARKERS) and len(message) < 30:
                    message.append(lines[i])
                    i += 1
                current.append(RaisedException(m["type"], "\n".join(message).strip(), tuple(frames)))
            # where the next traceback starts decides whether it chains on this one
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            if not (j < len(lines) and lines[j].startswith(_CHAIN_MARKERS)):
                chains.append(current)
                current = []
            continue
        i += 1
    if current:
        chains.append(current)
    return ParsedTraceback(tuple(chains[-1]) if chains else ())


def _signal_name(sig: int | str | None) -> str | None:
    if sig is None or sig == "":
        return None
    if isinstance(sig, int) or str(sig).lstrip("-").isdigit():
        number = abs(int(sig))
        try:
            return _signal.Signals(number).name
        except ValueError:
            return f"SIG{number}"
    name = str(sig).upper()
    return name if name.startswith("SIG") else f"SIG{name}"


def is_user_file(path: str, user_paths: Sequence[str]) -> bool:
    """Whether a traceback frame's file is the user's code rather than Python, torch or site-packages."""
    if _LIBRARY_RE.search(path):
        return False
    if not path.startswith("/"):
        return True  # relative: run from the user's working directory (``python train.py``)
    if not user_paths:
        return True
    p = PurePosixPath(path)
    for user in user_paths:
        u = PurePosixPath(user)
        if p == u or u in p.parents:
            return True
    return False


def _marker(text: str) -> tuple[str, str, str] | None:
    for name, pattern, cls in _MARKERS:
        if m := pattern.search(text):
            return name, cls, m.group(0)
    return None


def classify_exit(
    exit_code: int | None,
    signal: int | str | None,
    stderr_tail: str,
    user_paths: Sequence[str] = (),
    *,
    oom_killed: bool = False,
) -> tuple[Classification, str, str]:
    """Classify a rank's exit. ``signal`` is a number or a name (``9``, ``"SIGKILL"``, ``"KILL"``);
    with no signal, a negative ``exit_code`` (Python's ``Popen.returncode``) or 128+N (a shell's) is
    read as signal N. ``oom_killed``: the agent saw the kernel OOM killer take this pid."""
    sig = _signal_name(signal)
    if sig is None and exit_code is not None and exit_code < 0:
        sig = _signal_name(-exit_code)
    if sig is None and exit_code is not None and 128 < exit_code <= 128 + 31 and exit_code - 128 in (6, 7, 9, 11, 15):
        sig = _signal_name(exit_code - 128)
    tail = "\n".join(strip_prefixes(stderr_tail or ""))

    if exit_code == 0 and sig is None:
        return "success", "", "exited with code 0"
    if oom_killed:
        return "infrastructure", "OOM killed", f"killed by the kernel OOM killer ({sig or f'exit code {exit_code}'})"
    if sig == "SIGKILL":
        marker = _marker(tail)
        if marker and marker[0] in ("OOM killed", "CUDA out of memory", "MemoryError"):
            return "infrastructure", marker[0], f"SIGKILL with {marker[2]!r} in stderr"
        return "infrastructure", "SIGKILL", "killed by SIGKILL: the kernel OOM killer or a node-level kill, not the code"
    if sig == "SIGBUS":
        return "infrastructure", "SIGBUS", "SIGBUS: a memory/hardware fault (bad page, shared memory gone)"

    parsed = parse_traceback(tail)
    final = parsed.final
    if final is not None:
        for exc in reversed(parsed.chain):
            marker = _marker(f"{exc.type}: {exc.message}")
            if marker:
                name, cls, text = marker
                where = f" (raised as {final.type})" if exc is not final else ""
                return cls, name, f"{exc.type}: {text!r} in the traceback{where}"
        frame = final.innermost
        if frame is None:
            return "unknown", final.type, f"{final.type} without a stack frame"
        if is_user_file(frame.file, user_paths):
            return "user_code", final.type, f"{final.type} raised in user code at {frame.file}:{frame.line} ({frame.func or 'module'}): {_short(final.message)}"
        user_frames = [f for f in final.frames if is_user_file(f.file, user_paths)]
        called_from = f", called from {user_frames[-1].file}:{user_frames[-1].line}" if user_frames else ""
        return "unknown", final.type, (f"{final.type} raised inside library code at {frame.file}:{frame.line}"
                                       f"{called_from}, without an infrastructure marker: {_short(final.message)}")
    marker = _marker(tail)
    if marker:
        name, cls, text = marker
        return cls, name, f"{text!r} in stderr ({sig or f'exit code {exit_code}'}, no Python traceback)"
    if sig is not None:
        return "unknown", sig, f"terminated by {sig} with no traceback or known error in stderr"
    return "unknown", "", f"exit code {exit_code} with no traceback or known error in stderr"


def _short(text: str, limit: int = 160) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."
