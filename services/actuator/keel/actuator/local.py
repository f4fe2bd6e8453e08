"""The ``local`` actuator: nodes are the agents of a local cluster (``keel cluster up``) on this machine.

- Evict: stop the node's agent (SIGTERM to its process group: the agent stops its ranks), SIGKILL what
  is left after a grace period, and mark the node ``evicted`` in ``cluster.json`` (a human's
  ``keel cluster`` commands see it). Its shared memory is left to ``cluster down``: a real evicted
  machine is drained, not wiped.
- Provision: start a new standby agent (``s<NN>``, the next free number) with its own overlay root,
  agent folder and shared-memory folder, the same job, rendezvous and settings as the cluster's nodes.
  It registers, runs its self-check and joins the pool by itself.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from keel.actuator.core import ActuatorError
from keel.cluster.local import (
    ClusterError,
    alive,
    atomic_write,
    load_cluster,
    ranks_of,
    seed_overlay_root,
    spawn_agent,
)

_FLAGS_WITH_NODE_VALUES = ("--keel-node-id", "--keel-agent-dir", "--keel-root", "--keel-ckpt-dir", "--keel-fault-domain")


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

    def evict(self, node_id: str, reason: str) -> str:
        state = self._state()
        node = next((n for n in state["nodes"] if n["node_id"] == node_id), None)
        if node is None:
            raise ActuatorError(f"no node {node_id!r} in the local cluster at {self.directory}")
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
        for rank_pid in ranks_of(Path(node["agent_dir"])):
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
        for _ in range(count):
            while f"s{number:02d}" in taken:
                number += 1
            node_id = f"s{number:02d}"
            taken.add(node_id)
            agent_dir = self.directory / "nodes" / node_id
            root = agent_dir / "root"
            seed_overlay_root(root, gpus=int(state.get("nproc_per_node", 1)))
            ckpt_dir = Path(state["shm_root"]) / node_id
            argv = _standby_argv(template["argv"], node_id=node_id, agent_dir=agent_dir, root=root, ckpt_dir=ckpt_dir,
                                 fault_domain=f"domain-{node_id}")
            env = dict(os.environ, **state.get("env", {}))
            process = spawn_agent(argv, env, agent_dir)
            state["nodes"].append({"node_id": node_id, "standby": True, "agent_dir": str(agent_dir), "root": str(root),
                                   "pid": process.pid, "ckpt_dir": str(ckpt_dir), "argv": argv, "provisioned": True})
            started.append(node_id)
        self._save(state)
        return started


_NODE_CREDENTIAL_FLAGS = frozenset({"--keel-tls-cert", "--keel-tls-key", "--keel-tls-ca"})


def _standby_argv(template: list[str], *, node_id: str, agent_dir: Path, root: Path, ckpt_dir: Path,
                  fault_domain: str) -> list[str]:
    """A worker node's ``keel run`` command line turned into a new standby's: its own id and folders,
    ``--keel-standby``, and the same training command (a standby starts it only when promoted)."""
    values = {"--keel-node-id": node_id, "--keel-agent-dir": str(agent_dir), "--keel-root": str(root),
              "--keel-ckpt-dir": str(ckpt_dir), "--keel-fault-domain": fault_domain}
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
        if arg != "--keel-standby":
            argv.append(arg)
        if arg == "--keel-supervised":
            argv.append("--keel-standby")
        index += 1
    return argv
