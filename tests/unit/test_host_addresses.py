"""``host_addresses``: what a node registers so that a peer's report of an unreachable address names it."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from keel.agent.host_addresses import host_addresses


def test_this_hosts_addresses_leave_out_loopback_and_include_the_routed_interface(tmp_path: Path) -> None:
    addresses = host_addresses(tmp_path / "no-if_inet6")
    assert addresses == sorted(addresses)
    assert all(not ipaddress.ip_address(a).is_loopback for a in addresses), addresses
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.1", 9))  # sends nothing: asks the kernel which address routes there
            routed = probe.getsockname()[0]
        except OSError:
            routed = None  # no route at all (an isolated namespace): nothing more to compare
    if routed is not None and not ipaddress.ip_address(routed).is_loopback:
        assert routed in addresses, (routed, addresses)


def test_ipv6_addresses_come_from_if_inet6_without_loopback_and_link_local(tmp_path: Path) -> None:
    if_inet6 = tmp_path / "if_inet6"
    if_inet6.write_text("00000000000000000000000000000001 01 80 10 80       lo\n"
                        "fe800000000000000000000000000001 02 40 20 80     eth0\n"
                        "fd000000000000000000000000000077 02 40 00 80     eth0\n")
    addresses = host_addresses(if_inet6)
    assert "fd00::77" in addresses
    assert "::1" not in addresses and "fe80::1" not in addresses
