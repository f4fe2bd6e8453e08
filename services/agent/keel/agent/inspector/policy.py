"""Every threshold of the inspector, in one frozen object. Durations are ``timedelta``s.

The timeout hierarchy for ranks (a hang must not be declared during setup, compilation, checkpoints or
eval):

- ``setup``: ``setup_timeout`` (300 s). The first steps, until ``warmup_steps`` step times are known,
  also get ``setup_timeout`` (compile, allocator warm-up, NCCL init).
- ``step``: ``max(step_timeout_floor, step_timeout_factor × p<step_timeout_percentile> of the last
  calibration_window step times)`` = max(25 s, 3 × p99) by default.
- ``checkpoint``: ``checkpoint_timeout`` (600 s); ``eval``: ``eval_timeout`` (600 s).
- ``done``: never a hang.
- inside a collective (``Session.waiting``), in the ``step`` phase once ``warmup_steps`` steps are known:
  ``max(collective_timeout_floor, collective_timeout_factor × p99 of the recent per-step longest waits)``
  = max(5 s, 5 × p99) by default. Evals, checkpoints and setup wait in their own phases (their own
  timeouts), so a rank that waits for a peer's 60 s save is no hang, provided the wait is inside the phase.
- a stopped process (SIGSTOP, state ``T``) for ``stopped_timeout`` (3 s).
- heartbeat lost (no report at all): ``max(heartbeat_timeout, phase timeout)`` so a rank that holds
  the GIL while it saves does not look dead.

Hysteresis for soft signals (health signals must recover, and one blip must not evict): a soft
occurrence is tolerated ``soft_repeat_count - 1`` times within ``soft_repeat_window`` ("tolerated twice
in five minutes"); the next one fails the signal with medium confidence. Occurrences older than the
window are forgotten.
A ``failed`` soft sample marked ``fatal_if_persists`` (a NIC link down) becomes fatal once it has been
bad for ``persist_fatal_after``. A signal recovers after ``recovery_hold`` of clear samples
(``fatal_recovery_hold`` if it was fatal: a fatal XID is an event, its absence proves less).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from keel.events.units import parse_duration, parse_size

# XIDs that say the node (GPU, memory, bus, NVLink) is broken. See NVIDIA's XID catalogue.
DEFAULT_FATAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
# XIDs an application causes (bad kernel, page fault, preemption cleanup): not a node fault.
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

DEFAULT_NIC_IGNORE = r"^(lo|docker\d*|veth.*|br-.*|virbr.*|cali.*|flannel.*|cni.*|tun\d*|tap.*|kube-.*|vxlan.*|dummy.*|ifb\d*)$"


@dataclass(frozen=True)
class InspectorPolicy:
    probe_interval: timedelta = timedelta(seconds=1)

    # hysteresis
    soft_repeat_count: int = 3
    soft_repeat_window: timedelta = timedelta(minutes=5)
    persist_fatal_after: timedelta = timedelta(seconds=30)
    recovery_hold: timedelta = timedelta(seconds=30)
    fatal_recovery_hold: timedelta = timedelta(minutes=10)

    # ranks
    heartbeat_timeout: timedelta = timedelta(seconds=60)
    step_timeout_floor: timedelta = timedelta(seconds=25)
    """Below 30 s so that, with a 1 s probe interval and publishing, a hang is reported within 30 s."""
    step_timeout_factor: float = 3.0
    step_timeout_percentile: float = 99.0
    collective_timeout_floor: timedelta = timedelta(seconds=5)
    """A rank inside one collective longer than max(this, ``collective_timeout_factor`` × p99 of its
    recent per-step longest collective waits), in the ``step`` phase after warm-up, hangs."""
    collective_timeout_factor: float = 5.0
    stopped_timeout: timedelta = timedelta(seconds=3)
    """A rank whose process has been stopped (SIGSTOP: state ``T``) this long hangs."""
    warmup_steps: int = 3
    calibration_window: int = 100
    setup_timeout: timedelta = timedelta(seconds=300)
    checkpoint_timeout: timedelta = timedelta(seconds=600)
    eval_timeout: timedelta = timedelta(seconds=600)

    # GPU
    xid_fatal: frozenset[int] = DEFAULT_FATAL_XIDS
    xid_ignore: frozenset[int] = DEFAULT_IGNORED_XIDS
    """Never a node fault. Wins over ``xid_fatal``: a site can silence a default-fatal XID it finds noisy."""
    gpu_temp_degraded_c: float = 87.0
    gpu_sbe_delta_degraded: int = 10
    """New volatile single-bit ECC errors between two samples that count as one soft occurrence."""

    # host
    psi_memory_full_avg10_pct: float = 10.0
    psi_io_full_avg10_pct: float = 30.0
    psi_cpu_some_avg10_pct: float = 90.0
    load_per_cpu_degraded: float = 2.0
    disk_paths: tuple[str, ...] = ("/",)
    disk_min_free_bytes: int = 1024**3
    disk_warn_free_fraction: float = 0.05

    # NICs
    nic_ignore_pattern: str = DEFAULT_NIC_IGNORE
    peer_retransmit_limit: int = 3
    """A rank's connection to a peer this many retransmission timeouts in a row (about 1.4 s on a fast
    link: 200 ms, doubling) names that peer as unreachable (``peers.py``)."""

    def __post_init__(self) -> None:
        if self.soft_repeat_count < 1:
            raise ValueError("soft_repeat_count must be at least 1")
        if self.warmup_steps < 1:
            raise ValueError("warmup_steps must be at least 1")
        if self.peer_retransmit_limit < 1:
            raise ValueError("peer_retransmit_limit must be at least 1")
        if not self.collective_timeout_factor > 0:
            raise ValueError("collective_timeout_factor must be positive")
        if not 0 < self.step_timeout_percentile <= 100:
            raise ValueError("step_timeout_percentile must be in (0, 100]")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> InspectorPolicy:
        """Build from a config mapping: durations as ``"30s"`` text, ``*_bytes`` as ``"1GiB"`` text."""
        known = {f.name: f for f in fields(cls)}
        unknown = set(config) - set(known)
        if unknown:
            raise ValueError(f"unknown inspector policy keys: {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, value in config.items():
            default = getattr(cls, name)
            try:
                values[name] = _coerce(name, default, value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"inspector policy {name}: {exc}") from None
        return cls(**values)


def _coerce(name: str, default: Any, value: Any) -> Any:
    """A config value in the type of the field's default; text (environment variables) is parsed,
    lists may be given as comma-separated text."""
    if isinstance(default, timedelta):
        return parse_duration(value)
    if name.endswith("_bytes"):
        return parse_size(value)
    if isinstance(value, str) and isinstance(default, (frozenset, tuple)):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(default, frozenset):
        return frozenset(int(v) for v in value)
    if isinstance(default, tuple):
        return tuple(str(v) for v in value)
    if isinstance(default, bool):
        if isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"expected true or false, got {value!r}")
            return value.lower() in ("true", "1", "yes")
        return bool(value)
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value
