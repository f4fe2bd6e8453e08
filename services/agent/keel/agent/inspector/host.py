"""Host probes: pressure stall information, OOM kills, CPU overload, free disk space.

Each reads files under ``root`` (``/`` on a real node, the overlay root of a simulated one):

- ``<root>/proc/pressure/{memory,io,cpu}`` (PSI): ``some|full avg10=… avg60=… avg300=… total=…``
- ``<root>/proc/vmstat``: the ``oom_kill`` counter; a rise between samples is an OOM kill.
- ``<root>/proc/loadavg``: the 1-minute load average against the CPU count.
- disk space: ``os.statvfs(<root>/<path>)`` for ``policy.disk_paths``, unless
  ``<root>/run/keel/disk.json`` overrides a path (fault injection ``disk-full``)::

      {"/": {"free_bytes": 0, "total_bytes": 107374182400}}

  ``total_bytes`` is optional (without it only the absolute free-space limit applies).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .observation import Observation, fatal, finish, healthy, informational
from .policy import InspectorPolicy

DISK_OVERRIDE = Path("run/keel/disk.json")


def under(root: Path, path: str | Path) -> Path:
    return Path(root) / str(path).lstrip("/")


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """``{"some": {"avg10": 1.5, …, "total": 123.0}, "full": {…}}``. Raises ``ValueError`` when malformed."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        kind, _, rest = line.partition(" ")
        if kind not in ("some", "full"):
            raise ValueError(f"unexpected PSI line {line!r}")
        values: dict[str, float] = {}
        for item in rest.split():
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"unexpected PSI field {item!r}")
            values[name] = float(value)
        if "avg10" not in values:
            raise ValueError(f"PSI line without avg10: {line!r}")
        out[kind] = values
    if "some" not in out:
        raise ValueError("PSI file without a 'some' line")
    return out


class PressureProbe:
    """PSI: memory ``full``, io ``full`` and cpu ``some`` avg10 above the policy's percentages."""

    name = "psi"

    def __init__(self, root: Path = Path("/"), policy: InspectorPolicy | None = None) -> None:
        self.root = Path(root)
        self.policy = policy or InspectorPolicy()
        self._announced = False

    def collect(self) -> list[Observation]:
        p = self.policy
        limits = {"memory": ("full", p.psi_memory_full_avg10_pct), "io": ("full", p.psi_io_full_avg10_pct),
                  "cpu": ("some", p.psi_cpu_some_avg10_pct)}
        obs: list[Observation] = []
        errors: list[str] = []
        base = under(self.root, "proc/pressure")
        if not base.is_dir():
            if self._announced:
                return []
            self._announced = True
            return [informational("host", "psi", "node", f"no pressure stall information at {base} (kernel without PSI)")]
        for resource, (kind, limit) in limits.items():
            path = base / resource
            try:
                psi = parse_psi(path.read_text())
            except (OSError, ValueError) as exc:
                errors.append(f"{path}: {exc}")
                continue
            line = psi.get(kind) or psi["some"]
            avg10 = line["avg10"]
            ev: dict[str, Any] = {"resource": resource, "kind": kind, "avg10": avg10, "avg60": line.get("avg60"), "limit_pct": limit}
            check = f"{resource}_pressure"
            if avg10 >= limit:
                obs.append(Observation("host", check, resource, "degraded", "low", False,
                                       f"{resource} pressure: {kind} avg10={avg10:g}% (limit {limit:g}%)", ev))
            else:
                obs.append(healthy("host", check, resource, **ev))
        return finish("host", "psi", obs, errors)


class OomProbe:
    """OOM kills from the ``oom_kill`` counter in ``/proc/vmstat`` (a rise since the last sample)."""

    name = "vmstat"

    def __init__(self, root: Path = Path("/"), policy: InspectorPolicy | None = None) -> None:
        self.root = Path(root)
        self.policy = policy or InspectorPolicy()
        self._last: int | None = None
        self._announced = False

    def collect(self) -> list[Observation]:
        path = under(self.root, "proc/vmstat")
        try:
            text = path.read_text()
        except OSError as exc:
            return finish("host", "vmstat", [], [f"{path}: {exc}"])
        counters: dict[str, str] = dict(line.split(None, 1) for line in text.splitlines() if len(line.split()) == 2)
        if "oom_kill" not in counters:
            if self._announced:
                return finish("host", "vmstat", [], [])
            self._announced = True
            return finish("host", "vmstat", [informational("host", "oom_kill", "vmstat", f"{path} has no oom_kill counter (kernel < 4.13)")], [])
        try:
            value = int(counters["oom_kill"])
        except ValueError:
            return finish("host", "vmstat", [], [f"{path}: oom_kill is not a number: {counters['oom_kill']!r}"])
        previous, self._last = self._last, value
        if previous is None or value <= previous:  # first sample is the baseline; a drop is a reboot
            return finish("host", "vmstat", [Observation("host", "oom_kill", "vmstat", evidence={"oom_kill": value}, new_events=0)], [])
        delta = value - previous
        return finish("host", "vmstat", [Observation(
            "host", "oom_kill", "vmstat", "degraded", "low", False,
            f"the kernel OOM killer killed {delta} process(es) since the last sample",
            {"oom_kill": value, "new_kills": delta}, new_events=delta)], [])


class LoadProbe:
    """CPU overload: the 1-minute load average per CPU above ``policy.load_per_cpu_degraded``."""

    name = "loadavg"

    def __init__(self, root: Path = Path("/"), policy: InspectorPolicy | None = None, cpu_count: int | None = None) -> None:
        self.root = Path(root)
        self.policy = policy or InspectorPolicy()
        self.cpu_count = cpu_count or len(os.sched_getaffinity(0)) or 1

    def collect(self) -> list[Observation]:
        path = under(self.root, "proc/loadavg")
        try:
            fields = path.read_text().split()
            load1, load5 = float(fields[0]), float(fields[1])
        except (OSError, ValueError, IndexError) as exc:
            return finish("host", "loadavg", [], [f"{path}: {exc or 'too few fields'}"])
        per_cpu = load1 / self.cpu_count
        ev = {"load1": load1, "load5": load5, "cpus": self.cpu_count, "load_per_cpu": round(per_cpu, 3),
              "limit_per_cpu": self.policy.load_per_cpu_degraded}
        if per_cpu > self.policy.load_per_cpu_degraded:
            obs = Observation("host", "cpu_overload", "node", "degraded", "low", False,
                              f"load {load1:g} on {self.cpu_count} CPUs ({per_cpu:.2f}/CPU, limit {self.policy.load_per_cpu_degraded:g})", ev)
        else:
            obs = healthy("host", "cpu_overload", "node", **ev)
        return finish("host", "loadavg", [obs], [])


class DiskSpaceProbe:
    """Free space on ``policy.disk_paths``: below ``disk_min_free_bytes`` is a fatal disk fault (the
    job cannot write checkpoints or logs); below ``disk_warn_free_fraction`` is degraded."""

    name = "disk"

    def __init__(self, root: Path = Path("/"), policy: InspectorPolicy | None = None) -> None:
        self.root = Path(root)
        self.policy = policy or InspectorPolicy()

    def _overrides(self, errors: list[str]) -> dict[str, dict[str, Any]]:
        path = under(self.root, DISK_OVERRIDE)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            errors.append(f"{path}: {exc}")
            return {}
        if not isinstance(data, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("free_bytes"), int) for v in data.values()
        ):
            errors.append(f"{path}: expected {{path: {{\"free_bytes\": int, \"total_bytes\": int}}}}")
            return {}
        return data

    def collect(self) -> list[Observation]:
        p = self.policy
        errors: list[str] = []
        overrides = self._overrides(errors)
        obs: list[Observation] = []
        for disk_path in p.disk_paths:
            if disk_path in overrides:
                free = int(overrides[disk_path]["free_bytes"])
                total = overrides[disk_path].get("total_bytes")
                source = str(DISK_OVERRIDE)
            else:
                target = under(self.root, disk_path)
                try:
                    st = os.statvfs(target)
                except OSError as exc:
                    errors.append(f"statvfs({target}): {exc}")
                    continue
                free, total, source = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, "statvfs"
            ev: dict[str, Any] = {"path": disk_path, "free_bytes": free, "total_bytes": total, "source": source,
                                  "min_free_bytes": p.disk_min_free_bytes}
            fraction = free / total if isinstance(total, int) and total > 0 else None
            if free < p.disk_min_free_bytes:
                obs.append(fatal("disk", "disk_full", disk_path,
                                 f"{disk_path} has {free} bytes free (minimum {p.disk_min_free_bytes})", **ev))
            elif fraction is not None and fraction < p.disk_warn_free_fraction:
                obs.append(Observation("disk", "disk_full", disk_path, "degraded", "low", False,
                                       f"{disk_path} is {100 * (1 - fraction):.1f}% full", {**ev, "free_fraction": round(fraction, 4)}))
            else:
                obs.append(healthy("disk", "disk_full", disk_path, **ev))
        return finish("disk", "disk", obs, errors)
