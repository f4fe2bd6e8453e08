"""Peers a rank cannot reach, from its TCP connections' retransmissions (``inspector/peers.py``, issue 16).

The fixture lines follow the kernel's format (``net/ipv4/tcp_ipv4.c: get_tcp4_sock``, ``tcp6``'s likewise):
``sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...``, the
addresses as host-order 32-bit words in hex (little-endian here: ``02044D0A`` is 10.77.4.2). The probe is
also run on this machine's own ``/proc``, against a connection whose socket it must find.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from keel.agent.inspector.peers import (
    PeerReachProbe,
    ProcNetTcpError,
    parse_proc_net_tcp,
    socket_inodes,
    stuck_peers,
)
from keel.agent.inspector.policy import InspectorPolicy

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
          "                                                     ")
LISTEN = "   0: 00000000:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4100 1 0000000000000000 100 0 0 10 0"
# 10.77.2.2:45678 -> 10.77.4.2:29500, established, 40 KiB unacknowledged, retransmission timer, 3 timeouts
STUCK = "   1: 02024D0A:B26E 02044D0A:733C 01 0000A000:00000000 01:00000050 00000003  1000        0 4242 2 0000000000000000 20 4 30 10 -1"
# a second connection to the same peer (gloo keeps one per pair and process group), 5 timeouts
STUCK_TOO = "   2: 02024D0A:B270 02044D0A:8C01 01 00000400:00000000 01:000000C8 00000005  1000        0 4243 2 0000000000000000 20 4 30 10 -1"
# 10.77.2.2 -> 10.77.3.2: one timeout only (a lost segment, recovered by the next ACK)
ONE_LOSS = "   3: 02024D0A:B272 02034D0A:733C 01 00000200:00000000 01:00000014 00000001  1000        0 4244 2 0000000000000000 20 4 30 10 -1"
# 10.77.2.2 -> 10.77.5.2: keepalive timer, nothing outstanding
KEEPALIVE = "   4: 02024D0A:B274 02054D0A:733C 01 00000000:00000000 02:000003E8 00000000  1000        0 4245 1 0000000000000000 20 4 30 10 -1"
# 127.0.0.1 -> 127.0.0.1: loopback, retransmitting (names no host)
LOOPBACK = "   5: 0100007F:B276 0100007F:733C 01 00000100:00000000 01:00000050 00000004  1000        0 4246 2 0000000000000000 20 4 30 10 -1"
# the agent's own connection to NATS (not a rank's socket), retransmitting
AGENT_NATS = "   6: 02024D0A:B278 0100A8C0:1116 01 00000100:00000000 01:00000050 00000004  1000        0 5000 2 0000000000000000 20 4 30 10 -1"
# 10.77.2.2 -> 10.77.6.2: FIN_WAIT1 (04) with retransmissions: closing, not a peer the ranks wait on
CLOSING = "   7: 02024D0A:B27A 02064D0A:733C 04 00000001:00000000 01:00000050 00000006  1000        0 4247 2 0000000000000000 20 4 30 10 -1"
# tcp6: ::ffff:10.77.2.2 -> ::ffff:10.77.7.2 (a dual-stack socket to an IPv4 peer), 3 timeouts
V6_MAPPED = ("   0: 0000000000000000FFFF000002024D0A:B27C 0000000000000000FFFF000002074D0A:733C 01 00000100:00000000 "
             "01:00000050 00000003  1000        0 4248 2 0000000000000000 20 4 30 10 -1")

TCP = "\n".join([HEADER, LISTEN, STUCK, STUCK_TOO, ONE_LOSS, KEEPALIVE, LOOPBACK, AGENT_NATS, CLOSING]) + "\n"
RANK_INODES = frozenset({4100, 4242, 4243, 4244, 4245, 4246, 4247, 4248})


def test_lines_decode_to_addresses_ports_states_and_counters() -> None:
    sockets = parse_proc_net_tcp(TCP, byteorder="little")
    assert len(sockets) == 8  # the header is skipped
    stuck = sockets[1]
    assert (stuck.local, stuck.local_port, stuck.remote, stuck.remote_port) == ("10.77.2.2", 45678, "10.77.4.2", 29500)
    assert (stuck.state, stuck.tx_queue, stuck.timer, stuck.retransmits, stuck.inode) == (1, 0xA000, 1, 3, 4242)
    assert sockets[0].state == 0x0A and sockets[0].remote == "0.0.0.0"
    assert sockets[5].remote == "127.0.0.1"
    [v6] = parse_proc_net_tcp(HEADER + "\n" + V6_MAPPED, byteorder="little")
    assert (v6.local, v6.remote, v6.retransmits) == ("10.77.2.2", "10.77.7.2", 3)


def test_a_peer_retransmitted_to_three_times_in_a_row_is_named_with_its_reason() -> None:
    peers = stuck_peers(parse_proc_net_tcp(TCP, byteorder="little"), min_retransmits=3, inodes=RANK_INODES)
    assert [p.address for p in peers] == ["10.77.4.2"]  # not one loss, keepalive, loopback, the agent's, closing
    [peer] = peers
    assert (peer.retransmits, peer.connections, peer.unacknowledged_bytes) == (5, 2, 0xA000 + 0x400)
    assert "2 connection(s) to 10.77.4.2 (:45678->:29500, :45680->:35841)" in peer.reason
    assert "retransmitted 5 times in a row" in peer.reason and "(limit 3)" in peer.reason


def test_the_limit_and_the_inode_filter_decide() -> None:
    sockets = parse_proc_net_tcp(TCP, byteorder="little")
    assert [p.address for p in stuck_peers(sockets, min_retransmits=1, inodes=RANK_INODES)] == ["10.77.3.2", "10.77.4.2"]
    assert [p.address for p in stuck_peers(sockets, min_retransmits=6, inodes=RANK_INODES)] == []
    assert stuck_peers(sockets, min_retransmits=3, inodes=frozenset({4100})) == []  # only the listener is the rank's
    every = stuck_peers(sockets, min_retransmits=3, inodes=None)
    assert [p.address for p in every] == ["10.77.4.2", "192.168.0.1"]  # without the filter the agent's own shows
    with pytest.raises(ValueError, match="at least 1"):
        stuck_peers(sockets, min_retransmits=0)


def test_a_line_not_in_the_kernels_format_is_an_error_naming_it() -> None:
    with pytest.raises(ProcNetTcpError, match="line 2 .*'1: 02024D0A:B26E'"):
        parse_proc_net_tcp(HEADER + "\n   1: 02024D0A:B26E\n")
    with pytest.raises(ProcNetTcpError, match="neither 8 .* nor 32"):
        parse_proc_net_tcp(HEADER + "\n" + STUCK.replace("02044D0A:733C", "2044D0A:733C"))


def test_socket_inodes_come_from_fd_link_targets() -> None:
    assert socket_inodes(["socket:[4242]", "pipe:[77]", "/dev/null", "socket:[9]"]) == frozenset({4242, 9})


def _fake_proc(root: Path, pid: int, tcp: str, inodes: list[int]) -> None:
    (root / str(pid) / "fd").mkdir(parents=True)
    (root / str(pid) / "ns").mkdir()
    (root / str(pid) / "net").mkdir()
    for fd, inode in enumerate(inodes, start=3):
        os.symlink(f"socket:[{inode}]", root / str(pid) / "fd" / str(fd))
    os.symlink("net:[4026532000]", root / str(pid) / "ns" / "net")
    (root / str(pid) / "net" / "tcp").write_text(tcp)


def test_the_probe_reports_a_stuck_peer_failed_then_healthy_once_it_clears(tmp_path: Path) -> None:
    if sys.byteorder != "little":
        pytest.fail("the fixture's words are little-endian; write big-endian ones for this host")
    _fake_proc(tmp_path, 321, TCP, [4242, 4243])
    probe = PeerReachProbe(tmp_path, InspectorPolicy())
    first = {(o.check, o.key): o for o in probe.collect([321])}
    failed = first[("peer_unreachable", "10.77.4.2")]
    assert (failed.component, failed.status, failed.confidence, failed.is_fatal, failed.immediate) == \
        ("rank", "failed", "medium", False, True)
    assert failed.evidence["peer_address"] == "10.77.4.2" and failed.evidence["retransmits"] == 5
    assert first[("probe", "peers")].status == "healthy"
    (tmp_path / "321" / "net" / "tcp").write_text(HEADER + "\n" + LISTEN + "\n")  # the connections moved again
    second = {(o.check, o.key): o for o in probe.collect([321])}
    assert second[("peer_unreachable", "10.77.4.2")].status == "healthy"
    third = probe.collect([321])  # cleared once: no more samples about that peer
    assert [o.key for o in third if o.check == "peer_unreachable"] == []


def test_an_unreadable_table_is_a_degraded_probe_and_keeps_the_peer(tmp_path: Path) -> None:
    assert sys.byteorder == "little", "the fixture's words are little-endian"
    _fake_proc(tmp_path, 321, TCP, [4242])
    probe = PeerReachProbe(tmp_path, InspectorPolicy())
    assert any(o.check == "peer_unreachable" and o.status == "failed" for o in probe.collect([321]))
    (tmp_path / "321" / "net" / "tcp").write_text(HEADER + "\n   1: garbage\n")
    obs = probe.collect([321])
    [failed_probe] = [o for o in obs if o.check == "probe"]
    assert failed_probe.status == "degraded" and "net/tcp" in failed_probe.detail
    assert [o for o in obs if o.check == "peer_unreachable"] == []  # no information is not "clear"


def test_a_rank_gone_since_it_was_listed_is_no_error(tmp_path: Path) -> None:
    probe = PeerReachProbe(tmp_path, InspectorPolicy())
    assert [(o.check, o.status) for o in probe.collect([999999])] == [("probe", "healthy")]


def test_on_this_machine_the_probe_finds_its_own_processes_connection() -> None:
    """The real kernel's table: a connection of this process, found by its socket's inode, decoded right."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        text = (Path("/proc") / str(os.getpid()) / "net" / "tcp").read_text()
        sockets = parse_proc_net_tcp(text)
        inode = os.fstat(client.fileno()).st_ino
        [mine] = [s for s in sockets if s.inode == inode]
        assert (mine.local, mine.local_port) == client.getsockname()
        assert (mine.remote, mine.remote_port) == server.getsockname()
        assert mine.state == 1 and mine.retransmits == 0
        # Loopback never names a peer, and a healthy connection is not stuck.
        assert stuck_peers(sockets, min_retransmits=1, inodes=frozenset({inode})) == []
        probe = PeerReachProbe(Path("/proc"), InspectorPolicy())
        assert [(o.check, o.status) for o in probe.collect([os.getpid()])] == [("probe", "healthy")]
    finally:
        accepted.close()
        client.close()
        server.close()
