"""What the Kubernetes actuator does with a node and the job's pods, decided from API objects (pure, no I/O).

Objects are the API's JSON (``v1.Node``, ``v1.Pod``) as dicts. Keel marks what it does: the label
``keel.dev/evicted`` (with the job, the time and the incident in labels, the reason in an annotation) and
the taint ``keel.dev/evicted:NoSchedule``. A node cordoned without Keel's label is someone else's cordon:
Keel neither writes over it nor ever uncordons a node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

DOMAIN = "keel.dev"
EVICTED_LABEL = f"{DOMAIN}/evicted"
TAINT_KEY = f"{DOMAIN}/evicted"
JOB_LABEL = f"{DOMAIN}/job"
ROLE_LABEL = f"{DOMAIN}/role"
PROMOTED_LABEL = f"{DOMAIN}/promoted"
REASON_ANNOTATION = f"{DOMAIN}/evicted-reason"

_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]+")


def label_value(text: str) -> str:
    """``text`` as a valid label value: at most 63 characters of ``[A-Za-z0-9._-]``, starting and ending
    with an alphanumeric character ("" when nothing is left)."""
    value = _LABEL_VALUE.sub("-", text)[:63]
    return value.strip("-._")


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def cordoned(node: dict[str, Any]) -> bool:
    return bool((node.get("spec") or {}).get("unschedulable"))


def evicted_by_keel(node: dict[str, Any]) -> bool:
    return _labels(node).get(EVICTED_LABEL) == "true"


@dataclass(frozen=True)
class CordonPlan:
    action: Literal["cordon", "none"]
    detail: str
    patch: dict[str, Any] | None = None
    """The strategic-merge patch to send (``action == "cordon"``): carries the node's ``resourceVersion``,
    so a node changed since it was read is refused (409) rather than written over."""


def plan_cordon(node: dict[str, Any], *, reason: str, job_id: str, incident: str, by: str, now: datetime) -> CordonPlan:
    """Cordon, taint and label ``node`` for ``reason`` unless it is cordoned already: by Keel (nothing
    twice) or by someone else (their cordon is theirs: the node is left as it is)."""
    name = (node.get("metadata") or {}).get("name", "?")
    if evicted_by_keel(node):
        return CordonPlan("none", f"{name} already cordoned by Keel: nothing to do to the node")
    if cordoned(node):
        return CordonPlan("none", f"{name} already cordoned by someone else; left as it is (Keel neither writes over "
                                  "a cordon it did not make nor uncordons a node)")
    taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != TAINT_KEY]
    taints.append({"key": TAINT_KEY, "value": label_value(job_id) or "job", "effect": "NoSchedule"})
    labels = {EVICTED_LABEL: "true", f"{DOMAIN}/evicted-job": label_value(job_id), f"{DOMAIN}/evicted-by": label_value(by),
              f"{DOMAIN}/evicted-at": str(int(now.timestamp()))}
    if incident:
        labels[f"{DOMAIN}/incident"] = label_value(incident)
    metadata: dict[str, Any] = {"labels": {k: v for k, v in labels.items() if v},
                                "annotations": {REASON_ANNOTATION: reason[:1000]}}
    version = (node.get("metadata") or {}).get("resourceVersion")
    if version:
        metadata["resourceVersion"] = version
    patch = {"metadata": metadata, "spec": {"unschedulable": True, "taints": taints}}
    return CordonPlan("cordon", f"{name} cordoned, tainted {TAINT_KEY}:NoSchedule and labelled", patch)


def pod_node(pod: dict[str, Any]) -> str:
    return (pod.get("spec") or {}).get("nodeName") or ""


def pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def standby_names(pods: list[dict[str, Any]], nodes: dict[str, dict[str, Any]]) -> list[str]:
    """The standbys among the job's standby pods: each ready pod's node (Keel's node id is its node's name),
    unless promoted, ending, or on a node gone or cordoned; a pod not ready yet (pending, starting) counts
    under its own name (``pod/<name>``), so a refill is not asked for twice."""
    found: list[str] = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        if _labels(pod).get(PROMOTED_LABEL) == "true" or metadata.get("deletionTimestamp"):
            continue
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            continue
        node = pod_node(pod)
        if node and (node not in nodes or cordoned(nodes[node])):
            continue  # its node is gone or cordoned: no standby
        found.append(node if node and pod_ready(pod) else f"pod/{metadata.get('name', '?')}")
    return found
