"""Planning a host network (``keel.cluster.netns``): names within the kernel's limits, addresses, the ``ip``
commands, and the errors for bad input. Pure: nothing is created here."""

from __future__ import annotations

import ipaddress

import pytest

from keel.cluster import netns
from keel.cluster.netns import NetnsError, NetworkPlan, plan_network


def test_a_plan_gives_each_host_its_own_address_namespace_and_short_interface_names() -> None:
    plan = plan_network("0a1b2", 7, ["n00", "n01", "s00"], owner_pid=42)
    assert plan.bridge == "kn0a1b2br" and plan.gateway == "10.77.7.1" and str(plan.subnet) == "10.77.7.0/24"
    assert [h.address for h in plan.hosts] == ["10.77.7.10", "10.77.7.11", "10.77.7.12"]
    assert [h.netns for h in plan.hosts] == ["keel-0a1b2-n00", "keel-0a1b2-n01", "keel-0a1b2-s00"]
    names = [plan.bridge, *(h.veth for h in plan.hosts), *(h.peer for h in plan.hosts)]
    assert len(set(names)) == len(names) and all(len(n) <= 15 for n in names)  # IFNAMSIZ - 1
    assert NetworkPlan.from_json(plan.to_json()) == plan
    # A host added later takes the lowest free address, also after one was removed.
    smaller = plan.without_host("n01")
    assert smaller.with_host("s01").host("s01").address == "10.77.7.11"


def test_the_commands_bring_up_a_bridge_and_a_veth_per_host_and_cut_only_the_hosts_end() -> None:
    plan = plan_network("fffff", 0, ["a"])
    commands = netns.up_commands(plan)
    # The control plane (root namespace) holds the gateway on a veth pair of its own: its link can be cut too.
    assert commands[:7] == [["ip", "link", "add", "knfffffbr", "type", "bridge"],
                            ["ip", "link", "set", "knfffffbr", "up"],
                            ["ip", "link", "add", "knfffffc0", "type", "veth", "peer", "name", "knfffffc1"],
                            ["ip", "addr", "add", "10.77.0.1/24", "dev", "knfffffc0"],
                            ["ip", "link", "set", "knfffffc1", "master", "knfffffbr"],
                            ["ip", "link", "set", "knfffffc1", "up"],
                            ["ip", "link", "set", "knfffffc0", "up"]]
    assert netns.cut_commands(plan, netns.CONTROL_HOST) == [["ip", "link", "set", "knfffffc1", "down"]]
    assert netns.restore_commands(plan, netns.CONTROL_HOST) == [["ip", "link", "set", "knfffffc1", "up"]]
    assert ["ip", "link", "del", "knfffffc0"] in netns.down_commands(plan)
    host = plan.host("a")
    assert ["ip", "netns", "add", "keel-fffff-a"] in commands
    assert ["ip", "-n", "keel-fffff-a", "addr", "add", "10.77.0.10/24", "dev", "eth0"] in commands
    assert ["ip", "-n", "keel-fffff-a", "link", "set", "lo", "up"] in commands
    assert ["ip", "link", "set", host.veth, "master", "knfffffbr"] in commands
    assert netns.cut_commands(plan, "a") == [["ip", "link", "set", host.veth, "down"]]
    assert netns.restore_commands(plan, "a") == [["ip", "link", "set", host.veth, "up"]]
    assert netns.down_commands(plan)[-1] == ["ip", "link", "del", "knfffffbr"]
    assert netns.in_host(plan, "a", ["python", "-V"]) == ["nsenter", "--net=/run/netns/keel-fffff-a", "--", "python", "-V"]


def test_bad_input_gets_a_clear_error() -> None:
    with pytest.raises(NetnsError, match="five lower-case hex digits"):
        plan_network("XYZ", 0)
    with pytest.raises(NetnsError, match="out of 0..255"):
        plan_network("abcde", 256)
    plan = plan_network("abcde", 1, ["a"])
    with pytest.raises(NetnsError, match="already has a host 'a'"):
        plan.with_host("a")
    with pytest.raises(NetnsError, match="host name 'Bad Name'"):
        plan.with_host("Bad Name")
    with pytest.raises(NetnsError, match="host name 'control'"):  # the control plane's, not a namespace
        plan.with_host(netns.CONTROL_HOST)
    with pytest.raises(NetnsError, match="no host 'b'"):
        netns.cut_commands(plan, "b")
    full = plan_network("abcde", 1, [f"h{i}" for i in range(245)])
    with pytest.raises(NetnsError, match="is full"):
        full.with_host("one-more")
    assert ipaddress.ip_address(full.hosts[-1].address) == ipaddress.ip_address("10.77.1.254")


def test_a_free_subnet_is_the_lowest_unused() -> None:
    assert netns.free_index(set()) == 0
    assert netns.free_index({0, 1, 3}) == 2
    with pytest.raises(NetnsError, match="every 10.77.x.0/24 subnet is taken"):
        netns.free_index(set(range(256)))
