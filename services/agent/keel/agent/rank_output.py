"""Where a rank's stdout and stderr go, as torchrun's ``--redirects``, ``--tee``, ``--log-dir`` and
``--local-ranks-filter`` say (``plan_outputs``, pure), and the thread that copies them to the agent's
console (``ConsoleTail``).

torchrun's layout (``DefaultLogsSpecs``): one run folder ``<log dir>/<run id>_<random>/`` per launch,
``attempt_<restart count>/<local rank>/`` in it per attempt and rank, holding ``stdout.log`` and
``stderr.log`` for the redirected or tee'd streams and ``error.json`` (``TORCHELASTIC_ERROR_FILE``).
A stream neither redirected nor tee'd goes to the console as it is; a tee'd one to its file and to the
console, each line prefixed ``[<role><local rank>]:`` (or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``);
``--local-ranks-filter`` keeps the other ranks off the console (not out of their files).

Keel differs in one way, by design: every stream goes to a file, because the agent classifies a rank's
exit from its stderr tail and keeps the output of a restarted generation. A stream torchrun would leave
on the console goes to Keel's own file (``<agent dir>/logs/rank<R>.g<G>.stdout|stderr``) and the
agent copies its lines to its own stdout or stderr as they come (no prefix); a redirected or tee'd one
goes to torchrun's file, and Keel's name for it is a symbolic link to that file.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import IO

log = logging.getLogger(__name__)

OUT, ERR = 1, 2
"""torchrun's ``Std`` flags: 1 stdout, 2 stderr, 3 both, 0 neither."""
_VALUE = re.compile(r"^[0123]$")
_MAPPING = re.compile(r"^(\d:[0123],)*(\d:[0123])$")


class StdSpecError(ValueError):
    """A ``--redirects``/``--tee`` value torchrun would refuse."""


def parse_std(text: str) -> int | dict[int, int]:
    """``"3"`` -> 3 (every local rank); ``"0:1,1:2"`` -> {0: 1, 1: 2} (torchrun's ``Std.from_str``)."""
    if _VALUE.match(text):
        return int(text)
    if _MAPPING.match(text):
        return {int(rank): int(value) for rank, value in (item.split(":") for item in text.split(","))}
    raise StdSpecError(f"{text!r} is neither 0-3 nor LOCAL_RANK:0-3,... (e.g. 3, or 0:1,1:2)")


def per_rank(text: str, nproc: int) -> list[int]:
    """The streams of each local rank 0..nproc-1 (a mapping's missing ranks: none)."""
    value = parse_std(text)
    if isinstance(value, int):
        return [value] * nproc
    return [value.get(local_rank, 0) for local_rank in range(nproc)]


@dataclass(frozen=True)
class StreamPlan:
    path: Path
    """The file the rank writes the stream to."""
    console: str | None
    """Copy its lines to the agent's console with this prefix ("" none); None: not shown."""
    torchrun_file: bool
    """``path`` is torchrun's ``stdout.log``/``stderr.log`` (redirected or tee'd), not Keel's own file."""


@dataclass(frozen=True)
class RankOutputPlan:
    stdout: StreamPlan
    stderr: StreamPlan
    error_file: str
    """``TORCHELASTIC_ERROR_FILE`` ('' under ``--log-dir /dev/null``, as torchrun)."""


def line_prefix(role: str, rank: int, local_rank: int, template: str | None) -> str:
    if template:
        return Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
    return f"[{role}{local_rank}]:"


def plan_outputs(*, nproc: int, global_ranks: list[int], generation: int, role: str, redirects: str, tee: str,
                 local_ranks_filter: frozenset[int] | None, attempt_dir: Path | None, keel_logs: Path,
                 prefix_template: str | None = None) -> list[RankOutputPlan]:
    """Each local rank's streams (pure). ``attempt_dir``: ``<run dir>/attempt_<generation>`` (None: the
    run goes to ``/dev/null``, ``--log-dir /dev/null``)."""
    redirected, teed = per_rank(redirects, nproc), per_rank(tee, nproc)
    plans = []
    for local_rank in range(nproc):
        rank = global_ranks[local_rank]
        shown = local_ranks_filter is None or local_rank in local_ranks_filter
        prefix = line_prefix(role, rank, local_rank, prefix_template)
        streams = []
        for flag, name in ((OUT, "stdout"), (ERR, "stderr")):
            keel_file = keel_logs / f"rank{rank}.g{generation}.{name}"
            if (redirected[local_rank] | teed[local_rank]) & flag:
                path = Path(os.devnull) if attempt_dir is None else attempt_dir / str(local_rank) / f"{name}.log"
                console = prefix if teed[local_rank] & flag and shown else None
                streams.append(StreamPlan(path, console, attempt_dir is not None))
            else:
                streams.append(StreamPlan(keel_file, "" if shown else None, False))
        error_file = "" if attempt_dir is None else str(attempt_dir / str(local_rank) / "error.json")
        plans.append(RankOutputPlan(streams[0], streams[1], error_file))
    return plans


def make_run_dir(base: Path, run_id: str) -> Path:
    """torchrun's run folder: a fresh ``<base>/<run id>_<random>`` (created, 0700)."""
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{run_id}_", dir=base))


def prepare_attempt(attempt_dir: Path, nproc: int) -> None:
    """An empty ``attempt_<n>/`` with one folder per local rank (a rerun attempt starts clean, as torchrun)."""
    import shutil

    shutil.rmtree(attempt_dir, ignore_errors=True)
    for local_rank in range(nproc):
        (attempt_dir / str(local_rank)).mkdir(parents=True)


@dataclass
class _Tail:
    path: Path
    console: IO[bytes]
    prefix: bytes
    filtered: IO[bytes] | None
    needles: tuple[bytes, ...]
    start: int = 0
    handle: IO[bytes] | None = None
    partial: bytes = b""


class ConsoleTail:
    """Copies the lines written to the ranks' files after ``follow`` to the agent's stdout/stderr (a
    thread polling every ``interval_s``, as torchrun's tee does), optionally duplicating lines that
    contain a filter word into a ``filtered_*.log``. ``finish(paths)`` drains those files to their end
    and stops following them."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._tails: list[_Tail] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, path: Path, console: IO[bytes], prefix: str, filtered: IO[bytes] | None = None,
               needles: Iterable[str] = ()) -> None:
        try:
            start = path.stat().st_size  # only what is written from now on (Keel's own files are appended to)
        except OSError:
            start = 0
        with self._lock:
            self._tails.append(_Tail(path, console, prefix.encode(), filtered, tuple(n.encode() for n in needles),
                                     start))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="keel-console-tail", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.pump()

    def pump(self, final: Iterable[Path] = ()) -> None:
        """One pass over the followed files; those in ``final`` are read to their end and dropped."""
        final_paths = set(final)
        with self._lock:
            for tail in list(self._tails):
                last = tail.path in final_paths
                self._copy(tail, last)
                if last:
                    if tail.handle is not None:
                        tail.handle.close()
                    self._tails.remove(tail)

    @staticmethod
    def _copy(tail: _Tail, last: bool) -> None:
        if tail.handle is None:
            try:
                tail.handle = open(tail.path, "rb")  # noqa: SIM115 - kept open while followed
                tail.handle.seek(tail.start)
            except OSError:
                return
        data = tail.partial + tail.handle.read()
        lines = data.split(b"\n")
        tail.partial = lines.pop()
        if last and tail.partial:
            lines.append(tail.partial)
            tail.partial = b""
        if not lines:
            return
        try:
            tail.console.write(b"".join(tail.prefix + line + b"\n" for line in lines))
            tail.console.flush()
            if tail.filtered is not None:
                tail.filtered.write(b"".join(tail.prefix + line + b"\n" for line in lines
                                             if any(n in line for n in tail.needles)))
                tail.filtered.flush()
        except (OSError, ValueError) as exc:  # a closed console: the files keep everything
            log.debug("console copy of %s failed: %r", tail.path, exc)

    def finish(self, paths: Iterable[Path]) -> None:
        self.pump(final=paths)

    def close(self) -> None:
        """Drain every followed file and stop the thread."""
        with self._lock:
            paths = [t.path for t in self._tails]
        self.pump(final=paths)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        self._stop = threading.Event()
