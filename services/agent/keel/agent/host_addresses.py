"""The IP addresses of this host's network interfaces, for ``NodeRegistered.addresses``.

Peers name a host they cannot reach by the address their connections go to (``inspector/peers.py``);
the controller maps it back to the node through the addresses each node registered. Read from the
kernel of the agent's network namespace, so a host on a network namespace reports its own link's
address. IPv4 (one primary address per interface, ``SIOCGIFADDR``) and IPv6 (``/proc/net/if_inet6``);
loopback and link-local addresses are left out: they name no host to anyone else.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915


def _ipv4(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # no IPv4 address on it (EADDRNOTAVAIL), or it went away
    return socket.inet_ntoa(packed[20:24])


def _ipv6(if_inet6: Path) -> list[str]:
    try:
        lines = if_inet6.read_text().splitlines()
    except OSError:
        return []  # no IPv6 in this kernel
    return [str(ipaddress.IPv6Address(bytes.fromhex(line.split()[0]))) for line in lines if line.split()]


def host_addresses(if_inet6: Path = Path("/proc/net/if_inet6")) -> list[str]:
    """This host's interface addresses, sorted, without loopback and link-local ones (never raises)."""
    found: set[str] = set()
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        address = _ipv4(name)
        if address is not None:
            found.add(address)
    found.update(_ipv6(if_inet6))
    return sorted(a for a in found
                  if not (ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_link_local))
