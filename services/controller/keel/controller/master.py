"""Where the ranks' rendezvous (``MASTER_ADDR``) is served after a restart (pure).

Global rank 0 hosts the ranks' ``TCPStore`` (as under torchrun), so ``MASTER_ADDR`` is the host of node
rank 0. When a standby on another host takes over node rank 0 (its host cut off or evicted), the
rendezvous must move with it: every node of the new generation is told the new address in its restart
command, and keeps it for later generations. On one machine (the flat local cluster) every node
registers the same addresses, so nothing moves.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from keel.controller.state import NodeView
from keel.events.types import Promotion


@dataclass(frozen=True)
class RendezvousMove:
    """``address``: the new ``MASTER_ADDR`` ("" : it stays where it is); ``reason``: why, for the decision."""

    address: str
    reason: str


def _shared_prefix_bits(a: str, b: str) -> int:
    """How many leading bits two addresses share (-1 across address families)."""
    x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    if x.version != y.version:
        return -1
    width = x.max_prefixlen
    return width - (int(x) ^ int(y)).bit_length()


def moved_rendezvous(promotions: Iterable[Promotion], nodes: Mapping[str, NodeView]) -> RendezvousMove:
    """The rendezvous after a restart with ``promotions``: it moves when a standby takes over global rank
    0 from a node on another host (the two registered no address in common), to the standby's address
    nearest the old host's (the longest shared prefix: the same network, on a host with several). It
    stays when rank 0 stays, when both nodes share a host, and when either registered no address (an
    agent older than ``NodeRegistered`` v2: nothing to go by)."""
    for promotion in promotions:
        if 0 not in promotion.ranks:
            continue
        old, new = nodes.get(promotion.replaces_node_id), nodes.get(promotion.standby_node_id)
        old_addresses = old.addresses if old is not None else ()
        new_addresses = new.addresses if new is not None else ()
        if not old_addresses or not new_addresses:
            return RendezvousMove("", f"{promotion.standby_node_id} takes over rank 0 from "
                                      f"{promotion.replaces_node_id}, but one of them registered no address: the "
                                      f"ranks' rendezvous stays where it is")
        if set(old_addresses) & set(new_addresses):
            return RendezvousMove("", f"{promotion.standby_node_id} takes over rank 0 on "
                                      f"{promotion.replaces_node_id}'s host: the ranks' rendezvous stays")
        address = max(new_addresses, key=lambda a: (max(_shared_prefix_bits(a, o) for o in old_addresses), a))
        return RendezvousMove(address, f"rank 0 moves from {promotion.replaces_node_id} "
                                       f"({', '.join(old_addresses)}) to {promotion.standby_node_id}: the ranks' "
                                       f"rendezvous (MASTER_ADDR) moves to {address}")
    return RendezvousMove("", "")
