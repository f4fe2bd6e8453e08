"""Injected workload faults: the fault file ``keel inject`` has the node agent write, and its parsing.

The agent writes ``$KEEL_FAULT_FILE`` (replacing it whole, e.g. write-then-rename) as JSON::

    {"id": "f-12", "kind": "crash" | "hang" | "hang_stopped" | "slow" | "nan" | "oom" | "oom_kernel",
     "rank": 3 | null,              # global rank; null = every rank of this node
     "params": {...},               # optional, per kind (below)
     "generation": 2}               # optional: only processes of this restart generation apply it

Common params: ``at_step`` (int, optional) is the first step that does not complete normally; without
it the fault takes effect at the next ``Session.step_done``. Per kind: ``slow`` takes ``fraction``
(float > 0, default 0.3: each step becomes 30 % slower); ``hang`` and ``hang_stopped`` take ``phase``
(``step``, ``eval``, ``checkpoint`` or ``setup``, optional): the rank stops inside the next collective it
enters in that phase, so where the hang lands does not depend on when the fault arrived (without it, the
next collective of any phase). The others take no params.

What each does (``keel.sdk.session``): ``crash`` raises; ``oom`` allocates up to 256 MiB and raises a
Python ``MemoryError`` (an exception, not a kill); ``oom_kernel`` moves the rank into its own memory
cgroup with a 64 MiB limit and allocates until the kernel OOM killer SIGKILLs it (root and a memory
controller needed, else it crashes saying so); ``hang`` makes the rank stop inside its next collective
(``Session.waiting``) while its peers block in the real one, alive (the heartbeat goes on);
``hang_stopped`` does the same with SIGSTOP, so the process is frozen whole; ``nan`` and ``slow`` are
numeric and timing faults.

The file is read only where fault injection is on: the agent sets ``KEEL_FAULT_FILE`` for its ranks
only when it was started with ``--keel-fault-injection`` (``keel cluster up --fault-injection``); a
plain ``torchrun`` run opts in by setting the variable itself. The file is opened without following a
symbolic link and used only when it is this user's own regular file that nobody else can write
(``keel.checkpoint.owned``); anything else is logged and ignored.

A fault id is applied at most once per process. A process started after a restart applies a fault
left in the file again unless the fault names another ``generation`` (or the agent cleared the file):
the agent should stamp ``generation`` or rewrite the file when it restarts ranks.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from keel.checkpoint.owned import UntrustedPathError, read_owned_text

__all__ = ["FAULT_KINDS", "FaultFileError", "InjectedFault", "FaultFileWatcher", "parse_fault"]

FAULT_KINDS = frozenset({"crash", "hang", "hang_stopped", "slow", "nan", "oom", "oom_kernel"})
HANG_PHASES = ("step", "eval", "checkpoint", "setup")

_log = logging.getLogger("keel.sdk")


class FaultFileError(ValueError):
    """The fault file is not valid JSON or does not describe a fault; it is ignored."""


@dataclass(frozen=True)
class InjectedFault:
    id: str
    kind: str
    rank: int | None
    params: dict[str, Any] = field(default_factory=dict)
    generation: int | None = None

    @property
    def at_step(self) -> int | None:
        value = self.params.get("at_step")
        return None if value is None else int(value)

    @property
    def phase(self) -> str | None:
        """For a hang: the phase whose next collective it stops in (None: the next collective of any)."""
        value = self.params.get("phase")
        return None if value is None else str(value)

    def targets(self, rank: int, generation: int) -> bool:
        """Whether a process of global ``rank`` in restart ``generation`` should apply this fault."""
        if self.rank is not None and self.rank != rank:
            return False
        return self.generation is None or self.generation == generation


def parse_fault(text: str) -> InjectedFault:
    """Parse the fault file's text. Raises ``FaultFileError`` with the reason; unknown kinds included."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FaultFileError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FaultFileError(f"expected a JSON object, got {type(data).__name__}")
    fault_id, kind = data.get("id"), data.get("kind")
    if not isinstance(fault_id, str) or not fault_id:
        raise FaultFileError("missing or empty string field 'id'")
    if kind not in FAULT_KINDS:
        raise FaultFileError(f"fault {fault_id}: unknown kind {kind!r} (known: {', '.join(sorted(FAULT_KINDS))})")
    rank = data.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise FaultFileError(f"fault {fault_id}: 'rank' must be a non-negative integer or null, got {rank!r}")
    params = data.get("params") or {}
    if not isinstance(params, dict):
        raise FaultFileError(f"fault {fault_id}: 'params' must be an object, got {type(params).__name__}")
    at_step = params.get("at_step")
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int)):
        raise FaultFileError(f"fault {fault_id}: params.at_step must be an integer, got {at_step!r}")
    phase = params.get("phase")
    if phase is not None and (kind not in ("hang", "hang_stopped") or phase not in HANG_PHASES):
        raise FaultFileError(f"fault {fault_id}: params.phase is for hang and hang_stopped, one of "
                             f"{', '.join(HANG_PHASES)}; got {phase!r} for {kind}")
    if kind == "slow":
        fraction = params.get("fraction", 0.3)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0:
            raise FaultFileError(f"fault {fault_id}: params.fraction must be a number > 0, got {fraction!r}")
    generation = data.get("generation")
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)):
        raise FaultFileError(f"fault {fault_id}: 'generation' must be an integer or null, got {generation!r}")
    return InjectedFault(id=fault_id, kind=kind, rank=rank, params=dict(params), generation=generation)


class FaultFileWatcher:
    """Reads the fault file only when it changed (``os.stat``: mtime, size, inode) and yields each
    fault id for this process at most once. A malformed or unknown fault is logged once and skipped."""

    def __init__(self, path: str, *, rank: int, generation: int) -> None:
        self.path = path
        self.rank = rank
        self.generation = generation
        self._last_stat: tuple[int, int, int] | None = None
        self._seen_ids: set[str] = set()

    def poll(self) -> InjectedFault | None:
        """A new fault for this process, or ``None``. Cost when nothing changed: one ``stat``."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            self._last_stat = None
            return None
        except OSError as exc:
            _log.error("keel fault file %s unreadable (%s); ignoring it", self.path, exc)
            return None
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if signature == self._last_stat:
            return None
        self._last_stat = signature
        try:
            text = read_owned_text(self.path)
        except FileNotFoundError:
            return None
        except UntrustedPathError as exc:
            _log.error("keel fault file ignored: %s", exc)
            return None
        except OSError as exc:
            _log.error("keel fault file %s unreadable (%s); ignoring it", self.path, exc)
            return None
        if not text.strip():
            return None
        try:
            fault = parse_fault(text)
        except FaultFileError as exc:
            _log.error("keel fault file %s ignored: %s", self.path, exc)
            return None
        if fault.id in self._seen_ids or not fault.targets(self.rank, self.generation):
            return None
        self._seen_ids.add(fault.id)
        return fault


SDC_FILE_ENV = "KEEL_SIMULATED_SDC_FILE"
"""Where a local cluster node's simulated silent data corruption is described (``keel inject sdc``)."""


class SimulatedCorruption:
    """A local cluster's simulated defective hardware (``keel inject sdc``): while the node's file
    ``$KEEL_SIMULATED_SDC_FILE`` exists (JSON ``{"bit": 30, "index": 0, "ranks": null}``; ``ranks``: only
    these global ranks, as for one bad GPU of a node; null: every rank of the node), every gradient this process
    computes has that bit of that element flipped, as a defective ALU would, silently and every time -
    in training and in a rung-5 replay alike. Stop-time diagnostics do not see it (they check the matmul
    path of the simulated GPUs only): that is what makes it *silent*.

    ``apply(tensor)`` flips in place (float32 or any 4-byte dtype; other dtypes are left alone) and
    returns whether it did. Costs one ``stat`` when nothing changed. A malformed file is logged once and
    treated as absent. On a real node the variable is unset and nothing is ever corrupted."""

    def __init__(self, path: str | None, rank: int = 0) -> None:
        self.path = path
        self.rank = rank
        self._signature: tuple[int, int, int] | None = None
        self._spec: tuple[int, int] | None = None
        self.flips = 0

    def _current(self) -> tuple[int, int] | None:
        if not self.path:
            return None
        try:
            st = os.lstat(self.path)
        except OSError:
            self._signature, self._spec = None, None
            return None
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if signature != self._signature:
            self._signature = signature
            try:
                data = json.loads(read_owned_text(self.path) or "{}")
                bit, index = int(data.get("bit", 30)), int(data.get("index", 0))
                if not 0 <= bit < 32 or index < 0:
                    raise ValueError(f"bit must be in 0..31 and index >= 0, got bit {bit}, index {index}")
                ranks = data.get("ranks")
                if ranks is not None and (not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks)):
                    raise ValueError(f"ranks must be a list of integers or null, got {ranks!r}")
                self._spec = (bit, index) if ranks is None or self.rank in ranks else None
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                _log.error("keel simulated SDC file %s ignored: %s", self.path, exc)
                self._spec = None
        return self._spec

    def apply(self, tensor: Any) -> bool:
        spec = self._current()
        if spec is None or tensor.numel() == 0 or tensor.element_size() != 4:
            return False
        bit, index = spec
        import torch  # only processes that train import torch; the agent never calls this

        flat = tensor.view(-1)
        word = flat[index % flat.numel()].view(torch.int32)
        word.bitwise_xor_(torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32))
        self.flips += 1
        return True
