"""The Kubernetes actuator against the API's published contract (no API server runs here): every request it
makes is one of the official client's operations, with accepted query parameters and a body its JSON schema
accepts (``tests/k8s_contract.py``), served by an in-memory fake whose answers validate too."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from keel.actuator.core import ActuatorError
from keel.actuator.kubernetes import KubernetesActuator
from keel.actuator.kubernetes_rules import (
    EVICTED_LABEL,
    JOB_LABEL,
    PROMOTED_LABEL,
    REASON_ANNOTATION,
    ROLE_LABEL,
    TAINT_KEY,
    label_value,
)
from tests.k8s_contract import ContractError, FakeKubeApi, check_request

JOB, NS = "llm", "training"
NOW = datetime(2026, 12, 4, 21, 30, tzinfo=UTC)


@pytest.fixture
def cluster() -> FakeKubeApi:
    api = FakeKubeApi()
    for name in ("gpu-1", "gpu-2", "gpu-3", "spare-1"):
        api.add_node(name, taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    for index, node in enumerate(("gpu-1", "gpu-2", "gpu-3")):
        api.add_pod(NS, f"llm-worker-{index}", node, {JOB_LABEL: JOB, ROLE_LABEL: "worker"})
    api.add_pod(NS, "llm-standby-0", "spare-1", {JOB_LABEL: JOB, ROLE_LABEL: "standby"})
    api.add_pod(NS, "other-job", "gpu-2", {JOB_LABEL: "other"})
    api.deployments[(NS, "llm-standby")] = 1
    return api


def actuator(api: FakeKubeApi) -> KubernetesActuator:
    return KubernetesActuator(api, keel_job_id=JOB, namespace=NS, standby_deployment="llm-standby", clock=lambda: NOW)


def test_evict_cordons_taints_labels_and_deletes_only_the_jobs_pods(cluster: FakeKubeApi) -> None:
    detail = actuator(cluster).evict("gpu-2", "XID 79 on GPU 3: fallen off the bus", incident="7f3a9c")
    node = cluster.nodes["gpu-2"]
    assert node["spec"]["unschedulable"] is True
    assert {"key": TAINT_KEY, "value": JOB, "effect": "NoSchedule"} in node["spec"]["taints"]
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in node["spec"]["taints"]  # kept
    labels = node["metadata"]["labels"]
    assert labels[EVICTED_LABEL] == "true" and labels["keel.dev/incident"] == "7f3a9c"
    assert labels["keel.dev/evicted-job"] == JOB and labels["keel.dev/evicted-by"] == "keel-actuator"
    assert labels["keel.dev/evicted-at"] == str(int(NOW.timestamp()))
    assert node["metadata"]["annotations"][REASON_ANNOTATION] == "XID 79 on GPU 3: fallen off the bus"
    assert (NS, "llm-worker-1") not in cluster.pods and (NS, "other-job") in cluster.pods  # only the job's pods
    assert "llm-worker-1" in detail and "cordoned" in detail


def test_a_repeated_eviction_does_nothing_twice(cluster: FakeKubeApi) -> None:
    actuator(cluster).evict("gpu-2", "XID 79")
    version = cluster.nodes["gpu-2"]["metadata"]["resourceVersion"]
    writes = len([r for r in cluster.requests if r[0] in ("PATCH", "DELETE")])
    detail = actuator(cluster).evict("gpu-2", "XID 79")
    assert "already cordoned by Keel" in detail and "no pod of the job left" in detail
    assert cluster.nodes["gpu-2"]["metadata"]["resourceVersion"] == version
    assert len([r for r in cluster.requests if r[0] in ("PATCH", "DELETE")]) == writes


def test_a_humans_cordon_is_left_alone_but_the_job_leaves_the_node(cluster: FakeKubeApi) -> None:
    cluster.nodes["gpu-3"]["spec"]["unschedulable"] = True  # kubectl cordon gpu-3
    before = dict(cluster.nodes["gpu-3"]["metadata"]["labels"])
    detail = actuator(cluster).evict("gpu-3", "NIC down")
    assert "cordoned by someone else" in detail
    assert cluster.nodes["gpu-3"]["metadata"]["labels"] == before and EVICTED_LABEL not in before
    assert not [r for r in cluster.requests if r[0] == "PATCH"]
    assert (NS, "llm-worker-2") not in cluster.pods


def test_a_node_changed_between_read_and_patch_is_read_again(cluster: FakeKubeApi) -> None:
    api = actuator(cluster)
    real_request = cluster.request
    raced = []

    def racing(method, path, **kwargs):  # type: ignore[no-untyped-def]
        if method == "PATCH" and not raced:  # someone labels the node first: our resourceVersion is stale
            raced.append(True)
            cluster.nodes["gpu-1"]["metadata"]["labels"]["team"] = "infra"
            cluster._bump(cluster.nodes["gpu-1"])
        return real_request(method, path, **kwargs)

    cluster.request = racing  # type: ignore[method-assign]
    api.evict("gpu-1", "GPU lost")
    labels = cluster.nodes["gpu-1"]["metadata"]["labels"]
    assert labels["team"] == "infra" and labels[EVICTED_LABEL] == "true"


def test_standbys_promotion_and_refill(cluster: FakeKubeApi) -> None:
    api = actuator(cluster)
    assert api.standbys() == ["spare-1"]
    api.mark_promoted("spare-1")
    assert cluster.pods[(NS, "llm-standby-0")]["metadata"]["labels"][PROMOTED_LABEL] == "true"
    assert api.standbys() == []
    started = api.provision_standbys(1)
    assert started == ["llm-standby+1"] and cluster.deployments[(NS, "llm-standby")] == 2
    # The Deployment's new pod, pending, counts: the same refill redelivered asks for nothing more.
    cluster.add_pod(NS, "llm-standby-1", None, {JOB_LABEL: JOB, ROLE_LABEL: "standby"})
    assert api.standbys() == ["pod/llm-standby-1"]
    # A standby on a node someone cordoned is no standby.
    cluster.add_pod(NS, "llm-standby-2", "gpu-3", {JOB_LABEL: JOB, ROLE_LABEL: "standby"})
    cluster.nodes["gpu-3"]["spec"]["unschedulable"] = True
    assert api.standbys() == ["pod/llm-standby-1"]


def test_bad_targets_fail_clearly(cluster: FakeKubeApi) -> None:
    with pytest.raises(ActuatorError, match="not a node of this Kubernetes cluster"):
        actuator(cluster).evict("gpu-99", "test")
    missing = KubernetesActuator(cluster, keel_job_id=JOB, namespace=NS, standby_deployment="nope")
    with pytest.raises(ActuatorError, match="no standby Deployment training/nope"):
        missing.provision_standbys(1)


@pytest.mark.parametrize("method, path, query, body, content_type, message", [
    ("GET", "/api/v1/nodez/gpu-1", None, None, "application/json", "not an operation"),
    ("GET", "/api/v1/pods", {"labelSelectr": "a=b"}, None, "application/json", "query parameters"),
    ("PATCH", "/api/v1/nodes/gpu-1", None, {"spec": {"unschedulabe": True}}, "application/strategic-merge-patch+json", "not a valid V1Node"),
    ("PATCH", "/api/v1/nodes/gpu-1", None, {"spec": {"taints": [{"value": "x"}]}}, "application/strategic-merge-patch+json", "not a valid V1Node"),
    ("PATCH", "/api/v1/nodes/gpu-1", None, {"spec": {}}, "text/plain", "content type"),
    ("DELETE", "/api/v1/namespaces/a/pods/b", None, {"gracePeriodSecs": 3}, "application/json", "not a valid V1DeleteOptions"),
])
def test_the_contract_refuses_what_the_api_would(method: str, path: str, query: dict[str, str] | None, body: object,
                                                  content_type: str, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        check_request(method, path, query, body, content_type)


def test_label_values_are_valid() -> None:
    assert label_value("incident 7f3a/9c!") == "incident-7f3a-9c"
    assert len(label_value("x" * 100)) == 63 and label_value("--") == ""
