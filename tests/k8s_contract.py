"""The Kubernetes API's published contract, for testing Keel's Kubernetes actuator without an API server
(none can run on these machines).

- **Operations**: every (method, path, query parameters, content types) of the official Python client
  (``kubernetes``, generated from the API's OpenAPI document), read from its generated source, so no
  operation is made up here.
- **Objects**: the API's JSON schemas (``kubernetes-validate``'s bundle of the OpenAPI definitions, the
  ``-strict`` variant: an unknown field is an error), for request bodies and for what the fake answers.

``FakeKubeApi`` is an in-memory API server for the operations the actuator uses; every request it gets is
checked against both before it is served (``ContractError`` otherwise), and every object it answers with
validates too. ``tests/integration/test_kubernetes_http.py`` serves it over HTTPS to the real adapter.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import files
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from keel.actuator.kubernetes import KubeApiError

SCHEMA_VERSION = "v1.37.0-local-strict"


class ContractError(AssertionError):
    """A request that is not one of the API's published operations, or a body or answer its schema refuses."""


@dataclass(frozen=True)
class Operation:
    name: str
    method: str
    template: str
    query: frozenset[str]
    content_types: tuple[str, ...]
    returns: str
    """The client's model name of the answer (``V1Node``): a PATCH body is a partial one of these."""

    @functools.cached_property
    def pattern(self) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\\\{[^}]+\\\}", r"[^/]+", re.escape(self.template)) + "$")


def _client_dir() -> Path:
    for entry in files("kubernetes") or []:
        if str(entry).replace("\\", "/").endswith("kubernetes/client/api/core_v1_api.py"):
            return Path(str(entry.locate())).parent
    raise RuntimeError("the kubernetes client is not installed (make install puts it in .venv, without its dependencies)")


@functools.cache
def operations() -> tuple[Operation, ...]:
    found = []
    for source in sorted(_client_dir().glob("*_api.py")):
        text = source.read_text()
        returns = dict(re.findall(r"\n    def (\w+)\(\n(?:.*\n)*?    \) -> (\w+):", text))
        for name, body in re.findall(r"\n    def _(\w+)_serialize\((.*?)(?=\n    def |\Z)", text, re.S):
            head = re.search(r"method='(\w+)',\s*resource_path='([^']+)'", body)
            if not head:
                continue
            content = re.search(r"select_header_content_type\(\s*\[([^\]]*)\]", body)
            found.append(Operation(
                name=name, method=head.group(1), template=head.group(2),
                query=frozenset(re.findall(r"_query_params\.append\(\('(\w+)'", body)),
                content_types=tuple(re.findall(r"'([^']+)'", content.group(1))) if content else (),
                returns=returns.get(name, "")))
    return tuple(found)


@functools.cache
def _schemas() -> tuple[dict[str, Any], Registry]:
    import kubernetes_validate

    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / SCHEMA_VERSION / "_definitions.json"
    document = json.loads(path.read_text())
    return document, Registry().with_resource(document["$id"], DRAFT202012.create_resource(document))


def definition(model: str) -> str:
    """The schema definition of a client model name: ``V1Node`` -> ``io.k8s.api.core.v1.Node``."""
    match = re.fullmatch(r"(V\d+(?:alpha\d+|beta\d+)?)(\w+)", model)
    if not match:
        raise ContractError(f"{model!r} is not a versioned model name")
    version, kind = match.group(1).lower(), match.group(2)
    document, _ = _schemas()
    candidates = [name for name in document["$defs"] if name.endswith(f".{version}.{kind}")]
    preferred = [c for c in candidates if c.startswith("io.k8s.api.core.")] or candidates
    if len(preferred) != 1:
        raise ContractError(f"no single schema for {model}: {candidates}")
    return preferred[0]


def validate(obj: Any, model: str, what: str) -> None:
    document, registry = _schemas()
    validator = jsonschema.Draft202012Validator({"$ref": f"{document['$id']}#/$defs/{definition(model)}"}, registry=registry)
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        raise ContractError(f"{what}: not a valid {model}: " + "; ".join(
            f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}" for e in errors[:5]))


def check_request(method: str, path: str, query: Mapping[str, str] | None, body: Any, content_type: str) -> Operation:
    """The published operation this request is, its query parameters and body checked; ``ContractError`` if none."""
    matches = [op for op in operations() if op.method == method and op.pattern.match(path)]
    if not matches:
        raise ContractError(f"{method} {path} is not an operation of the Kubernetes API")
    # The most specific template (fewest placeholders) is the one that applies.
    op = min(matches, key=lambda o: o.template.count("{"))
    unknown = set(query or {}) - op.query
    if unknown:
        raise ContractError(f"{op.name}: query parameters {sorted(unknown)} are not accepted (accepted: {sorted(op.query)})")
    if body is not None:
        if op.method == "PATCH":
            if content_type not in op.content_types:
                raise ContractError(f"{op.name}: content type {content_type} not accepted ({op.content_types})")
            if content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                validate(body, op.returns, f"{op.name} body")  # a merge patch is a partial object
        elif op.method == "DELETE":
            validate(body, "V1DeleteOptions", f"{op.name} body")
        elif op.method in ("POST", "PUT"):
            validate(body, op.returns, f"{op.name} body")
    return op


def _match_labels(obj: dict[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _match_fields(obj: dict[str, Any], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if key != "spec.nodeName":
            raise ContractError(f"the fake answers only spec.nodeName field selectors, not {key}")
        if (obj.get("spec") or {}).get("nodeName") != value:
            return False
    return True


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeKubeApi:
    """An in-memory API server for nodes, pods and deployments' scale, checking every request against the
    published contract (``check_request``) and every answer against its schema. ``requests`` records each
    one as (method, path, query, body, content type)."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.deployments: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str, dict[str, str], Any, str]] = []
        self._version = 100

    def _bump(self, obj: dict[str, Any]) -> None:
        self._version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._version)

    def add_node(self, name: str, **spec: Any) -> dict[str, Any]:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                "spec": dict(spec), "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        self._bump(node)
        validate(node, "V1Node", "fake node")
        self.nodes[name] = node
        return node

    def add_pod(self, namespace: str, name: str, node: str | None, labels: dict[str, str], *, ready: bool = True) -> dict[str, Any]:
        status: dict[str, Any] = {"phase": "Running" if node else "Pending"}
        if node:
            status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
               "spec": {"containers": [{"name": "agent", "image": "keel-agent"}], **({"nodeName": node} if node else {})},
               "status": status}
        self._bump(pod)
        validate(pod, "V1Pod", "fake pod")
        self.pods[(namespace, name)] = pod
        return pod

    def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None, body: Any = None,
                content_type: str = "application/json") -> Any:
        op = check_request(method, path, query, body, content_type)
        self.requests.append((method, path, dict(query or {}), copy.deepcopy(body), content_type))
        answer = self._serve(op, path, dict(query or {}), body)
        if op.returns and op.returns not in ("object", "str"):
            validate(answer, op.returns, f"the fake's answer to {op.name}")
        return copy.deepcopy(answer)

    def _serve(self, op: Operation, path: str, query: dict[str, str], body: Any) -> Any:
        parts = path.strip("/").split("/")
        if op.name == "read_node":
            return self._get_node(parts[-1])
        if op.name == "patch_node":
            node = self._get_node(parts[-1])
            wanted = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if wanted and wanted != node["metadata"]["resourceVersion"]:
                raise KubeApiError(409, f"Operation cannot be fulfilled on nodes \"{parts[-1]}\": the object has been modified")
            patch = copy.deepcopy(body)
            patch.get("metadata", {}).pop("resourceVersion", None)
            _merge(node, patch)
            self._bump(node)
            return node
        if op.name in ("list_pod_for_all_namespaces", "list_namespaced_pod"):
            namespace = parts[3] if op.name == "list_namespaced_pod" else None
            items = [p for (ns, _), p in sorted(self.pods.items()) if (namespace is None or ns == namespace)
                     and _match_labels(p, query.get("labelSelector", "")) and _match_fields(p, query.get("fieldSelector", ""))]
            return {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(self._version)}, "items": items}
        if op.name == "delete_namespaced_pod":
            key = (parts[3], parts[5])
            if key not in self.pods:
                raise KubeApiError(404, f"pods \"{parts[5]}\" not found")
            return self.pods.pop(key)
        if op.name == "patch_namespaced_pod":
            key = (parts[3], parts[5])
            if key not in self.pods:
                raise KubeApiError(404, f"pods \"{parts[5]}\" not found")
            _merge(self.pods[key], body)
            self._bump(self.pods[key])
            return self.pods[key]
        if op.name in ("read_namespaced_deployment_scale", "patch_namespaced_deployment_scale"):
            key = (parts[4], parts[6])
            if key not in self.deployments:
                raise KubeApiError(404, f"deployments.apps \"{parts[6]}\" not found")
            if op.name == "patch_namespaced_deployment_scale":
                self.deployments[key] = int(body["spec"]["replicas"])
            return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": key[1], "namespace": key[0]},
                    "spec": {"replicas": self.deployments[key]}, "status": {"replicas": self.deployments[key]}}
        raise ContractError(f"the fake does not serve {op.name} ({op.method} {op.template})")

    def _get_node(self, name: str) -> dict[str, Any]:
        if name not in self.nodes:
            raise KubeApiError(404, f"nodes \"{name}\" not found")
        return self.nodes[name]


__all__ = ["ContractError", "FakeKubeApi", "check_request", "operations", "validate"]
