"""The NATS configuration docker-compose.yml ships (infra/nats/nats.conf), run by the real ``nats-server``.

Docker is not available here, so the test plays the compose file's part: the ``credentials`` step
(``keel-credentials init --tls-host nats ... --export-server ... --export ...``, the same console script) writes
the server's files and the consumers' bundles; the shipped configuration, with only its container paths and
ports replaced (each replacement must match exactly once, so a change to the file is noticed here), is served
by the ``nats-server`` of this environment. A Keel client with its exported bundle reaches it over TLS as its
own identity, with its permissions enforced; without an identity, or in plain text, it is refused."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from keel.infra.bus import Bus, NotAuthorized, NotPermitted, connect_credentials
from keel.infra.config import BusSettings, load_settings
from keel.infra.embedded import _nats_server_binary, free_port
from keel.infra.nats_auth import bus_settings_for
from keel.infra.provision import main as keel_credentials

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONTAINER_FOLDER = "/etc/nats/keel"  # where docker-compose.yml mounts the nats-credentials volume


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"infra/nats/nats.conf no longer has exactly one {old!r}: update this test"
    return text.replace(old, new)


def shipped_config(etc: Path, port: int, monitor_port: int, store: Path) -> Path:
    """infra/nats/nats.conf with the container's ports and paths replaced, at ``etc/nats.conf`` (so its
    relative ``include`` resolves as it does in /etc/nats/ in the container)."""
    text = (ROOT / "infra/nats/nats.conf").read_text()
    text = _replace_once(text, 'listen: "0.0.0.0:4222"', f'listen: "127.0.0.1:{port}"')
    text = _replace_once(text, "http_port: 8222", f'http: "127.0.0.1:{monitor_port}"')
    text = _replace_once(text, 'store_dir: "/data"', f"store_dir: {json.dumps(str(store))}")
    quoted = f'"{CONTAINER_FOLDER}/'
    assert text.count(quoted) == 2  # the certificate and the key; the include is relative
    text = text.replace(quoted, f'"{etc / "keel"}/')
    path = etc / "nats.conf"
    path.write_text(text)
    return path


def _healthy(monitor_port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:  # the compose healthcheck's URL
        with opener.open(f"http://127.0.0.1:{monitor_port}/healthz?js-enabled-only=true", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def compose_nats(scratch_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """(URL, folder of the exported bundles): the compose credentials step, then the shipped nats.conf served."""
    exports, etc = scratch_dir / "export", scratch_dir / "etc-nats"
    exports.mkdir(mode=0o700)
    etc.mkdir()
    monkeypatch.setenv("KEEL_CREDENTIALS_DIR", str(scratch_dir / "master"))
    argv = ["init", "--tls-host=nats", "--tls-host=localhost", "--tls-host=127.0.0.1",
            f"--export-server={etc / 'keel'}", f"--export=migrate={exports / 'migrate'}",
            f"--export=recorder={exports / 'recorder'}", f"--export=operator={exports / 'operator'}"]
    assert keel_credentials(argv) == 0
    monkeypatch.delenv("KEEL_CREDENTIALS_DIR")
    port, monitor_port = free_port(), free_port()
    config = shipped_config(etc, port, monitor_port, scratch_dir / "data")
    log = (scratch_dir / "nats.log").open("wb")
    process = subprocess.Popen([str(_nats_server_binary()), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not _healthy(monitor_port):
            assert process.poll() is None, (scratch_dir / "nats.log").read_text()
            assert time.monotonic() < deadline, (scratch_dir / "nats.log").read_text()
            time.sleep(0.05)
        # The certificate names localhost (and nats, which does not resolve here); the client verifies it.
        yield f"tls://localhost:{port}", exports
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def bundle_settings(exports: Path, bundle: str, identity: str) -> BusSettings:
    """What a container with ``KEEL_CREDENTIALS_DIR`` at this bundle connects with."""
    settings = load_settings(environ={"KEEL_CREDENTIALS_DIR": str(exports / bundle)})
    return bus_settings_for(settings, identity)


async def test_the_shipped_config_serves_keel_identities_over_tls_only(compose_nats: tuple[str, Path]) -> None:
    url, exports = compose_nats
    started = time.monotonic()
    admin = bundle_settings(exports, "migrate", "admin")
    assert admin.tls_ca == exports / "migrate/nats/shard-ca/tls/ca.pem" and admin.credentials is not None
    migrate = await Bus.connect(url, admin, name="keel-migrate", administer=True)  # creates the streams
    await migrate.close()

    recorder = await Bus.connect(url, bundle_settings(exports, "recorder", "recorder"), name="keel-recorder")
    try:  # its own permissions, not just any password: a controller's decision is refused by the server
        with pytest.raises(NotPermitted):
            await recorder.publish_raw("keel.j.node.n0.NodeEvictionDecided", b"{}", msg_id="forged-1")
    finally:
        await recorder.close()

    with pytest.raises(NotAuthorized):  # TLS verified, but no identity
        await Bus.connect(url, BusSettings(tls_ca=admin.tls_ca), name="stranger")
    with pytest.raises(Exception, match="(?i)certificate|ssl"):  # an identity, but not the server's CA
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                           **connect_credentials(BusSettings(credentials=admin.credentials), url))  # type: ignore[arg-type]
    plain = url.replace("tls://", "nats://")
    with pytest.raises(Exception, match="(?i)certificate|ssl|tls"):  # the server speaks TLS only
        await nats.connect(plain, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                           **connect_credentials(BusSettings(credentials=admin.credentials), plain))  # type: ignore[arg-type]
    assert time.monotonic() - started < 10

