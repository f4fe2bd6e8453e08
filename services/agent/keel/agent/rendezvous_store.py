"""The c10d rendezvous's I/O (the decisions are ``keel.agent.rendezvous``'s).

- The store: a ``torch.distributed.TCPStore`` at ``--rdzv-endpoint``, as torchrun's c10d backend. The
  agent on the machine the endpoint names hosts it (``is_host`` in ``--rdzv-conf`` overrides; when the
  port is taken, by another agent of the same job on that machine, it joins as a client). torch is
  imported only here, only for a rendezvous. The round's state is one JSON value under
  ``keel.rendezvous.<rdzv id>``, changed with compare-and-set.
- The ranks' store is separate, as under torchrun: the node of rank 0 picks a free base port below the
  ephemeral range (``keel.infra.embedded.rendezvous_base_port``), clear of the rendezvous port by
  ``WORKER_PORT_SPAN``, so generation g's ``MASTER_PORT = base + g`` and the diagnostics rounds'
  ``base + 500 + r`` never land on it; its ``MASTER_ADDR`` is its interface toward the endpoint.
- Once every admitted node (and every standby that came to watch) has read the outcome, or
  ``close_timeout`` passed, the host stops listening: the rendezvous serves the first start only.
- The outcome is recorded in ``<agent dir>/rendezvous.json`` (0600): an agent restarted under the running
  job takes its rank from there instead of rendezvousing again.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from keel.agent.rendezvous import (
    Member,
    RendezvousConf,
    Round,
    admit,
    duplicate_node_ids,
    judge,
    leave,
    settle,
    worker_port_clear,
)
from keel.checkpoint.slots import write_file_atomic

log = logging.getLogger(__name__)

KEY_PREFIX = "keel.rendezvous."
RECORD_FILE = "rendezvous.json"
POLL_S = 0.1


class RendezvousFailed(RuntimeError):
    """The rendezvous did not give this node a rank; the message says why."""


@dataclass(frozen=True)
class RendezvousResult:
    rdzv_id: str
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    """The ranks' base port (generation g: ``+ g``)."""

    def to_json(self) -> str:
        return json.dumps({"rdzv_id": self.rdzv_id, "node_rank": self.node_rank, "nnodes": self.nnodes,
                           "master_addr": self.master_addr, "master_port": self.master_port}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> RendezvousResult:
        raw = json.loads(text)
        result = cls(rdzv_id=str(raw["rdzv_id"]), node_rank=int(raw["node_rank"]), nnodes=int(raw["nnodes"]),
                     master_addr=str(raw["master_addr"]), master_port=int(raw["master_port"]))
        if not (0 <= result.node_rank < result.nnodes and 0 < result.master_port < 65536):
            raise ValueError(f"inconsistent rendezvous record {raw!r}")
        return result


def read_record(agent_dir: Path) -> RendezvousResult | None:
    try:
        return RendezvousResult.from_json((Path(agent_dir) / RECORD_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring an unreadable %s in %s: %s", RECORD_FILE, agent_dir, exc)
        return None


def write_record(agent_dir: Path, result: RendezvousResult) -> None:
    write_file_atomic(Path(agent_dir) / RECORD_FILE, result.to_json().encode(), mode=0o600)


def remove_record(agent_dir: Path) -> None:
    (Path(agent_dir) / RECORD_FILE).unlink(missing_ok=True)


# -- this machine's addresses ---------------------------------------------------------------------------


def names_this_machine(host: str) -> bool:
    """Whether ``host`` is this machine: localhost, a loopback address, its host name, or an address it can
    bind (an address assigned to one of its interfaces)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return True
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def interface_toward(host: str, port: int) -> str:
    """The local address this machine reaches ``host`` from (a UDP "connect" sends nothing): the
    interface of the cluster network, where the shard store listens by default on a multi-node job and
    where rank 0's store is advertised after a rendezvous."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise OSError(f"cannot tell which interface reaches the rendezvous master {host}:{port} ({exc}); "
                      f"give --keel-store-address HOST:PORT or the checkpoint.store_address setting") from None


def workers_base_port(endpoint_port: int, pick: Callable[[], int] | None = None) -> int:
    """A free base port for the ranks' store, clear of the rendezvous port (``worker_port_clear``)."""
    from keel.infra.embedded import rendezvous_base_port

    for _ in range(20):
        base = (pick or rendezvous_base_port)()
        if worker_port_clear(base, endpoint_port):
            return base
    raise RendezvousFailed(f"no free base port for the ranks' store clear of the rendezvous port {endpoint_port}")


# -- the store ------------------------------------------------------------------------------------------


def _open_store(host: str, port: int, conf: RendezvousConf, *, hosting: bool, connect_s: float) -> tuple[Any, bool]:
    """(store, hosting). Hosting fails over to a client when the port is taken (as torch's c10d does)."""
    import torch.distributed as dist

    if hosting:
        try:
            store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                  timeout=conf.read_timeout, multi_tenant=True)
            log.info("hosting the rendezvous store on port %d", port)
            return store, True
        except (RuntimeError, ValueError) as exc:  # DistNetworkError is a RuntimeError
            if conf.is_host:
                raise RendezvousFailed(f"cannot host the rendezvous store on port {port} (is_host=true): "
                                       f"{str(exc).splitlines()[0]}") from None
            log.info("port %d is taken (%s): joining the rendezvous as a client", port, str(exc).splitlines()[0])
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(1.0, connect_s)))
    except (RuntimeError, ValueError) as exc:
        raise RendezvousFailed(
            f"cannot reach the rendezvous store at {host}:{port} within {max(1.0, connect_s):g}s "
            f"({str(exc).splitlines()[0]}): is the agent of the machine it names started? (its host stops "
            f"listening once the rendezvous closed: a node started later joins as --keel-standby of a "
            f"static launch or with the next start of the job)") from None
    return store, False


def _update(store: Any, key: str, change: Callable[[Round], Round]) -> Round:
    """Apply ``change`` to the round in the store with compare-and-set (retried on a concurrent change)."""
    while True:
        raw = store.get(key)
        current = Round.from_json(raw)
        new = change(current)
        if new == current:
            return current
        text = new.to_json()
        if store.compare_set(key, raw, text) == text.encode():
            return new


def rendezvous(*, rdzv_id: str, node_id: str, host: str, port: int, min_nodes: int, max_nodes: int,
               conf: RendezvousConf, standby: bool = False, clock: Callable[[], float] = time.time,
               pick_port: Callable[[], int] | None = None) -> RendezvousResult:
    """Join the rendezvous ``rdzv_id`` at ``host:port`` and return this node's rank (a standby only
    watches: it learns ``nnodes`` and the master, with ``node_rank`` 0 as a placeholder)."""
    key = KEY_PREFIX + rdzv_id
    me = Member(node_id, f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}")
    start = clock()
    hosting = conf.is_host if conf.is_host is not None else names_this_machine(host)
    store, hosting = _open_store(host, port, conf, hosting=hosting, connect_s=min(conf.read_timeout.total_seconds(),
                                                                                   conf.join_timeout.total_seconds()))
    try:
        store.compare_set(key, "", Round().to_json())  # the first one in creates the round
        if standby:
            store.add(key + ".watchers", 1)
            closed = _watch(store, key, start=start, clock=clock, conf=conf)
            node_rank, nnodes = 0, len(closed.members)
        else:
            node_rank, nnodes, closed = _join(store, key, me, min_nodes=min_nodes, max_nodes=max_nodes, conf=conf,
                                              start=start, clock=clock)
            dupes = duplicate_node_ids(closed)
            if dupes:
                log.warning("the rendezvous admitted several agents with node id(s) %s: give each node its own "
                            "--keel-node-id, or the control plane takes them for one node", ", ".join(dupes))
        if node_rank == 0 and not standby:
            master: dict[str, Any] = {"addr": interface_toward(host, port), "port": workers_base_port(port, pick_port)}
            store.set(key + ".master", json.dumps(master))
        else:
            try:
                store.wait([key + ".master"], conf.read_timeout)
            except (RuntimeError, ValueError) as exc:
                raise RendezvousFailed(f"node rank 0 did not publish its address within read_timeout "
                                       f"{conf.read_timeout.total_seconds():g}s ({str(exc).splitlines()[0]})") from None
            master = json.loads(store.get(key + ".master"))
        store.add(key + ".acks", 1)
        if hosting:
            _linger(store, key, len(closed.members), conf)
    except RendezvousFailed:
        raise
    except (RuntimeError, ValueError) as exc:  # the store went away (its host gave up) or timed out
        raise RendezvousFailed(f"lost the rendezvous store at {host}:{port}: {str(exc).splitlines()[0]}") from None
    finally:
        del store  # the host stops listening
    result = RendezvousResult(rdzv_id=rdzv_id, node_rank=node_rank, nnodes=nnodes, master_addr=str(master["addr"]),
                              master_port=int(master["port"]))
    log.info("%s: rendezvous %s at %s:%d done in %.1fs: node rank %s of %d, ranks' store %s:%d", node_id, rdzv_id,
             host, port, clock() - start, "- (standby)" if standby else node_rank, nnodes, result.master_addr,
             result.master_port)
    return result


def _join(store: Any, key: str, me: Member, *, min_nodes: int, max_nodes: int, conf: RendezvousConf, start: float,
          clock: Callable[[], float]) -> tuple[int, int, Round]:
    refusal = ""

    def join(current: Round) -> Round:
        nonlocal refusal
        admission = admit(settle(current, min_nodes=min_nodes, now=clock()), me, min_nodes=min_nodes,
                          max_nodes=max_nodes, now=clock(), conf=conf)
        refusal = admission.refused
        return admission.round

    _update(store, key, join)
    if refusal:
        raise RendezvousFailed(refusal)
    while True:
        current = _update(store, key, lambda r: settle(r, min_nodes=min_nodes, now=clock()))
        verdict = judge(current, me.token, min_nodes=min_nodes, max_nodes=max_nodes, joined_at=start, now=clock(),
                        conf=conf)
        if verdict.failed:
            _update(store, key, lambda r: leave(r, me.token, min_nodes=min_nodes))
            raise RendezvousFailed(verdict.failed)
        if verdict.node_rank is not None:
            return verdict.node_rank, verdict.nnodes, current
        time.sleep(POLL_S)


def _watch(store: Any, key: str, *, start: float, clock: Callable[[], float], conf: RendezvousConf) -> Round:
    while True:
        current = Round.from_json(store.get(key))
        if current.closed:
            return current
        if clock() - start >= conf.join_timeout.total_seconds():
            raise RendezvousFailed(f"the rendezvous did not close within join_timeout "
                                   f"{conf.join_timeout.total_seconds():g}s")
        time.sleep(POLL_S)


def _linger(store: Any, key: str, members: int, conf: RendezvousConf) -> None:
    """The host waits for every member and watcher to read the outcome, at most ``close_timeout``."""
    deadline = time.monotonic() + conf.close_timeout.total_seconds()
    while time.monotonic() < deadline:
        if store.add(key + ".acks", 0) >= members + store.add(key + ".watchers", 0):
            return
        time.sleep(POLL_S)
    log.warning("closing the rendezvous store after close_timeout %gs: not every node read its rank",
                conf.close_timeout.total_seconds())
