"""Peers a rank cannot reach: its TCP connections (gloo's, the rendezvous store's) that keep retransmitting.

A host cut off the network gives nobody an error: its peers' ranks just wait in the next collective, and
only the inspector's step timeout would notice. But the kernel knows sooner: a connection with data the
peer never acknowledges sits in the retransmission timer, and each retransmission timeout (200 ms at
first on a fast link, then doubling) adds one to its count. Three in a row (about 1.4 s) and the peer's
kernel is not answering at all: the peer's host is unreachable, not slow.

``/proc/<pid>/net/tcp`` (and ``tcp6``) list every TCP socket of the process's network namespace, one a
line after a header (``include/net/tcp.h``, ``net/ipv4/tcp_ipv4.c: get_tcp4_sock``)::

      sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
       0: 0200000A:A1B2 0300000A:1F90 01 00000040:00000000 01:00000064 00000003  1000        0 4242 ...

Addresses are the 32-bit words of the address in host byte order, in hex (``0200000A`` is 10.0.0.2 on
a little-endian host), ports big-endian hex; ``st`` is the TCP state (``01`` established); ``tr`` the
active timer (``1`` retransmission, ``2`` keepalive, ``3`` TIME_WAIT, ``4`` zero-window probe) and
``retrnsmt`` the retransmission timeouts since the last acknowledgement (``icsk_retransmits``).

``stuck_peers`` (pure) names each remote address with a socket of the given inodes (the ranks' own
sockets) in the retransmission timer with at least ``min_retransmits`` timeouts; ``PeerReachProbe``
reads the files for the node's rank pids and turns that into ``peer_unreachable`` observations (component
``rank``, key: the peer's address) that the controller maps to the node holding that address.
"""

from __future__ import annotations

import ipaddress
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .observation import Observation, healthy, probe_failed, probe_ok
from .policy import InspectorPolicy

TCP_ESTABLISHED = 0x01
TIMER_RETRANSMIT = 1
TIMER_ZERO_WINDOW_PROBE = 4
"""Both mean unacknowledged data: a retransmission, or a probe of a peer whose window stays shut. Only
the first means the peer's kernel does not answer; a zero window is a slow reader, not a lost host."""


@dataclass(frozen=True)
class TcpSocket:
    """One line of ``/proc/net/tcp{,6}``, decoded."""

    local: str
    local_port: int
    remote: str
    remote_port: int
    state: int
    tx_queue: int
    """Bytes sent and not yet acknowledged."""
    timer: int
    retransmits: int
    inode: int


class ProcNetTcpError(ValueError):
    """A line of ``/proc/net/tcp`` that does not have the kernel's format."""


def _address(text: str, byteorder: str) -> str:
    """A hex address as the kernel prints it (32-bit words, each in host byte order) to text."""
    fmt = "<" if byteorder == "little" else ">"
    if len(text) == 8:
        return str(ipaddress.IPv4Address(struct.pack(f"{fmt}I", int(text, 16))))
    if len(text) == 32:
        words = [int(text[i:i + 8], 16) for i in range(0, 32, 8)]
        address = ipaddress.IPv6Address(struct.pack(f"{fmt}4I", *words))
        return str(address.ipv4_mapped or address)  # an IPv4 peer on a dual-stack socket is that IPv4 address
    raise ProcNetTcpError(f"address {text!r} is neither 8 (IPv4) nor 32 (IPv6) hex digits")


def parse_proc_net_tcp(text: str, *, byteorder: str = sys.byteorder) -> list[TcpSocket]:
    """Every socket listed in the text of ``/proc/net/tcp`` or ``tcp6`` (the header line is skipped).

    ``byteorder``: the byte order of the host that wrote the text (the kernel prints host-order words).
    Raises ``ProcNetTcpError`` naming the line for one it cannot read: a probe must not guess."""
    sockets = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0] == "sl":
            continue
        try:
            local, local_port = fields[1].split(":")
            remote, remote_port = fields[2].split(":")
            tx_queue, _rx_queue = fields[4].split(":")
            timer, _when = fields[5].split(":")
            sockets.append(TcpSocket(
                local=_address(local, byteorder), local_port=int(local_port, 16),
                remote=_address(remote, byteorder), remote_port=int(remote_port, 16),
                state=int(fields[3], 16), tx_queue=int(tx_queue, 16), timer=int(timer, 16),
                retransmits=int(fields[6], 16), inode=int(fields[9])))
        except (IndexError, ValueError) as exc:
            raise ProcNetTcpError(f"line {number} is not in /proc/net/tcp's format ({exc}): {line.strip()!r}") from exc
    return sockets


@dataclass(frozen=True)
class StuckPeer:
    """A remote address the given sockets cannot reach, and why."""

    address: str
    retransmits: int
    """The most retransmission timeouts in a row of any of its connections."""
    connections: int
    unacknowledged_bytes: int
    reason: str


def stuck_peers(sockets: Iterable[TcpSocket], *, min_retransmits: int,
                inodes: frozenset[int] | None = None) -> list[StuckPeer]:
    """The remote addresses with an established connection (of ``inodes``; ``None``: any) in the
    retransmission timer after at least ``min_retransmits`` timeouts in a row, sorted by address.

    Loopback peers are left out: a host cannot be cut off from itself, and on a one-host cluster every
    node shares that address, so it names nobody."""
    if min_retransmits < 1:
        raise ValueError(f"min_retransmits must be at least 1, not {min_retransmits}")
    by_address: dict[str, list[TcpSocket]] = {}
    for s in sockets:
        if inodes is not None and s.inode not in inodes:
            continue
        if s.state != TCP_ESTABLISHED or s.timer != TIMER_RETRANSMIT or s.retransmits < min_retransmits:
            continue
        if ipaddress.ip_address(s.remote).is_loopback:
            continue
        by_address.setdefault(s.remote, []).append(s)
    out = []
    for address in sorted(by_address):
        stuck = by_address[address]
        worst = max(s.retransmits for s in stuck)
        unacked = sum(s.tx_queue for s in stuck)
        ports = ", ".join(f":{s.local_port}->:{s.remote_port}" for s in sorted(stuck, key=lambda s: s.local_port))
        out.append(StuckPeer(address, worst, len(stuck), unacked,
                             f"{len(stuck)} connection(s) to {address} ({ports}) retransmitted {worst} times in a "
                             f"row with {unacked} bytes unacknowledged (limit {min_retransmits}): its host does "
                             f"not answer"))
    return out


def socket_inodes(fd_names: Iterable[str]) -> frozenset[int]:
    """The socket inodes among a process's ``/proc/<pid>/fd`` link targets (``socket:[4242]``)."""
    inodes = set()
    for name in fd_names:
        if name.startswith("socket:[") and name.endswith("]"):
            inodes.add(int(name[8:-1]))
    return frozenset(inodes)


class PeerReachProbe:
    """Samples the TCP connections of the node's ranks: a ``peer_unreachable`` signal per peer address.

    ``collect(pids)``: ``pids`` are the node's live rank processes (the agent knows them). Each stuck peer
    is a ``failed``, medium-confidence, ``immediate`` observation (the retransmission count already is the
    threshold); a peer once stuck gets a healthy sample when its connections move again or close, so the
    signal recovers. Not fatal: the controller judges it with what it knows of the named node."""

    name = "peers"

    def __init__(self, proc: Path = Path("/proc"), policy: InspectorPolicy | None = None) -> None:
        self.proc = Path(proc)
        self.policy = policy or InspectorPolicy()
        self._reported: set[str] = set()

    def _read(self, pids: Sequence[int], errors: list[str]) -> tuple[list[TcpSocket], frozenset[int]]:
        inodes: set[int] = set()
        namespaces: dict[str, int] = {}
        for pid in pids:
            fd_dir = self.proc / str(pid) / "fd"
            try:
                targets = []
                for fd in fd_dir.iterdir():
                    try:
                        targets.append(str(fd.readlink()))
                    except OSError:
                        continue  # closed since the listing
                inodes |= socket_inodes(targets)
                namespaces.setdefault(str((self.proc / str(pid) / "ns/net").readlink()), pid)
            except FileNotFoundError:
                continue  # the rank exited since the agent listed it: RankExited's business
            except OSError as exc:
                errors.append(f"{fd_dir}: {exc}")
        sockets: list[TcpSocket] = []
        for pid in namespaces.values():  # one read per network namespace: every rank of a node shares it
            for name in ("tcp", "tcp6"):
                path = self.proc / str(pid) / "net" / name
                try:
                    sockets += parse_proc_net_tcp(path.read_text())
                except FileNotFoundError:
                    continue  # no IPv6 in this kernel, or the rank exited
                except (OSError, ProcNetTcpError) as exc:
                    errors.append(f"{path}: {exc}")
        return sockets, frozenset(inodes)

    def collect(self, pids: Sequence[int]) -> list[Observation]:
        errors: list[str] = []
        sockets, inodes = self._read(pids, errors) if pids else ([], frozenset())
        stuck = stuck_peers(sockets, min_retransmits=self.policy.peer_retransmit_limit, inodes=inodes)
        obs: list[Observation] = []
        for peer in stuck:
            obs.append(Observation("rank", "peer_unreachable", peer.address, "failed", "medium", False, peer.reason,
                                   {"peer_address": peer.address, "retransmits": peer.retransmits,
                                    "connections": peer.connections, "unacknowledged_bytes": peer.unacknowledged_bytes},
                                   immediate=True))
        named = {p.address for p in stuck}
        # A read that failed is no information, not a clear connection: its peers stay as they were.
        cleared = set() if errors else self._reported - named
        for address in sorted(cleared):
            obs.append(healthy("rank", "peer_unreachable", address, peer_address=address))
        self._reported = (self._reported | named) - cleared
        obs.append(probe_failed("rank", "peers", errors) if errors else probe_ok("rank", "peers"))
        return obs
