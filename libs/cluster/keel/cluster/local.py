"""`keel cluster up|down|status` and `keel inject`: a local multi-node cluster and fault injection.

A local cluster runs N node agents on this machine, each a separate node with its own id, fault
domain, agent directory and *overlay root*: the files its health probes read (``proc/pressure``,
``proc/vmstat``, ``sys/class/net``, ``dev/kmsg``, ``run/keel/nvml.json`` — simulated GPUs, since the
machine has none). Hardware faults are injected by changing those files, exactly as the kernel or the
driver would change the real ones; workload faults are written to the node's fault file, which the
training processes' SDK reads. Every injection is also published as a ``FaultInjected`` event, so
detection latency is measured from the log. ``nic-down`` takes ``interface`` (default ``eth0``) and
``flaps``: with ``flaps=N`` the link is not left down but went down and up N times (``carrier_changes``
+= 2N), a soft signal the inspector tolerates and stop-time diagnostics catch.

Standbys run idle with the job's training command (``--keel-standby``): a ``StandbyPromotionRequested``
gives one any node's slice of ranks (``keel.agent.commands``).

By default every node shares this machine's loopback. Given a host network (``keel.cluster.netns``,
``keel cluster up --hosts netns``), each node is a host of its own on it: its agent runs in the node's
network namespace and everything between nodes crosses the bridge; ``cut_link`` partitions one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from keel.cluster import netns
from keel.cluster.netns import HOST_IFNAME, NetnsError, NetworkPlan
from keel.events.envelope import Event, now_utc
from keel.events.types import FaultInjected
from keel.events.units import parse_duration
from keel.infra.bus import Bus
from keel.infra.config import Settings, credentials_path
from keel.infra.embedded import rendezvous_base_port
from keel.infra.nats_auth import OPERATOR, NatsAuthError, NatsAuthority, bus_settings_for
from keel.infra.secrets import ensure_private_dir
from keel.infra.shard_ca import issue_node_certificate
from keel.infra.signing import keyring_path

WORKLOAD_FAULTS = {"crash", "hang", "hang_stopped", "slow", "nan", "oom", "oom_kernel"}
HARDWARE_FAULTS = {"gpu-lost", "xid", "nic-down", "disk-full", "sdc"}
RANK_READ_FAULTS = WORKLOAD_FAULTS | {"sdc"}
LINK_FAULTS = {"link-cut", "link-restore"}
"""Faults of a host network (``keel cluster up --hosts netns``): a host's link to the bridge cut (optionally
restored after ``params["for"]``, a duration) or restored. The target is a node (its host), or a host of the
network that runs no node: ``control`` (the control plane's) or one of the NATS servers' (``nats-1``...)."""
"""Faults the ranks apply themselves from files: only in a cluster started with fault injection on."""
FAULT_KINDS = WORKLOAD_FAULTS | HARDWARE_FAULTS
SIMULATED_NIC = "eth0"


class ClusterError(RuntimeError):
    """A user-facing cluster or injection error."""


# -- cluster state ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    standby: bool
    agent_dir: Path
    root: Path
    pid: int

    @property
    def fault_file(self) -> Path:
        return self.agent_dir / "fault.json"


def cluster_dir(settings: Settings, override: str | None = None) -> Path:
    return Path(override) if override else settings.home / "cluster"


def load_cluster(directory: Path) -> dict[str, Any]:
    state_file = directory / "cluster.json"
    if not state_file.exists():
        raise ClusterError(f"no local cluster in {directory}: run `keel cluster up` first")
    return json.loads(state_file.read_text())


def cluster_nodes(state: dict[str, Any]) -> dict[str, NodeInfo]:
    return {
        n["node_id"]: NodeInfo(n["node_id"], n["standby"], Path(n["agent_dir"]), Path(n["root"]), n["pid"])
        for n in state["nodes"]
    }


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def seed_overlay_root(root: Path, gpus: int) -> None:
    """The files a simulated node's probes read: a calm host (no pressure, no load: copying this
    machine's live values would freeze whatever load it had at that moment into every node), this
    machine's vmstat counters, a simulated NIC and simulated GPUs."""
    calm_psi = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    for relative, text in (("proc/pressure/memory", calm_psi), ("proc/pressure/cpu", calm_psi),
                           ("proc/pressure/io", calm_psi), ("proc/loadavg", "0.00 0.00 0.00 1/100 1\n")):
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    try:
        (root / "proc/vmstat").write_text(Path("/proc/vmstat").read_text())
    except OSError:
        (root / "proc/vmstat").write_text("oom_kill 0\n")
    nic = root / "sys/class/net" / SIMULATED_NIC
    nic.mkdir(parents=True, exist_ok=True)
    (nic / "operstate").write_text("up\n")
    (nic / "carrier").write_text("1\n")
    (nic / "carrier_changes").write_text("0\n")
    (root / "dev").mkdir(parents=True, exist_ok=True)
    (root / "dev/kmsg").write_text("")
    devices: list[dict[str, object]] = [  # the simulated NVML document (JSON)
        {"index": i, "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'{root}/{i}')}",
         "name": "Simulated GPU (keel local cluster)", "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
         "temperature_c": 40, "ecc": {"volatile_sbe": 0, "volatile_dbe": 0, "aggregate_sbe": 0, "aggregate_dbe": 0},
         "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
         "retired_pages_pending": False, "throttle_reasons": 0, "xids": [], "lost": False, "error": None}
        for i in range(gpus)
    ]
    atomic_write(root / "run/keel/nvml.json", json.dumps({"device_count": gpus, "devices": devices}, indent=1))


NODE_ENV = ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
"""Variables besides ``KEEL_*`` that every agent of the cluster gets, recorded so that a node started later
(``start_node``, the actuator's standbys and refills) runs as its peers do: a different ``OMP_NUM_THREADS``
changes a rank's floating-point reduction order, and a resumed job would no longer be bitwise exact."""


def cluster_up(
    settings: Settings,
    directory: Path,
    *,
    nodes: int,
    standby: int,
    nproc_per_node: int,
    job_id: str,
    command: list[str],
    nats_url: str | None,
    extra_env: dict[str, str] | None = None,
    probe_interval: str = "1s",
    heartbeat_interval: str = "5s",
    persist_root: Path | None = None,
    fault_injection: bool = False,
    network: NetworkPlan | None = None,
) -> dict[str, Any]:
    """Start ``nodes`` agents running ``command`` (and ``standby`` idle ones). Returns the state written.

    ``network`` (``keel.cluster.netns``, ``keel cluster up --hosts netns``): each node is a host of its own
    on that network (a namespace named after the node, added here, removed by ``cluster_down``); its agent
    runs inside it, the rendezvous master is node rank 0's host address, each shard store binds its host's
    address and gloo its ``eth0``. ``nats_url`` must then be reachable from the bridge (not loopback).
    Without it, every node shares this machine's loopback (the flat local cluster).

    ``fault_injection``: the agents run with ``--keel-fault-injection``, so ``keel inject`` can make their
    ranks fail (workload faults and ``sdc``, which the ranks read from files); off, ``inject`` refuses
    those kinds. Each node's agent folder is created private to this user (0700) before the agent starts.

    Each node gets its own shared-memory checkpoint folder under one ``/dev/shm/keel-cluster-*`` root
    (removed by ``cluster_down``; ``kill_node`` removes one node's, as losing the machine would) and
    the persistent tier under ``persist_root`` (default: the configured ``checkpoint.persist_root``,
    ``<home>/checkpoints``, the folder the checkpoint broker of ``keel up`` writes manifests in).
    """
    if (directory / "cluster.json").exists():
        state = json.loads((directory / "cluster.json").read_text())
        if any(alive(n["pid"]) for n in state["nodes"]):
            raise ClusterError(f"a local cluster already runs in {directory}; `keel cluster down` first")
    if not command:
        raise ClusterError("no training command: keel cluster up --nodes N -- [-m module | script.py] [args]")
    if network is not None:
        _check_reachable_from_hosts(nats_url, network)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    master_port = rendezvous_base_port()
    shm_root = Path("/dev/shm") / f"keel-cluster-{uuid.uuid4().hex[:10]}"
    # The agents write shards where the broker looks for them: one setting for both, or the disk tier
    # never commits (the broker would wait for shard files in another folder and give every step up).
    persist_root = persist_root or settings.checkpoint.resolved_persist_root(settings.home)
    env = dict(os.environ, **(extra_env or {}))
    # The simulated nodes share this host's cores: one OpenMP thread per rank, as torchrun gives several
    # ranks of one host (each agent alone would leave it unset for a single rank per node).
    env.setdefault("OMP_NUM_THREADS", "1")
    if nats_url:
        env["KEEL_NATS_URL"] = nats_url
    # The agents check their commands' signatures against the keyring these settings name (a config file
    # given to this command is not read by the agents).
    env.setdefault("KEEL_SIGNING__KEYRING", str(keyring_path(settings)))
    node_ids = [f"s{index - nodes:02d}" if index >= nodes else f"n{index:02d}" for index in range(nodes + standby)]
    addresses = {node_id: "127.0.0.1" for node_id in node_ids}
    if network is not None:
        # Every node's host before any agent starts: the rendezvous master is node rank 0's host.
        env["GLOO_SOCKET_IFNAME"] = HOST_IFNAME  # gloo would resolve the machine's hostname, on no host's link
        issue_agent_identities(credentials_path(settings), job_id, node_ids)
        try:
            for node_id in node_ids:
                network = netns.add_host(network, node_id)
                addresses[node_id] = network.host(node_id).address
        except NetnsError as exc:
            for node_id in node_ids:
                if any(h.name == node_id for h in network.hosts):
                    network = netns.remove_host(network, node_id)
            raise ClusterError(f"cannot make the node hosts: {exc}") from None
    master_addr = addresses[node_ids[0]]
    node_states = []
    for index, node_id in enumerate(node_ids):
        is_standby = index >= nodes
        agent_dir = ensure_private_dir(directory / "nodes" / node_id)  # what the agent accepts
        root = agent_dir / "root"
        seed_overlay_root(root, gpus=nproc_per_node)
        argv = [
            sys.executable, "-m", "keel.cli.main", "run",
            "--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node),
            "--node-rank", str(min(index, nodes - 1)), "--master-addr", master_addr, "--master-port", str(master_port),
            "--keel-job-id", job_id, "--keel-node-id", node_id, "--keel-fault-domain", f"domain-{index}",
            "--keel-agent-dir", str(agent_dir), "--keel-root", str(root),
            "--keel-probe-interval", probe_interval, "--keel-heartbeat-interval", heartbeat_interval,
            "--keel-ckpt-dir", str(shm_root / node_id), "--keel-persist-root", str(persist_root),
            "--keel-store-address", f"{addresses[node_id]}:0",
            *(["--keel-fault-injection"] if fault_injection else []),
        ]
        # The launcher holds the credentials folder: it issues each node its shard-store certificate from
        # the job's CA (keel.infra.shard_ca), so the agents never need the CA's key.
        tls = issue_node_certificate(credentials_path(settings), job_id, node_id, hosts=(addresses[node_id],))
        argv += ["--keel-tls-cert", str(tls.cert), "--keel-tls-key", str(tls.key), "--keel-tls-ca", str(tls.ca)]
        # A standby carries the training command too: promoted, it runs the ranks of the slice it takes.
        argv += ["--keel-standby", *command] if is_standby else list(command)
        node_state = {"node_id": node_id, "standby": is_standby, "agent_dir": str(agent_dir), "root": str(root),
                      "ckpt_dir": str(shm_root / node_id), "argv": argv, "address": addresses[node_id]}
        if network is not None:
            node_state["host"] = node_id
        node_state["pid"] = spawn_agent(host_argv(network, node_state, argv), env, agent_dir).pid
        node_states.append(node_state)
    state = {"job_id": job_id, "nodes": node_states, "master_port": master_port, "nproc_per_node": nproc_per_node,
             "hosts": "netns" if network is not None else "flat", "master_addr": master_addr,
             "network": network.tag if network is not None else None,
             "credentials_dir": str(credentials_path(settings)),
             "command": command, "started_at": now_utc().isoformat(), "shm_root": str(shm_root),
             "persist_root": str(persist_root), "fault_injection": fault_injection, "env": {k: v for k, v in env.items() if k.startswith("KEEL_") or k in NODE_ENV}}
    atomic_write(directory / "cluster.json", json.dumps(state, indent=2))
    return state


def _check_reachable_from_hosts(nats_url: str | None, network: NetworkPlan) -> None:
    """The agents on the node hosts must reach NATS across the bridge: a loopback URL names each host's own."""
    if not nats_url:
        return
    host = urlsplit(nats_url).hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        raise ClusterError(f"NATS at {nats_url} listens on loopback, which the node hosts cannot reach (each has its "
                           f"own): start the control plane on the host network, `keel up --hosts netns` (NATS then "
                           f"runs on three hosts of its own), or give a NATS URL on the bridge")


def home_network(home: Path) -> NetworkPlan | None:
    """The host network ``keel up --hosts netns`` made for the control plane under ``home`` (None: none)."""
    try:
        tag = json.loads((home / "network.json").read_text())["tag"]
    except (OSError, ValueError, KeyError):
        return None
    try:
        return netns.current(tag)
    except NetnsError:
        return None


def ensure_home_network(home: Path) -> NetworkPlan:
    """``home``'s host network, made now when there is none (a bridge, the control plane on its gateway address,
    and the three hosts of the embedded NATS cluster, ``netns.NATS_HOSTS``); it stays until ``drop_home_network``
    (``keel down``)."""
    network = home_network(home)
    try:
        if network is None:
            network = netns.create()
            atomic_write(home / "network.json", json.dumps({"tag": network.tag, "bridge": network.bridge,
                                                             "gateway": network.gateway}))
        return netns.with_nats_hosts(network)
    except NetnsError as exc:
        raise ClusterError(f"--hosts netns: {exc}") from None


def drop_home_network(home: Path) -> None:
    network = home_network(home)
    if network is not None:
        netns.destroy(network)
    (home / "network.json").unlink(missing_ok=True)


def issue_agent_identities(credentials: Path, job_id: str, node_ids: list[str]) -> None:
    """Issue the agents' NATS identities here, before they start on their hosts: an agent issues its own when it
    has none, but it then has the local server reload, which it checks on the server's monitoring port on
    127.0.0.1, and a node host's loopback is its own."""
    authority = NatsAuthority(credentials)
    try:
        if authority.local_server() is None:
            return
        for node_id in node_ids:
            authority.ensure_agent(job_id, node_id)
    except (OSError, NatsAuthError) as exc:
        raise ClusterError(f"cannot issue the agents' NATS identities in {authority.folder}: {exc}") from None


def host_network(state: dict[str, Any]) -> NetworkPlan | None:
    """The host network a cluster's nodes live on (None: a flat cluster), as recorded now."""
    if not state.get("network"):
        return None
    try:
        return netns.current(state["network"])
    except NetnsError as exc:
        raise ClusterError(f"the cluster's host network is gone: {exc}") from None


def host_argv(network: NetworkPlan | None, node: dict[str, Any], argv: list[str]) -> list[str]:
    """``argv`` run on ``node``'s host: inside its namespace on a host network, else as it is."""
    return netns.in_host(network, node["host"], argv) if network is not None and node.get("host") else argv


def cut_link(directory: Path, node_id: str) -> str:
    """Partition ``node_id``'s host (a cluster on a host network): its link to the bridge goes down; its agent
    and ranks keep running, unreachable. Returns what was done, for humans."""
    state = load_cluster(directory)
    node = _node_entry(state, node_id)
    network = host_network(state)
    if network is None or not node.get("host"):
        raise ClusterError("a link cut needs a cluster whose nodes are hosts: `keel cluster up --hosts netns`")
    netns.cut(network, node["host"])
    return f"link of host {node['host']} ({node['address']}) cut from the bridge {network.bridge}"


def restore_link(directory: Path, node_id: str) -> None:
    state = load_cluster(directory)
    network = host_network(state)
    node = _node_entry(state, node_id)
    if network is None or not node.get("host"):
        raise ClusterError("no host network in this cluster")
    netns.restore(network, node["host"])


def spawn_agent(argv: list[str], env: dict[str, str], agent_dir: Path) -> subprocess.Popen:
    with open(agent_dir / "agent.log", "ab") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _node_entry(state: dict[str, Any], node_id: str) -> dict[str, Any]:
    for node in state["nodes"]:
        if node["node_id"] == node_id:
            return node
    raise ClusterError(f"no node {node_id!r} in this cluster (nodes: {[n['node_id'] for n in state['nodes']]})")


def kill_node(directory: Path, node_id: str) -> None:
    """Lose a node as a machine is lost: SIGKILL its agent and ranks, and wipe its shared memory."""
    state = load_cluster(directory)
    node = _node_entry(state, node_id)
    for pid in ranks_of(Path(node["agent_dir"]), zygotes=True):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if alive(node["pid"]):
        os.killpg(node["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(node["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(node["ckpt_dir"], ignore_errors=True)


def _signal_node(node: dict[str, Any], signum: int) -> list[int]:
    """Send ``signum`` to the node's agent and to every process of its ranks and zygote (each in its own
    process group); the pids signalled."""
    pids = [node["pid"], *ranks_of(Path(node["agent_dir"]), zygotes=True)]
    hit = []
    for pid in pids:
        for send in (os.killpg, os.kill):  # the group (workers included), and the process if it leads none
            try:
                send(pid, signum)
                hit.append(pid)
            except (ProcessLookupError, PermissionError):
                continue
    return sorted(set(hit))


def freeze_node(directory: Path, node_id: str) -> list[int]:
    """Freeze a node as a host that hangs or whose link is cut: SIGSTOP its agent and every process of its
    ranks (the controller stops hearing it and evicts it after ``node_silence_timeout``), and mark it
    ``unreachable``: the ``local`` actuator cannot drain it, as nothing reaches a partitioned host (the
    eviction is reported ``failed``; the controller fences the node all the same). ``thaw_node`` lets it
    run on: the host comes back with its old agent and ranks. Returns the pids stopped."""
    state = load_cluster(directory)
    node = _node_entry(state, node_id)
    if not alive(node["pid"]):
        raise ClusterError(f"node {node_id} is not running; nothing to freeze")
    node["unreachable"] = True
    atomic_write(directory / "cluster.json", json.dumps(state, indent=2))
    return _signal_node(node, signal.SIGSTOP)


def thaw_node(directory: Path, node_id: str) -> list[int]:
    """The frozen host comes back (``freeze_node``): SIGCONT its processes, reachable again. Returns the pids."""
    state = load_cluster(directory)
    node = _node_entry(state, node_id)
    node.pop("unreachable", None)
    atomic_write(directory / "cluster.json", json.dumps(state, indent=2))
    return _signal_node(node, signal.SIGCONT)


def start_node(directory: Path, node_id: str) -> int:
    """Start a fresh agent for ``node_id`` (a replacement machine with empty shared memory). It joins as
    an idle standby with the node's rank slice and starts ranks on the next restart command (or on a
    promotion, which may give it any slice). Returns its pid."""
    state = load_cluster(directory)
    node = _node_entry(state, node_id)
    if alive(node["pid"]):
        raise ClusterError(f"node {node_id} is still running (pid {node['pid']}); kill it first")
    argv = list(node["argv"])
    if "--keel-standby" not in argv:
        argv.insert(argv.index("run") + 1, "--keel-standby")  # before the training command
    env = dict(os.environ, **state.get("env", {}))
    process = spawn_agent(host_argv(host_network(state), node, argv), env, Path(node["agent_dir"]))
    node["pid"] = process.pid
    atomic_write(directory / "cluster.json", json.dumps(state, indent=2))
    return process.pid


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def cluster_down(directory: Path, grace_s: float = 15.0) -> list[str]:
    """Stop every agent (each stops its ranks); SIGKILL what remains. Idempotent."""
    if not (directory / "cluster.json").exists():
        return []
    nodes = json.loads((directory / "cluster.json").read_text())["nodes"]
    for node in nodes:
        if node.get("unreachable"):
            _signal_node(node, signal.SIGCONT)  # a frozen node cannot act on SIGTERM
        if alive(node["pid"]):
            os.kill(node["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(n["pid"]) for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    for node in nodes:
        if alive(node["pid"]):
            os.killpg(node["pid"], signal.SIGKILL)
    for node in nodes:  # ranks (and zygotes) live in their own process groups: make sure none is left behind
        for pid in ranks_of(Path(node["agent_dir"]), zygotes=True):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    state = json.loads((directory / "cluster.json").read_text())
    shm_root = state.get("shm_root")
    if shm_root:
        shutil.rmtree(shm_root, ignore_errors=True)
    if state.get("network"):  # the node hosts this cluster added (the bridge is its owner's: keel up, a test)
        try:
            network = netns.current(state["network"])
        except NetnsError:
            network = None
        for node in nodes:
            if network is not None and node.get("host") and any(h.name == node["host"] for h in network.hosts):
                network = netns.remove_host(network, node["host"])
    return [n["node_id"] for n in nodes]


def ranks_of(agent_dir: Path, *, zygotes: bool = False) -> list[int]:
    """The node's rank processes (found by the agent socket in their environment); with ``zygotes``, its
    warm zygote too (named ``keel-zygote``; its forked ranks inherit its environment but not its name)."""
    from keel.protocol.processes import ZYGOTE_NAME

    pids = []
    marker = f"KEEL_AGENT_SOCKET={agent_dir / 'agent.sock'}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker not in (proc / "environ").read_bytes():
                continue
            if not zygotes and (proc / "comm").read_text().strip() == ZYGOTE_NAME:
                continue
            pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def cluster_status(directory: Path) -> dict[str, Any]:
    state = load_cluster(directory)
    for node in state["nodes"]:
        node["running"] = alive(node["pid"])
        node["ranks"] = ranks_of(Path(node["agent_dir"]))
    return state


# -- fault injection -------------------------------------------------------------------------------


class FaultSpec(BaseModel):
    """One fault: which, where, with what parameters; ``at`` is the offset in a scenario."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["crash", "hang", "hang_stopped", "slow", "nan", "gpu-lost", "xid", "nic-down", "oom", "oom_kernel",
                  "disk-full", "sdc", "link-cut", "link-restore"]
    node: str
    rank: int | None = Field(default=None, ge=0)
    params: dict[str, Any] = Field(default_factory=dict)
    at: timedelta = timedelta(0)

    @field_validator("at", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> timedelta:
        return parse_duration(value)


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    faults: list[FaultSpec] = Field(min_length=1)


def load_scenario(path: Path) -> Scenario:
    """Parse a scenario file; ``ClusterError`` names the file, the fault and the field on any problem."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ClusterError(f"scenario {path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ClusterError(f"scenario {path}: not valid YAML: {exc}") from None
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()[:5]
        )
        raise ClusterError(f"scenario {path}: {problems}") from None


def apply_fault(node: NodeInfo, fault: FaultSpec, fault_id: str) -> str:
    """Change the node's files to produce ``fault``; returns what was done, for humans."""
    if fault.kind in WORKLOAD_FAULTS:
        if node.standby:
            raise ClusterError(f"{node.node_id} is a standby: it runs no training process to {fault.kind}")
        atomic_write(node.fault_file, json.dumps({"id": fault_id, "kind": fault.kind, "rank": fault.rank,
                                                   "params": fault.params}))
        target = f"rank {fault.rank}" if fault.rank is not None else "every rank"
        return f"{fault.kind} for {target} of {node.node_id} via {node.fault_file}"
    root = node.root
    if fault.kind in ("gpu-lost", "xid"):
        nvml_path = root / "run/keel/nvml.json"
        snapshot = json.loads(nvml_path.read_text())
        index = int(fault.params.get("gpu", fault.rank if fault.rank is not None else 0))
        devices = {d["index"]: d for d in snapshot["devices"]}
        if index not in devices:
            raise ClusterError(f"{node.node_id} has no GPU {index} (it has {sorted(devices)})")
        device = devices[index]
        if fault.kind == "gpu-lost":
            device["lost"], device["error"] = True, "GPU is lost"
            detail = f"GPU {index} of {node.node_id} fell off the bus"
        else:
            xid = int(fault.params.get("xid", 79))
            device["xids"].append({"seq": len(device["xids"]) + 1, "xid": xid, "data": 0})
            detail = f"XID {xid} on GPU {index} of {node.node_id}"
        atomic_write(nvml_path, json.dumps(snapshot, indent=1))
        return detail
    if fault.kind == "nic-down":
        nic = root / "sys/class/net" / str(fault.params.get("interface", SIMULATED_NIC))
        if not nic.is_dir():
            raise ClusterError(f"{node.node_id} has no interface {nic.name}")
        changes = int((nic / "carrier_changes").read_text().strip() or 0)
        flaps = int(fault.params.get("flaps", 0))
        if flaps < 0:
            raise ClusterError(f"nic-down flaps must be >= 0, got {flaps}")
        if flaps:
            # A flap: the link went down and came back up, `flaps` times; it is up again now. The
            # inspector reports it as a soft, low-confidence signal (no rung-1 eviction); stop-time
            # diagnostics on this node fail the inter-node check (keel.agent.diagnostics).
            (nic / "carrier_changes").write_text(f"{changes + 2 * flaps}\n")
            return f"{nic.name} of {node.node_id} flapped {flaps}x"
        (nic / "operstate").write_text("down\n")
        (nic / "carrier").write_text("0\n")
        (nic / "carrier_changes").write_text(f"{changes + 1}\n")
        return f"{nic.name} of {node.node_id} is down"
    if fault.kind == "sdc":
        # Silent data corruption: the node's hardware flips one bit of every gradient its ranks compute
        # (``keel.sdk.faults.SimulatedCorruption``), from the next step on and after every restart. The
        # inspector and stop-time diagnostics see nothing; only numbers (a NaN, a spike) and a rung-5 replay do.
        bit, index = int(fault.params.get("bit", 30)), int(fault.params.get("index", 0))
        if not 0 <= bit < 32 or index < 0:
            raise ClusterError(f"sdc needs bit in 0..31 and index >= 0, got bit {bit}, index {index}")
        ranks = [fault.rank] if fault.rank is not None else None
        atomic_write(root / "run/keel/sdc.json", json.dumps({"bit": bit, "index": index, "ranks": ranks}))
        target = f"rank {fault.rank}" if fault.rank is not None else "every rank"
        return f"bit {bit} of gradient element {index} flips on {target} of {node.node_id}, silently"
    if fault.kind == "disk-full":
        total = 100 * 1024**3
        atomic_write(root / "run/keel/disk.json", json.dumps({"/": {"free_bytes": 0, "total_bytes": total}}))
        return f"/ of {node.node_id} is full"
    raise ClusterError(f"unknown fault kind {fault.kind!r}")  # pydantic's Literal makes this unreachable


async def publish_injection(nats_url: str, settings: Settings, job_id: str, node: NodeInfo, fault: FaultSpec,
                            fault_id: str, detail: str, injected_at: datetime) -> None:
    bus = await Bus.connect(nats_url, bus_settings_for(settings, OPERATOR), name="keel-inject")
    try:
        event = Event.create(
            FaultInjected(kind=fault.kind, node_id=node.node_id, rank=fault.rank,
                          params={**fault.params, "detail": detail, "fault_id": fault_id}),
            event_id=uuid.UUID(fault_id), job_id=job_id, subject=f"node/{node.node_id}", producer="cli",
            occurred_at=injected_at,
        )
        await bus.publish(event)
    finally:
        await bus.close()


def link_fault_target(state: dict[str, Any], name: str) -> tuple[NetworkPlan, str]:
    """The host network and host a link fault on ``name`` acts on: a node's host, ``control`` (the control plane),
    or another host of the network (a NATS server's); ``ClusterError`` when the cluster has no host network or
    no such host."""
    network = host_network(state)
    if network is None:
        raise ClusterError("a link fault needs a cluster whose nodes are hosts: `keel cluster up --hosts netns`")
    node = next((n for n in state["nodes"] if n["node_id"] == name), None)
    host = node.get("host") if node is not None else name
    if host != netns.CONTROL_HOST and not any(h.name == host for h in network.hosts):
        raise ClusterError(f"no host {name!r} on the cluster's network (nodes: "
                           f"{', '.join(sorted(n['node_id'] for n in state['nodes']))}; other hosts: "
                           f"{', '.join([netns.CONTROL_HOST, *sorted(set(h.name for h in network.hosts) - {n.get('host') for n in state['nodes']})])})")
    return network, host


def apply_link_fault(state: dict[str, Any], fault: FaultSpec) -> str:
    """Cut (or restore) a host's link; a cut with ``params["for"]`` (a duration) is restored that long after by a
    detached process (``python -m keel.cluster.netns restore``), so the caller need not outlive the cut."""
    network, host = link_fault_target(state, fault.node)
    if fault.kind == "link-restore":
        netns.restore(network, host)
        return f"link of host {host} restored"
    unknown = sorted(set(fault.params) - {"for"})
    if unknown:
        raise ClusterError(f"link-cut takes only the parameter 'for' (a duration), not {', '.join(unknown)}")
    restore_after = None
    if "for" in fault.params:
        try:
            restore_after = parse_duration(fault.params["for"])
        except (TypeError, ValueError) as exc:
            raise ClusterError(f"link-cut for={fault.params['for']!r}: {exc}") from None
        if restore_after <= timedelta(0):
            raise ClusterError(f"link-cut for={fault.params['for']!r}: must be longer than 0 s")
    netns.cut(network, host)
    if restore_after is None:
        return f"link of host {host} cut from the bridge {network.bridge} (`keel inject link-restore --node {fault.node}`)"
    subprocess.Popen([sys.executable, "-m", "keel.cluster.netns", "restore", network.tag, host, "--after",
                      str(restore_after.total_seconds())], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    return (f"link of host {host} cut from the bridge {network.bridge}, restored in "
            f"{restore_after.total_seconds():g} s")


def inject(settings: Settings, directory: Path, faults: list[FaultSpec], nats_url: str | None) -> list[str]:
    """Apply faults in order, each at its ``at`` offset from now; publish each as an event (a link fault's
    before it is applied: the cut may be this host's own, the control plane's)."""
    state = load_cluster(directory)
    nodes = cluster_nodes(state)
    for fault in faults:
        if fault.kind in LINK_FAULTS:
            link_fault_target(state, fault.node)
    unknown = sorted({f.node for f in faults if f.kind not in LINK_FAULTS} - set(nodes))
    if unknown:
        raise ClusterError(f"no node {', '.join(unknown)} in the local cluster (nodes: {', '.join(sorted(nodes))})")
    refused = sorted({f.kind for f in faults} & RANK_READ_FAULTS)
    if refused and not state.get("fault_injection"):
        raise ClusterError(f"the local cluster in {directory} runs without fault injection: its ranks read no fault "
                           f"file, so {', '.join(refused)} would do nothing. Start it with `keel cluster up "
                           "--fault-injection ...` (cluster_up(fault_injection=True)) to inject those")
    done = []
    start = time.monotonic()
    for fault in sorted(faults, key=lambda f: f.at):
        delay_s = fault.at.total_seconds() - (time.monotonic() - start)
        if delay_s > 0:
            time.sleep(delay_s)
        fault_id = str(uuid.uuid4())
        injected_at = now_utc()  # before the fault exists: detection is measured from here
        node = nodes.get(fault.node) or NodeInfo(fault.node, False, directory, directory, 0)
        if fault.kind in LINK_FAULTS:
            if nats_url:
                asyncio.run(publish_injection(nats_url, settings, state["job_id"], node, fault, fault_id,
                                              f"{fault.kind} of {fault.node}", injected_at))
            done.append(apply_link_fault(state, fault))
            continue
        detail = apply_fault(node, fault, fault_id)
        if nats_url:
            asyncio.run(publish_injection(nats_url, settings, state["job_id"], node, fault, fault_id,
                                          detail, injected_at))
        done.append(detail)
    return done
