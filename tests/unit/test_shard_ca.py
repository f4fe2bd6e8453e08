"""The shard stores' per-job CA (``keel.infra.shard_ca``): private files, one CA per job, node identities."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from cryptography import x509

from keel.infra.secrets import InsecurePathError
from keel.infra.shard_ca import (
    SERVER_NAME,
    ShardCaError,
    ensure_job_ca,
    issue_node_certificate,
    job_ca_dir,
    node_identity,
    node_uri,
    parse_node_uri,
    rotate_job_ca,
)


def test_a_node_certificate_names_its_node_and_every_file_is_private(tmp_path: Path) -> None:
    creds = issue_node_certificate(tmp_path, "train-1", "gpu07", hosts=("10.0.0.7", "gpu07.dc1"))
    folder = job_ca_dir(tmp_path, "train-1")
    files = [folder / "ca.key", folder / "ca.pem", creds.cert, creds.key, creds.ca]
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o600"}
    assert {oct(d.stat().st_mode & 0o777) for d in (tmp_path / "shard-ca", folder, creds.cert.parent)} == {"0o700"}
    cert_pem, _, ca_pem = creds.load()
    assert ca_pem == (folder / "ca.pem").read_bytes()
    assert node_identity(cert_pem, "train-1") == "gpu07"
    sans = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [SERVER_NAME, "gpu07.dc1"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    with pytest.raises(ShardCaError, match="node 'gpu07' of job 'train-1', not of job 'other'"):
        node_identity(cert_pem, "other")
    with pytest.raises(ShardCaError, match="names no Keel node"):
        node_identity(b"not a certificate", "train-1")


def test_one_ca_per_job_reused_by_every_issue_and_replaced_by_a_rotation(tmp_path: Path) -> None:
    first = ensure_job_ca(tmp_path, "job").read_bytes()
    assert issue_node_certificate(tmp_path, "job", "n0").ca.read_bytes() == first
    assert issue_node_certificate(tmp_path, "other", "n0").ca.read_bytes() != first
    rotate_job_ca(tmp_path, "job")
    assert not job_ca_dir(tmp_path, "job").exists()
    assert ensure_job_ca(tmp_path, "job").read_bytes() != first


def test_agents_starting_together_share_one_ca(tmp_path: Path) -> None:
    cas: list[bytes] = []
    threads = [threading.Thread(target=lambda n=n: cas.append(issue_node_certificate(tmp_path, "job", f"n{n}").ca.read_bytes()))
               for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cas) == 6 and len(set(cas)) == 1


def test_a_ca_key_others_can_read_is_refused_with_how_to_fix(tmp_path: Path) -> None:
    ensure_job_ca(tmp_path, "job")
    key = job_ca_dir(tmp_path, "job") / "ca.key"
    os.chmod(key, 0o644)
    with pytest.raises(InsecurePathError, match="chmod 600"):
        issue_node_certificate(tmp_path, "job", "n0")


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "x" * 200])
def test_ids_that_cannot_name_a_folder_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ShardCaError, match="cannot name a credentials folder"):
        issue_node_certificate(tmp_path, "job", bad)
    with pytest.raises(ShardCaError, match="job id"):
        ensure_job_ca(tmp_path, bad)


def test_node_uris_round_trip_and_other_uris_name_nobody() -> None:
    assert parse_node_uri(node_uri("job 1", "n/0")) == ("job 1", "n/0")
    assert parse_node_uri("https://example.com/node/x") is None
