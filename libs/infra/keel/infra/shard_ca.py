"""The shard stores' per-job certificate authority: mutual TLS between the node agents of one job.

Every node agent's shard store (``keel.agent.shard_store``) serves and dials its peers over mTLS. Trust is
per job: Keel creates one CA per job id and issues each node agent a certificate naming its node id, so
a peer proves which node of which job it is, and nothing outside the job can connect.

Layout, under the credentials folder (``keel.infra.config.credentials_path``), in ``shard-ca/``::

    shard-ca/<job>/ca.key                 the CA's private key (0600; never leaves this folder)
    shard-ca/<job>/ca.pem                 the CA certificate (what every node trusts)
    shard-ca/<job>/nodes/<node>/key.pem   a node's private key (0600)
    shard-ca/<job>/nodes/<node>/cert.pem  its certificate
    shard-ca/<job>/nodes/<node>/ca.pem    a copy of the CA certificate, so the folder is all a node needs

Folders are 0700 and every file 0600 (``keel.infra.secrets``); a folder or file that is not private to
this user is refused with the reason. A node certificate carries:

- a URI SAN ``keel://<job>/node/<node>`` (percent-encoded): the identity the shard store authorizes on
  (``node_identity``);
- the DNS SAN ``SERVER_NAME``, which clients verify the server against (every node of the job serves
  under that one name: a peer's address is no identity, its certificate is);
- DNS or IP SANs for the ``hosts`` it serves on, for tools that verify the address.

Keys are ECDSA P-256 (what gRPC's BoringSSL handles best). Contracts: ``ensure_job_ca`` creates the
CA once and reuses it afterwards; ``issue_node_certificate`` issues a fresh key and certificate on every
call; ``rotate_job_ca`` removes the job's CA and every certificate it issued, so the next issue starts a
new CA (agents of a running job must then be restarted with new certificates).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from keel.infra.secrets import ensure_private_dir, read_secret, write_secret

__all__ = [
    "SUBFOLDER",
    "SERVER_NAME",
    "CA_VALIDITY",
    "NODE_VALIDITY",
    "NodeCredentials",
    "ShardCaError",
    "job_ca_dir",
    "ensure_job_ca",
    "issue_node_certificate",
    "rotate_job_ca",
    "node_uri",
    "parse_node_uri",
    "node_identity",
]

SUBFOLDER = "shard-ca"
"""The credentials sub-folder this module owns."""
SERVER_NAME = "shard-store.keel.invalid"
"""The DNS name every node certificate carries and every client verifies (``.invalid``: never resolvable)."""
CA_VALIDITY = dt.timedelta(days=3650)
NODE_VALIDITY = dt.timedelta(days=365)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ShardCaError(ValueError):
    """A job or node id that cannot name a folder, or a certificate that names no node of the job."""


@dataclass(frozen=True)
class NodeCredentials:
    """Where a node's mTLS material lies: its certificate, its private key, and the job's CA certificate."""

    cert: Path
    key: Path
    ca: Path

    def load(self) -> tuple[bytes, bytes, bytes]:
        """``(certificate chain, private key, CA certificate)``, PEM, each read through ``read_secret``
        (private regular files of this user only)."""
        return read_secret(self.cert), read_secret(self.key), read_secret(self.ca)


def _folder_name(kind: str, value: str) -> str:
    if not _SAFE_NAME.match(value) or value in (".", ".."):
        raise ShardCaError(f"{kind} id {value!r} cannot name a credentials folder: use letters, digits, '.', '_' "
                           f"and '-' (at most 128, not starting with '.', '_' or '-')")
    return value


def job_ca_dir(credentials: Path, job_id: str) -> Path:
    """``<credentials>/shard-ca/<job>``; ``ShardCaError`` for a job id that cannot name a folder."""
    return Path(credentials) / SUBFOLDER / _folder_name("job", job_id)


def node_uri(job_id: str, node_id: str) -> str:
    """The URI SAN naming ``node_id`` of ``job_id``."""
    return f"keel://{quote(job_id, safe='')}/node/{quote(node_id, safe='')}"


def parse_node_uri(uri: str) -> tuple[str, str] | None:
    """``(job, node)`` of a ``node_uri``; None for any other URI."""
    match = re.match(r"^keel://([^/]+)/node/([^/]+)$", uri)
    return (unquote(match.group(1)), unquote(match.group(2))) if match else None


def node_identity(pem_cert: bytes, job_id: str) -> str:
    """The node id a certificate (already verified against the job's CA by the TLS handshake) names for
    ``job_id``. ``ShardCaError`` when it names none, several, or a node of another job."""
    try:
        cert = x509.load_pem_x509_certificate(pem_cert)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise ShardCaError(f"the peer's certificate names no Keel node: {exc}") from None
    found = [parsed for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)
             if (parsed := parse_node_uri(uri)) is not None]
    if len(found) != 1:
        raise ShardCaError(f"the peer's certificate must name exactly one Keel node (a keel://<job>/node/<id> URI), "
                           f"it names {len(found)}")
    job, node = found[0]
    if job != job_id:
        raise ShardCaError(f"the peer's certificate names node {node!r} of job {job!r}, not of job {job_id!r}")
    return node


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock: agents of one host starting together must not each create a CA."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_job_ca(credentials: Path, job_id: str) -> Path:
    """The job's CA certificate (``ca.pem``), created with its key on first use. Returns its path."""
    folder = job_ca_dir(credentials, job_id)
    ensure_private_dir(folder.parent)
    ensure_private_dir(folder)
    with _locked(folder):
        return _ensure_job_ca(folder, job_id)


def _ensure_job_ca(folder: Path, job_id: str) -> Path:
    cert_path, key_path = folder / "ca.pem", folder / "ca.key"
    if key_path.exists() and cert_path.exists():
        read_secret(key_path)  # refuses a key that is not private, before anything trusts it
        return cert_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Keel"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"Keel shard-store CA for job {job_id}")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    # The key first: a crash in between leaves a key without a certificate, which the next call replaces.
    write_secret(key_path, _key_pem(key))
    write_secret(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path


def _san(hosts: tuple[str, ...], job_id: str, node_id: str) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(node_uri(job_id, node_id)),
                                     x509.DNSName(SERVER_NAME)]
    for host in dict.fromkeys(h.strip("[]") for h in hosts if h):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue_node_certificate(credentials: Path, job_id: str, node_id: str, *,
                           hosts: tuple[str, ...] = ()) -> NodeCredentials:
    """Issue ``node_id`` of ``job_id`` a fresh key and certificate from the job's CA (created if absent),
    for serving and dialing the shard stores; ``hosts``: the addresses it serves on (SANs). Returns the
    paths; the folder ``shard-ca/<job>/nodes/<node>`` is all the node needs."""
    ca_cert_path = ensure_job_ca(credentials, job_id)
    folder = job_ca_dir(credentials, job_id)
    ca_key = serialization.load_pem_private_key(read_secret(folder / "ca.key"), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ShardCaError(f"{folder / 'ca.key'} is not an ECDSA key: remove {folder} to create a new CA")
    ca_pem = read_secret(ca_cert_path)
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    node_dir = folder / "nodes" / _folder_name("node", node_id)
    ensure_private_dir(node_dir.parent)
    ensure_private_dir(node_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + NODE_VALIDITY, ca_cert.not_valid_after_utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Keel"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, node_id[:64])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(_san(hosts, job_id, node_id), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = NodeCredentials(cert=node_dir / "cert.pem", key=node_dir / "key.pem", ca=node_dir / "ca.pem")
    write_secret(paths.key, _key_pem(key))
    write_secret(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
    write_secret(paths.ca, ca_pem)
    return paths


def rotate_job_ca(credentials: Path, job_id: str) -> None:
    """Remove the job's CA and every node certificate it issued (the next ``issue_node_certificate``
    creates a new CA). Running agents keep their old certificates until restarted: rotate between runs."""
    folder = job_ca_dir(credentials, job_id)
    if folder.is_symlink():
        raise ShardCaError(f"{folder} is a symbolic link: refusing to remove what it points to")
    shutil.rmtree(folder, ignore_errors=True)
