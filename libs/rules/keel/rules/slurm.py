"""Slurm's own notations, read without a process (pure): node lists and a job step's environment.

``expand_hostlist`` is what ``scontrol show hostnames`` prints; ``slurm_step`` is what ``keel run`` takes
from the variables ``srun`` sets in every task (``SLURM_JOB_ID``, ``SLURM_NODEID``, ``SLURM_NNODES``,
``SLURMD_NODENAME``, ``SLURM_STEP_NODELIST``), the way torchrun users pass them by hand.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SlurmStep:
    """This task's place in a Slurm job step (one task per node: ``srun --ntasks-per-node=1``)."""

    job_id: str
    node_name: str
    node_index: int
    """``SLURM_NODEID``: this node's index among the step's nodes (0 first)."""
    nodes: tuple[str, ...]
    """The step's nodes, in Slurm's order (``SLURM_STEP_NODELIST``)."""

    @property
    def head(self) -> str:
        """The first node: where torchrun users put ``--master-addr`` / the rendezvous endpoint."""
        return self.nodes[0]


def slurm_step(environ: Mapping[str, str]) -> SlurmStep | None:
    """This process's Slurm step, or None outside one (no ``SLURM_JOB_ID``, ``SLURM_NODEID`` or
    ``SLURM_STEP_NODELIST``: for example a batch script's own shell, before ``srun``). Raises ``ValueError`` for variables Slurm would
    not set that way (a node index that is not a number or is outside the node list)."""
    job_id, index_text = environ.get("SLURM_JOB_ID"), environ.get("SLURM_NODEID")
    # Only srun sets the step's variables: a batch script's own shell has SLURM_NODEID and the job's node
    # list too, but runs on one node, and a keel run there must not wait for the allocation's other nodes.
    nodelist = environ.get("SLURM_STEP_NODELIST") or ""
    if not job_id or index_text is None or not nodelist:
        return None
    nodes = tuple(expand_hostlist(nodelist))
    if not index_text.isdigit():
        raise ValueError(f"SLURM_NODEID must be a number, got {index_text!r}")
    index = int(index_text)
    name = environ.get("SLURMD_NODENAME") or (nodes[index] if index < len(nodes) else "")
    if not nodes or index >= len(nodes) or not name:
        raise ValueError(f"SLURM_NODEID {index} does not fit the step's nodes {nodelist!r}")
    return SlurmStep(job_id=job_id, node_name=name, node_index=index, nodes=nodes)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact node list (``n[1-3,5],gpu-a[01-02]``) as names, in order. Raises ``ValueError``
    for a malformed list. (What ``scontrol show hostnames`` prints, without a process.)"""
    names: list[str] = []
    depth, start = 0, 0
    parts = []
    for index, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    parts.append(text[start:])
    for part in (p.strip() for p in parts):
        if not part:
            continue
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if not match:
            if "[" in part or "]" in part:
                raise ValueError(f"unsupported node list part {part!r} in {text!r}")
            names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"bad range {item!r} in node list {text!r}")
            width = len(low)
            last = int(high) if high else int(low)
            if last < int(low):
                raise ValueError(f"descending range {item!r} in node list {text!r}")
            names.extend(f"{prefix}{number:0{width}d}{suffix}" for number in range(int(low), last + 1))
    return names
