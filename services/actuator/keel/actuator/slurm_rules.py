"""What the Slurm actuator does with a node, decided from what Slurm says about it (pure, no I/O).

Slurm's own words are parsed here: ``scontrol show node -o`` (one line per node, ``Key=Value`` pairs, the
value of ``Reason`` running to the end of the line) and ``scontrol show hostnames`` style node lists. The
decisions carry their reasons; ``keel.actuator.slurm`` runs the commands.

Keel's drains are marked: their reason starts with ``REASON_PREFIX``. A drain whose reason does not is a
human's (or another tool's) and is never written over or undone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from keel.rules.slurm import expand_hostlist

__all__ = ["expand_hostlist"]

REASON_PREFIX = "keel:"
"""Every drain reason Keel writes starts with this; Slurm shows it in ``sinfo -R`` and ``scontrol show node``."""

REASON_MAX_CHARS = 200
"""Slurm keeps the reason in its state file and prints it in tables: one short line."""

_DRAIN_FLAGS = ("DRAIN", "DRAINING", "DRAINED")


@dataclass(frozen=True)
class SlurmNode:
    """A node as ``scontrol show node -o`` describes it."""

    name: str
    state: str
    """``State`` as Slurm prints it, e.g. ``IDLE``, ``MIXED+DRAIN``, ``DOWN*+DRAIN``, ``ALLOCATED``."""
    reason: str = ""
    """``Reason`` without Slurm's ``[user@time]`` suffix ("" when none)."""
    reason_by: str = ""
    """Who set the reason (the ``user`` of the suffix), when Slurm says."""

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(part.rstrip("*~#!%$@^-") for part in self.state.upper().split("+"))

    @property
    def drained(self) -> bool:
        """Drained or draining: Slurm starts no new work on it."""
        return any(flag in self.flags for flag in _DRAIN_FLAGS)

    @property
    def drained_by_keel(self) -> bool:
        return self.drained and self.reason.startswith(REASON_PREFIX)

    @property
    def usable(self) -> bool:
        """Up and not drained: a node Slurm would give work to."""
        return not self.drained and not ({"DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "FUTURE"} & self.flags) \
            and "*" not in self.state


_REASON_SUFFIX = re.compile(r"\s*\[(?P<user>[^@\]\s]+)@[^\]]*\]\s*$")


def parse_show_node(text: str) -> list[SlurmNode]:
    """Nodes from ``scontrol show node -o`` (one node per line). ``Reason`` is the last field and may hold
    spaces and ``=``: everything after ``Reason=`` is the reason. Raises ``ValueError`` for a line with no
    ``NodeName``."""
    nodes = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        head, _, reason_text = line.partition(" Reason=")
        # 22.05 prints Comment= and Extra= after the reason: they end it (and are not the node's fields).
        reason_text = re.split(r" (?:Comment|Extra)=", reason_text, maxsplit=1)[0]
        head = re.split(r" (?:Comment|Extra)=", head, maxsplit=1)[0]  # without a reason they end the line
        fields = dict(part.split("=", 1) for part in head.split() if "=" in part)
        if "NodeName" not in fields:
            raise ValueError(f"not a node line of scontrol show node -o: {line[:120]!r}")
        reason, by = reason_text.strip(), ""
        match = _REASON_SUFFIX.search(reason)
        if match:
            by, reason = match.group("user"), reason[: match.start()].strip()
        if reason in ("(null)", "none"):
            reason = ""
        nodes.append(SlurmNode(name=fields["NodeName"], state=fields.get("State", ""), reason=reason, reason_by=by))
    return nodes


def drain_reason(reason: str) -> str:
    """Keel's drain reason for ``reason``: one line, printable, ``REASON_PREFIX`` first, at most
    ``REASON_MAX_CHARS`` characters."""
    one_line = " ".join("".join(ch if ch.isprintable() else " " for ch in reason).split())
    text = f"{REASON_PREFIX} {one_line}" if one_line else f"{REASON_PREFIX} evicted"
    return text if len(text) <= REASON_MAX_CHARS else text[: REASON_MAX_CHARS - 1] + "…"


@dataclass(frozen=True)
class DrainPlan:
    action: Literal["drain", "none"]
    detail: str
    reason: str = ""
    """The reason to write (``action == "drain"``)."""


def plan_drain(node: SlurmNode, reason: str) -> DrainPlan:
    """Drain ``node`` for ``reason`` unless it is drained already: by Keel (a redelivered or repeated
    command: nothing twice) or by someone else (their reason stays; Keel never writes over a human's drain)."""
    if node.drained_by_keel:
        return DrainPlan("none", f"{node.name} already drained by Keel ({node.reason!r}): nothing to do")
    if node.drained:
        by = f" by {node.reason_by}" if node.reason_by else ""
        return DrainPlan("none", f"{node.name} already drained{by} ({node.reason or 'no reason'!r}); left as it is, "
                                 "Keel does not write over a drain it did not make")
    if node.reason and node.reason_by not in ("", "slurm"):
        return DrainPlan("none", f"{node.name} is {node.state} with {node.reason_by}'s reason ({node.reason!r}); left as "
                                 "it is, Keel does not write over a reason it did not set")
    text = drain_reason(reason)
    down = " (it is down; drained so it stays out when it returns)" if not node.usable else ""
    return DrainPlan("drain", f"{node.name} drained in Slurm: {text!r}{down}", text)
