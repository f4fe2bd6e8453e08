"""Terraform for Kubernetes, rendered by the real ``terraform`` and checked against the Kubernetes API's schema.

No Kubernetes API server runs here and the Terraform registry is out of reach, so the root module (which needs
the kubernetes and random providers) cannot be initialised. Everything it applies is computed by
``infra/terraform/modules/manifests``, which needs no provider: this test runs the root's own ``variables.tf``
and ``manifests.tf`` (the module call) with ``terraform apply`` in a scratch folder, over credentials that
``keel-credentials`` really issued, with the generated database passwords replaced by fixed ones. Then:

- every object validates against the API's published OpenAPI schema (v1.37, strict: an unknown field fails);
- every service ``keel up`` starts runs, with startup, readiness and liveness probes, as the commands its image has;
- the node-agent DaemonSet has host PID, SYS_PTRACE, a memory ``/dev/shm``, the GPUs and NVML, each node's own bundle;
- the actuator's RBAC grants exactly the calls the Kubernetes actuator makes (``tests/k8s_contract.py``'s fake);
- NetworkPolicies put NATS and the database behind labels that exactly the pods needing them carry;
- the rendered ``nats.conf`` is accepted by the real ``nats-server``; images are pinned by digest.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from keel.actuator.kubernetes import KubernetesActuator
from keel.actuator.kubernetes_rules import JOB_LABEL, ROLE_LABEL
from keel.cli.runtime import SERVICES
from keel.infra.embedded import _nats_server_binary
from tests.k8s_contract import FakeKubeApi, check_request, validate
from tests.unit.test_deployment_files import _console_scripts, _dockerfile_installs

ROOT = Path(__file__).resolve().parents[2]
TERRAFORM = ROOT / "infra/terraform"
NAMESPACE, JOB = "keel", "llm"
WORKERS, SPARES = ["gpu-001", "gpu-002"], ["spare-001"]
DIGEST = "@sha256:" + "0123456789abcdef" * 4
IMAGES = {"image": f"registry.example.com/keel:0.1{DIGEST}", "agent_image": f"registry.example.com/keel-agent:0.1{DIGEST}",
          "nats_image": f"nats:2.10-alpine{DIGEST}"}


def _terraform(folder: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("terraform")
    assert binary, "terraform is not installed: these checks run the real one (it is on the CI machines)"
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1", "TF_CLI_CONFIG_FILE": os.devnull,
           "TF_INPUT": "0"}
    result = subprocess.run([binary, f"-chdir={folder}", *args], capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert result.returncode == 0, f"terraform {' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


API_TOKEN_ENTRY = {"name": "oncall", "scope": "read", "sha256": "ab" * 32}
"""An ``api_tokens`` entry as ``keel-api --new-token`` prints it."""


def _credentials(scratch: Path) -> Path:
    """A credentials folder as the operator makes it (terraform/README.md), and every node's agent bundle."""
    master = scratch / "credentials"
    env = {**os.environ, "KEEL_CREDENTIALS_DIR": str(master), "KEEL_HOME": str(scratch / "home")}
    hosts = [f"nats.{NAMESPACE}.svc.cluster.local", f"*.nats-headless.{NAMESPACE}.svc.cluster.local"]
    credentials = str(Path(sys.executable).parent / "keel-credentials")
    subprocess.run([credentials, "init", *[a for h in hosts for a in ("--tls-host", h)],
                    "--auth-file", str(master / "nats-authorization.conf")], env=env, check=True, capture_output=True)
    for node in WORKERS + SPARES:
        subprocess.run([credentials, "issue-agent", "--job", JOB, "--node", node, "--store-host", node,
                        "--export", str(master / "agents" / node), "--export-server", str(scratch / "nats-server")],
                       env=env, check=True, capture_output=True)
    return master


def _variables(master: Path, **overrides: Any) -> dict[str, Any]:
    return {
        **IMAGES,
        "database_url": "postgresql://keel_migrate:migrate-pw@db-primary.example.com:5432,db-standby.example.com:5432/keel"
                        "?sslmode=verify-full&sslrootcert=system&target_session_attrs=read-write",
        "database_cidrs": ["10.20.0.0/24"],
        "kube_api_cidrs": ["10.0.0.1/32"],
        "nats_client_cidrs": ["10.30.0.0/16"],
        "credentials_dir": str(master),
        "nats_authorization_file": str(master.parent / "nats-server/authorization.conf"),
        "checkpoint_volume_claim": "keel-checkpoints",
        "image_pull_secrets": ["registry"],
        "api_tokens": [API_TOKEN_ENTRY],
        "api_client_cidrs": ["10.40.0.0/16"],
        "job": {"id": JOB, "nodes": WORKERS, "standby_nodes": SPARES, "node_selector": {"keel.dev/pool": "llm"},
                "standby_selector": {"keel.dev/pool": "spare"}, "nproc_per_node": 8, "gpus_per_node": 8,
                "command": ["python", "-m", "llm.train", "--config", "70b.yaml"], "rdzv_endpoint": "10.30.0.11:29400",
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        **overrides,
    }


def _workspace(scratch: Path, name: str = "root") -> Path:
    """The root's variables and module call, with fixed database passwords in place of random_password."""
    folder = scratch / name
    folder.mkdir()
    for name in ("variables.tf", "manifests.tf"):
        shutil.copy(TERRAFORM / name, folder / name)
    shutil.copytree(TERRAFORM / "modules", folder / "modules")
    (folder / "harness.tf").write_text("""
locals {
  database_passwords = { recorder = "recorder-pw", decider = "decider-pw", auditor = "auditor-pw" }
}
output "objects" {
  value = merge({ "Namespace/ns" = module.manifests.namespace }, module.manifests.base, module.manifests.migrate,
  module.manifests.workloads)
}
output "secrets" {
  value     = module.manifests.secrets
  sensitive = true
}
""")
    _terraform(folder, "init", "-backend=false")
    return folder


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("terraform")
    yield path


@pytest.fixture(scope="module")
def rendered(scratch: Path) -> dict[str, Any]:
    master = _credentials(scratch)
    folder = _workspace(scratch)
    (folder / "test.tfvars.json").write_text(json.dumps(_variables(master)))
    _terraform(folder, "apply", "-auto-approve", "-var-file=test.tfvars.json")
    outputs = json.loads(_terraform(folder, "output", "-json").stdout)
    return {"objects": outputs["objects"]["value"], "secrets": outputs["secrets"]["value"], "folder": folder, "master": master}


def _all(rendered: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {**rendered["objects"], **rendered["secrets"]}


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def _workloads(rendered: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {key: obj for key, obj in rendered["objects"].items() if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job")}


def test_every_object_validates_against_the_kubernetes_schema(rendered: dict[str, Any]) -> None:
    objects = _all(rendered)
    kinds = {obj["kind"] for obj in objects.values()}
    assert kinds == {"Namespace", "Secret", "ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget", "Job",
                     "Deployment", "DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                     "RoleBinding", "NetworkPolicy"}
    for key, obj in objects.items():
        assert key == f"{obj['kind']}/{obj['metadata']['name']}" or obj["kind"] in ("Namespace", "Job")
        assert obj["apiVersion"].rsplit("/", 1)[-1] == "v1", key
        validate(obj, f"V1{obj['kind']}", key)  # strict: an unknown or misspelt field fails here
    # The strict schema does refuse a misspelt field (this check can fail).
    broken = json.loads(json.dumps(objects["Deployment/keel-controller"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = broken["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate(broken, "V1Deployment", "broken")


def test_every_service_keel_up_starts_runs_once_with_probes_and_its_own_secrets(rendered: dict[str, Any]) -> None:
    objects = rendered["objects"]
    control = {obj["metadata"]["name"]: obj for obj in objects.values()
               if obj["kind"] == "Deployment" and obj["metadata"]["labels"].get("keel.dev/plane") == "control"}
    assert sorted(control) == sorted(f"keel-{name}" for name in SERVICES)
    for name, deployment in control.items():
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
        [container] = _pod_spec(deployment)["containers"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in container, (name, probe)
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        alive = env["KEEL_SERVICE_READY_FILE"]
        assert alive in container["readinessProbe"]["exec"]["command"] and alive in " ".join(container["livenessProbe"]["exec"]["command"])
        # Its own credentials Secret, copied by the init container, and the database role it needs (or none).
        volumes = {v["name"]: v for v in _pod_spec(deployment)["volumes"]}
        assert volumes["credentials-source"]["secret"]["secretName"] == f"keel-credentials-{name.removeprefix('keel-')}"
        secrets = [e["secretRef"]["name"] for e in container["envFrom"] if "secretRef" in e]
        expected = {"keel-recorder": ["keel-database-recorder"], "keel-actuator": [], "keel-notifier": []}.get(
            name, ["keel-database-decider"])
        assert secrets == expected, name
    actuator = _pod_spec(control["keel-actuator"])
    assert actuator["serviceAccountName"] == "keel-actuator" and actuator["automountServiceAccountToken"] is True
    assert all(_pod_spec(d).get("automountServiceAccountToken") is False for n, d in control.items() if n != "keel-actuator")
    env = {e["name"]: e["value"] for e in actuator["containers"][0]["env"]}
    assert env["KEEL_ACTUATOR__KIND"] == "kubernetes" and env["KEEL_JOB_ID"] == JOB
    assert env["KEEL_ACTUATOR__KUBERNETES__STANDBY_DEPLOYMENT"] in {o["metadata"]["name"] for o in objects.values() if o["kind"] == "Deployment"}
    # The migrate Job runs first (its name changes with the image, so a new image migrates again).
    job = objects["Job/keel-migrate"]
    assert _pod_spec(job)["containers"][0]["command"] == ["keel-migrate"]
    assert re.fullmatch(r"keel-migrate-[0-9a-f]{10}", job["metadata"]["name"])


def test_every_command_is_one_the_image_installs(rendered: dict[str, Any]) -> None:
    scripts = _console_scripts()
    control_image = _dockerfile_installs(ROOT / "Dockerfile")
    agent_image = _dockerfile_installs(ROOT / "infra/images/agent.Dockerfile")
    for key, obj in _workloads(rendered).items():
        for container in [*_pod_spec(obj).get("initContainers", []), *_pod_spec(obj)["containers"]]:
            if container["image"] == IMAGES["nats_image"]:
                continue
            installed = agent_image if container["image"] == IMAGES["agent_image"] else control_image
            command = container["command"][0]
            assert command in scripts and scripts[command] in installed, (key, command)
            assert container["image"] in (IMAGES["image"], IMAGES["agent_image"])


def test_images_are_pinned_by_digest_and_a_tag_alone_is_refused(rendered: dict[str, Any]) -> None:
    for key, obj in _workloads(rendered).items():
        for container in [*_pod_spec(obj).get("initContainers", []), *_pod_spec(obj)["containers"]]:
            assert re.search(r"@sha256:[0-9a-f]{64}$", container["image"]), (key, container["image"])
    folder: Path = rendered["folder"]
    (folder / "tag.tfvars.json").write_text(json.dumps(_variables(rendered["master"], agent_image="registry.example.com/keel-agent:latest")))
    refused = _terraform(folder, "plan", "-var-file=tag.tfvars.json", check=False)
    assert refused.returncode != 0 and "agent_image must be pinned by digest" in refused.stderr


def test_bad_inputs_are_refused_with_their_reason(rendered: dict[str, Any]) -> None:
    folder: Path = rendered["folder"]
    cases: dict[str, dict[str, Any]] = {
        "database_cidrs must list": {"database_cidrs": []},
        "a node is either a worker": {"job": {**_variables(rendered["master"])["job"], "standby_nodes": ["gpu-001"]}},
        "nats_client_cidrs must list the training nodes": {"nats_client_cidrs": []},
        "database_url must say how it uses TLS": {"database_url": "postgresql://keel_migrate:pw@db:5432/keel"},
        "every api_tokens entry needs scope read or operator": {"api_tokens": [{**API_TOKEN_ENTRY, "scope": "admin"}]},
    }
    for message, override in cases.items():
        (folder / "bad.tfvars.json").write_text(json.dumps(_variables(rendered["master"], **override)))
        result = _terraform(folder, "plan", "-var-file=bad.tfvars.json", check=False)
        assert result.returncode != 0 and message in " ".join(result.stderr.split()), (message, result.stderr[-1500:])


def test_the_http_api_runs_as_the_auditor_behind_its_tokens_and_only_its_clients_reach_it(rendered: dict[str, Any]) -> None:
    objects = rendered["objects"]
    deployment = objects["Deployment/keel-api"]
    [container] = _pod_spec(deployment)["containers"]
    assert container["command"] == ["keel-api"] and container["envFrom"] == [{"secretRef": {"name": "keel-database-auditor"}}]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert json.loads(env["KEEL_API__TOKENS"]) == [API_TOKEN_ENTRY]  # the digest only: no token in the cluster
    assert env["KEEL_API__LISTEN_PORT"] == "8380" and "KEEL_NATS_URL" not in env
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    assert "initContainers" not in _pod_spec(deployment)  # no NATS identity to install
    auditor = base64.b64decode(rendered["secrets"]["Secret/keel-database-auditor"]["data"]["KEEL_DATABASE_URL"]).decode()
    assert auditor.startswith("postgresql://keel_auditor:auditor-pw@")
    service = objects["Service/keel-api"]["spec"]
    assert _selects(service["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert service["ports"] == [{"name": "http", "port": 8380, "protocol": "TCP", "targetPort": "http"}]
    policy = next(o["spec"] for o in objects.values() if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "keel-api")
    assert _selects(policy["podSelector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    [rule] = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"keel.dev/api-client": "true"}}},
                            {"ipBlock": {"cidr": "10.40.0.0/16"}}] and rule["ports"] == [{"port": 8380, "protocol": "TCP"}]


def test_the_node_agent_daemonset_has_what_the_agent_needs(rendered: dict[str, Any]) -> None:
    objects = rendered["objects"]
    daemonset = objects[f"DaemonSet/keel-agent-{JOB}"]
    standby = objects["Deployment/keel-standby"]
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert "replicas" not in standby["spec"]  # the actuator owns the standby count
    for obj, role in ((daemonset, "worker"), (standby, "standby")):
        spec = _pod_spec(obj)
        assert obj["spec"]["template"]["metadata"]["labels"][JOB_LABEL] == JOB
        assert obj["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == role
        assert spec["hostPID"] is True and spec["hostNetwork"] is True
        [agent] = spec["containers"]
        assert "SYS_PTRACE" in agent["securityContext"]["capabilities"]["add"]
        assert agent["resources"]["limits"]["nvidia.com/gpu"] == "8"
        env = {e["name"]: e for e in agent["env"]}
        assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"].split(",")  # NVML
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        command = agent["command"]
        assert command[:2] == ["keel", "run"] and command[-5:] == ["python", "-m", "llm.train", "--config", "70b.yaml"]
        assert command[command.index("--keel-node-id") + 1] == "$(NODE_NAME)"
        assert command[command.index("--keel-ckpt-dir") + 1].startswith("/dev/shm/")
        assert ("--keel-standby" in command) == (role == "standby")
        # Every node's bundle is projected under its name; the init container installs only this node's.
        [init] = spec["initContainers"]
        assert init["command"][init["command"].index("--from") + 1].endswith("/$(NODE_NAME)")
        assert "agent-bundles" not in {m["name"] for m in agent["volumeMounts"]}
        sources = volumes["agent-bundles"]["projected"]["sources"]
        assert sorted(s["secret"]["name"] for s in sources) == sorted(f"keel-agent-{n}" for n in WORKERS + SPARES)
        for source in sources:
            secret = rendered["secrets"][f"Secret/{source['secret']['name']}"]
            node = source["secret"]["name"].removeprefix("keel-agent-")
            for item in source["secret"]["items"]:
                assert item["key"] in secret["data"] and item["path"].startswith(f"{node}/")
            paths = {item["path"] for item in source["secret"]["items"]}
            assert f"{node}/nats/agent.{JOB}.{node}.json" in paths and f"{node}/store/key.pem" in paths
            identity = json.loads(base64.b64decode(secret["data"][f"nats_agent.{JOB}.{node}.json"]))
            assert node in json.dumps(identity)


def test_rbac_grants_exactly_the_calls_the_actuator_makes(rendered: dict[str, Any]) -> None:
    objects = rendered["objects"]
    cluster_rules = objects[f"ClusterRole/keel-actuator-{NAMESPACE}"]["rules"]
    namespace_rules = objects["Role/keel-actuator"]["rules"]
    for binding in (objects[f"ClusterRoleBinding/keel-actuator-{NAMESPACE}"], objects["RoleBinding/keel-actuator"]):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "keel-actuator", "namespace": NAMESPACE}]

    # Every call the actuator makes in its life: evict, standbys, promote, refill, against the published contract.
    api = FakeKubeApi()
    for node in WORKERS + SPARES:
        api.add_node(node)
    for index, node in enumerate(WORKERS):
        api.add_pod("training", f"llm-{index}", node, {JOB_LABEL: JOB, ROLE_LABEL: "worker"})
    api.add_pod(NAMESPACE, "keel-standby-abc", SPARES[0], {JOB_LABEL: JOB, ROLE_LABEL: "standby"})
    api.deployments[(NAMESPACE, "keel-standby")] = 1
    actuator = KubernetesActuator(api, keel_job_id=JOB, namespace=NAMESPACE, standby_deployment="keel-standby",
                                  clock=lambda: datetime(2026, 12, 5, tzinfo=UTC))
    actuator.evict(WORKERS[0], "xid 79", "incident-1")
    assert actuator.standbys() == [SPARES[0]]
    actuator.mark_promoted(SPARES[0])
    actuator.provision_standbys(1)

    verbs = {"GET": "get", "PATCH": "patch", "DELETE": "delete", "POST": "create", "PUT": "update"}
    used: set[tuple[str, int]] = set()
    for method, path, query, body, content_type in api.requests:
        check_request(method, path, query, body, content_type)
        parts = path.strip("/").split("/")
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        namespace = rest[1] if rest[0] == "namespaces" else None
        rest = rest[2:] if rest[0] == "namespaces" else rest
        resource, name = rest[0], (rest[1] if len(rest) > 1 else None)
        if len(rest) > 2:
            resource = f"{resource}/{rest[2]}"
        verb = "list" if method == "GET" and name is None else verbs[method]
        granted = [(scope, i) for scope, rules in (("cluster", cluster_rules), ("namespace", namespace_rules))
                   for i, rule in enumerate(rules)
                   if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
                   and (scope == "cluster" or namespace == NAMESPACE)
                   and (name is None or name in rule.get("resourceNames", [name]))]
        assert granted, f"{method} {path}: not granted ({verb} {group}/{resource} in {namespace})"
        used |= {(scope, i) for scope, i in granted}
    # Least privilege: no rule grants a verb the actuator never uses.
    for scope, rules in (("cluster", cluster_rules), ("namespace", namespace_rules)):
        for i, rule in enumerate(rules):
            assert (scope, i) in used, f"{scope} rule {rule} grants what the actuator never asks for"
            assert len(rule["verbs"]) <= 2 and "*" not in rule["verbs"] + rule["resources"]


def _selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def test_network_policies_put_nats_and_the_database_behind_the_pods_that_need_them(rendered: dict[str, Any]) -> None:
    objects = rendered["objects"]
    policies = {o["metadata"]["name"]: o["spec"] for o in objects.values() if o["kind"] == "NetworkPolicy"}
    assert policies["keel-default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    nats = policies["nats"]
    assert nats["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "nats"
    client_rule = next(rule for rule in nats["ingress"] if rule["ports"] == [{"port": 4222, "protocol": "TCP"}])
    nats_clients = client_rule["from"][0]["podSelector"]["matchLabels"]
    database = policies["keel-database-egress"]
    assert [peer["ipBlock"]["cidr"] for peer in database["egress"][0]["to"]] == ["10.20.0.0/24"]
    assert database["egress"][0]["ports"] == [{"port": 5432, "protocol": "TCP"}]
    database_clients = database["podSelector"]["matchLabels"]
    api_clients = policies["keel-kube-api-egress"]["podSelector"]["matchLabels"]
    for key, obj in _workloads(rendered).items():
        labels = obj["spec"]["template"]["metadata"]["labels"]
        spec = _pod_spec(obj)
        env_from = [e for c in spec["containers"] for e in c.get("envFrom", [])]
        uses_database = any(e.get("secretRef", {}).get("name", "").startswith("keel-database-") for e in env_from)
        uses_nats = any(e.get("configMapRef", {}).get("name") == "keel-settings" for e in env_from)
        assert _selects(database_clients, labels) == uses_database, key
        assert _selects(nats_clients, labels) == uses_nats, key
        assert _selects(api_clients, labels) == (spec.get("serviceAccountName") == "keel-actuator"), key


def test_the_rendered_nats_config_is_accepted_by_nats_server(rendered: dict[str, Any], scratch: Path) -> None:
    objects = rendered["objects"]
    config = objects["ConfigMap/nats-config"]["data"]["nats.conf"]
    routes = re.findall(r'"(nats-route://[^"]+)"', config)
    assert routes == [f"nats-route://nats-{i}.nats-headless.{NAMESPACE}.svc.cluster.local:6222" for i in range(3)]
    assert "sync_interval: always" in config and "max_payload: 1048576" in config
    # The pod's files, where its volumes put them, under a scratch /etc/nats.
    etc = scratch / "etc-nats"
    secrets = rendered["secrets"]
    for folder, secret in (("tls", "Secret/nats-tls"), ("auth", "Secret/nats-authorization")):
        (etc / folder).mkdir(parents=True)
        for key, value in secrets[secret]["data"].items():
            (etc / folder / key).write_bytes(base64.b64decode(value))
    (etc / "config").mkdir()
    (etc / "config/nats.conf").write_text(config.replace("/etc/nats/", f"{etc}/").replace('"/data"', f'"{scratch / "data"}"'))
    env = {**os.environ, "SERVER_NAME": "nats-0"}
    accepted = subprocess.run([str(_nats_server_binary()), "-t", "-c", str(etc / "config/nats.conf")], capture_output=True,
                              text=True, env=env, timeout=60)
    assert accepted.returncode == 0, accepted.stderr + accepted.stdout
    # It can fail: a config without the authorization it includes is refused.
    (etc / "auth/authorization.conf").unlink()
    refused = subprocess.run([str(_nats_server_binary()), "-t", "-c", str(etc / "config/nats.conf")], capture_output=True,
                             text=True, env=env, timeout=60)
    assert refused.returncode != 0


def test_secrets_hold_each_roles_database_url(rendered: dict[str, Any]) -> None:
    secrets = rendered["secrets"]
    urls = {role: base64.b64decode(secrets[f"Secret/keel-database-{role}"]["data"]["KEEL_DATABASE_URL"]).decode()
            for role in ("migrate", "recorder", "decider")}
    assert urls["migrate"].startswith("postgresql://keel_migrate:migrate-pw@db-primary.example.com:5432,db-standby")
    assert urls["recorder"].startswith("postgresql://keel_recorder:recorder-pw@db-primary.example.com:5432,db-standby")
    assert urls["decider"].startswith("postgresql://keel_decider:decider-pw@")
    assert all(url.endswith("target_session_attrs=read-write") for url in urls.values())
    # No secret value appears in a non-Secret object.
    flat = json.dumps(rendered["objects"])
    assert "migrate-pw" not in flat and "BEGIN" not in flat


def test_the_terraform_files_are_formatted_and_the_module_validates(scratch: Path) -> None:
    result = _terraform(TERRAFORM, "fmt", "-check", "-recursive", "-diff", check=False)
    assert result.returncode == 0, f"run `terraform fmt -recursive infra/terraform`:\n{result.stdout[-2000:]}"
    module = scratch / "module"
    shutil.copytree(TERRAFORM / "modules/manifests", module)
    _terraform(module, "init", "-backend=false")
    assert "The configuration is valid" in _terraform(module, "validate", "-no-color").stdout


def _empty_fields(value: Any, path: str = "") -> Iterator[str]:
    """Paths of empty lists and maps: the API server drops them, and the provider then fails the apply."""
    if isinstance(value, dict):
        if not value and not path.endswith(("/emptyDir", "/podSelector")):
            yield path
        for key, item in value.items():
            yield from _empty_fields(item, f"{path}/{key}")
    elif isinstance(value, list):
        if not value:
            yield path
        for index, item in enumerate(value):
            yield from _empty_fields(item, f"{path}/{index}")


def test_no_manifest_sends_an_empty_list_or_map(rendered: dict[str, Any], scratch: Path) -> None:
    for key, obj in _all(rendered).items():
        assert list(_empty_fields(obj)) == [], key
    # The control plane alone, every optional input at its default (no selector, no pull secret, no job).
    folder: Path = rendered["folder"]
    minimal = {key: value for key, value in _variables(rendered["master"]).items()
               if key in ("image", "agent_image", "nats_image", "database_url", "database_cidrs", "kube_api_cidrs",
                          "credentials_dir")}
    (folder / "minimal.tfvars.json").write_text(json.dumps(minimal))
    _terraform(folder, "apply", "-auto-approve", "-var-file=minimal.tfvars.json")
    outputs = json.loads(_terraform(folder, "output", "-json").stdout)
    objects = {**outputs["objects"]["value"], **outputs["secrets"]["value"]}
    assert not any(obj["kind"] == "DaemonSet" for obj in objects.values())
    for key, obj in objects.items():
        assert list(_empty_fields(obj)) == [], key
        validate(obj, f"V1{obj['kind']}", key)


# -- the API's actions: operator tokens and chat-ops ---------------------------------------------------------

OPERATOR_TOKENS = [{"name": "alice", "scope": "operator", "sha256": "cd" * 32},
                   {"name": "pager", "scope": "operator", "sha256": "ef" * 32, "identity": "bob@corp"}]
"""Operator tokens: one acting as its name, one as another identity (with an "@", which no Secret key may hold)."""


@pytest.fixture(scope="module")
def acting(rendered: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """The same deployment with operator tokens and chat-ops (Slack and one callback): the API acts."""
    master: Path = rendered["master"]
    env = {**os.environ, "KEEL_CREDENTIALS_DIR": str(master), "KEEL_HOME": str(scratch / "home")}
    credentials = str(Path(sys.executable).parent / "keel-credentials")
    for operator in ("alice", "bob@corp"):  # what the README says to run for each operator token's identity
        subprocess.run([credentials, "init", "--operator", operator], env=env, check=True, capture_output=True)
    chatops = scratch / "chatops"
    chatops.mkdir()
    (chatops / "slack").write_text("slack-signing-secret-0123456789\n")
    (chatops / "pager").write_text("whsec_" + base64.b64encode(b"p" * 32).decode() + "\n")
    variables = _variables(master, api_tokens=[API_TOKEN_ENTRY, *OPERATOR_TOKENS], api_chatops={
        "slack_signing_secret_file": str(chatops / "slack"), "slack_approvers": {"U024BE7LH": "alice"},
        "callbacks": [{"name": "pager", "secret_file": str(chatops / "pager"), "approvers": ["bob@corp"]}],
        "timestamp_tolerance": "2m"})
    folder = _workspace(scratch, "root-acting")
    (folder / "test.tfvars.json").write_text(json.dumps(variables))
    _terraform(folder, "apply", "-auto-approve", "-var-file=test.tfvars.json")
    outputs = json.loads(_terraform(folder, "output", "-json").stdout)
    return {"objects": outputs["objects"]["value"], "secrets": outputs["secrets"]["value"], "folder": folder,
            "master": master, "variables": variables}


def test_an_acting_api_gets_the_chatops_identity_its_keys_and_nats_and_starts_on_them(acting: dict[str, Any],
                                                                                    scratch: Path) -> None:
    from keel.api.main import chatops_of, operator_keys, tokens_of
    from keel.infra.config import load_settings
    from keel.infra.nats_auth import bus_settings_for, load_identity
    from keel.infra.provision import install_tree

    objects, secrets = acting["objects"], acting["secrets"]
    for key, obj in {**objects, **secrets}.items():
        validate(obj, f"V1{obj['kind']}", key)
        assert list(_empty_fields(obj)) == [], key
    deployment = objects["Deployment/keel-api"]
    spec = _pod_spec(deployment)
    [container], [init] = spec["containers"], spec["initContainers"]
    # Its bundle, installed as every control-plane pod's is, and the settings ConfigMap (NATS URL, credentials dir).
    assert init["command"][:2] == ["keel-credentials", "install"]
    assert container["envFrom"] == [{"configMapRef": {"name": "keel-settings"}}, {"secretRef": {"name": "keel-database-auditor"}}]
    settings_map = objects["ConfigMap/keel-settings"]["data"]
    assert settings_map["KEEL_NATS_URL"] == f"tls://nats.{NAMESPACE}.svc.cluster.local:4222"
    volumes = {v["name"]: v for v in spec["volumes"]}
    source = volumes["credentials-source"]["secret"]
    assert source["secretName"] == "keel-credentials-api"
    paths = sorted(item["path"] for item in source["items"])
    # Least privilege: the chatops identity, its key, the operator tokens' keys and chat-ops' secrets; no other
    # identity or key (not the CLI operator's, not a service's).
    assert paths == ["chatops/callback-pager.secret", "chatops/slack.secret", "nats/chatops.json",
                     "nats/shard-ca/tls/ca.pem", "signing/alice.key", "signing/bob@corp.key", "signing/chatops.key",
                     "signing/keyring.json"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert {"checksum/keel-credentials", "checksum/keel-settings"} <= set(annotations)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert json.loads(env["KEEL_API__TOKENS"]) == [API_TOKEN_ENTRY, *OPERATOR_TOKENS]  # identity kept, none added

    # What the pod holds, put where its volumes put it, copied as the init container does, read as keel-api does
    # at start: every operator token's key, the NATS identity, chat-ops' secrets. No exit 2.
    secret = secrets["Secret/keel-credentials-api"]["data"]
    mounted = scratch / "api-mounted"
    for item in source["items"]:
        (mounted / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (mounted / item["path"]).write_bytes(base64.b64decode(secret[item["key"]]))
    assert (mounted / "signing/bob@corp.key").read_bytes() == (acting["master"] / "signing/bob@corp.key").read_bytes()
    run_dir = scratch / "api-run"
    install_tree(mounted, run_dir / "credentials")
    pod_env = {**settings_map, **env, "KEEL_CREDENTIALS_DIR": str(run_dir / "credentials")}
    pod_env = {k: v.replace(settings_map["KEEL_CREDENTIALS_DIR"], str(run_dir / "credentials")) for k, v in pod_env.items()}
    settings = load_settings(environ=pod_env)
    assert sorted(operator_keys(settings, tokens_of(settings))) == ["alice", "bob@corp"]
    assert settings.api.chatops.enabled and settings.api.chatops.slack_approvers == {"U024BE7LH": "alice"}
    assert settings.api.chatops.timestamp_tolerance.total_seconds() == 120
    chatops_of(settings, None)  # type: ignore[arg-type]  # reads and checks both secrets; the bus is used later
    bus = bus_settings_for(settings, settings.api.chatops.signing_identity)
    assert load_identity(bus.credentials).name == "chatops"

    # Its pod is a NATS client, and the policies let it reach NATS (4222) and nothing else new.
    policies = {o["metadata"]["name"]: o["spec"] for o in objects.values() if o["kind"] == "NetworkPolicy"}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    nats_ingress = next(r for r in policies["nats"]["ingress"] if r["ports"] == [{"port": 4222, "protocol": "TCP"}])
    assert _selects(nats_ingress["from"][0]["podSelector"]["matchLabels"], labels)
    assert policies["keel-api"]["egress"][1:] == [{"to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "nats", "app.kubernetes.io/name": "nats"}}}],
                                                   "ports": [{"port": 4222, "protocol": "TCP"}]}]


def test_a_read_only_api_gets_no_nats_access_and_no_bundle(rendered: dict[str, Any]) -> None:
    objects = rendered["objects"]
    labels = objects["Deployment/keel-api"]["spec"]["template"]["metadata"]["labels"]
    assert "keel.dev/nats-client" not in labels and "Secret/keel-credentials-api" not in rendered["secrets"]
    policy = next(o["spec"] for o in objects.values() if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "keel-api")
    assert all(4222 not in [p["port"] for p in rule.get("ports", [])] for rule in policy["egress"])


def test_an_operator_token_without_its_key_or_a_read_token_with_an_identity_is_refused_at_plan(acting: dict[str, Any]) -> None:
    folder: Path = acting["folder"]
    cases = {
        "these have none: ghost (identity ghost:": [{"name": "ghost", "scope": "operator", "sha256": "aa" * 32}],
        "these have none: pager (identity nobody:": [{**OPERATOR_TOKENS[1], "identity": "nobody"}],
        "only an operator token has an identity": [{**API_TOKEN_ENTRY, "identity": "alice"}],
        "these name another role's (its private key would go into the API's Secret): pager (identity controller)":
            [{**OPERATOR_TOKENS[1], "identity": "controller"}],
    }
    for message, tokens in cases.items():
        (folder / "bad.tfvars.json").write_text(json.dumps({**acting["variables"], "api_tokens": tokens}))
        result = _terraform(folder, "plan", "-no-color", "-var-file=bad.tfvars.json", check=False)
        said = " ".join(result.stderr.replace("│", " ").split())
        assert result.returncode != 0 and message in said, (message, said[-1500:])
