"""A three-server JetStream cluster of real nats-server processes (``keel.infra.embedded.NatsCluster``), with
Keel's streams replicated on all three (R3):

- the stream leader SIGKILLed while a node agent's outbox publishes, then started again: every acknowledged
  event is in the stream exactly once, in the order it was put, and the restarted server has them all too;
- the stream leader frozen (SIGSTOP: to the others a server cut off, its connections left hanging) for
  several seconds while publishing: the same;
- routes authenticate: a server without the cluster's route password (or, with TLS on, without TLS) never
  becomes a route, one with it does;
- the stream leader's host cut off (its link down, three network namespaces as hosts) for 8 s: the same;
- ``keel up``'s runtime with ``nats.embedded_cluster_size: 3`` starts the three and makes R3 streams.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.cli.runtime import administer_streams, runtime_for
from keel.events.envelope import Event, now_utc
from keel.events.types import NodeRegistered
from keel.infra.bus import Bus
from keel.infra.config import BusSettings, NatsSettings, PostgresSettings, Settings, resolve_endpoints
from keel.infra.embedded import (
    LOCALHOST,
    NatsCluster,
    NatsServer,
    _nats_server_binary,
    _spawn_detached,
    free_port,
    rendezvous_base_port,
)
from keel.infra.nats_auth import (
    ADMIN,
    AGENT,
    AUDITOR,
    ROUTE_USER,
    NatsAuthority,
    NatsScope,
    bus_settings_for,
    route_password,
)
from keel.infra.outbox import Outbox

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EVENTS = 240
PREFIX, STREAM, DLQ = "kc", "KC", "KC_DLQ"


def cluster_at(root: Path, *, tls: bool = False) -> NatsCluster:
    """Three servers on 127.0.0.1, their client, monitoring and route ports each a free run of three."""
    base = rendezvous_base_port(offsets=(0, 1, 2, 100, 101, 102, 200, 201, 202))
    credentials = root / "credentials"
    credentials.mkdir(mode=0o700)
    return NatsCluster(root, base, base + 100, base + 200, size=3, credentials_dir=credentials, tls=tls,
                       scope=NatsScope(PREFIX, STREAM, DLQ))


@pytest.fixture
def cluster(scratch_dir: Path) -> Iterator[NatsCluster]:
    nats = cluster_at(scratch_dir)
    nats.start(timeout_s=45)
    yield nats
    nats.stop()


def settings_for(cluster: NatsCluster, identity: str) -> BusSettings:
    assert cluster.credentials_dir is not None
    return BusSettings(subject_prefix=PREFIX, stream=STREAM, dlq_stream=DLQ, max_bytes="32MiB", replicas=3,
                       credentials=cluster.servers[0].identity_file(identity), publish_timeout="3s",
                       retry_backoff_initial="50ms", retry_backoff_max="500ms", ping_interval="2s")


def registered(index: int) -> Event:
    """What an agent of node ``n`` may publish (its identity is for that node)."""
    return Event.create(NodeRegistered(node_id="n", host=f"h{index}"), job_id="j", subject="node/n",
                        producer="agent", occurred_at=now_utc())


async def stream_leader(bus: Bus, cluster: NatsCluster) -> NatsServer:
    deadline = time.monotonic() + 20
    while True:
        try:
            info = await bus.js.stream_info(STREAM)
            if info.cluster is not None and info.cluster.leader:
                return cluster.server_named(info.cluster.leader)
        except Exception:  # noqa: BLE001 - during an election the stream has no leader to answer
            pass
        assert time.monotonic() < deadline, "the stream has no leader"
        await asyncio.sleep(0.2)


def messages_on(server: NatsServer) -> int | None:
    """How many messages ``server``'s own replica of the events stream holds (its monitoring endpoint)."""
    jsz = server.monitor("jsz?accounts=true&streams=true")
    for account in (jsz or {}).get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            if stream.get("name") == STREAM:
                return int(stream["state"]["messages"])
    return None


async def stream_ids(bus: Bus, expected: int) -> list[str]:
    """Every message's ``Nats-Msg-Id`` in stream order, read with a fresh durable consumer."""
    puller = await bus.pull_consumer("cluster-check", ack_all=True)
    ids: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        messages = await puller.fetch(500, 0.5)
        ids += [(m.headers or {}).get("Nats-Msg-Id", "") for m in messages]
        if messages:
            await messages[-1].ack()
        elif len(ids) >= expected:
            break
    await puller.unsubscribe()
    return ids


async def publish_directly(bus: Bus, events: list[Event], stop: asyncio.Event, acknowledged: list[Event]) -> None:
    """What a service does: ``Bus.publish`` one event after another, no outbox, until ``stop``; a
    ``PublishFailed`` fails the test. ``acknowledged``: the events acknowledged so far."""
    for event in events:
        if stop.is_set():
            break
        await bus.publish(event)
        acknowledged.append(event)
        await asyncio.sleep(0.02)


async def publish_through_fault(cluster: NatsCluster, fault, heal) -> None:  # type: ignore[no-untyped-def]
    """An agent's outbox puts ``EVENTS`` events, 10 ms apart, onto the R3 stream, and a service publishes
    others itself; a third of the way the stream leader gets ``fault``, two thirds of the way ``heal``. Then
    every acknowledged event is in the stream once, in the order of its publisher, and on every server."""
    authority = NatsAuthority(cluster.credentials_dir)  # type: ignore[arg-type]
    agent = authority.ensure("agent.j.n", AGENT, node="n", job="j")
    admin = await Bus.connect(cluster.url, settings_for(cluster, ADMIN), name="cluster-admin", administer=True)
    try:
        info = await admin.js.stream_info(STREAM)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        outbox = Outbox(cluster.url, settings_for(cluster, ADMIN).model_copy(update={"credentials": agent}),
                        name="cluster-agent")
        stop = asyncio.Event()
        running = asyncio.create_task(outbox.run(stop))
        service = await Bus.connect(cluster.url, settings_for(cluster, ADMIN), name="cluster-service")
        published: list[Event] = []
        direct = asyncio.create_task(publish_directly(service, [registered(i) for i in range(1000, 1000 + 10 * EVENTS)],
                                                      stop, published))
        before_fault = 0
        events = [registered(i) for i in range(EVENTS)]
        faulted: NatsServer | None = None
        for index, event in enumerate(events):
            if index == EVENTS // 3:
                faulted = await stream_leader(admin, cluster)
                before_fault = len(published)
                await asyncio.to_thread(fault, faulted)
            if index == 2 * EVENTS // 3:
                assert faulted is not None
                # The fault mattered: the others elected another leader meanwhile.
                assert (await stream_leader(admin, cluster)).server_name != faulted.server_name
                await asyncio.to_thread(heal, faulted)
            outbox.put(event)
            await asyncio.sleep(0.01)
        assert await outbox.flush(60), f"{len(outbox.pending)} events never acknowledged"
        assert (outbox.published, outbox.dropped, outbox.refused) == (EVENTS, 0, 0)
        stop.set()
        await asyncio.wait_for(running, 20)
        await outbox.close()
        await asyncio.wait_for(direct, 30)  # raises PublishFailed if the service gave up on one
        await service.close()
        assert len(published) > before_fault, "the service's publishing did not go on past the fault"
        ids = await stream_ids(admin, EVENTS + len(published))
        wanted = {str(event.id) for event in events}
        assert [i for i in ids if i in wanted] == [str(event.id) for event in events], (
            f"{len(ids)} messages, {len(set(ids))} distinct; missing {len(wanted - set(ids))}")
        assert [i for i in ids if i not in wanted] == [str(event.id) for event in published]
        deadline = time.monotonic() + 30
        while any(messages_on(server) != len(ids) for server in cluster.servers):
            assert time.monotonic() < deadline, {s.server_name: messages_on(s) for s in cluster.servers}
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def test_stream_leader_killed_and_restarted_loses_no_acknowledged_event(cluster: NatsCluster) -> None:
    started = time.monotonic()
    await publish_through_fault(cluster, NatsServer.kill, lambda server: server.start(timeout_s=20))
    assert time.monotonic() - started < 60


async def test_stream_leader_frozen_loses_no_acknowledged_event(cluster: NatsCluster) -> None:
    def freeze(server: NatsServer) -> None:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(6)  # the others elect a new leader meanwhile; clients on it time out

    def thaw(server: NatsServer) -> None:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGCONT)

    await publish_through_fault(cluster, freeze, thaw)


def rogue_server(scratch: Path, target_route_port: int, route_url_auth: str, *, tls: bool = False) -> NatsServer:
    """A nats-server (no JetStream) that dials ``target_route_port`` as a route with ``route_url_auth``
    (``user:password@`` or ``""``), started by hand: none of Keel's configuration."""
    store = scratch / f"rogue-{free_port()}"
    store.mkdir()
    server = NatsServer(store, free_port(), free_port())
    route_port = free_port()
    cluster: dict[str, object] = {"name": "keel", "listen": f"{LOCALHOST}:{route_port}",
                                  "routes": [f"nats-route://{route_url_auth}{LOCALHOST}:{target_route_port}"]}
    if tls:
        cluster["tls"] = {"timeout": 2}
    server.config_file.write_text("\n".join([
        f'listen: "{LOCALHOST}:{server.port}"', f'http: "{LOCALHOST}:{server.monitor_port}"',
        f"server_name: {store.name}", f"cluster {json.dumps(cluster)}", ""]))
    with open(server.log_file, "ab") as log:
        pid = _spawn_detached([str(_nats_server_binary()), "-c", str(server.config_file)], log.fileno(), scratch)
    server.pid_file.write_text(f"{pid}\n")
    return server


def route_names(server: NatsServer) -> set[str]:
    return {str(route.get("remote_name")) for route in (server.monitor("routez") or {}).get("routes") or []}


def wait_for_route(server: NatsServer, name: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if name in route_names(server):
            return True
        time.sleep(0.2)
    return False


def test_a_server_without_the_route_password_cannot_join(cluster: NatsCluster, scratch_dir: Path) -> None:
    target = cluster.servers[0]
    assert target.routes is not None and route_names(target) == {"nats-2", "nats-3"}
    password = route_password(cluster.credentials_dir)  # type: ignore[arg-type]
    assert os.stat(cluster.credentials_dir / "nats" / "cluster-route.password").st_mode & 0o777 == 0o600  # type: ignore[operator]
    assert password not in target.config_file.read_text()
    assert os.stat(target.cluster_file).st_mode & 0o777 == 0o600
    rogues = [rogue_server(scratch_dir, target.routes.port, ""),
              rogue_server(scratch_dir, target.routes.port, f"{ROUTE_USER}:wrong-{password[:20]}@")]
    member = None
    try:
        for rogue in rogues:
            assert not wait_for_route(target, rogue.server_name or "", 3.0)
            assert int((rogue.monitor("routez") or {}).get("num_routes", -1)) == 0
            assert "authentication failure" in target.log_file.read_text().lower()
        # The control: the same server with the password is taken in (so the two above were refused for it).
        member = rogue_server(scratch_dir, target.routes.port, f"{ROUTE_USER}:{password}@")
        assert wait_for_route(target, member.server_name or "", 10.0), target.log_file.read_text()[-2000:]
    finally:
        for rogue in [*rogues, *([member] if member else [])]:
            rogue.stop()


def test_tls_cluster_refuses_a_plaintext_route(scratch_dir: Path) -> None:
    cluster = cluster_at(scratch_dir, tls=True)
    cluster.start(timeout_s=45)
    try:
        assert cluster.url.startswith("tls://") and cluster.url.count("tls://") == 3
        target = cluster.servers[0]
        assert target.routes is not None and route_names(target) == {"nats-2", "nats-3"}
        password = route_password(cluster.credentials_dir)  # type: ignore[arg-type]
        rogue = rogue_server(scratch_dir, target.routes.port, f"{ROUTE_USER}:{password}@")
        try:
            assert not wait_for_route(target, rogue.server_name or "", 3.0)
        finally:
            rogue.stop()
    finally:
        cluster.stop()


async def test_keel_up_starts_an_embedded_cluster_with_r3_streams(scratch_dir: Path) -> None:
    """``keel up`` with ``nats.embedded_cluster_size: 3``: three servers, Keel's streams on all three, the
    runtime file naming all of them; ``keel down`` with settings that no longer say so stops all three."""
    base = rendezvous_base_port(offsets=(0, 1, 2, 100, 101, 102, 200, 201, 202))
    settings = Settings(home=scratch_dir / "home", credentials_dir=scratch_dir / "credentials",
                        nats=NatsSettings(embedded_cluster_size=3, port=base, monitor_port=base + 100,
                                          cluster_port=base + 200),
                        postgres=PostgresSettings(port=free_port()))
    assert settings.bus.replicas == 3
    runtime = runtime_for(settings)
    try:
        info = await asyncio.to_thread(runtime.up, 60.0)
        assert info["nats"]["url"] == ",".join(f"nats://{LOCALHOST}:{base + i}" for i in range(3))
        assert [server["name"] for server in info["nats"]["servers"]] == ["nats-1", "nats-2", "nats-3"]
        assert resolve_endpoints(settings, None)[0] == info["nats"]["url"]
        await administer_streams(info["nats"]["url"], settings)
        bus = await Bus.connect(info["nats"]["url"], bus_settings_for(settings, AUDITOR), name="cluster-auditor")
        try:
            for stream in (settings.bus.stream, settings.bus.dlq_stream):
                stream_info = await bus.js.stream_info(stream)
                assert stream_info.config.num_replicas == 3
                assert stream_info.cluster is not None and len(stream_info.cluster.replicas or []) == 2
        finally:
            await bus.close()
        assert runtime.status()["nats"]["running"] is True
    finally:
        await asyncio.to_thread(runtime_for(settings.model_copy(update={"nats": NatsSettings()})).down)
    assert not any(server.is_running() for server in runtime.nats_cluster.servers)


# ----------------------------------------------------------------------------- a real partition (netns)


class Hosts:
    """Three network namespaces, each a "host" with its own address on a bridge of this (root) namespace, which
    the test's clients use too: 10.<a>.<b>.2..4, the bridge .1. ``cut(i)`` takes host i's link down (the
    partition: no packet to or from it, connections left hanging), ``mend(i)`` brings it back."""

    def __init__(self) -> None:
        tag = os.urandom(2).hex()
        self.bridge = f"kcb{tag}"
        self.namespaces = [f"kc{tag}h{i}" for i in range(3)]
        self.links = [f"kc{tag}v{i}" for i in range(3)]
        a, b = 200 + int(tag[:2], 16) % 50, int(tag[2:], 16)
        self.gateway = f"10.{a}.{b}.1"
        self.addresses = tuple(f"10.{a}.{b}.{i + 2}" for i in range(3))

    @staticmethod
    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def create(self) -> None:
        self.ip("link", "add", self.bridge, "type", "bridge")
        self.ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        self.ip("link", "set", self.bridge, "up")
        for namespace, link, address in zip(self.namespaces, self.links, self.addresses, strict=True):
            self.ip("netns", "add", namespace)
            self.ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self.ip("link", "set", link, "master", self.bridge, "up")
            self.ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            self.ip("-n", namespace, "link", "set", "eth0", "up")
            self.ip("-n", namespace, "link", "set", "lo", "up")

    def launchers(self) -> tuple[tuple[str, ...], ...]:
        return tuple(("ip", "netns", "exec", namespace) for namespace in self.namespaces)

    def cut(self, index: int) -> None:
        self.ip("link", "set", self.links[index], "down")

    def mend(self, index: int) -> None:
        self.ip("link", "set", self.links[index], "up")

    def remove(self) -> None:
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "network namespaces need root and iproute2's ip"
    probe = f"kcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=10)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None if made.returncode == 0 else f"cannot create a network namespace: {made.stderr.decode().strip()}"


async def test_stream_leader_partitioned_loses_no_acknowledged_event(scratch_dir: Path) -> None:
    """The three servers on three hosts (network namespaces, nothing over loopback between them); the stream
    leader's link is cut for 8 s while an agent and a service publish, then mended."""
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    hosts = Hosts()
    try:
        hosts.create()
        base = rendezvous_base_port(offsets=(0, 1, 2, 100, 101, 102, 200, 201, 202))
        credentials = scratch_dir / "credentials"
        credentials.mkdir(mode=0o700)
        cluster = NatsCluster(scratch_dir, base, base + 100, base + 200, size=3, hosts=hosts.addresses,
                              credentials_dir=credentials, scope=NatsScope(PREFIX, STREAM, DLQ),
                              launchers=hosts.launchers())
        cluster.start(timeout_s=45)
        try:
            assert cluster.url == ",".join(f"nats://{address}:{base + i}" for i, address in enumerate(hosts.addresses))
            for server in cluster.servers:
                assert {route.get("ip") for route in (server.monitor("routez") or {}).get("routes") or []} <= set(
                    hosts.addresses) - {server.host}

            def cut(server: NatsServer) -> None:
                hosts.cut(cluster.servers.index(server))
                time.sleep(8)

            def mend(server: NatsServer) -> None:
                hosts.mend(cluster.servers.index(server))

            await publish_through_fault(cluster, cut, mend)
        finally:
            cluster.stop()
    finally:
        hosts.remove()
