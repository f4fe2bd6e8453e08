"""The Kubernetes actuator's real adapter (``HttpKubeApi``: HTTPS, a bearer token re-read from its file, the
CA it is given) against the contract-checking fake served over HTTPS on loopback: the same requests reach
the fake as in the unit tests, so the fake stands for the adapter's behaviour too. Errors come back as the
API sends them (status and message)."""

from __future__ import annotations

import datetime as dt
import json
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from keel.actuator.core import ActuatorError
from keel.actuator.kubernetes import HttpKubeApi, KubeApiError, KubernetesActuator
from keel.actuator.kubernetes_rules import EVICTED_LABEL, JOB_LABEL, ROLE_LABEL
from tests.k8s_contract import ContractError, FakeKubeApi

TOKEN = "s3cret-token"


def self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "apiserver.crt", folder / "apiserver.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
def apiserver(tmp_path: Path) -> Iterator[tuple[str, Path, FakeKubeApi, list[str]]]:
    fake = FakeKubeApi()
    fake.add_node("gpu-1")
    fake.add_node("spare-1")
    fake.add_pod("ns", "w-0", "gpu-1", {JOB_LABEL: "llm", ROLE_LABEL: "worker"})
    fake.add_pod("ns", "s-0", "spare-1", {JOB_LABEL: "llm", ROLE_LABEL: "standby"})
    fake.deployments[("ns", "llm-standby")] = 1
    seen_tokens: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            seen_tokens.append(self.headers.get("Authorization", ""))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._answer(401, {"kind": "Status", "message": "Unauthorized"})
            url = urllib.parse.urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            try:
                answer = fake.request(self.command, url.path, query=dict(urllib.parse.parse_qsl(url.query)), body=body,
                                      content_type=self.headers.get("Content-Type", "application/json"))
            except KubeApiError as exc:
                return self._answer(exc.status, {"kind": "Status", "message": str(exc)})
            except ContractError as exc:
                return self._answer(422, {"kind": "Status", "message": f"contract: {exc}"})
            self._answer(200, answer)

        do_GET = do_PATCH = do_DELETE = _serve

        def _answer(self, status: int, document: object) -> None:
            data = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    cert, key = self_signed(tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://localhost:{server.server_address[1]}", cert, fake, seen_tokens
    finally:
        server.shutdown()
        server.server_close()


def test_the_http_adapter_speaks_the_published_api(apiserver, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, ca, fake, tokens = apiserver
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    api = HttpKubeApi(url, token=lambda: token_file.read_text().strip(), ca_file=ca)
    actuator = KubernetesActuator(api, keel_job_id="llm", namespace="ns", standby_deployment="llm-standby")
    assert actuator.standbys() == ["spare-1"]
    detail = actuator.evict("gpu-1", "GPU lost", incident="abc")
    assert "cordoned" in detail and "w-0" in detail
    assert fake.nodes["gpu-1"]["metadata"]["labels"][EVICTED_LABEL] == "true" and ("ns", "w-0") not in fake.pods
    assert actuator.provision_standbys(2) == ["llm-standby+1", "llm-standby+2"]
    assert fake.deployments[("ns", "llm-standby")] == 3
    assert set(tokens) == {f"Bearer {TOKEN}"}
    # The API's errors arrive as such: a missing node is the actuator's clear error, a bad token a 401.
    with pytest.raises(ActuatorError, match="not a node"):
        actuator.evict("gpu-9", "x")
    token_file.write_text("rotated-but-wrong")
    with pytest.raises(KubeApiError, match="401"):
        actuator.standbys()


def test_an_untrusted_or_unreachable_server_is_a_clear_error(apiserver, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, _, _, _ = apiserver
    other_ca, _ = self_signed(tmp_path / "other" if (tmp_path / "other").mkdir() is None else tmp_path)
    with pytest.raises(ActuatorError, match="unreachable"):
        HttpKubeApi(url, token=TOKEN, ca_file=other_ca).request("GET", "/api/v1/nodes/gpu-1")
    with pytest.raises(ActuatorError, match="not in a Kubernetes pod"):
        HttpKubeApi.in_cluster(environ={})
