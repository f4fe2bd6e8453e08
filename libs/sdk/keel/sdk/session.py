"""The Keel session: what a training loop reports to its node agent, and the injected-fault hooks.

Call order::

    session = keel.sdk.init()                 # first, before init_process_group (reads the env)
    with session.phase("setup"):
        ...                                   # init_process_group, build model, restore
    with session.phase("step"):
        for step in range(start, steps):
            loss = compute(...) * session.nan_factor()  # inside the step; 1.0 unless a nan fault fires
            ...                                          # backward
            session.corrupt(local_grads)                 # before the all-reduce; a no-op off a local cluster
            ...                                          # all-reduce, optimizer.step
            session.step_done(step, loss=..., grad_norm=..., tokens=...)   # once per step, last
            if eval_due:
                with session.phase("eval"):
                    ...
    session.done()                            # after a clean finish only

Every phase change and every ``step_done`` sends a report at once; a daemon heartbeat thread re-sends
the current state every ``KEEL_HEARTBEAT_INTERVAL`` (default ``"1s"``), so the agent sees a process
that is alive but makes no progress (stuck in a collective, or hung by an injected fault) as the same
step reported again and again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from keel.events.units import parse_duration
from keel.protocol import node_local_pb2 as pb
from keel.protocol.processes import MEMORY_CGROUP_ROOT, injected_oom_cgroup_name, memory_cgroup_path
from keel.sdk.faults import SDC_FILE_ENV, FaultFileWatcher, InjectedFault, SimulatedCorruption
from keel.sdk.transport import DatagramSender

if TYPE_CHECKING:
    from keel.sdk.checkpoint import Checkpointer

__all__ = ["PHASES", "SessionConfig", "Session", "init"]

_log = logging.getLogger("keel.sdk")

PHASES: dict[str, pb.Phase] = {
    "setup": pb.PHASE_SETUP,
    "step": pb.PHASE_STEP,
    "checkpoint": pb.PHASE_CHECKPOINT,
    "eval": pb.PHASE_EVAL,
    "done": pb.PHASE_DONE,
}
DEFAULT_HEARTBEAT_INTERVAL = timedelta(seconds=1)
OOM_CAP_BYTES = 256 * 1024**2
"""An injected ``oom`` allocates at most this much before raising ``MemoryError``."""
_OOM_CHUNK_BYTES = 16 * 1024**2
_HANG_POLL_S = 1.0
KERNEL_OOM_LIMIT_BYTES = 64 * 1024**2
"""An injected ``oom_kernel``'s cgroup limit on the rank's new allocations."""
KERNEL_OOM_CAP_BYTES = 4 * 1024**3


def groups_on_the_wire(groups: dict[str, list[int]]) -> dict[str, object]:
    """A rank's parallel groups as it reports them to its agent: a shard group equal to the DP group (FSDP2 on a
    1-D mesh, ZeRO over DP, whose DP group is often the whole world) is sent as ``"dp"``, not as a second copy of
    the list, so the report and the node's registration stay within their size limits at tens of thousands of
    ranks."""
    wire: dict[str, object] = dict(groups)
    shard = groups.get("shard") or []
    if shard and sorted(set(shard)) == sorted(set(groups.get("dp") or [])):
        wire["shard"] = "dp"
    return wire


@dataclass(frozen=True)
class SessionConfig:
    """What the node agent tells a rank through its environment (see ``from_env``)."""

    job_id: str = ""
    node_id: str = ""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    generation: int = 0
    agent_socket: str | None = None
    fault_file: str | None = None
    sdc_file: str | None = None
    heartbeat_interval: timedelta = DEFAULT_HEARTBEAT_INTERVAL

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SessionConfig:
        """Read ``KEEL_JOB_ID``, ``KEEL_NODE_ID``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
        ``KEEL_GENERATION``, ``KEEL_AGENT_SOCKET``, ``KEEL_FAULT_FILE``, ``KEEL_SIMULATED_SDC_FILE`` and
        ``KEEL_HEARTBEAT_INTERVAL``
        (a duration with a unit, e.g. ``"500ms"``). Unset means: local run, rank 0 of 1, no agent."""
        env = os.environ if env is None else env
        interval_text = env.get("KEEL_HEARTBEAT_INTERVAL")
        interval = parse_duration(interval_text) if interval_text else DEFAULT_HEARTBEAT_INTERVAL
        if interval <= timedelta(0):
            raise ValueError(f"KEEL_HEARTBEAT_INTERVAL must be positive, got {interval_text!r}")
        return cls(
            job_id=env.get("KEEL_JOB_ID", ""),
            node_id=env.get("KEEL_NODE_ID", ""),
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            generation=int(env.get("KEEL_GENERATION", "0")),
            agent_socket=env.get("KEEL_AGENT_SOCKET") or None,
            fault_file=env.get("KEEL_FAULT_FILE") or None,
            sdc_file=env.get(SDC_FILE_ENV) or None,
            heartbeat_interval=interval,
        )


class Session:
    """One training process's link to its node agent. Create with ``keel.sdk.init()``.

    Without ``agent_socket`` it reports nothing and starts no thread (a plain ``torchrun`` run), but
    still measures steps and still applies faults from ``fault_file``. Not meant to be shared between
    processes; ``step_done`` and ``phase`` are called from the training thread only.
    """

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # guards the report state below and seq
        self._seq = 0
        self._phase = pb.PHASE_SETUP
        self._step = -1
        self._step_time_s = 0.0
        self._compute_time_s = 0.0
        self._wait_s = 0.0
        # Collectives (``waiting``): read by the heartbeat thread, written by the training thread; each
        # is one attribute assignment (atomic under the GIL), so no lock is needed.
        self._collective_seq = 0
        self._collective_name = ""
        self._collective_entered_s: float | None = None  # monotonic; None: not inside a collective
        self._collective_wait_max_s = 0.0  # longest single wait of the step in progress
        self._last_step_collective_wait_max_s = 0.0
        self._loss = 0.0
        self._grad_norm = 0.0
        self._tokens_per_s = 0.0
        self._mark_s = time.monotonic()
        self._injected_sleep_s = 0.0
        self._slow_fraction = 0.0
        self._nan_at_step: int | None = None
        self._armed_hang: InjectedFault | None = None
        """A ``hang`` / ``hang_stopped`` fault that takes effect at the next collective's entrance."""
        self._pending: list[InjectedFault] = []
        self._closed = False
        self._sender = DatagramSender(config.agent_socket) if config.agent_socket else None
        self._faults = (
            FaultFileWatcher(config.fault_file, rank=config.rank, generation=config.generation) if config.fault_file else None
        )
        self._corruption = SimulatedCorruption(config.sdc_file, config.rank)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._error = ""
        self._checkpointer: Checkpointer | None = None
        self._checkpoint_step: int | None = None
        self._checkpoint_groups_json = ""
        if self._sender is not None:
            self._send_report()
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="keel-heartbeat", daemon=True)
            self._heartbeat.start()
            self._chain_excepthook()

    def _chain_excepthook(self) -> None:
        """On an uncaught exception, after the traceback is printed, tell the agent at once: a dying
        torch process can take seconds to shut its process groups down, and the agent should not
        wait for the exit to know the rank failed."""
        previous = sys.excepthook

        def report_failure(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            previous(exc_type, exc, tb)
            sys.stderr.flush()
            if self._closed or issubclass(exc_type, KeyboardInterrupt):
                return
            with self._lock:
                self._phase = pb.PHASE_FAILED
                # The traceback's tail, not just its last line: the agent classifies the exit from it when
                # the stderr it captured was cut short or muddled by output after the traceback.
                self._error = "".join(traceback.format_exception(exc_type, exc, tb))[-4000:]
            self._send_report()

        sys.excepthook = report_failure

    # -- reporting ---------------------------------------------------------------------------------

    @property
    def reports_sent(self) -> int:
        return self._sender.sent if self._sender else 0

    @property
    def reports_dropped(self) -> int:
        """Reports the agent could not take (socket missing, nobody bound, buffer full)."""
        return self._sender.dropped if self._sender else 0

    @property
    def current_phase(self) -> str:
        return pb.Phase.Name(self._phase).removeprefix("PHASE_").lower()

    @property
    def last_step(self) -> int:
        """The last step passed to ``step_done``; ``-1`` before the first."""
        return self._step

    def _send_report(self) -> None:
        if self._sender is None:
            return
        cfg = self.config
        with self._lock:
            self._seq += 1
            report = pb.RankReport(
                job_id=cfg.job_id,
                node_id=cfg.node_id,
                rank=cfg.rank,
                local_rank=cfg.local_rank,
                pid=os.getpid(),
                generation=cfg.generation,
                seq=self._seq,
                sent_at_unix_s=time.time(),
                phase=self._phase,
                step=self._step,
                step_time_s=self._step_time_s,
                compute_time_s=self._compute_time_s,
                collective_seq=self._collective_seq,
                collective_wait_s=self._current_collective_wait_s(),
                collective=self._collective_name,
                collective_wait_max_s=self._last_step_collective_wait_max_s,
                loss=self._loss,
                grad_norm=self._grad_norm,
                tokens_per_s=self._tokens_per_s,
                error=self._error,
                checkpoint_step=self._checkpoint_step,
                checkpoint_groups_json=self._checkpoint_groups_json,
                checkpoint_blocking_s=self._checkpointer.blocking_total_s if self._checkpointer is not None else 0.0,
            )
            payload = report.SerializeToString()
        self._sender.send(payload)

    def _heartbeat_loop(self) -> None:
        interval_s = self.config.heartbeat_interval.total_seconds()
        while not self._stop.wait(interval_s):  # waits without holding the GIL
            self._send_report()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Report ``name`` (``setup``, ``step``, ``checkpoint``, ``eval``) now; on exit report the phase
        that was current before. Phases nest. Entering or leaving a phase restarts the step clock, so
        the time of an eval or checkpoint is not counted as step time."""
        if name not in PHASES or name == "done":
            raise ValueError(f"unknown phase {name!r}; expected one of setup, step, checkpoint, eval")
        previous = self._phase
        self._set_phase(PHASES[name])
        try:
            yield
        finally:
            self._set_phase(previous)

    @contextmanager
    def waiting(self, name: str = "collective") -> Iterator[None]:
        """Mark a collective (all-reduce, a pipeline send or receive, a barrier) named ``name``: the time
        inside is waiting for peers, not this rank's own work.

        Two uses. Reports carry ``compute_time_s``, the step's time outside such waits: every rank of a
        synchronous job takes as long per step as the slowest, but only the slow one computes longer,
        which is how the analyzer finds a fail-slow node. And reports carry how long the rank has been
        inside the current collective (``collective_wait_s``): the agent calls a rank that waits in one
        collective far longer than its usual waits hung (seconds, not the step timeout). Do not nest."""
        started = time.monotonic()
        self._collective_seq += 1
        self._collective_name = name
        self._collective_entered_s = started
        try:
            armed = self._armed_hang
            if armed is not None and (armed.phase is None or armed.phase == self.current_phase):
                self._hang_in_collective(armed, name)
            yield
        finally:
            self._collective_entered_s = None
            waited_s = time.monotonic() - started
            self._wait_s += waited_s
            self._collective_wait_max_s = max(self._collective_wait_max_s, waited_s)

    def _current_collective_wait_s(self) -> float:
        entered = self._collective_entered_s
        return max(time.monotonic() - entered, 0.0) if entered is not None else 0.0

    def _set_phase(self, phase: pb.Phase) -> None:
        with self._lock:
            self._phase = phase
        self._mark_s = time.monotonic()
        self._injected_sleep_s = 0.0
        self._wait_s = 0.0
        self._collective_wait_max_s = 0.0
        self._send_report()

    def attach_checkpointer(self, checkpointer: Checkpointer) -> None:
        """From now on ``step_done(step)`` first calls ``checkpointer.snapshot(step)`` (a no-op if the loop
        already did), and reports carry the checkpointer's parallel groups. Called by ``Checkpointer``."""
        self._checkpointer = checkpointer
        with self._lock:
            self._checkpoint_groups_json = json.dumps(groups_on_the_wire(checkpointer.groups), sort_keys=True)

    def checkpoint_completed(self, step: int) -> None:
        """Report that the slot of ``step`` is COMPLETE; thread-safe (the checkpoint copy thread calls it)."""
        with self._lock:
            self._checkpoint_step = step
        self._send_report()

    def step_done(
        self, step: int, *, loss: float | None = None, grad_norm: float | None = None, tokens: int | None = None,
        snapshot: bool = True,
    ) -> None:
        """Record that ``step`` finished; call once per step, after ``optimizer.step``.

        With an attached ``Checkpointer``, first snapshots ``step`` (counted in the step's time), unless
        ``snapshot`` is false: the caller takes it later (an evaluation that moves the RNGs runs after it first).

        ``step_time_s`` is the time since the previous ``step_done`` or phase change (an injected
        ``slow`` fault's delay included), ``tokens_per_s`` is ``tokens / step_time_s``. ``tokens`` is what
        this rank's data-parallel replica processed in the step. Sends a report, then checks the fault
        file (one ``stat``) and applies a due fault, which may raise, block forever, or sleep.
        """
        if self._checkpointer is not None and snapshot:
            self._checkpointer.snapshot(step)
        now = time.monotonic()
        # Reported: the whole step, an injected slowdown included (that is what a slow rank looks like).
        # The slowdown itself is based on the step without it, so it does not compound.
        step_time_s = max(now - self._mark_s, 0.0)
        work_time_s = max(step_time_s - self._injected_sleep_s, 0.0)
        compute_time_s = max(step_time_s - self._wait_s, 0.0) if self._wait_s > 0 else 0.0
        self._mark_s = now
        self._injected_sleep_s = 0.0
        self._wait_s = 0.0
        self._last_step_collective_wait_max_s = self._collective_wait_max_s
        self._collective_wait_max_s = 0.0
        with self._lock:
            self._step = step
            self._step_time_s = step_time_s
            self._compute_time_s = compute_time_s
            if loss is not None:
                self._loss = float(loss)
            if grad_norm is not None:
                self._grad_norm = float(grad_norm)
            self._tokens_per_s = tokens / step_time_s if tokens and step_time_s > 0 else 0.0
        if self._nan_at_step is not None and step >= self._nan_at_step:
            self._nan_at_step = None
        self._send_report()
        self._apply_faults(step, work_time_s)

    def done(self) -> None:
        """Report ``done`` (silence after it is not a hang) and stop the heartbeat. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._phase = pb.PHASE_DONE
        self._send_report()
        self.close()

    def close(self) -> None:
        """Stop the heartbeat and close the socket without reporting ``done`` (e.g. after an error)."""
        self._closed = True
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=1.0)
        if self._sender is not None:
            self._sender.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.done()
        else:
            self.close()

    # -- injected faults ---------------------------------------------------------------------------

    def corrupt(self, local_gradients: Any) -> bool:
        """Apply this node's simulated silent data corruption (``keel inject sdc`` on a local cluster) to
        this rank's gradients, in place, before they are reduced: True when a bit was flipped. Call it
        in training and in a rung-5 replay alike (the defect is the hardware's, not the step's)."""
        return self._corruption.apply(local_gradients)

    def nan_factor(self) -> float:
        """``1.0``, or ``nan`` during the step an injected ``nan`` fault targets.

        Multiply the loss (last pipeline stage) or the stage's output activations by it inside the
        step, so that the NaN comes out of the real forward and backward passes.
        """
        if self._nan_at_step is not None and self._step + 1 >= self._nan_at_step:
            return math.nan
        return 1.0

    def _apply_faults(self, step: int, step_time_s: float) -> None:
        if self._faults is not None:
            fault = self._faults.poll()
            if fault is not None:
                _log.warning("keel fault %s (%s) received by rank %d at step %d", fault.id, fault.kind, self.config.rank, step)
                self._pending.append(fault)
        if self._pending:
            # A fault with at_step = s makes step s the first one that does not complete normally: it is
            # applied here, after step s - 1.
            due = [f for f in self._pending if f.at_step is None or step + 1 >= f.at_step]
            self._pending = [f for f in self._pending if f not in due]
            for fault in due:
                self._apply(fault, step)
        if self._slow_fraction > 0:
            delay_s = self._slow_fraction * step_time_s
            self._injected_sleep_s = delay_s
            time.sleep(delay_s)

    def _apply(self, fault: InjectedFault, step: int) -> None:
        rank = self.config.rank
        where = f"fault {fault.id} on rank {rank} after step {step}"
        if fault.kind == "crash":
            print(f"keel injected crash: {where}", file=sys.stderr, flush=True)
            raise RuntimeError(f"keel injected crash ({where})")
        if fault.kind == "oom":
            print(f"keel injected oom: {where}", file=sys.stderr, flush=True)
            _injected_oom(OOM_CAP_BYTES)
        if fault.kind in ("hang", "hang_stopped"):
            if self._collective_seq == 0:
                # The loop marks no collectives (no ``waiting``): stop here, at the step boundary.
                print(f"keel injected {fault.kind} (at the step boundary: the loop marks no collectives): {where}",
                      file=sys.stderr, flush=True)
                _stop_or_block(fault.kind)
            in_phase = f" of phase {fault.phase}" if fault.phase else ""
            print(f"keel injected {fault.kind}: {where}; the rank stops inside its next collective{in_phase}",
                  file=sys.stderr, flush=True)
            self._armed_hang = fault
        if fault.kind == "oom_kernel":
            print(f"keel injected oom_kernel: {where}; allocating under a memory cgroup limit until the kernel "
                  f"OOM killer ends this process", file=sys.stderr, flush=True)
            _injected_kernel_oom(injected_oom_cgroup_name(rank, os.getpid()))
        if fault.kind == "slow":
            self._slow_fraction = float(fault.params.get("fraction", 0.3))
            print(f"keel injected slow x{1 + self._slow_fraction:.2f}: {where}", file=sys.stderr, flush=True)
        if fault.kind == "nan":
            self._nan_at_step = step + 1
            print(f"keel injected nan into step {step + 1}: {where}", file=sys.stderr, flush=True)


    def _hang_in_collective(self, fault: InjectedFault, collective: str) -> None:
        """The armed hang takes effect: this rank has entered ``collective`` (its reports say so) and stops
        there before its contribution reaches the wire, so its peers block in the real collective waiting
        for it - what a rank whose GPU kernel, NIC or host thread stalls mid-collective looks like. ``hang``
        blocks the training thread forever (the process stays alive: the heartbeat thread keeps reporting);
        ``hang_stopped`` stops the whole process with SIGSTOP, as a frozen host or a debugger would."""
        self._armed_hang = None
        print(f"keel injected {fault.kind} inside collective {collective!r} "
              f"(#{self._collective_seq}) on rank {self.config.rank}", file=sys.stderr, flush=True)
        self._send_report()  # the agent sees the rank inside the collective from now on, not a second later
        _stop_or_block(fault.kind)


def _stop_or_block(kind: str) -> None:
    """``hang_stopped``: SIGSTOP this process (it stays stopped until SIGCONT or SIGKILL). ``hang``:
    block this thread forever in a wait that releases the GIL (the heartbeat thread goes on), in a loop
    so that py-spy shows this frame and a spurious wake-up changes nothing."""
    if kind == "hang_stopped":
        os.kill(os.getpid(), signal.SIGSTOP)
    never = threading.Event()
    while True:
        never.wait(_HANG_POLL_S)


def _injected_kernel_oom(cgroup_name: str, root: str = MEMORY_CGROUP_ROOT, limit_bytes: int = KERNEL_OOM_LIMIT_BYTES,
                        cap_bytes: int = KERNEL_OOM_CAP_BYTES) -> None:
    """Move this process into a new memory cgroup (v1 ``memory`` controller or cgroup v2) under its
    current one, limited to ``limit_bytes`` of *new* allocations (what is already charged stays with the
    parent), then allocate and touch memory until the kernel OOM killer sends SIGKILL - the kill a rank
    gets when it outgrows its container's or Slurm job step's memory limit. Raises ``RuntimeError`` with the
    reason when the cgroup cannot be made (not root, no memory controller), and ``MemoryError`` if the
    kernel has not killed the process after ``cap_bytes`` (the limit did not apply)."""
    try:
        path = _make_memory_cgroup(cgroup_name, root, limit_bytes)
    except OSError as exc:
        raise RuntimeError(f"keel injected oom_kernel cannot run here: no memory cgroup for this rank ({exc}); "
                           f"use the 'oom' fault (a Python MemoryError) instead") from None
    print(f"keel injected oom_kernel: this rank now runs in {path} (limit {limit_bytes // 1024**2} MiB)",
          file=sys.stderr, flush=True)
    hoard: list[bytearray] = []
    while len(hoard) * _OOM_CHUNK_BYTES < cap_bytes:
        hoard.append(bytearray(_OOM_CHUNK_BYTES))  # bytearray zero-fills: every page is touched
    hoard.clear()
    raise MemoryError(f"keel injected oom_kernel: allocated {cap_bytes // 1024**2} MiB under {path} and the kernel "
                      f"did not kill the process (the limit did not apply)")


def _make_memory_cgroup(name: str, root: str, limit_bytes: int) -> str:
    """Create ``name`` under this process's memory cgroup, limit it, move this process in; its path."""
    target = memory_cgroup_path(name, root)  # under this process's own memory cgroup
    os.makedirs(target, exist_ok=True)
    limit_file = "memory.max" if os.path.exists(os.path.join(target, "memory.max")) else "memory.limit_in_bytes"
    with open(os.path.join(target, limit_file), "w", encoding="utf-8") as f:
        f.write(str(limit_bytes))
    with open(os.path.join(target, "cgroup.procs"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    return target


def _injected_oom(cap_bytes: int) -> None:
    """Allocate (and touch) memory in chunks up to ``cap_bytes``, then raise ``MemoryError``."""
    hoard: list[bytearray] = []
    try:
        while len(hoard) * _OOM_CHUNK_BYTES < cap_bytes:
            hoard.append(bytearray(_OOM_CHUNK_BYTES))
    finally:
        hoard.clear()
    raise MemoryError(f"keel injected oom after allocating {cap_bytes // 1024**2} MiB")


def init(env: Mapping[str, str] | None = None) -> Session:
    """Create the process's session from the environment the agent (or torchrun) set; see
    ``SessionConfig.from_env``. Call once per process, before the training loop."""
    return Session(SessionConfig.from_env(env))
