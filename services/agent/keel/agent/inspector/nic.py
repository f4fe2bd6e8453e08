"""NIC and InfiniBand link health from sysfs: links that go down, links that flap.

Ethernet / IPoIB (``<root>/sys/class/net/<if>/``): ``operstate`` (``up``, ``down``, ``unknown``,
``lowerlayerdown``, …), ``carrier`` (``1``/``0``; reading it fails with EINVAL on an admin-down
interface) and ``carrier_changes`` (a counter: a down+up pair is one flap).
InfiniBand (``<root>/sys/class/infiniband/<dev>/ports/<n>/``): ``state`` (``4: ACTIVE``,
``1: DOWN``, ``2: INIT``, ``3: ARMED``), ``phys_state`` (``5: LinkUp``, ``3: Disabled``,
``2: Polling``) and ``counters/link_downed`` (each increment is one flap).

Only links that were up when first seen (or named in ``interfaces``) are watched: a port without a
cable is not a fault. ``lo`` and virtual interfaces matching ``policy.nic_ignore_pattern`` are skipped.
A link that is down is a ``failed`` soft sample that becomes fatal once it persists
(``policy.persist_fatal_after``); flaps are soft occurrences (tolerated twice in five minutes).

Fault injection ``nic-down`` writes ``down`` to ``<root>/sys/class/net/<if>/operstate`` and ``0`` to
``carrier`` (and, for a flap, adds 2 to ``carrier_changes``); for IB ``1: DOWN`` to ``state``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .observation import Observation, finish, healthy, informational
from .policy import InspectorPolicy

_UP_OPERSTATES = {"up", "unknown"}  # "unknown": drivers that do not report operstate; carrier decides


def _read(path: Path) -> str:
    return path.read_text().strip()


class NicProbe:
    name = "nic"

    def __init__(self, root: Path = Path("/"), policy: InspectorPolicy | None = None,
                 interfaces: Sequence[str] | None = None) -> None:
        self.root = Path(root)
        self.policy = policy or InspectorPolicy()
        self.interfaces = set(interfaces) if interfaces is not None else None
        self._ignore = re.compile(self.policy.nic_ignore_pattern)
        self._watched: set[str] = set()
        self._unwatched: set[str] = set()
        self._last_changes: dict[str, int] = {}
        self._pending_changes: dict[str, int] = {}

    # -- helpers ------------------------------------------------------------------------------------

    def _first_sight(self, key: str, up: bool, obs: list[Observation], ev: dict[str, Any]) -> bool:
        """Whether to watch this link. Decided once: up at first sight or explicitly named."""
        if key in self._watched:
            return True
        if key in self._unwatched:
            return False
        named = self.interfaces is not None and key.split("/")[0] in self.interfaces
        if up or named:
            self._watched.add(key)
            return True
        self._unwatched.add(key)
        obs.append(informational("nic", "link", key, f"{key} was down when first seen: not watched", **ev))
        return False

    def _flaps(self, key: str, changes: int) -> int:
        """Flaps since the last sample from a change counter (down+up = one flap)."""
        previous = self._last_changes.get(key)
        self._last_changes[key] = changes
        if previous is None or changes < previous:
            return 0
        pending = self._pending_changes.get(key, 0) + (changes - previous)
        self._pending_changes[key] = pending % 2
        return pending // 2

    def _link_observations(self, key: str, up: bool, flaps: int, ev: dict[str, Any], what: str) -> list[Observation]:
        out = []
        if up:
            out.append(healthy("nic", "link_down", key, **ev))
        else:
            out.append(Observation("nic", "link_down", key, "failed", "medium", False, f"{key} link is down ({what})", ev,
                                   fatal_if_persists=True))
        if flaps:
            out.append(Observation("nic", "link_flap", key, "degraded", "low", False, f"{key} link flapped {flaps}x since the last sample",
                                   {**ev, "flaps": flaps}, new_events=flaps))
        else:
            out.append(Observation("nic", "link_flap", key, evidence=ev, new_events=0))
        return out

    # -- collection ---------------------------------------------------------------------------------

    def collect(self) -> list[Observation]:
        obs: list[Observation] = []
        errors: list[str] = []
        self._ethernet(obs, errors)
        self._infiniband(obs, errors)
        return finish("nic", "nic", obs, errors)

    def _ethernet(self, obs: list[Observation], errors: list[str]) -> None:
        base = self.root / "sys/class/net"
        try:
            names = sorted(p.name for p in base.iterdir())
        except OSError as exc:
            errors.append(f"{base}: {exc}")
            return
        for name in names:
            if self.interfaces is not None and name not in self.interfaces:
                continue
            if self.interfaces is None and self._ignore.match(name):
                continue
            path = base / name
            try:
                operstate = _read(path / "operstate")
            except OSError as exc:
                errors.append(f"{path / 'operstate'}: {exc}")
                continue
            try:
                carrier: int | None = int(_read(path / "carrier"))
            except OSError:
                carrier = None  # EINVAL while the interface is admin-down
            except ValueError as exc:
                errors.append(f"{path / 'carrier'}: {exc}")
                continue
            changes: int | None
            try:
                changes = int(_read(path / "carrier_changes"))
            except FileNotFoundError:
                changes = None
            except (OSError, ValueError) as exc:
                errors.append(f"{path / 'carrier_changes'}: {exc}")
                continue
            up = operstate in _UP_OPERSTATES and carrier == 1
            ev: dict[str, Any] = {"interface": name, "operstate": operstate, "carrier": carrier, "carrier_changes": changes}
            if not self._first_sight(name, up, obs, ev):
                continue
            flaps = self._flaps(name, changes) if changes is not None else 0
            obs.extend(self._link_observations(name, up, flaps, ev, f"operstate {operstate}, carrier {carrier}"))

    def _infiniband(self, obs: list[Observation], errors: list[str]) -> None:
        base = self.root / "sys/class/infiniband"
        if not base.is_dir():
            return
        for dev in sorted(p.name for p in base.iterdir()):
            if self.interfaces is not None and dev not in self.interfaces:
                continue
            ports = base / dev / "ports"
            try:
                port_names = sorted(p.name for p in ports.iterdir())
            except OSError as exc:
                errors.append(f"{ports}: {exc}")
                continue
            for port in port_names:
                key = f"{dev}/{port}"
                path = ports / port
                try:
                    state = _read(path / "state")
                    phys = _read(path / "phys_state")
                except OSError as exc:
                    errors.append(f"{path}: {exc}")
                    continue
                if not re.match(r"^\d+: \S", state) or not re.match(r"^\d+: \S", phys):
                    errors.append(f"{path}: unexpected state {state!r} / phys_state {phys!r}")
                    continue
                downed: int | None
                try:
                    downed = int(_read(path / "counters/link_downed"))
                except FileNotFoundError:
                    downed = None
                except (OSError, ValueError) as exc:
                    errors.append(f"{path / 'counters/link_downed'}: {exc}")
                    continue
                up = state.endswith("ACTIVE") and phys.endswith("LinkUp")
                ev: dict[str, Any] = {"device": dev, "port": port, "state": state, "phys_state": phys, "link_downed": downed}
                if not self._first_sight(key, up, obs, ev):
                    continue
                flaps = 0
                if downed is not None:
                    previous = self._last_changes.get(key)
                    self._last_changes[key] = downed
                    flaps = downed - previous if previous is not None and downed > previous else 0
                obs.extend(self._link_observations(key, up, flaps, ev, f"state {state}, phys_state {phys}"))
