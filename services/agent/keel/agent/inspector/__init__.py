"""The node side of the inspector: small probes, a pure hysteresis core, and the exit classifier.

The agent wires it like this (one loop, every ``policy.probe_interval``)::

    probes = default_probes(root, policy)             # root: "/" or the node's overlay root
    core, state = InspectorCore(node_id, policy), InspectorCore(node_id, policy).initial_state()
    ...
    observations = [o for p in probes for o in p.collect()] + rank_probe.collect(views, now)
    observations += peer_probe.collect([v.pid for v in views if v.alive])   # peers the ranks cannot reach
    state, changes = core.step(state, observations, now)   # publish each NodeHealthChanged in changes

and on a rank exit: ``classification, error_type, reason = classify_exit(code, sig, stderr_tail, user_paths)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .core import InspectorCore, InspectorState, SignalState, Verdict
from .exits import classify_exit, parse_traceback
from .gpu import GpuProbe, NvmlSnapshot, NvmlSource, NvmlUnavailable, OverlayNvmlSource, PynvmlSource, classify_xid
from .host import DiskSpaceProbe, LoadProbe, OomProbe, PressureProbe
from .kmsg import DevKmsgReader, FileKmsgReader, KernelLogProbe, parse_kmsg_line
from .nic import NicProbe
from .observation import Observation
from .peers import PeerReachProbe, StuckPeer, parse_proc_net_tcp, stuck_peers
from .policy import InspectorPolicy
from .ranks import RankProbe, RankView, phase_timeout, step_timeout


class Probe(Protocol):
    """A node probe: ``collect()`` samples once and returns observations (healthy ones included)."""

    name: str

    def collect(self) -> list[Observation]: ...


def default_probes(root: Path = Path("/"), policy: InspectorPolicy | None = None) -> list[Probe]:
    """Every node probe for ``root``. On ``/`` the real NVML and ``/dev/kmsg``; on an overlay root
    ``<root>/run/keel/nvml.json`` and ``<root>/dev/kmsg`` (a regular file)."""
    policy = policy or InspectorPolicy()
    root = Path(root)
    real = root == Path("/")
    nvml: NvmlSource = PynvmlSource() if real else OverlayNvmlSource(root)
    if real:
        try:
            kmsg = KernelLogProbe(DevKmsgReader(), policy)
        except OSError as exc:  # not root / no CAP_SYSLOG: say so once instead of pretending
            kmsg = KernelLogProbe(None, policy, unavailable_reason=f"cannot open /dev/kmsg: {exc}")
    else:
        kmsg = KernelLogProbe(FileKmsgReader(root / "dev/kmsg"), policy)
    return [GpuProbe(nvml, policy), kmsg, PressureProbe(root, policy), OomProbe(root, policy),
            LoadProbe(root, policy), DiskSpaceProbe(root, policy), NicProbe(root, policy)]


__all__ = [
    "DevKmsgReader", "DiskSpaceProbe", "FileKmsgReader", "GpuProbe", "InspectorCore", "InspectorPolicy",
    "InspectorState", "KernelLogProbe", "LoadProbe", "NicProbe", "NvmlSnapshot", "NvmlSource", "NvmlUnavailable",
    "Observation", "OomProbe", "OverlayNvmlSource", "PeerReachProbe", "PressureProbe", "Probe", "PynvmlSource", "RankProbe",
    "RankView", "SignalState", "StuckPeer", "Verdict", "classify_exit", "classify_xid", "default_probes",
    "parse_kmsg_line", "parse_proc_net_tcp", "parse_traceback", "phase_timeout", "step_timeout", "stuck_peers",
]
