"""The NATS cluster settings (``nats.cluster``, ``nats.embedded_cluster_size``, ``nats.hosts``, derived
``bus.replicas``) and the layout and configuration of an embedded cluster (``NatsCluster``), without servers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from keel.cli.runtime import runtime_for
from keel.infra.bus import server_urls
from keel.infra.config import ConfigError, load_settings
from keel.infra.embedded import NatsCluster, NatsServer, RuntimeStartError
from keel.infra.nats_auth import ROUTE_USER, route_password


def test_an_embedded_cluster_gets_r3_streams() -> None:
    settings = load_settings(environ={"KEEL_NATS__EMBEDDED_CLUSTER_SIZE": "3"})
    assert (settings.nats.embedded_cluster_size, settings.bus.replicas, settings.nats_url) == (3, 3, None)
    runtime = runtime_for(settings)
    assert (runtime.nats_cluster_size, runtime.nats_cluster.size) == (3, 3)
    assert load_settings(environ={}).bus.replicas == 1


def test_an_external_cluster_is_every_clients_server_list() -> None:
    urls = "nats://10.0.0.1:4222, nats://10.0.0.2:4222,tls://nats-3.example:4222"
    settings = load_settings(environ={"KEEL_NATS__CLUSTER": urls})
    assert settings.nats.cluster == ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222", "tls://nats-3.example:4222"]
    assert settings.nats_url == "nats://10.0.0.1:4222,nats://10.0.0.2:4222,tls://nats-3.example:4222"
    assert server_urls(settings.nats_url) == settings.nats.cluster
    assert settings.bus.replicas == 3
    # A service started with the joined URL (KEEL_NATS_URL) derives the same.
    assert load_settings(environ={"KEEL_NATS_URL": settings.nats_url}).bus.replicas == 3
    assert load_settings(environ={"KEEL_NATS__CLUSTER": urls, "KEEL_BUS__REPLICAS": "1"}).bus.replicas == 1
    assert load_settings(environ={"KEEL_NATS_URL": "nats://a:4222"}).bus.replicas == 1


def test_the_same_servers_in_nats_url_and_nats_cluster_are_fine(tmp_path: Path) -> None:
    config = tmp_path / "keel.yaml"
    config.write_text("nats:\n  cluster: [nats://a:4222, nats://b:4222, nats://c:4222]\n")
    settings = load_settings(config, environ={"KEEL_NATS_URL": "nats://a:4222,nats://b:4222,nats://c:4222"})
    assert settings.bus.replicas == 3


@pytest.mark.parametrize(("environ", "reason"), [
    ({"KEEL_NATS__EMBEDDED_CLUSTER_SIZE": "2"}, "embedded_cluster_size must be 1, 3 or 5"),
    ({"KEEL_NATS__EMBEDDED_CLUSTER_SIZE": "three"}, "nats.embedded_cluster_size"),
    ({"KEEL_NATS__CLUSTER": "10.0.0.1:4222"}, "is not a NATS server URL"),
    ({"KEEL_NATS__CLUSTER": "http://a:4222"}, "is not a NATS server URL"),
    ({"KEEL_NATS__CLUSTER": "nats://a:4222", "KEEL_NATS_URL": "nats://b:4222"}, "both name NATS servers"),
    ({"KEEL_NATS__CLUSTER": "nats://a:4222", "KEEL_NATS__EMBEDDED_CLUSTER_SIZE": "3"}, "set one of the two"),
    ({"KEEL_BUS__REPLICAS": "3"}, "bus.replicas 3 needs at least 3 NATS servers"),
    ({"KEEL_NATS__EMBEDDED_CLUSTER_SIZE": "3", "KEEL_NATS__HOSTS": "10.0.0.1,10.0.0.2"}, "2 addresses for 3"),
    ({"KEEL_NATS__HOSTS": "nats-1.local"}, "is not an IP address"),
    ({"KEEL_NATS__EMBEDDED_CLUSTER_SIZE": "3", "KEEL_NATS__CLUSTER_PORT": "4323"}, "falls in the ports of port"),
    ({"KEEL_NATS__EMBEDDED_CLUSTER_SIZE": "5", "KEEL_NATS__PORT": "65533"}, "past 65535"),
])
def test_bad_cluster_settings_say_what_is_wrong(environ: dict[str, str], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        load_settings(environ=environ)


def test_cluster_layout(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, 4322, 8322, 6322, size=3, hosts=("10.0.0.1", "10.0.0.2", "10.0.0.3"),
                          credentials_dir=tmp_path / "credentials")
    servers = cluster.servers
    assert [s.server_name for s in servers] == ["nats-1", "nats-2", "nats-3"]
    assert [(s.host, s.port, s.monitor_port) for s in servers] == [
        ("10.0.0.1", 4322, 8322), ("10.0.0.2", 4323, 8323), ("10.0.0.3", 4324, 8324)]
    assert servers[1].routes is not None
    assert servers[1].routes.port == 6323
    assert servers[1].routes.peers == (("10.0.0.1", 6322), ("10.0.0.3", 6324))
    assert cluster.url == "nats://10.0.0.1:4322,nats://10.0.0.2:4323,nats://10.0.0.3:4324"
    single = NatsCluster(tmp_path, 4322, 8322).servers
    assert len(single) == 1 and single[0].routes is None and single[0].store_dir == tmp_path / "nats"


@pytest.mark.parametrize(("size", "hosts", "reason"), [
    (2, (), "1, 3 or 5 servers"),
    (4, (), "1, 3 or 5 servers"),
    (3, ("10.0.0.1", "10.0.0.2"), "2 NATS server addresses for 3 servers"),
])
def test_bad_cluster_shapes_are_refused(tmp_path: Path, size: int, hosts: tuple[str, ...], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        NatsCluster(tmp_path, 4322, 8322, 6322, size=size, hosts=hosts)


def test_rendered_configuration_keeps_the_route_password_private(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    cluster = NatsCluster(tmp_path, 4322, 8322, 6322, size=3, credentials_dir=credentials)
    server = cluster.servers[0]
    config = server._render_config()
    assert 'listen: "127.0.0.1:4322"' in config and "server_name: \"nats-1\"" in config
    assert f'include "{server.cluster_file.name}"' in config
    block = server._render_cluster()
    password = route_password(credentials)
    assert password not in config and password in block
    assert os.stat(credentials / "nats" / "cluster-route.password").st_mode & 0o777 == 0o600
    assert route_password(credentials) == password  # generated once
    cluster_block = json.loads(block.split("cluster ", 1)[1])
    assert cluster_block["listen"] == "127.0.0.1:6322"
    assert cluster_block["authorization"]["user"] == ROUTE_USER
    assert cluster_block["routes"] == [f"nats-route://{ROUTE_USER}:{password}@127.0.0.1:{port}" for port in (6323, 6324)]
    assert "tls" not in cluster_block
    single = NatsCluster(tmp_path, 4322, 8322).servers[0]._render_config()
    assert "cluster" not in single and "server_name" not in single


def test_tls_cluster_routes_verify_certificates(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    server = NatsCluster(tmp_path, 4322, 8322, 6322, size=3, credentials_dir=credentials, tls=True).servers[2]
    assert server.url == "tls://127.0.0.1:4324"
    tls = json.loads(server._render_cluster().split("cluster ", 1)[1])["tls"]
    assert tls["verify"] is True
    assert all(Path(tls[key]).is_file() for key in ("cert_file", "key_file", "ca_file"))


def test_a_tampered_route_password_is_refused(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    route_password(credentials)
    path = credentials / "nats" / "cluster-route.password"
    path.write_text("short\n")
    with pytest.raises(Exception, match="does not hold a route password"):
        route_password(credentials)


def test_launchers_and_foreign_addresses(tmp_path: Path) -> None:
    launchers = tuple(("ip", "netns", "exec", f"h{i}") for i in range(3))
    cluster = NatsCluster(tmp_path, 4322, 8322, 6322, size=3, launchers=launchers)
    assert [s.launcher for s in cluster.servers] == list(launchers)
    with pytest.raises(ValueError, match="2 launchers for 3 NATS servers"):
        NatsCluster(tmp_path, 4322, 8322, 6322, size=3, launchers=launchers[:2])
    # 192.0.2.1 (TEST-NET-1) is no address of this host: said so before anything is spawned.
    server = NatsServer(tmp_path / "nats", 4322, 8322, host="192.0.2.1", credentials_dir=tmp_path / "credentials")
    with pytest.raises(RuntimeStartError, match="192.0.2.1 is not an address of this host"):
        server.start(timeout_s=1)
