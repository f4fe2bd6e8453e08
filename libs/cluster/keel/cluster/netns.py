"""Hosts on a real network on this machine: one Linux network namespace per host, each joined by a veth
pair to one bridge, each with its own IPv4 address (``10.77.<n>.0/24``).

The *gateway* address (``<subnet>.1``) is the control-plane host: the root namespace, where PostgreSQL and the
services run (PostgreSQL on its loopback: only the control plane uses it). It sits on a veth pair of its own
whose other end is a port of the bridge, like every other host's, so the control plane's link can be cut
too (``cut(plan, CONTROL_HOST)``). ``keel up --hosts netns`` runs the three servers of a NATS cluster on three
hosts of their own (``NATS_HOSTS``), so losing any one host (the control plane's included) loses no NATS
quorum. Every host has its own loopback, so nothing between two hosts can use it: gloo, the gRPC shard
stores and NATS cross the bridge.

Planning is pure (``plan_network``, ``NetworkPlan.with_host``, the ``*_commands`` functions return ``ip``
argument lists); ``create``, ``add_host``, ``cut``, ``restore`` and ``destroy`` run them. Each network is
recorded in ``/run/keel-netns/<tag>.json`` with the process that owns it (``owner_pid``; None: kept until
``destroy``), so ``destroy_stale`` removes what a crashed test left behind. Names: namespaces
``keel-<tag>-<host>``, interfaces ``kn<tag>…`` (15 characters at most, the kernel's limit); inside a
host the link is ``eth0``.

A *link cut* (``cut``) sets the host's veth end on the bridge down: a partition. The host's processes keep
running and see their peers time out, as they would on a machine whose switch port died.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

RECORDS = Path("/run/keel-netns")
NETNS_DIR = Path("/run/netns")
CONTROL_HOST = "control"
"""The control-plane host's name for ``cut`` / ``restore``: the root namespace, on the gateway address."""
NATS_HOSTS = ("nats-1", "nats-2", "nats-3")
"""The hosts of an embedded three-server NATS cluster on a host network (``with_nats_hosts``)."""
HOST_IFNAME = "eth0"
"""The host's link, inside its namespace (ranks get ``GLOO_SOCKET_IFNAME`` = this)."""
FIRST_HOST_OCTET = 10
_CAP_NET_ADMIN = 12
_HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,15}$")


class NetnsError(RuntimeError):
    """Network namespaces cannot be used here, or an ``ip`` command failed (the message says which)."""


@dataclass(frozen=True)
class HostPlan:
    name: str
    netns: str
    veth: str
    """The pair's end on the bridge (root namespace): what ``cut`` sets down."""
    peer: str
    """The pair's other end before it moves into the namespace (renamed ``eth0`` there)."""
    address: str


@dataclass(frozen=True)
class NetworkPlan:
    tag: str
    index: int
    """The subnet's third octet: ``10.77.<index>.0/24``."""
    hosts: tuple[HostPlan, ...] = ()
    owner_pid: int | None = None

    @property
    def bridge(self) -> str:
        return f"kn{self.tag}br"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.77.{self.index}.0/24")

    @property
    def gateway(self) -> str:
        """The control-plane host's address (the root namespace, on ``control_link``)."""
        return str(self.subnet.network_address + 1)

    @property
    def control_link(self) -> str:
        """The root namespace's end of the control plane's veth pair (it holds ``gateway``)."""
        return f"kn{self.tag}c0"

    @property
    def control_port(self) -> str:
        """The control plane's veth end on the bridge: what ``cut(plan, CONTROL_HOST)`` sets down."""
        return f"kn{self.tag}c1"

    def link_of(self, name: str) -> str:
        """The bridge port of host ``name`` (``CONTROL_HOST``: the control plane's)."""
        return self.control_port if name == CONTROL_HOST else self.host(name).veth

    def addresses(self, names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        return tuple(self.host(name).address for name in names)

    def host(self, name: str) -> HostPlan:
        for host in self.hosts:
            if host.name == name:
                return host
        raise NetnsError(f"no host {name!r} in network {self.tag} (hosts: {[h.name for h in self.hosts]})")

    def with_host(self, name: str) -> NetworkPlan:
        """This plan with one more host, on the next free address and interface number."""
        if not _HOST_NAME.match(name) or name == CONTROL_HOST:
            raise NetnsError(f"host name {name!r}: lower-case letters, digits and '-', at most 16 characters")
        if any(h.name == name for h in self.hosts):
            raise NetnsError(f"network {self.tag} already has a host {name!r}")
        used = {int(h.address.rsplit(".", 1)[1]) for h in self.hosts}
        octet = next(o for o in range(FIRST_HOST_OCTET, 255) if o not in used) if len(used) < 245 else None
        if octet is None:
            raise NetnsError(f"network {self.tag} is full ({len(self.hosts)} hosts)")
        number = octet - FIRST_HOST_OCTET
        host = HostPlan(name=name, netns=f"keel-{self.tag}-{name}", veth=f"kn{self.tag}v{number}",
                        peer=f"kn{self.tag}p{number}", address=str(self.subnet.network_address + octet))
        return replace(self, hosts=(*self.hosts, host))

    def without_host(self, name: str) -> NetworkPlan:
        self.host(name)
        return replace(self, hosts=tuple(h for h in self.hosts if h.name != name))

    def to_json(self) -> dict[str, object]:
        return {"tag": self.tag, "index": self.index, "owner_pid": self.owner_pid,
                "hosts": [vars(h) for h in self.hosts]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NetworkPlan:
        return cls(tag=data["tag"], index=int(data["index"]), owner_pid=data.get("owner_pid"),
                   hosts=tuple(HostPlan(**h) for h in data.get("hosts", [])))


# -- pure planning ---------------------------------------------------------------------------------


def plan_network(tag: str, index: int, hosts: list[str] | tuple[str, ...] = (), owner_pid: int | None = None,
                 ) -> NetworkPlan:
    if not re.fullmatch(r"[0-9a-f]{5}", tag):
        raise NetnsError(f"network tag {tag!r}: five lower-case hex digits")
    if not 0 <= index <= 255:
        raise NetnsError(f"subnet index {index} out of 0..255")
    plan = NetworkPlan(tag=tag, index=index, owner_pid=owner_pid)
    for name in hosts:
        plan = plan.with_host(name)
    return plan


def free_index(used: set[int]) -> int:
    """The lowest third octet of ``10.77.x.0/24`` not in ``used``."""
    for index in range(256):
        if index not in used:
            return index
    raise NetnsError("every 10.77.x.0/24 subnet is taken by another network on this machine")


def bridge_commands(plan: NetworkPlan) -> list[list[str]]:
    # The gateway is not the bridge's own address but the root end of a veth pair on it: a link that can be cut.
    prefix = plan.subnet.prefixlen
    return [["ip", "link", "add", plan.bridge, "type", "bridge"],
            ["ip", "link", "set", plan.bridge, "up"],
            ["ip", "link", "add", plan.control_link, "type", "veth", "peer", "name", plan.control_port],
            ["ip", "addr", "add", f"{plan.gateway}/{prefix}", "dev", plan.control_link],
            ["ip", "link", "set", plan.control_port, "master", plan.bridge],
            ["ip", "link", "set", plan.control_port, "up"],
            ["ip", "link", "set", plan.control_link, "up"]]


def host_commands(plan: NetworkPlan, host: HostPlan) -> list[list[str]]:
    inside = ["ip", "-n", host.netns]
    return [["ip", "netns", "add", host.netns],
            ["ip", "link", "add", host.veth, "type", "veth", "peer", "name", host.peer],
            ["ip", "link", "set", host.peer, "netns", host.netns],
            [*inside, "link", "set", host.peer, "name", HOST_IFNAME],
            [*inside, "addr", "add", f"{host.address}/{plan.subnet.prefixlen}", "dev", HOST_IFNAME],
            [*inside, "link", "set", "lo", "up"],
            [*inside, "link", "set", HOST_IFNAME, "up"],
            ["ip", "link", "set", host.veth, "master", plan.bridge],
            ["ip", "link", "set", host.veth, "up"]]


def up_commands(plan: NetworkPlan) -> list[list[str]]:
    return [*bridge_commands(plan), *(c for host in plan.hosts for c in host_commands(plan, host))]


def host_down_commands(host: HostPlan) -> list[list[str]]:
    # Deleting the namespace deletes its end of the pair, and with it the other end.
    return [["ip", "link", "del", host.veth], ["ip", "netns", "del", host.netns]]


def down_commands(plan: NetworkPlan) -> list[list[str]]:
    return [*(c for host in plan.hosts for c in host_down_commands(host)), ["ip", "link", "del", plan.control_link],
            ["ip", "link", "del", plan.bridge]]


def cut_commands(plan: NetworkPlan, name: str) -> list[list[str]]:
    return [["ip", "link", "set", plan.link_of(name), "down"]]


def restore_commands(plan: NetworkPlan, name: str) -> list[list[str]]:
    return [["ip", "link", "set", plan.link_of(name), "up"]]


def in_host(plan: NetworkPlan, name: str, argv: list[str]) -> list[str]:
    """``argv`` run inside host ``name``'s network namespace (only the network changes: files, shared
    memory and processes stay this machine's). ``nsenter`` execs ``argv``: its pid is the process's."""
    return ["nsenter", f"--net={NETNS_DIR / plan.host(name).netns}", "--", *argv]


# -- running it ------------------------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (None: they can): not root / no CAP_NET_ADMIN, or no
    ``ip`` / ``nsenter``."""
    try:
        caps = next(int(line.split()[1], 16) for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        caps = 0
    if os.geteuid() != 0:
        return "network namespaces need root with CAP_NET_ADMIN (this process does not run as root)"
    if not caps >> _CAP_NET_ADMIN & 1:
        return "network namespaces need CAP_NET_ADMIN (this process runs as root without it: a container without it?)"
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"network namespaces need {' and '.join(missing)} (iproute2, util-linux), not found on PATH"
    return None


def _run(commands: list[list[str]], *, check: bool = True) -> None:
    for argv in commands:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if result.returncode and check:
            raise NetnsError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.returncode}")


def _record(plan: NetworkPlan) -> None:
    RECORDS.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = RECORDS / f".{plan.tag}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(plan.to_json(), indent=1))
    tmp.chmod(0o600)
    os.replace(tmp, RECORDS / f"{plan.tag}.json")


def recorded() -> list[NetworkPlan]:
    plans = []
    for path in sorted(RECORDS.glob("*.json")) if RECORDS.is_dir() else []:
        try:
            plans.append(NetworkPlan.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return plans


def _used_indices() -> set[int]:
    used = {plan.index for plan in recorded()}
    result = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=30)
    used |= {int(m) for m in re.findall(r"inet 10\.77\.(\d+)\.", result.stdout)}
    return used


def require_available() -> None:
    reason = unavailable_reason()
    if reason:
        raise NetnsError(reason)


def create(hosts: list[str] | tuple[str, ...] = (), *, owner_pid: int | None = None) -> NetworkPlan:
    """Make a bridge and ``hosts`` (each a namespace with its address), recorded first so that a failure
    half-way is cleaned up (here, or by ``destroy_stale``). ``owner_pid``: the network is stale once that
    process is gone."""
    require_available()
    plan = plan_network(uuid.uuid4().hex[:5], free_index(_used_indices()), hosts, owner_pid)
    _record(plan)
    try:
        _run(up_commands(plan))
    except BaseException:
        destroy(plan)
        raise
    return plan


def add_host(plan: NetworkPlan, name: str) -> NetworkPlan:
    """One more host on a running network; returns (and records) the new plan."""
    require_available()
    bigger = plan.with_host(name)
    _record(bigger)
    try:
        _run(host_commands(bigger, bigger.host(name)))
    except BaseException:
        _run(host_down_commands(bigger.host(name)), check=False)
        _record(plan)
        raise
    return bigger


def remove_host(plan: NetworkPlan, name: str) -> NetworkPlan:
    _run(host_down_commands(plan.host(name)), check=False)
    smaller = plan.without_host(name)
    _record(smaller)
    return smaller


def with_nats_hosts(plan: NetworkPlan) -> NetworkPlan:
    """``plan`` with the hosts of a three-server NATS cluster (``NATS_HOSTS``), added (and recorded) when missing."""
    for name in NATS_HOSTS:
        if not any(h.name == name for h in plan.hosts):
            plan = add_host(plan, name)
    return plan


def cut(plan: NetworkPlan, name: str) -> None:
    """Partition host ``name`` (``CONTROL_HOST``: the control plane): its link to the bridge goes down; its
    processes keep running."""
    _run(cut_commands(plan, name))


def restore(plan: NetworkPlan, name: str) -> None:
    _run(restore_commands(plan, name))


def destroy(plan: NetworkPlan) -> None:
    """Remove every namespace, interface and the bridge of ``plan``, and its record. Idempotent: what is
    already gone is skipped. (Processes still in a namespace keep only their own loopback.)"""
    _run(down_commands(plan), check=False)
    (RECORDS / f"{plan.tag}.json").unlink(missing_ok=True)


def current(tag: str) -> NetworkPlan:
    """The recorded plan of network ``tag`` (hosts added since ``create`` included)."""
    for plan in recorded():
        if plan.tag == tag:
            return plan
    raise NetnsError(f"no network {tag!r} recorded in {RECORDS}")


def destroy_stale() -> list[str]:
    """Destroy the recorded networks whose owner process is gone (a crashed test's); returns their tags."""
    from keel.cluster.local import alive  # the cluster module builds on this one

    gone = [plan for plan in recorded() if plan.owner_pid is not None and not alive(plan.owner_pid)]
    for plan in gone:
        destroy(plan)
    return [plan.tag for plan in gone]


def main(argv: list[str] | None = None) -> int:
    """``python -m keel.cluster.netns restore TAG HOST [--after SECONDS]``: restore host ``HOST``'s link in
    network ``TAG`` (after a wait): what ``keel inject link-cut --param for=60s`` leaves running. A network
    destroyed meanwhile is nothing to restore."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m keel.cluster.netns")
    parser.add_argument("action", choices=("restore",))
    parser.add_argument("tag")
    parser.add_argument("host")
    parser.add_argument("--after", type=float, default=0.0, help="seconds to wait first")
    args = parser.parse_args(argv)
    time.sleep(max(0.0, args.after))
    try:
        restore(current(args.tag), args.host)
    except NetnsError as exc:
        print(f"keel: link of {args.host} not restored: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
