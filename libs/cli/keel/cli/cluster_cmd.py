"""``keel cluster`` and ``keel inject``: a local multi-node cluster of node agents (``keel.cluster.local``)
and faults injected into it.

    keel cluster up --nodes N [--standby S] [--nproc-per-node P] [--job-id J] [--dir D] [--fault-injection]
                    [--hosts flat|netns] -- [-m MOD | F] [args]
    keel cluster down | status [--dir D]
    keel inject KIND --node NODE [--rank R] [--param k=v ...] [--dir D]   one fault (link-cut: a host's link)
    keel inject --scenario FILE [--dir D]                                 a timed list of faults

The cluster lives in ``--dir`` (default ``<home>/cluster``). (Named ``cluster_cmd`` so that it does not
read as the ``keel.cluster`` distribution.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keel.cli.common import CliError, Subparsers, nats_url_or_none
from keel.infra.config import Settings


def register(sub: Subparsers) -> None:
    cluster = sub.add_parser("cluster", help="a local multi-node cluster of node agents")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    cluster_up = cluster_sub.add_parser("up", help="start N agents running the training command")
    cluster_up.add_argument("--nodes", type=int, required=True)
    cluster_up.add_argument("--standby", type=int, default=0)
    cluster_up.add_argument("--nproc-per-node", type=int, default=1)
    cluster_up.add_argument("--job-id", default="job")
    cluster_up.add_argument("--dir", help="cluster state directory (default <home>/cluster)")
    cluster_up.add_argument("--probe-interval", default="1s")
    cluster_up.add_argument("--heartbeat-interval", default="5s")
    cluster_up.add_argument("--fault-injection", action="store_true",
                            help="let `keel inject` make the ranks fail (crash hang slow nan oom sdc): they read "
                                 "a fault file; off by default")
    cluster_up.add_argument("--hosts", choices=("flat", "netns"), default="flat",
                            help="flat: every node on this host's loopback (default); netns: each node a host of "
                                 "its own (a network namespace on the bridge of `keel up --hosts netns`; needs "
                                 "root / CAP_NET_ADMIN)")
    cluster_up.add_argument("command", nargs=argparse.REMAINDER, help="-- [-m module | script.py] [args]")
    cluster_up.set_defaults(func=cmd_cluster)
    for name, text in (("down", "stop every agent and rank"), ("status", "agents and their ranks")):
        parser_ = cluster_sub.add_parser(name, help=text)
        parser_.add_argument("--dir")
        parser_.set_defaults(func=cmd_cluster)

    inject = sub.add_parser("inject", help="inject a fault into the local cluster")
    inject.add_argument("kind", nargs="?", help="crash hang hang_stopped slow nan oom oom_kernel gpu-lost xid nic-down disk-full sdc, and on a "
                        "cluster of hosts (--hosts netns) link-cut (--param for=60s: restored after) link-restore")
    inject.add_argument("--node", help="the node; for link-cut/link-restore also a host without a node: control (the "
                        "control plane's), nats-1, nats-2, nats-3")
    inject.add_argument("--rank", type=int)
    inject.add_argument("--param", action="append", default=[], help="key=value (JSON values allowed)")
    inject.add_argument("--scenario", help="YAML file: faults: [{at: 10s, kind: hang, node: n01, rank: 2}]")
    inject.add_argument("--dir")
    inject.set_defaults(func=cmd_inject)


def cmd_cluster(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cluster.local import ClusterError, cluster_dir, cluster_down, cluster_status, cluster_up, home_network
    from keel.cluster.netns import unavailable_reason

    directory = cluster_dir(settings, args.dir)
    try:
        if args.cluster_command == "up":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            network = None
            if args.hosts == "netns":
                reason = unavailable_reason()
                if reason:
                    raise CliError(f"--hosts netns: {reason}; use the flat local cluster (--hosts flat) here")
                network = home_network(settings.home)
                if network is None:
                    raise CliError("--hosts netns: no host network: start the control plane on one first, "
                                   "`keel up --hosts netns` (its NATS then listens on the bridge)")
            state = cluster_up(settings, directory, nodes=args.nodes, standby=args.standby,
                               nproc_per_node=args.nproc_per_node, job_id=args.job_id, command=command,
                               nats_url=nats_url_or_none(settings), probe_interval=args.probe_interval,
                               heartbeat_interval=args.heartbeat_interval, fault_injection=args.fault_injection,
                               network=network)
            print(json.dumps(state, indent=2))
        elif args.cluster_command == "down":
            stopped = cluster_down(directory)
            print(f"keel: cluster down ({len(stopped)} agents stopped)")
        else:
            print(json.dumps(cluster_status(directory), indent=2))
    except ClusterError as exc:
        raise CliError(str(exc)) from None
    return 0


def cmd_inject(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cluster.local import ClusterError, FaultSpec, cluster_dir, inject, load_scenario

    directory = cluster_dir(settings, args.dir)
    try:
        if args.scenario:
            faults = load_scenario(Path(args.scenario)).faults
        else:
            if not args.kind or not args.node:
                raise CliError("keel inject KIND --node NODE [--rank R] [--param k=v], or --scenario FILE")
            params = {}
            for item in args.param:
                key, sep, value = item.partition("=")
                if not sep:
                    raise CliError(f"--param takes key=value, got {item!r}")
                try:
                    params[key] = json.loads(value)
                except ValueError:
                    params[key] = value
            try:
                faults = [FaultSpec(kind=args.kind, node=args.node, rank=args.rank, params=params)]
            except ValueError as exc:
                raise CliError(f"invalid fault: {exc}") from None
        for line in inject(settings, directory, faults, nats_url_or_none(settings)):
            print(f"keel: injected {line}")
    except ClusterError as exc:
        raise CliError(str(exc)) from None
    return 0
