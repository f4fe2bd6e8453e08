"""Shrink instead of stop: whether the job can go on with the nodes it has left, and as which node ranks (pure).

When an incident evicts nodes and the standby pool has none ready, the controller normally holds the
recovery until the pool refills. With ``controller.shrink_without_standby`` on it may instead restart the
nodes that stay as a smaller job: node ranks ``0..k-1`` in the order their old ranks ran (so the node
that ran global rank 0 stays node rank 0 when it stays), ``k * ranks_per_node`` ranks in all. Each new
rank restores the last committed step resharded from every old rank's shard (the broker's plan with
``reshard_from``; ``Checkpointer.load_resharded``). The job does not grow back by itself when a standby
turns up later: the next restart keeps the smaller layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from keel.controller.state import NodeView


@dataclass(frozen=True)
class Shrink:
    """A shrink the job can take: ``nodes`` in new node-rank order, the new world size, and why."""

    nodes: tuple[str, ...]
    ranks_per_node: int
    world_size: int
    old_world_size: int
    reason: str

    def node_rank(self, node_id: str) -> int:
        return self.nodes.index(node_id)


def plan_shrink(staying: Sequence[NodeView], leaving: Sequence[NodeView], *, min_nodes: int,
                node_multiple: int) -> Shrink | str:
    """The shrink onto ``staying`` after ``leaving`` go, or why there is none (a reason to record).

    Refused when a node left runs no ranks or not as many as the others (node ranks are uniform slices),
    when fewer than ``min_nodes`` would stay, and when the count left is not a multiple of
    ``node_multiple`` (a pipeline or tensor-parallel group spanning nodes cannot change width at restore).
    """
    nodes = [n for n in staying if n.ranks]
    if not nodes:
        return "no node would stay"
    widths = {len(n.ranks) for n in [*nodes, *(n for n in leaving if n.ranks)]}
    if len(widths) != 1:
        return f"the nodes run unequal numbers of ranks ({', '.join(map(str, sorted(widths)))}): node ranks are uniform slices"
    [per_node] = widths
    if len(nodes) < min_nodes:
        return f"{len(nodes)} node(s) would stay, fewer than shrink_min_nodes {min_nodes}"
    if len(nodes) % node_multiple:
        return (f"{len(nodes)} node(s) would stay, not a multiple of shrink_node_multiple {node_multiple} (the nodes a "
                f"pipeline or tensor-parallel group spans)")
    ordered = tuple(n.node_id for n in sorted(nodes, key=lambda n: min(n.ranks)))
    old_world = per_node * (len(nodes) + sum(1 for n in leaving if n.ranks))
    world = per_node * len(nodes)
    return Shrink(nodes=ordered, ranks_per_node=per_node, world_size=world, old_world_size=old_world,
                  reason=f"shrink from {old_world} to {world} ranks on {len(nodes)} node(s) "
                         f"({per_node} per node), the last step resharded onto them")
