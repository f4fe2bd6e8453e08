"""Stop-time diagnostics (rung 2 of the escalation ladder): one node's side of a round.

A round tests the hardware a crash or hang without a culprit may have come from, while the job's ranks
are stopped. Every node of the round runs it at once, with ``nproc_per_node`` local processes each:

- ``gpu_matmul``: a float32 matmul on each of the node's GPUs (TF32 off) checked against a float64 CPU
  reference; the error of each element is normalised by ``(|A| @ |B|)`` of that element and must stay
  within ``DiagnosticsPolicy.matmul_rtol``. Local process ``l`` tests GPUs ``g`` with
  ``g % nproc_per_node == l``, so every GPU of the node is tested. Without CUDA: ``skipped`` ("no GPU").
- ``intra_node_all_to_all``: ``all_to_all_single`` on gloo among the node's own processes (a node-local
  ``FileStore``, no port), every chunk verified element-wise. Note: gloo moves host memory; it tests the
  host path, not NVLink (an NCCL variant would, on machines with GPUs).
- ``inter_node_all_gather``: ``all_gather`` on one gloo world of ``len(nodes) * nproc_per_node``
  processes (rank = index of the node in the command's ``nodes`` x ``nproc_per_node`` + local rank),
  rendezvousing on a ``TCPStore`` at the job's ``master_addr``, port ``master_port + 500 + round``
  (``round_port``), hosted by global rank 0 - the first process of the first node listed (which must
  therefore be reachable at ``master_addr``: list the master node first). Each rank sends a
  deterministic tensor (``expected_chunk``); every received chunk is compared exactly (all_gather does
  no arithmetic). Bandwidth is bus bandwidth in gigabits per second: bytes each rank received / the
  fastest of ``all_gather_iterations`` timed calls (one when no ``min_bandwidth_gbps`` floor judges them:
  the figure is then informational, and every call costs the whole world's bytes); the floor fails a slow
  world. Before the process group, every rank writes ``joined/<rank>`` to the store and waits for all:
  a peer that never joins makes the check fail at the deadline naming its node (``suspects``), instead
  of hanging; a rendezvous host that never answers is named the same way. The process group's timeout is
  the time left, so a peer dying mid-collective fails the check too.

Time: the request carries one absolute deadline (the agent sets it to receipt + ``timeout_s``). Local
checks get up to half of the time left; the inter-node check the rest, minus ``result_margin_s`` to
write the result. The node process kills workers still running at the deadline (a GPU kernel that
hangs cannot be interrupted otherwise) and reports what they finished; the agent kills the node process
if even that overruns. Workers write their reports incrementally, so a hang names the check it hung in.

**Local-cluster simulation.** When the request's ``root`` is not ``/`` (a simulated node of ``keel
cluster``, whose overlay root holds the files its probes read), the round honours the simulated
hardware, as the real hardware would behave:

- a link in ``<root>/sys/class/net/<if>/`` that is down (``operstate`` not up, or ``carrier`` not 1),
  or that flapped (``carrier_changes`` at least 2 above the request's ``nic_baseline``, which the agent
  records when it starts and after every round), keeps the node's processes out of the inter-node
  all-gather: the node reports ``inter_node_all_gather`` failed naming the link (and itself as suspect);
  its peers' checks time out and name it (or, when it would have hosted the rendezvous, name it as the
  host that never answered). Intra-node and GPU checks still run.
- a simulated GPU in ``<root>/run/keel/nvml.json`` that is lost, missing, or carries a fatal XID
  (``InspectorPolicy.xid_fatal``), a double-bit ECC error or a failed row remap fails ``gpu_matmul``
  with a detail naming it, with or without CUDA.

On a real machine (root ``/``) nothing is simulated. ``keel inject nic-down --param flaps=N`` makes a
node fail the inter-node check without a rung-1 signal (a flap is a soft, low-confidence signal).

Formats: the request and every report are JSON files (pydantic models), never pickle; the local
processes are forked from the node process after it imported torch once (import takes ~3-4 s, forking
~ms), and hand their reports back as JSON files.

Run: ``python -m keel.agent.diagnostics --request REQUEST.json --result RESULT.json`` (exit 0 when a
result was written, whether or not the checks passed; 2 on a bad request). The agent launches it with
``RoundProcess``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from keel.agent.inspector.gpu import (
    NvmlReadError,
    NvmlSnapshot,
    NvmlUnavailable,
    OverlayNvmlSource,
    classify_xid,
    xid_name,
)
from keel.agent.inspector.policy import InspectorPolicy
from keel.agent.warm import ForkedProcess, Zygote, ZygoteError, kill_group
from keel.events.types import CheckResult, DiagnosticCheck

log = logging.getLogger(__name__)

CHECKS: tuple[DiagnosticCheck, ...] = ("gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather")
LOCAL_CHECKS: tuple[DiagnosticCheck, ...] = ("gpu_matmul", "intra_node_all_to_all")
"""What a standby's self-check runs: everything that needs no other node."""
ROUND_PORT_OFFSET = 500


def round_port(master_port: int, round_: int) -> int:
    """The inter-node rendezvous port of ``round_`` (rounds never share store keys; restart generations
    use ``master_port + generation``, far below)."""
    return master_port + ROUND_PORT_OFFSET + round_


# -- formats -------------------------------------------------------------------------------------------


class DiagnosticsPolicy(BaseModel):
    """How strict and how big the checks are. Defaults suit a CPU-only test machine and a real node alike."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    matmul_rtol: float = Field(default=1e-4, gt=0)
    """Largest normalised element error ``|C - R| / (|A| @ |B|)`` of the float32 matmul (float32 with K=1024
    stays near 1e-7; the worst-case rounding bound is K x 2^-24 = 6e-5)."""
    matmul_size: int = Field(default=1024, ge=16)
    all_gather_elements: int = Field(default=1 << 18, ge=1)
    """float32 elements each rank contributes (1 MiB), at most ``all_gather_max_bytes`` / world size. Gloo
    moves host memory, so this tests the host path and its figure is no fabric benchmark: 1 MiB a rank
    verifies every byte path in under a second on 2 cores (4 MiB took a second longer)."""
    all_gather_max_bytes: int = Field(default=256 << 20, ge=4)
    """Bound on each rank's gathered output (world size x its chunk), so a large world stays in memory."""
    all_gather_iterations: int = Field(default=3, ge=1)
    all_to_all_elements: int = Field(default=1 << 16, ge=1)
    """float32 elements each local process sends to each other one."""
    min_bandwidth_gbps: float | None = Field(default=None, gt=0)
    """The inter-node all-gather fails below this bus bandwidth (Gbit/s); None: no floor."""
    result_margin_s: float = Field(default=2.0, ge=0)
    """Kept free at the end of a round to merge and write the result."""
    standby_check_timeout_s: float = Field(default=60.0, gt=0)


class RoundRequest(BaseModel):
    """What one node runs: written by the agent, read by ``python -m keel.agent.diagnostics``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    round: int = Field(ge=0)
    node_id: str
    nodes: list[str] = Field(min_length=1)
    """Every node of the round, in the command's order (it fixes the global ranks)."""
    checks: list[DiagnosticCheck] = Field(min_length=1)
    nproc_per_node: int = Field(ge=1)
    master_addr: str = "127.0.0.1"
    master_port: int = Field(default=0, ge=0, le=65535)
    """The round's own rendezvous port (``round_port``), not the job's base port."""
    deadline_unix_s: float
    """Absolute wall-clock deadline (``time.time()``) for the whole round."""
    root: str = "/"
    nic_baseline: dict[str, int] | None = None
    """``carrier_changes`` per link when the agent last vetted the node (simulation only)."""
    policy: DiagnosticsPolicy = DiagnosticsPolicy()

    @model_validator(mode="after")
    def _consistent(self) -> RoundRequest:
        if self.node_id not in self.nodes:
            raise ValueError(f"node {self.node_id!r} is not in the round's nodes {self.nodes}")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"the round's nodes repeat: {self.nodes}")
        if "inter_node_all_gather" in self.checks and not self.master_port:
            raise ValueError("inter_node_all_gather needs the round's master_port")
        return self

    @property
    def node_index(self) -> int:
        return self.nodes.index(self.node_id)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_index * self.nproc_per_node + local_rank

    def node_of_rank(self, rank: int) -> str:
        return self.nodes[rank // self.nproc_per_node]

    @property
    def simulated(self) -> bool:
        return Path(self.root) != Path("/")


class WorkerReport(BaseModel):
    """One local process's results so far (rewritten after every check)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    local_rank: int = Field(ge=0)
    results: list[CheckResult] = Field(default_factory=list)
    suspects: list[str] = Field(default_factory=list)
    running: DiagnosticCheck | None = None
    """The check under way when this was written (names where a killed worker hung)."""
    finished: bool = False


class NodeReport(BaseModel):
    """One node's result of a round: what the agent turns into ``DiagnosticsCompleted``/``StandbyChecked``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_id: str
    round: int = Field(ge=0)
    passed: bool
    results: list[CheckResult] = Field(default_factory=list)
    suspects: list[str] = Field(default_factory=list)
    detail: str = ""
    duration_s: float = Field(default=0.0, ge=0)


class RequestError(ValueError):
    """A request file that cannot be run; the message says why."""


def load_request(path: Path) -> RoundRequest:
    try:
        return RoundRequest.model_validate_json(Path(path).read_bytes())
    except OSError as exc:
        raise RequestError(f"cannot read diagnostics request {path}: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise RequestError(f"invalid diagnostics request {path}: {problems}") from None


def _write_json_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- pure evaluation -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """How one received chunk differs from what its sender should have sent."""

    elements: int
    of: int
    max_abs_diff: float


def bandwidth_gbps(bytes_moved: int, seconds: float) -> float | None:
    """Gigabits per second; None when nothing was measured."""
    if bytes_moved <= 0 or seconds <= 0:
        return None
    return bytes_moved * 8 / seconds / 1e9


def ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def evaluate_matmul(gpu: str, error: float, policy: DiagnosticsPolicy, duration_s: float = 0.0) -> CheckResult:
    """The verdict on one GPU's matmul, from its normalised error (NaN or inf: failed)."""
    if math.isfinite(error) and error <= policy.matmul_rtol:
        return CheckResult(check="gpu_matmul", passed=True, duration_s=duration_s,
                           detail=f"{gpu}: matmul error {error:.2e} within {policy.matmul_rtol:.0e}")
    return CheckResult(check="gpu_matmul", passed=False, duration_s=duration_s,
                       detail=f"{gpu}: matmul error {error:.2e} exceeds {policy.matmul_rtol:.0e} "
                              f"(wrong results from the GPU)")


def evaluate_all_gather(
    request: RoundRequest,
    mismatches: Mapping[int, Mismatch],
    bytes_received: int,
    best_seconds: float,
    duration_s: float,
) -> tuple[CheckResult, list[str]]:
    """The verdict on a completed all-gather: wrong data names its senders' nodes; the bandwidth floor
    (if any) fails a slow world without naming anyone. Returns the result and the suspects."""
    bandwidth = bandwidth_gbps(bytes_received, best_seconds)
    suspects = sorted({request.node_of_rank(r) for r in mismatches})
    if mismatches:
        worst = ", ".join(f"rank {r} ({request.node_of_rank(r)}): {m.elements} of {m.of} elements differ, "
                          f"max |diff| {m.max_abs_diff:g}" for r, m in sorted(mismatches.items())[:4])
        return CheckResult(check="inter_node_all_gather", passed=False, bandwidth_gbps=bandwidth, duration_s=duration_s,
                           detail=f"wrong data from {len(mismatches)} rank(s): {worst}"), suspects
    floor = request.policy.min_bandwidth_gbps
    world = f"{request.world_size} processes on {len(request.nodes)} node(s)"
    if floor is not None and (bandwidth is None or bandwidth < floor):
        measured = "not measured" if bandwidth is None else f"{bandwidth:.2f} Gbit/s"
        return CheckResult(check="inter_node_all_gather", passed=False, bandwidth_gbps=bandwidth, duration_s=duration_s,
                           detail=f"bus bandwidth {measured} below the floor of {floor:g} Gbit/s ({world})"), []
    measured = "" if bandwidth is None else f", bus bandwidth {bandwidth:.2f} Gbit/s"
    return CheckResult(check="inter_node_all_gather", passed=True, bandwidth_gbps=bandwidth, duration_s=duration_s,
                       detail=f"all-gather verified across {world}{measured}"), []


def evaluate_all_to_all(mismatches: Mapping[int, Mismatch], local_world: int, duration_s: float) -> CheckResult:
    """The verdict on the intra-node all-to-all, from the chunks that arrived wrong (by local sender)."""
    if mismatches:
        worst = ", ".join(f"from local rank {r}: {m.elements} of {m.of} elements differ (max |diff| {m.max_abs_diff:g})"
                          for r, m in sorted(mismatches.items())[:4])
        return CheckResult(check="intra_node_all_to_all", passed=False, duration_s=duration_s,
                           detail=f"wrong data {worst}")
    return CheckResult(check="intra_node_all_to_all", passed=True, duration_s=duration_s,
                       detail=f"all-to-all verified among {local_world} local process(es)")


def missing_ranks_verdict(request: RoundRequest, missing: Sequence[int], waited_s: float,
                          duration_s: float) -> tuple[CheckResult, list[str]]:
    """Peers that never joined the inter-node rendezvous: the check fails naming their nodes."""
    nodes = sorted({request.node_of_rank(r) for r in missing})
    return (CheckResult(check="inter_node_all_gather", passed=False, duration_s=duration_s,
                        detail=f"rank(s) {ranks_text(missing)} of node(s) {', '.join(nodes)} never joined the "
                               f"all-gather rendezvous within {waited_s:.0f}s"),
            nodes)


@dataclass(frozen=True)
class LinkState:
    name: str
    operstate: str
    carrier: int | None
    carrier_changes: int | None

    @property
    def up(self) -> bool:
        return self.operstate in ("up", "unknown") and self.carrier == 1


def link_faults(links: Mapping[str, LinkState], baseline: Mapping[str, int] | None) -> list[str]:
    """Why the node's network would keep it out of the inter-node check: links down, gone (a link of
    ``baseline`` no longer there), or flapped (``carrier_changes`` at least 2 - one down and up - above
    ``baseline``; links the baseline lacks are judged only on being down)."""
    faults = []
    for name in sorted(set(links) | set(baseline or {})):
        link = links.get(name)
        if link is None:
            faults.append(f"{name} is gone")
        elif not link.up:
            faults.append(f"{name} is down (operstate {link.operstate}, carrier {link.carrier})")
        elif baseline and name in baseline and link.carrier_changes is not None and link.carrier_changes - baseline[name] >= 2:
            flaps = (link.carrier_changes - baseline[name]) // 2
            faults.append(f"{name} flapped {flaps}x (carrier_changes {baseline[name]} -> {link.carrier_changes})")
    return faults


def gpu_faults(snapshot: NvmlSnapshot, policy: InspectorPolicy | None = None) -> dict[int, str]:
    """Simulated GPUs that would fail a matmul: lost or missing, a fatal XID, uncorrectable memory."""
    policy = policy or InspectorPolicy()
    faults: dict[int, str] = {}
    present = {d.index for d in snapshot.devices}
    for index in range(max(snapshot.device_count, max(present, default=-1) + 1)):
        if index not in present and snapshot.devices:
            faults[index] = f"gpu{index} is missing (NVML sees {snapshot.device_count} device(s))"
    for dev in snapshot.devices:
        key = f"gpu{dev.index}"
        fatal_xids = [x.xid for x in dev.xids if classify_xid(x.xid, policy) == "fatal"]
        if dev.lost:
            faults[dev.index] = f"{key} is lost ({dev.error or 'GPU is lost'})"
        elif fatal_xids:
            faults[dev.index] = f"{key} had XID {fatal_xids[-1]} ({xid_name(fatal_xids[-1])})"
        elif dev.ecc and int(dev.ecc.get("volatile_dbe", 0)) > 0:
            faults[dev.index] = f"{key} has {dev.ecc['volatile_dbe']} uncorrectable ECC error(s)"
        elif dev.remapped_rows and dev.remapped_rows.get("failure"):
            faults[dev.index] = f"{key}: row remapping failed"
    return faults


def timed_iterations(policy: DiagnosticsPolicy) -> int:
    """Timed all-gathers a round runs: the best of several only matters when a bandwidth floor judges it."""
    return policy.all_gather_iterations if policy.min_bandwidth_gbps is not None else 1


def all_gather_elements(policy: DiagnosticsPolicy, world_size: int) -> int:
    """Each rank's chunk: the configured size, shrunk so the gathered output fits ``all_gather_max_bytes``."""
    return max(1, min(policy.all_gather_elements, policy.all_gather_max_bytes // (4 * max(1, world_size))))


def gpus_of(local_rank: int, nproc_per_node: int, gpu_count: int) -> list[int]:
    """The GPUs local process ``local_rank`` tests (every GPU of the node is tested by one process)."""
    return [g for g in range(gpu_count) if g % nproc_per_node == local_rank]


def merge_reports(request: RoundRequest, reports: Mapping[int, WorkerReport | None], exit_codes: Mapping[int, int | None],
                  duration_s: float) -> NodeReport:
    """The node's result from its local processes' reports. A process that left no report, or stopped
    before finishing a check, fails that check with the reason (killed at the deadline, crashed)."""
    by_check: dict[DiagnosticCheck, list[CheckResult]] = {c: [] for c in request.checks}
    suspects: set[str] = set()
    for local_rank in range(request.nproc_per_node):
        report = reports.get(local_rank)
        code = exit_codes.get(local_rank)
        done = {r.check: r for r in (report.results if report else [])}
        if report:
            suspects.update(report.suspects)
        for check in request.checks:
            if check in done:
                by_check[check].append(done[check])
                continue
            if code is None:
                why = "was still running at the deadline (killed)"
            elif code < 0:
                why = f"died of signal {signal.Signals(-code).name}"
            else:
                why = f"exited with code {code}"
            where = f" during {report.running}" if report and report.running else ""
            by_check[check].append(CheckResult(check=check, passed=False,
                                               detail=f"local process {local_rank} {why}{where} before finishing it"))
    results = []
    for check, parts in by_check.items():
        failed = [p for p in parts if not p.passed and not p.skipped]
        skipped = all(p.skipped for p in parts)
        shown = failed or ([p for p in parts if p.skipped] if skipped else [p for p in parts if not p.skipped])
        details = list(dict.fromkeys(p.detail for p in shown if p.detail))
        bandwidths = [p.bandwidth_gbps for p in parts if p.bandwidth_gbps is not None]
        results.append(CheckResult(check=check, passed=not failed and not skipped, skipped=skipped and not failed,
                                   detail="; ".join(details)[:2000], bandwidth_gbps=min(bandwidths) if bandwidths else None,
                                   duration_s=max((p.duration_s for p in parts), default=0.0)))
    failed_checks = [r for r in results if not r.passed and not r.skipped]
    if failed_checks:
        detail = "; ".join(f"{r.check} failed: {r.detail}" for r in failed_checks)
    else:
        ran = [r.check for r in results if r.passed]
        skipped_checks = [f"{r.check} skipped ({r.detail})" for r in results if r.skipped]
        detail = ", ".join(ran) + " passed" if ran else "nothing ran"
        if skipped_checks:
            detail += "; " + "; ".join(skipped_checks)
    return NodeReport(node_id=request.node_id, round=request.round, passed=not failed_checks, results=results,
                      suspects=sorted(suspects), detail=detail[:4000], duration_s=round(duration_s, 3))


def failed_report(request: RoundRequest, why: str, duration_s: float = 0.0) -> NodeReport:
    """Every check failed for one reason (the node process crashed, overran, or could not start)."""
    return NodeReport(node_id=request.node_id, round=request.round, passed=False, duration_s=round(duration_s, 3),
                      results=[CheckResult(check=c, passed=False, detail=why) for c in request.checks], detail=why)


# -- simulated hardware (I/O) ------------------------------------------------------------------------------


def read_links(root: Path, ignore_pattern: str | None = None) -> dict[str, LinkState]:
    """Ethernet/IPoIB links under ``<root>/sys/class/net`` (``lo`` and virtual ones skipped)."""
    pattern = re.compile(ignore_pattern or InspectorPolicy().nic_ignore_pattern)
    base = Path(root) / "sys/class/net"
    links = {}
    try:
        names = sorted(p.name for p in base.iterdir())
    except OSError:
        return {}
    for name in names:
        if pattern.match(name):
            continue

        def number(file: str, name: str = name) -> int | None:
            try:
                return int((base / name / file).read_text().strip())
            except (OSError, ValueError):
                return None

        try:
            operstate = (base / name / "operstate").read_text().strip()
        except OSError:
            continue
        links[name] = LinkState(name, operstate, number("carrier"), number("carrier_changes"))
    return links


def nic_baseline(root: Path) -> dict[str, int] | None:
    """What the agent records to judge flaps later: each link that is up now and its change counter.
    None on a real machine (root ``/``): nothing is simulated there."""
    if Path(root) == Path("/"):
        return None
    return {n: link.carrier_changes or 0 for n, link in read_links(root).items() if link.up}


def simulated_gpus(root: Path) -> tuple[int, dict[int, str]]:
    """The simulated GPU count and the faulty ones (by index); ``(0, {})`` without ``nvml.json``."""
    try:
        snapshot = OverlayNvmlSource(root).read()
    except NvmlUnavailable:
        return 0, {}
    except NvmlReadError as exc:
        return 1, {0: f"cannot read the simulated GPUs: {exc}"}
    return max(snapshot.device_count, len(snapshot.devices)), gpu_faults(snapshot)


# -- the checks (inside a local process; torch is imported by then) ----------------------------------------


def expected_chunk(torch: Any, tag: int, n: int) -> Any:
    """A deterministic float32 tensor, distinct per ``tag``, of integers below 2^24 (exact in float32)."""
    values = (torch.arange(n, dtype=torch.int64) * 2654435761 + tag * 40503 + 17) % 16777213
    return values.to(torch.float32)


def compare_chunk(torch: Any, received: Any, expected: Any) -> Mismatch | None:
    differ = received != expected
    count = int(differ.sum())
    if not count:
        return None
    diff = (received.double() - expected.double()).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    return Mismatch(count, int(expected.numel()), float(diff.max()))


def matmul_error(torch: Any, a64: Any, b64: Any, c: Any) -> float:
    """Largest element error of ``c`` against ``a64 @ b64``, normalised by ``|a64| @ |b64|`` (NaN: inf)."""
    reference = a64 @ b64
    scale = (a64.abs() @ b64.abs()).clamp_min(1e-300)
    error = ((c.double() - reference).abs() / scale).max()
    value = float(error)
    return value if not math.isnan(value) else math.inf


def _bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s`` (a hung CUDA call cannot be interrupted;
    the worker reports it and moves on). Raises ``TimeoutError``, or what ``fn`` raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="keel-diag-bounded", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    if thread.is_alive():
        raise TimeoutError(f"did not finish within {timeout_s:.1f}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def check_gpu_matmul(torch: Any, request: RoundRequest, local_rank: int, deadline_s: float) -> CheckResult:
    started = time.monotonic()
    policy = request.policy
    simulated_faults: dict[int, str] = {}
    cuda = torch.cuda.is_available()
    gpu_count = torch.cuda.device_count() if cuda else 0
    if request.simulated:
        count, simulated_faults = simulated_gpus(Path(request.root))
        gpu_count = count or gpu_count
    mine = gpus_of(local_rank, request.nproc_per_node, gpu_count)
    if not mine:
        why = "no GPU" if gpu_count == 0 else f"no GPU for local process {local_rank} ({gpu_count} GPU(s))"
        return CheckResult(check="gpu_matmul", passed=False, skipped=True, detail=why)
    failures = [simulated_faults[g] for g in mine if g in simulated_faults]
    if failures:
        return CheckResult(check="gpu_matmul", passed=False, duration_s=time.monotonic() - started,
                           detail="; ".join(failures) + " (simulated)")
    if not cuda:
        return CheckResult(check="gpu_matmul", passed=False, skipped=True,
                           detail=f"no GPU (CUDA unavailable; simulated {', '.join(f'gpu{g}' for g in mine)} healthy)")
    results = []
    for gpu in mine:
        device = gpu % torch.cuda.device_count()
        label = f"gpu{gpu}"

        def run(device: int = device) -> float:
            torch.backends.cuda.matmul.allow_tf32 = False
            generator = torch.Generator().manual_seed(1234 + device)
            n = policy.matmul_size
            a = torch.randn(n, n, generator=generator, dtype=torch.float32)
            b = torch.randn(n, n, generator=generator, dtype=torch.float32)
            c = (a.to(f"cuda:{device}") @ b.to(f"cuda:{device}")).cpu()
            torch.cuda.synchronize(device)
            return matmul_error(torch, a.double(), b.double(), c)

        one_started = time.monotonic()
        try:
            error = _bounded(run, deadline_s - time.monotonic())
        except TimeoutError as exc:
            results.append(CheckResult(check="gpu_matmul", passed=False, detail=f"{label}: matmul hung: {exc}",
                                       duration_s=time.monotonic() - one_started))
            break  # the device is stuck; later GPUs of this process would queue behind the hung thread
        except RuntimeError as exc:  # CUDA errors (an XID surfaces as one)
            results.append(CheckResult(check="gpu_matmul", passed=False, duration_s=time.monotonic() - one_started,
                                       detail=f"{label}: {type(exc).__name__}: {str(exc)[:300]}"))
            continue
        results.append(evaluate_matmul(label, error, policy, time.monotonic() - one_started))
    failed = [r for r in results if not r.passed]
    return CheckResult(check="gpu_matmul", passed=not failed, duration_s=time.monotonic() - started,
                       detail="; ".join(r.detail for r in (failed or results)))


def _timeout(deadline_s: float) -> timedelta:
    return timedelta(seconds=max(1.0, deadline_s - time.monotonic()))


def check_intra_node(torch: Any, request: RoundRequest, local_rank: int, store_file: Path,
                     deadline_s: float) -> tuple[CheckResult, list[str]]:
    import torch.distributed as dist

    started = time.monotonic()
    nproc = request.nproc_per_node
    n = request.policy.all_to_all_elements
    try:
        store = dist.FileStore(str(store_file), nproc)
        store.set_timeout(_timeout(deadline_s))
        dist.init_process_group("gloo", store=store, rank=local_rank, world_size=nproc, timeout=_timeout(deadline_s))
        send = torch.cat([expected_chunk(torch, local_rank * 1000 + dst, n) for dst in range(nproc)])
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send)
        chunks = received.split(n)
        mismatches = {src: m for src in range(nproc)
                      if (m := compare_chunk(torch, chunks[src], expected_chunk(torch, src * 1000 + local_rank, n)))}
        dist.destroy_process_group()
    except RuntimeError as exc:  # gloo/store errors and timeouts (DistError is a RuntimeError)
        return (CheckResult(check="intra_node_all_to_all", passed=False, duration_s=time.monotonic() - started,
                            detail=f"local process {local_rank}: {type(exc).__name__}: {_first_line(exc)}"),
                [request.node_id])
    result = evaluate_all_to_all(mismatches, nproc, time.monotonic() - started)
    return result, [] if result.passed else [request.node_id]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:400]


def check_inter_node(torch: Any, request: RoundRequest, local_rank: int, deadline_s: float) -> tuple[CheckResult, list[str]]:
    import torch.distributed as dist

    started = time.monotonic()
    if request.simulated:
        faults = link_faults(read_links(Path(request.root)), request.nic_baseline)
        if faults:
            return (CheckResult(check="inter_node_all_gather", passed=False,
                                detail=f"{'; '.join(faults)} (simulated): this node's processes do not join"),
                    [request.node_id])
    world = request.world_size
    rank = request.global_rank(local_rank)
    host = request.nodes[0]
    endpoint = f"{request.master_addr}:{request.master_port}"
    try:
        store = _connect_store(dist, request, world, rank, deadline_s)
    except RuntimeError as exc:
        who = "this node could not host it" if rank == 0 else f"hosted by {host}'s first process"
        return (CheckResult(check="inter_node_all_gather", passed=False, duration_s=time.monotonic() - started,
                            detail=f"could not reach the rendezvous at {endpoint} ({who}) within "
                                   f"{time.monotonic() - started:.0f}s: {_first_line(exc)}"),
                [] if rank == 0 else [host])
    # The connect attempts were short; every later wait (gloo's rendezvous included) may use the time left.
    store.set_timeout(_timeout(deadline_s))
    result: CheckResult
    suspects: list[str] = []
    joined_keys = [f"joined/{r}" for r in range(world)]
    try:
        store.set(f"joined/{rank}", request.node_id)
        try:
            store.wait(joined_keys, _timeout(deadline_s))
        except RuntimeError:
            missing = [r for r in range(world) if not _has_key(store, joined_keys[r])]
            if not missing:
                raise
            result, suspects = missing_ranks_verdict(request, missing, time.monotonic() - started,
                                                     time.monotonic() - started)
        else:
            result, suspects = _all_gather(torch, dist, store, request, rank, started, deadline_s)
        store.set(f"done/{rank}", "1")
        if rank == 0:  # the host keeps the store up until every rank that joined is done with it
            joined = [r for r in range(world) if _has_key(store, joined_keys[r])]
            try:
                store.wait([f"done/{r}" for r in joined], _timeout(deadline_s))
            except RuntimeError:
                pass
    except RuntimeError as exc:
        result = CheckResult(check="inter_node_all_gather", passed=False, duration_s=time.monotonic() - started,
                             detail=f"rendezvous at {endpoint} failed: {_first_line(exc)}")
    return result, suspects


CONNECT_MARGIN_S = 3.0
"""A client gives up reaching the round's host this long before the deadline: its last connect attempt may
overrun by about its own length (c10d's retry), and it must still fail the check, naming the host, and write its
report before the node kills what still runs at the deadline (1.5 s was too little on a loaded 2-core machine:
the client was killed first, and its report named nobody)."""


def _connect_store(dist: Any, request: RoundRequest, world: int, rank: int, deadline_s: float) -> Any:
    """Host (rank 0) or reach the round's ``TCPStore`` before ``deadline_s``. A client's connect overruns
    its timeout by up to about as much again (c10d retries after a random delay), so it tries in short
    attempts until the deadline: a host that comes up late is still reached, and none blocks past it."""
    if rank == 0:
        return dist.TCPStore(request.master_addr, request.master_port, world, is_master=True,
                             timeout=_timeout(deadline_s), wait_for_workers=False)
    # Wait for the host to listen with plain connects every 20 ms: a c10d client refused once backs off
    # for up to a second before it tries again, and every node starts its round at about the same time.
    while deadline_s - time.monotonic() > CONNECT_MARGIN_S:
        try:
            socket.create_connection((request.master_addr, request.master_port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.02)
    while True:
        attempt_s = min(5.0, max(0.5, (deadline_s - time.monotonic() - CONNECT_MARGIN_S) / 2.5))
        try:
            return dist.TCPStore(request.master_addr, request.master_port, world, is_master=False,
                                 timeout=timedelta(seconds=attempt_s), wait_for_workers=False)
        except RuntimeError:
            if deadline_s - time.monotonic() < CONNECT_MARGIN_S:
                raise


def _has_key(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def _all_gather(torch: Any, dist: Any, store: Any, request: RoundRequest, rank: int, started: float,
                deadline_s: float) -> tuple[CheckResult, list[str]]:
    world = request.world_size
    n = all_gather_elements(request.policy, world)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"pg{request.round}", store), rank=rank,
                                world_size=world, timeout=_timeout(deadline_s))
        mine = expected_chunk(torch, rank, n)
        warm = [torch.empty(1, dtype=torch.float32) for _ in range(world)]
        dist.all_gather(warm, expected_chunk(torch, rank, 1))  # warm-up: connections, buffers
        received = [torch.empty(n, dtype=torch.float32) for _ in range(world)]
        expected = [mine if source == rank else expected_chunk(torch, source, n) for source in range(world)]
        best = math.inf
        mismatches: dict[int, Mismatch] = {}
        for _ in range(timed_iterations(request.policy)):
            for tensor in received:
                tensor.fill_(-1.0)
            began = time.perf_counter()
            dist.all_gather(received, mine)
            best = min(best, time.perf_counter() - began)
            for source in range(world):
                mismatch = compare_chunk(torch, received[source], expected[source])
                if mismatch is not None:
                    mismatches[source] = mismatch
        dist.destroy_process_group()
    except RuntimeError as exc:
        return (CheckResult(check="inter_node_all_gather", passed=False, duration_s=time.monotonic() - started,
                            detail=f"all-gather across {world} processes failed: {type(exc).__name__}: {_first_line(exc)}"),
                [])
    bytes_received = (world - 1) * n * 4
    return evaluate_all_gather(request, mismatches, bytes_received, best, time.monotonic() - started)


def _worker(request: RoundRequest, local_rank: int, report_path: Path, store_file: Path) -> None:
    """One local process: the requested checks in order, its report rewritten after each."""
    import torch

    torch.set_num_threads(1)
    results: list[CheckResult] = []
    suspects: set[str] = set()
    round_deadline_s = time.monotonic() + (request.deadline_unix_s - time.time()) - request.policy.result_margin_s
    local_deadline_s = time.monotonic() + max(1.0, (round_deadline_s - time.monotonic()) / 2)

    def report(running: DiagnosticCheck | None, finished: bool = False) -> None:
        _write_json_atomic(report_path, WorkerReport(local_rank=local_rank, results=results, suspects=sorted(suspects),
                                                     running=running, finished=finished).model_dump_json())

    for check in [c for c in CHECKS if c in request.checks]:
        report(check)
        if check == "gpu_matmul":
            results.append(check_gpu_matmul(torch, request, local_rank, local_deadline_s))
        elif check == "intra_node_all_to_all":
            result, named = check_intra_node(torch, request, local_rank, store_file, local_deadline_s)
            results.append(result)
            suspects.update(named)
        else:
            result, named = check_inter_node(torch, request, local_rank, round_deadline_s)
            results.append(result)
            suspects.update(named)
    report(None, finished=True)


def run_round(request: RoundRequest, result_path: Path) -> NodeReport:
    """The node process: fork the local processes (after one torch import), wait for them until the
    deadline, merge their reports, write ``result_path``."""
    import multiprocessing

    import torch  # noqa: F401 - imported once here; the forked processes inherit it

    started = time.monotonic()
    work = result_path.parent / f"{result_path.stem}.workers"
    work.mkdir(parents=True, exist_ok=True)
    store_file = work / "intra.store"
    store_file.unlink(missing_ok=True)
    context = multiprocessing.get_context("fork")
    processes = {}
    for local_rank in range(request.nproc_per_node):
        path = work / f"local{local_rank}.json"
        path.unlink(missing_ok=True)
        process = context.Process(target=_worker_entry, args=(request, local_rank, path, store_file),
                                  name=f"keel-diag-{request.node_id}-{local_rank}")
        process.start()
        processes[local_rank] = process
    kill_at = time.monotonic() + (request.deadline_unix_s - time.time()) - request.policy.result_margin_s / 2
    for process in processes.values():
        process.join(max(0.0, kill_at - time.monotonic()))
    exit_codes: dict[int, int | None] = {}
    for local_rank, process in processes.items():
        if process.is_alive():
            process.kill()
            process.join(5)
            exit_codes[local_rank] = None
        else:
            exit_codes[local_rank] = process.exitcode
    reports: dict[int, WorkerReport | None] = {}
    for local_rank in processes:
        try:
            reports[local_rank] = WorkerReport.model_validate_json((work / f"local{local_rank}.json").read_bytes())
        except (OSError, ValidationError):
            reports[local_rank] = None
    node_report = merge_reports(request, reports, exit_codes, time.monotonic() - started)
    _write_json_atomic(result_path, node_report.model_dump_json(indent=1))
    return node_report


def _worker_entry(request: RoundRequest, local_rank: int, report_path: Path, store_file: Path) -> None:
    code = 0
    try:
        _worker(request, local_rank, report_path, store_file)
    except BaseException:  # noqa: BLE001 - the traceback goes to the log; the merge reports the exit
        logging.getLogger(__name__).exception("diagnostics local process %d failed", local_rank)
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown: a thread stuck in a hung CUDA call, or gloo's, must not keep it alive.
        os._exit(code)


# -- the agent's side (adapter: a subprocess per round) ----------------------------------------------------


class RoundProcess:
    """A round running as ``python -m keel.agent.diagnostics`` in its own process group.

    ``poll()`` returns the node's report once the process ended (or a failed one when it left none, or
    ran past the deadline: then it is killed). Never blocks; call it from the agent's loop.
    """

    def __init__(self, request: RoundRequest, directory: Path, *, python: str = sys.executable,
                 env: Mapping[str, str] | None = None, kill_grace_s: float = 1.0,
                 zygote: Zygote | None = None) -> None:
        """``zygote``: the node's warm zygote to fork the round from (torch imported: saves the interpreter
        start and the import); None or one not ready: a fresh process."""
        self.request = request
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.request_path = self.directory / "request.json"
        self.result_path = self.directory / "result.json"
        self.result_path.unlink(missing_ok=True)
        self.kill_grace_s = kill_grace_s
        self.started_s = time.monotonic()
        _write_json_atomic(self.request_path, request.model_dump_json(indent=1))
        environment = dict(os.environ if env is None else env)
        environment.setdefault("OMP_NUM_THREADS", "1")
        argv = ["-m", "keel.agent.diagnostics", "--request", str(self.request_path), "--result", str(self.result_path)]
        log_path = self.directory / "diagnostics.log"
        self.warm = False
        self.popen: ForkedProcess | subprocess.Popen[bytes]
        if zygote is not None and zygote.ready():
            try:
                self.popen = zygote.launch(f"round-{request.round}-{self.directory.name}", argv, environment,
                                           stdout=log_path, stderr=log_path)
                self.warm = True
            except ZygoteError as exc:
                log.warning("the zygote could not run the round (%s); starting a fresh process", exc)
        if not self.warm:
            with open(log_path, "ab") as log_file:
                self.popen = subprocess.Popen(
                    [python, *argv], env=environment, stdout=log_file, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.report: NodeReport | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> NodeReport | None:
        if self.report is not None:
            return self.report
        code = self.popen.poll()
        elapsed_s = time.monotonic() - self.started_s
        if code is None:
            if time.time() < self.request.deadline_unix_s + self.kill_grace_s:
                return None
            self.kill()
            self.report = failed_report(self.request, f"the diagnostics did not finish by the deadline "
                                        f"({elapsed_s:.0f}s after the start); killed", elapsed_s)
            return self.report
        try:
            self.report = NodeReport.model_validate_json(self.result_path.read_bytes())
        except (OSError, ValidationError) as exc:
            tail = _tail(self.directory / "diagnostics.log")
            self.report = failed_report(self.request, f"the diagnostics process exited with code {code} without a "
                                        f"result ({type(exc).__name__}); log tail: {tail}", elapsed_s)
        return self.report

    def kill(self) -> None:
        """End the round's processes (its whole process group); idempotent."""
        kill_group(self.popen, "diagnostics process")


def _tail(path: Path, chars: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return "(no log)"


# -- entry point ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keel.agent.diagnostics",
                                     description="Run one node's side of a stop-time diagnostics round.")
    parser.add_argument("--request", required=True, type=Path, help="RoundRequest JSON (written by the agent)")
    parser.add_argument("--result", required=True, type=Path, help="where to write the NodeReport JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        request = load_request(args.request)
    except RequestError as exc:
        print(f"keel diagnostics: {exc}", file=sys.stderr)
        return 2
    report = run_round(request, args.result)
    log.info("%s round %d: %s (%.1fs)", report.node_id, report.round, "passed" if report.passed else "FAILED",
             report.duration_s)
    for result in report.results:
        log.info("  %s: %s%s", result.check, "skipped" if result.skipped else "passed" if result.passed else "FAILED",
                 f" - {result.detail}" if result.detail else "")
    return 0


if __name__ == "__main__":
    code = main()
    # The result is written: skip the interpreter's teardown (torch's takes up to a second), so the agent
    # sees the exit, and reads the result, at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
