"""The ``local`` actuator: nodes are the agents of a local cluster (``keel cluster up``) on this machine.

- Evict: stop the node's agent (SIGTERM to its process group: the agent stops its ranks), SIGKILL what
  is left after a grace period, and mark the node ``evicted`` in ``cluster.json`` (a human's
  ``keel cluster`` commands see it). A node frozen as unreachable (``freeze_node``: a host cut off) cannot
  be drained: the eviction is reported failed, and the controller's fence keeps the node out. Its shared memory is left to ``cluster down``: a real evicted
  machine is drained, not wiped.
- Provision: start a new standby agent (``s<NN>``, the next free number) with its own overlay root,
  agent folder and shared-memory folder, the same job, rendezvous and settings as the cluster's nodes.
  It registers, runs its self-check and joins the pool by itself. On a cluster of hosts (``keel cluster up
  --hosts netns``) it gets a host of its own on the cluster's network, and its shard store that host's address.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from keel.actuator.core import ActuatorError
from keel.cluster import netns
from keel.cluster.local import (
    ClusterError,
    alive,
    atomic_write,
    host_argv,
    host_network,
    issue_agent_identities,
    load_cluster,
    ranks_of,
    seed_overlay_root,
    spawn_agent,
)

_FLAGS_WITH_NODE_VALUES = ("--keel-node-id", "--keel-agent-dir", "--keel-root", "--keel-ckpt-dir", "--keel-fault-domain",
                           "--keel-store-address")


class LocalActuator:
    name = "local"

    def __init__(self, directory: Path, grace_s: float = 10.0) -> None:
        self.directory = Path(directory)
        self.grace_s = grace_s

    def _state(self) -> dict[str, Any]:
        try:
            return load_cluster(self.directory)
        except (ClusterError, OSError, ValueError) as exc:
            raise ActuatorError(str(exc)) from exc

    def _save(self, state: dict[str, Any]) -> None:
        atomic_write(self.directory / "cluster.json", json.dumps(state, indent=2))

    def evict(self, node_id: str, reason: str, incident: str = "") -> str:
        state = self._state()
        node = next((n for n in state["nodes"] if n["node_id"] == node_id), None)
        if node is None:
            raise ActuatorError(f"no node {node_id!r} in the local cluster at {self.directory}")
        if node.get("unreachable"):
            # A frozen or partitioned host (``keel.cluster.local.freeze_node``): nothing reaches it.
            raise ActuatorError(f"{node_id} is unreachable (frozen or cut off): it cannot be drained now; "
                                f"it is fenced out of the job by the controller's decision")
        pid = node["pid"]
        how = "not running"
        if alive(pid):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + self.grace_s
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            how = "agent stopped"
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
                how = f"agent SIGKILLed after {self.grace_s:g} s"
        # Its ranks and warm zygote lead process groups of their own: an agent SIGKILLed cannot stop them.
        for rank_pid in ranks_of(Path(node["agent_dir"]), zygotes=True):
            try:
                os.killpg(rank_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        node["evicted"] = True
        node["evicted_reason"] = reason[:500]
        self._save(state)
        return f"{node_id} drained from the local cluster ({how})"

    def standbys(self) -> list[str]:
        return [n["node_id"] for n in self._state()["nodes"]
                if n["standby"] and not n.get("evicted") and not n.get("promoted") and alive(n["pid"])]

    def mark_promoted(self, node_id: str) -> None:
        state = self._state()
        node = next((n for n in state["nodes"] if n["node_id"] == node_id), None)
        if node is None:
            raise ActuatorError(f"no node {node_id!r} in the local cluster at {self.directory}")
        node["standby"], node["promoted"] = False, True
        self._save(state)

    def provision_standbys(self, count: int) -> list[str]:
        state = self._state()
        # A worker's command line: it carries the training command a promoted standby will run.
        template = next((n for n in state["nodes"] if not n["standby"]), state["nodes"][0])
        taken = {n["node_id"] for n in state["nodes"]}
        started = []
        number = 0
        try:
            network = host_network(state)
        except ClusterError as exc:
            raise ActuatorError(str(exc)) from exc
        for _ in range(count):
            while f"s{number:02d}" in taken:
                number += 1
            node_id = f"s{number:02d}"
            taken.add(node_id)
            agent_dir = self.directory / "nodes" / node_id
            root = agent_dir / "root"
            seed_overlay_root(root, gpus=int(state.get("nproc_per_node", 1)))
            ckpt_dir = Path(state["shm_root"]) / node_id
            address = "127.0.0.1"
            if network is not None:  # a machine of its own: a new host on the cluster's network
                try:
                    network = netns.add_host(network, node_id)
                except netns.NetnsError as exc:
                    raise ActuatorError(f"cannot make a host for standby {node_id}: {exc}") from exc
                address = network.host(node_id).address
                try:
                    issue_agent_identities(Path(state["credentials_dir"]), state["job_id"], [node_id])
                except (ClusterError, KeyError) as exc:
                    raise ActuatorError(f"standby {node_id}: {exc}") from exc
            argv = _standby_argv(template["argv"], node_id=node_id, agent_dir=agent_dir, root=root, ckpt_dir=ckpt_dir,
                                 fault_domain=f"domain-{node_id}", store_address=f"{address}:0")
            env = dict(os.environ, **state.get("env", {}))
            node = {"node_id": node_id, "standby": True, "agent_dir": str(agent_dir), "root": str(root),
                    "ckpt_dir": str(ckpt_dir), "argv": argv, "provisioned": True, "address": address,
                    **({"host": node_id} if network is not None else {})}
            node["pid"] = spawn_agent(host_argv(network, node, argv), env, agent_dir).pid
            state["nodes"].append(node)
            started.append(node_id)
        self._save(state)
        return started


_NODE_CREDENTIAL_FLAGS = frozenset({"--keel-tls-cert", "--keel-tls-key", "--keel-tls-ca"})


def _standby_argv(template: list[str], *, node_id: str, agent_dir: Path, root: Path, ckpt_dir: Path,
                  fault_domain: str, store_address: str = "127.0.0.1:0") -> list[str]:
    """A worker node's ``keel run`` command line turned into a new standby's: its own id, folders and shard-store
    address (its host's), ``--keel-standby``, and the same training command (a standby starts it only when
    promoted)."""
    values = {"--keel-node-id": node_id, "--keel-agent-dir": str(agent_dir), "--keel-root": str(root),
              "--keel-ckpt-dir": str(ckpt_dir), "--keel-fault-domain": fault_domain,
              "--keel-store-address": store_address}
    argv: list[str] = []
    index = 0
    while index < len(template):
        arg = template[index]
        if arg in _FLAGS_WITH_NODE_VALUES and index + 1 < len(template):
            argv += [arg, values[arg]]
            index += 2
            continue
        if arg in _NODE_CREDENTIAL_FLAGS and index + 1 < len(template):
            # The worker's shard-store certificate names the worker: the standby's agent issues its own
            # from the job's CA in the credentials folder (keel.infra.shard_ca).
            index += 2
            continue
        launcher = arg == "run" and argv[-1:] == ["keel.cli.main"]  # `python -m keel.cli.main run ...`
        if arg != "--keel-standby":
            argv.append(arg)
        if launcher:
            argv.append("--keel-standby")  # a launcher flag, before the training command
        index += 1
    return argv
