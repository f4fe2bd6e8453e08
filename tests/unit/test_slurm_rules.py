"""The Slurm actuator's pure part: reading ``scontrol show node -o`` and node lists, deciding a drain."""

from __future__ import annotations

import pytest

from keel.actuator.slurm_rules import (
    REASON_MAX_CHARS,
    REASON_PREFIX,
    SlurmNode,
    drain_reason,
    expand_hostlist,
    parse_show_node,
    plan_drain,
)

# Slurm 22.05's own output (Debian bookworm), one node drained by a human: note the OS field with spaces
# and the reason with '=' in it, followed by Slurm's [user@time] suffix.
SHOW_NODE = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.87 AvailableFeatures=(null) "
    "ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=localhost Port=16821 Version=22.05.8 "
    "OS=Linux 6.18.44-fc-v1252 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1 AllocMem=0 FreeMem=20532 Sockets=2 Boards=1 "
    "State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=train  "
    "BootTime=2026-12-04T19:23:01 SlurmdStartTime=2026-12-04T20:54:37 CfgTRES=cpu=2,mem=1M,billing=2 AllocTRES= "
    "CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s\n"
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 OS=Linux 6.18 #1 SMP  "
    "State=IDLE+DRAIN ThreadsPerCore=1 Partitions=train  ExtSensorsTemp=n/s "
    "Reason=human maintenance: fan=broken [root@2026-12-04T20:57:34]\n"
)


def test_show_node_is_read_with_the_reason_and_who_set_it() -> None:
    n1, n2 = parse_show_node(SHOW_NODE)
    assert (n1.name, n1.state, n1.reason, n1.drained, n1.usable) == ("n1", "IDLE", "", False, True)
    assert (n2.name, n2.state, n2.drained) == ("n2", "IDLE+DRAIN", True)
    assert n2.reason == "human maintenance: fan=broken" and n2.reason_by == "root"
    assert not n2.drained_by_keel


def test_a_line_without_a_node_name_is_refused() -> None:
    with pytest.raises(ValueError, match="not a node line"):
        parse_show_node("Arch=x86_64 State=IDLE\n")


@pytest.mark.parametrize("state, drained, usable", [
    ("IDLE", False, True), ("MIXED", False, True), ("ALLOCATED", False, True),
    ("MIXED+DRAIN", True, False), ("DRAINED", True, False), ("DOWN*+DRAIN", True, False),
    ("DOWN*", False, False), ("IDLE*", False, False), ("IDLE+NOT_RESPONDING", False, False),
])
def test_node_states(state: str, drained: bool, usable: bool) -> None:
    node = SlurmNode("n", state)
    assert (node.drained, node.usable) == (drained, usable)


def test_a_usable_node_is_drained_with_keels_reason() -> None:
    plan = plan_drain(SlurmNode("n3", "ALLOCATED"), "gpu_lost on GPU 2 (incident 7f3a, decision 12ab)")
    assert plan.action == "drain"
    assert plan.reason == f"{REASON_PREFIX} gpu_lost on GPU 2 (incident 7f3a, decision 12ab)"
    assert "n3 drained in Slurm" in plan.detail


def test_a_down_node_is_drained_too_so_it_stays_out_when_it_returns() -> None:
    plan = plan_drain(SlurmNode("n3", "DOWN*"), "heartbeat lost")
    assert plan.action == "drain" and "stays out when it returns" in plan.detail


def test_a_node_keel_drained_already_is_left_alone() -> None:
    plan = plan_drain(SlurmNode("n3", "MIXED+DRAIN", reason=f"{REASON_PREFIX} gpu_lost"), "gpu_lost again")
    assert plan.action == "none" and "already drained by Keel" in plan.detail


def test_a_humans_drain_is_never_written_over() -> None:
    plan = plan_drain(SlurmNode("n3", "IDLE+DRAIN", reason="disk swap", reason_by="alice"), "gpu_lost")
    assert plan.action == "none"
    assert "by alice" in plan.detail and "does not write over" in plan.detail and plan.reason == ""


def test_drain_reasons_are_one_short_printable_line() -> None:
    assert drain_reason("a\nb\tc\x00d") == f"{REASON_PREFIX} a b c d"
    assert drain_reason("") == f"{REASON_PREFIX} evicted"
    long = drain_reason("x" * 1000)
    assert len(long) == REASON_MAX_CHARS and long.endswith("…")


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,5],gpu-a[08-10]", ["n1", "n2", "n5", "gpu-a08", "gpu-a09", "gpu-a10"]),
    ("a,b", ["a", "b"]),
    ("rack[1-2]-x", ["rack1-x", "rack2-x"]),
    ("", []),
])
def test_node_lists_expand_as_scontrol_show_hostnames_does(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["n[1-3", "n1-3]", "n[a-b]", "n[3-1]", "n[1-2][3-4]"])
def test_malformed_node_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_fields_after_the_reason_end_it() -> None:
    # 22.05 prints Comment= and Extra= after Reason=.
    [node] = parse_show_node("NodeName=n3 State=IDLE+DRAIN Partitions=p Reason=bad dimm [alice@2026-12-04T10:00:00] "
                             "Comment=rack 3 Extra=x\n")
    assert (node.reason, node.reason_by) == ("bad dimm", "alice")
    # Without a reason, a comment's words are no fields: State stays the node's.
    [node] = parse_show_node("NodeName=n3 State=IDLE Partitions=p Comment=note State=DRAIN\n")
    assert node.state == "IDLE" and not node.drained


def test_a_down_node_with_someone_elses_reason_is_left_alone() -> None:
    plan = plan_drain(SlurmNode("n3", "DOWN*", reason="disk swap, do not use", reason_by="bob"), "xid 79")
    assert plan.action == "none" and "bob's reason" in plan.detail
    # Slurm's own reason for a node it marked down is no one's to keep: Keel drains it.
    plan = plan_drain(SlurmNode("n3", "DOWN*", reason="Not responding", reason_by="slurm"), "heartbeat lost")
    assert plan.action == "drain"
