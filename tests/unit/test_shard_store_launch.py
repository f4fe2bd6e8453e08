"""Where a node's shard store listens and which certificate it presents (``keel run`` arguments, settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.agent.launch_spec import LaunchError, parse_launch_args
from keel.cli.agent_cmd import store_bind_address, store_tls
from keel.infra.config import Settings
from keel.infra.shard_ca import issue_node_certificate, node_identity


def test_one_node_binds_loopback_and_several_never_every_interface_unless_asked(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    single = parse_launch_args(["--keel-job-id", "j", "train.py"])
    assert store_bind_address(single, settings) == "127.0.0.1:0"
    multi = parse_launch_args(["--nnodes", "2", "--master-addr", "127.0.0.1", "--keel-job-id", "j", "train.py"])
    assert multi.store_address == ""
    assert store_bind_address(multi, settings) == "127.0.0.1:0"  # the interface that reaches the master
    configured = Settings(home=tmp_path, checkpoint={"store_address": "10.1.2.3:7301"})
    assert store_bind_address(multi, configured) == "10.1.2.3:7301"
    explicit = parse_launch_args(["--nnodes", "2", "--keel-store-address", "0.0.0.0:7301", "train.py"])
    assert store_bind_address(explicit, configured) == "0.0.0.0:7301"


def test_tls_files_go_together_or_the_agent_issues_its_own(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="--keel-tls-key, --keel-tls-ca missing"):
        parse_launch_args(["--keel-tls-cert", "/x/cert.pem", "train.py"])
    settings = Settings(home=tmp_path)
    spec = parse_launch_args(["--keel-job-id", "j", "--keel-node-id", "n3", "train.py"])
    issued = store_tls(spec, settings, ("127.0.0.1",))  # from <home>/credentials/shard-ca/j/
    assert node_identity(issued.cert_chain, "j") == "n3"
    assert (tmp_path / "credentials" / "shard-ca" / "j" / "ca.key").exists()
    given = issue_node_certificate(tmp_path / "elsewhere", "j", "n3")
    spec = parse_launch_args(["--keel-job-id", "j", "--keel-node-id", "n3", "--keel-tls-cert", str(given.cert),
                              "--keel-tls-key", str(given.key), "--keel-tls-ca", str(given.ca), "train.py"])
    loaded = store_tls(spec, settings, ())
    assert loaded.cert_chain == given.cert.read_bytes() and "private_key=<hidden>" in repr(loaded)
