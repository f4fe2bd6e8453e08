"""The ``kubernetes`` actuator: nodes are Kubernetes nodes; Keel's node id is the node's name (the agent's
pod takes it from the downward API, ``spec.nodeName``).

- **Evict**: cordon the node, taint it ``keel.dev/evicted:NoSchedule`` and label it (``keel.dev/evicted``,
  the job, who, when, the incident; the reason in the ``keel.dev/evicted-reason`` annotation), then delete
  the job's pods on it (label ``keel.dev/job=<job>``). A node cordoned by someone else is left as it is
  (its pods of the job are still deleted: the job leaves the node); Keel never uncordons a node. A repeated
  command does nothing twice: the node is found labelled, and its pods are gone.
- **Standbys**: the job's pods of the standby set (labels ``keel.dev/job=<job>, keel.dev/role=standby``,
  a Deployment of agent pods started with ``--keel-standby``), ready on nodes not cordoned, less those
  promoted (labelled ``keel.dev/promoted=true``); a pod not ready yet counts, so a refill is not asked twice.
- **Refill**: scale the standby Deployment up by the count (``PATCH .../deployments/<name>/scale``).

Every request is one of the API's published operations (``tests/k8s_contract.py`` checks each against the
operations of the official client and the API's JSON schemas). No Kubernetes API server can run on the
machines Keel is built on: this actuator has not met a live cluster (docs/deploy.md).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from keel.actuator.core import ActuatorError
from keel.actuator.kubernetes_rules import JOB_LABEL, PROMOTED_LABEL, ROLE_LABEL, plan_cordon, standby_names
from keel.events.envelope import now_utc

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeApiError(ActuatorError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API: {status} {message}")
        self.status = status


class KubeApi(Protocol):
    def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None, body: Any = None,
                content_type: str = "application/json") -> Any:
        """One API call; the decoded JSON answer. Raises ``KubeApiError`` (with the HTTP status) or
        ``ActuatorError`` (unreachable)."""
        ...


class HttpKubeApi:
    """The API server over HTTPS with a bearer token: in a pod, the service account's token and CA and
    ``KUBERNETES_SERVICE_HOST``/``_PORT`` (``in_cluster``); elsewhere, the ones given."""

    def __init__(self, server: str, *, token: str | Callable[[], str], ca_file: Path | None, timeout_s: float = 30.0) -> None:
        self.server = server.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] = os.environ, account: Path = SERVICE_ACCOUNT) -> HttpKubeApi:
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ActuatorError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): the kubernetes actuator runs "
                                "in the cluster, with its service account")
        token_file = account / "token"

        def token() -> str:  # re-read: bound service-account tokens rotate
            try:
                return token_file.read_text().strip()
            except OSError as exc:
                raise ActuatorError(f"cannot read the service account token {token_file}: {exc}") from exc

        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", token=token, ca_file=account / "ca.crt")

    def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None, body: Any = None,
                content_type: str = "application/json") -> Any:
        url = self.server + path + (f"?{urllib.parse.urlencode(dict(query))}" if query else "")
        token = self._token() if callable(self._token) else self._token
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as answer:
                text = answer.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("message", detail)
            except ValueError:
                pass
            raise KubeApiError(exc.code, f"{method} {path}: {str(detail)[:300]}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ActuatorError(f"Kubernetes API at {self.server} unreachable: {exc}") from None
        return json.loads(text) if text else {}


class KubernetesActuator:
    name = "kubernetes"

    def __init__(self, api: KubeApi, *, keel_job_id: str, namespace: str, standby_deployment: str,
                 clock: Callable[[], datetime] = now_utc, grace_period_s: int = 30) -> None:
        self.api, self.job_id, self.namespace = api, keel_job_id, namespace
        self.standby_deployment = standby_deployment
        self.clock, self.grace_period_s = clock, grace_period_s

    def _node(self, name: str) -> dict[str, Any]:
        try:
            return self.api.request("GET", f"/api/v1/nodes/{_seg(name)}")
        except KubeApiError as exc:
            if exc.status == 404:
                raise ActuatorError(f"{name!r} is not a node of this Kubernetes cluster (Keel's node id must be the "
                                    "node's name)") from None
            raise

    def evict(self, node_id: str, reason: str, incident: str = "") -> str:
        details = []
        for attempt in range(3):  # a node changed between our read and our patch (409) is read again
            node = self._node(node_id)
            plan = plan_cordon(node, reason=reason, job_id=self.job_id, incident=incident, by="keel-actuator",
                               now=self.clock())
            if plan.action == "none":
                details.append(plan.detail)
                break
            try:
                self.api.request("PATCH", f"/api/v1/nodes/{_seg(node_id)}", body=plan.patch,
                                 content_type="application/strategic-merge-patch+json")
            except KubeApiError as exc:
                if exc.status == 409 and attempt < 2:
                    continue
                raise
            details.append(plan.detail)
            break
        pods = self.api.request("GET", "/api/v1/pods", query={
            "labelSelector": f"{JOB_LABEL}={self.job_id}", "fieldSelector": f"spec.nodeName={node_id}"})
        deleted = []
        for pod in pods.get("items") or []:
            metadata = pod.get("metadata") or {}
            try:
                self.api.request("DELETE", f"/api/v1/namespaces/{_seg(metadata['namespace'])}/pods/{_seg(metadata['name'])}",
                                 body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": self.grace_period_s})
            except KubeApiError as exc:
                if exc.status != 404:  # gone already: what we wanted
                    raise
            deleted.append(metadata["name"])
        details.append(f"deleted the job's pods there: {', '.join(deleted)}" if deleted else "no pod of the job left there")
        return "; ".join(details)

    def _standby_pods(self) -> list[dict[str, Any]]:
        answer = self.api.request("GET", f"/api/v1/namespaces/{_seg(self.namespace)}/pods",
                                  query={"labelSelector": f"{JOB_LABEL}={self.job_id},{ROLE_LABEL}=standby"})
        return list(answer.get("items") or [])

    def standbys(self) -> list[str]:
        pods = self._standby_pods()
        names = {p["spec"]["nodeName"] for p in pods if (p.get("spec") or {}).get("nodeName")}
        nodes = {}
        for name in sorted(names):
            try:
                nodes[name] = self._node(name)
            except ActuatorError:
                continue  # the node is gone: its pod is no standby
        return standby_names(pods, nodes)

    def mark_promoted(self, node_id: str) -> None:
        for pod in self._standby_pods():
            if (pod.get("spec") or {}).get("nodeName") == node_id:
                self.api.request("PATCH", f"/api/v1/namespaces/{_seg(self.namespace)}/pods/{_seg(pod['metadata']['name'])}",
                                 body={"metadata": {"labels": {PROMOTED_LABEL: "true"}}},
                                 content_type="application/merge-patch+json")

    def provision_standbys(self, count: int) -> list[str]:
        if count <= 0:
            return []
        path = f"/apis/apps/v1/namespaces/{_seg(self.namespace)}/deployments/{_seg(self.standby_deployment)}/scale"
        try:
            scale = self.api.request("GET", path)
        except KubeApiError as exc:
            if exc.status == 404:
                raise ActuatorError(f"no standby Deployment {self.namespace}/{self.standby_deployment}: Keel cannot "
                                    "refill standbys without it (docs/deploy.md)") from None
            raise
        replicas = int((scale.get("spec") or {}).get("replicas") or 0)
        self.api.request("PATCH", path, body={"spec": {"replicas": replicas + count}},
                         content_type="application/merge-patch+json")
        return [f"{self.standby_deployment}+{replicas + i}" for i in range(count)]


def _seg(text: str) -> str:
    """One path segment: names are DNS labels, but nothing unescaped reaches a URL."""
    return urllib.parse.quote(text, safe="")
