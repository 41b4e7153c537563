"""The chart against the closest thing to a cluster here: `kmock`, an in-memory Kubernetes API served over
real HTTPS, which the official `kubernetes` client talks to.

1. Helm renders the chart (GPU engine values); the installer applies every object to kmock.
2. kmock has no controllers, so the test plays them: the kubelet mounts the registry and the engine pod
   template ConfigMaps into the autoscaler (tests/registry/kubelet_volume.py, the kubelet's layout) and
   projects its service account token; the GPU node, the Cluster API MachineDeployment that Pools grow,
   and the ReplicaSet controller's pods are written as those controllers would.
3. The autoscaler's own code then runs as in its pod: its arguments (parsed by its real parser) name the
   files it reads, `read_engine_pod_template` reads the template, the registry loads from the mount, and
   the Kubernetes provider is built by `provider_factory_for` from the registry's Pool. The Pool names no
   kubeconfig, so the provider configures itself as in a pod: `load_incluster_config`, with
   KUBERNETES_SERVICE_HOST/PORT, the token and the cluster CA at the service account paths. That is why
   kmock serves HTTPS here (in-cluster config only speaks https) with a CA made for the test.

Checked: the engine Deployments the provider creates carry the chart's pod template (image, resources
and the Model's GPU count, node selector, tolerations, affinity, pull secrets...) and are valid in strict
mode; and every API call the provider made is one the chart's RBAC grants that service account, with
nothing granted that it did not use. kmock does not enforce RBAC itself, so the test evaluates the
rendered Role/ClusterRole rules against the recorded requests.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.test_utils
import kmock
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes import client as k8s
from kubernetes.config import incluster_config

from kvgate.autoscaler.main import read_engine_pod_template
from kvgate.autoscaler.settings import provider_factory_for
from kvgate.clock import FakeClock
from kvgate.providers.base import CapacityType, NodeClaim, OfferingKey, replica_spec_for
from kvgate.providers.k8s_manifests import object_name
from kvgate.registry import load_registry
from tests.helm.chart import FULLNAME, NAMESPACE, VALUE_SETS, find, manifests, with_registry
from tests.helm.test_cli_args import parse_kvgate
from tests.registry.kubelet_volume import KubeletVolume

SA_TOKEN = "autoscaler-service-account-token"
ADMIN_TOKEN = "installer-token"
# Resources the emulator serves, as "group/version/plural" (core: "v1/plural") -> (kind, namespaced).
RESOURCES = {
    "v1/configmaps": ("ConfigMap", True), "v1/secrets": ("Secret", True), "v1/services": ("Service", True),
    "v1/serviceaccounts": ("ServiceAccount", True), "v1/pods": ("Pod", True), "v1/nodes": ("Node", False),
    "apps/v1/deployments": ("Deployment", True), "apps/v1/statefulsets": ("StatefulSet", True),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True),
    "networking.k8s.io/v1/ingresses": ("Ingress", True),
    "gateway.networking.k8s.io/v1/httproutes": ("HTTPRoute", True),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True), "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True),
    "rbac.authorization.k8s.io/v1/clusterroles": ("ClusterRole", False),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", False),
    "cluster.x-k8s.io/v1beta1/machinedeployments": ("MachineDeployment", True),
}
PLURALS = {(key.rsplit("/", 1)[0], kind): key.rsplit("/", 1)[1] for key, (kind, _) in RESOURCES.items()}
VERBS = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


@dataclass
class Cluster:
    emulator: kmock.KubernetesEmulator
    host: str
    port: int
    ca_file: Path

    def client(self, token: str) -> k8s.ApiClient:
        configuration = k8s.Configuration()
        configuration.host = f"https://{self.host}:{self.port}"
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"authorization": f"Bearer {token}"}
        return k8s.ApiClient(configuration)


def certificate_for_loopback(directory: Path) -> tuple[Path, Path]:
    """A self-signed CA certificate for 127.0.0.1 (the test's cluster CA) and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kmock")])
    now = dt.datetime.now(dt.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(hours=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                   .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "ca.crt", directory / "tls.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def tls_server_class(context: ssl.SSLContext) -> type[aiohttp.test_utils.RawTestServer]:
    class TlsServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
            await super().start_server(loop=loop, ssl=context, **kwargs)
    return TlsServer


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cert_file, key_file = certificate_for_loopback(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    async with kmock.KubernetesEmulator() as emulator, \
            kmock.Server(emulator, server_cls=tls_server_class(context)) as server:
        for resource, (kind, namespaced) in RESOURCES.items():
            emulator.resources[resource] = {"kind": kind, "namespaced": namespaced}
        yield Cluster(emulator, server.url.host, server.url.port, cert_file)


def apply(api: k8s.ApiClient, obj: dict[str, Any]) -> None:
    """POST `obj` to its collection, as `kubectl apply` does for a new object."""
    group_version = obj["apiVersion"]
    plural = PLURALS[group_version, obj["kind"]]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    _, namespaced = RESOURCES[f"{group_version}/{plural}"]
    path = f"{prefix}/namespaces/{obj['metadata'].get('namespace', NAMESPACE)}/{plural}" if namespaced else f"{prefix}/{plural}"
    method, url, headers, body, _ = api.param_serialize("POST", path, body=obj, auth_settings=["BearerToken"],
                                                        header_params={"Content-Type": "application/json"})
    answer = api.call_api(method, url, header_params=headers, body=body)
    answer.read()
    assert answer.status in (200, 201), f"{obj['kind']}/{obj['metadata']['name']}: {answer.status} {answer.data[:500]!r}"


def play_the_controllers(emulator: kmock.KubernetesEmulator) -> None:
    """What exists in a GPU cluster before kvgate: a GPU node (kubelet and device plugin) and the Cluster
    API MachineDeployment that the Pool grows (kubernetes.node_pool: gpu-workers)."""
    emulator.objects["v1/nodes", None, "gpu-a"] = {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-a", "labels": {"gpu.example/class": "h100"}},
        "status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"},
                   "conditions": [{"type": "Ready", "status": "True"}]}}
    emulator.objects["cluster.x-k8s.io/v1beta1/machinedeployments", NAMESPACE, "gpu-workers"] = {
        "apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment",
        "metadata": {"name": "gpu-workers", "namespace": NAMESPACE},
        "spec": {"clusterName": "gpu", "replicas": 0}, "status": {"readyReplicas": 0}}


def add_pod(emulator: kmock.KubernetesEmulator, deployment: dict[str, Any], name: str, ip: str) -> None:
    """A pod of `deployment` as the ReplicaSet controller, the scheduler and the kubelet leave it."""
    template = deployment["spec"]["template"]
    emulator.objects["v1/pods", NAMESPACE, name] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": dict(template["metadata"]["labels"]),
                     "creationTimestamp": f"2026-01-01T00:00:0{len(name) % 10}Z"},
        "spec": {**template["spec"], "nodeName": "gpu-a"},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


def mount_autoscaler_volumes(api: k8s.ApiClient, autoscaler: dict[str, Any], root: Path) -> dict[str, Path]:
    """The kubelet's part: each ConfigMap volume of the autoscaler pod, read from the API and written in
    the kubelet's layout under `root`. Returns {mountPath in the pod: directory here}."""
    pod = autoscaler["spec"]["template"]["spec"]
    [container] = pod["containers"]
    config_maps = {v["name"]: v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    mounted = {}
    for mount in container["volumeMounts"]:
        if mount["name"] in config_maps:
            data = k8s.CoreV1Api(api).read_namespaced_config_map(config_maps[mount["name"]], NAMESPACE).data
            volume = KubeletVolume(root / mount["name"])
            volume.publish(data)
            mounted[mount["mountPath"]] = volume.root
    return mounted


def in_pod(path: str, mounted: dict[str, Path]) -> Path:
    """A path the autoscaler reads in its pod, as the file the kubelet put here."""
    for mount_path, here in mounted.items():
        if path == mount_path or path.startswith(mount_path + "/"):
            return here / path.removeprefix(mount_path).lstrip("/")
    raise AssertionError(f"{path} is on no mounted volume of the autoscaler pod")


def permissions_used(emulator: kmock.KubernetesEmulator, since: int) -> set[tuple[str, str, str, str | None, str | None]]:
    """(verb, apiGroup, resource, namespace, name) of every request after the first `since`."""
    used = set()
    for request in list(emulator)[since:]:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        assert (scheme.lower(), token) == ("bearer", SA_TOKEN)  # the projected token, no other credential
        verb = VERBS[str(request.method.value).upper()]
        if verb == "get" and request.name is None:
            verb = "list"
        used.add((verb, request.resource.group or "", request.resource.plural, request.namespace, request.name))
    return used


def granted(objects: list[dict[str, Any]], service_account: str, verb: str, group: str, resource: str,
            namespace: str | None, name: str | None) -> bool:
    """Whether the chart's RBAC lets `service_account` (in the release namespace) do this, as the API
    server's RBAC authorizer decides: a ClusterRole bound cluster-wide, or a Role bound in `namespace`."""
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": NAMESPACE}
    rules = []
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding") or subject not in binding["subjects"]:
            continue
        if binding["kind"] == "RoleBinding" and binding["metadata"]["namespace"] != namespace:
            continue
        ref = binding["roleRef"]
        # A RoleBinding's Role is in the binding's namespace; a ClusterRole has none.
        role_namespace = binding["metadata"]["namespace"] if ref["kind"] == "Role" else None
        [role] = [o for o in objects if o["kind"] == ref["kind"] and o["metadata"]["name"] == ref["name"]
                  and o["metadata"].get("namespace") == role_namespace]
        rules += role["rules"]
    return any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
               and ("resourceNames" not in rule or name in rule["resourceNames"]) for rule in rules)


async def test_the_autoscaler_creates_engines_from_the_charts_pod_template(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = manifests(with_registry(VALUE_SETS["gpu-engines"]))
    # The client blocks; the emulator serves on this event loop, so every call goes through a thread.
    installer = cluster.client(ADMIN_TOKEN)
    for obj in objects:
        await asyncio.to_thread(apply, installer, obj)
    play_the_controllers(cluster.emulator)

    # The autoscaler pod as the API server holds it, its arguments as its own parser reads them.
    autoscaler = installer.sanitize_for_serialization(await asyncio.to_thread(
        k8s.AppsV1Api(installer).read_namespaced_deployment, f"{FULLNAME}-autoscaler", NAMESPACE))
    pod = autoscaler["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    [container] = pod["containers"]
    args = parse_kvgate(container["args"])
    mounted = await asyncio.to_thread(mount_autoscaler_volumes, installer, autoscaler, tmp_path / "volumes")
    installer.close()

    # The service account token and cluster CA where the kubelet projects them, and the service env.
    token_file = tmp_path / "token"
    token_file.write_text(SA_TOKEN)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token_file))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(cluster.ca_file))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", cluster.host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(cluster.port))

    template = read_engine_pod_template(str(in_pod(args.engine_pod_template, mounted)))
    snapshot = load_registry(in_pod(args.registry, mounted), environ={})
    since = len(list(cluster.emulator))
    provider = provider_factory_for(args.cluster, FakeClock(), engine_pod_template=template)(
        "k8s-gpu", snapshot.pool("k8s-gpu"))
    spec = replica_spec_for(snapshot.model("llama-8b"))
    try:
        assert [n.name for n in await provider.gpu_nodes()] == ["gpu-a"]
        node = await provider.create(NodeClaim(id="claim-1", model="llama-8b",
                                               offering=OfferingKey("k8s-gpu", "h100-x8", CapacityType.ON_DEMAND)))
        cluster.emulator.objects["cluster.x-k8s.io/v1beta1/machinedeployments", NAMESPACE, "gpu-workers"].patch(
            {"status": {"readyReplicas": 1}})  # Cluster API brought the machine up
        await provider.start_replica(node.id, spec, replica_id="r-1")  # on the node kvgate bought
        await provider.start_replica("gpu-a", spec, replica_id="r-2")  # on a node the cluster had
        name = object_name("kvgate", args.cluster, "llama-8b", "k8s-gpu")
        deployment = dict(cluster.emulator.objects["apps/v1/deployments", NAMESPACE, name].raw)
        add_pod(cluster.emulator, deployment, "engine-1", "10.0.0.11")
        add_pod(cluster.emulator, deployment, "engine-2", "10.0.0.12")
        assert {h.id: h.url for h in await provider.list_replicas()} == {
            "r-1": "http://10.0.0.11:8000", "r-2": "http://10.0.0.12:8000"}
        await provider.stop_replica("r-1")
    finally:
        await provider.close()

    deployment = dict(cluster.emulator.objects["apps/v1/deployments", NAMESPACE, name].raw)
    deployment["metadata"].pop("resourceVersion", None)
    kubernetes_validate.validate(deployment, "1.30", strict=True)
    assert_uses_the_chart_template(deployment)
    assert_rbac_is_exactly_what_was_used(objects, pod["serviceAccountName"], permissions_used(cluster.emulator, since))


def assert_uses_the_chart_template(deployment: dict[str, Any]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    [engine] = pod["containers"]
    assert engine["image"] == "registry.example/kvgate:0.1.0-cuda12"  # engine.image; the Pool names none
    assert engine["resources"] == {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
                                   "limits": {"memory": "96Gi", "nvidia.com/gpu": "2"}}  # GPUs: the Model's count
    assert pod["nodeSelector"] == {"gpu.example/class": "h100"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"},
                                  {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["priorityClassName"] == "inference-critical" and pod["serviceAccountName"] == "engine"
    assert pod["automountServiceAccountToken"] is False
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in pod["volumes"]
    assert pod["securityContext"]["runAsNonRoot"] is True and engine["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "HF_HOME", "value": "/var/cache/kvgate/hf"} in engine["env"]
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "inference"
    # kvgate's own part, from the registry Model, in a form `kvgate engine` accepts.
    assert engine["command"] == ["kvgate", "engine"]
    engine_args = parse_kvgate(["engine", *engine["args"]])
    assert (engine_args.model, engine_args.served_model_name, engine_args.device) == (
        "s3://acme-models/llama-8b", "llama-8b", "cuda")


def assert_rbac_is_exactly_what_was_used(objects: list[dict[str, Any]], service_account: str,
                                         used: set[tuple[str, str, str, str | None, str | None]]) -> None:
    refused = [call for call in used if not granted(objects, service_account, *call)]
    assert refused == [], f"the chart's RBAC does not allow {refused}"
    needed = {(verb, group, resource) for verb, group, resource, _, _ in used}
    rules = [rule for o in objects if o["kind"] in ("Role", "ClusterRole") for rule in o["rules"]]
    offered = {(verb, group, resource) for rule in rules for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert offered == needed, f"granted but never used: {offered - needed}"
    assert needed == {("list", "", "nodes"), ("get", "", "nodes"), ("get", "apps", "deployments"),
                      ("create", "apps", "deployments"), ("patch", "apps", "deployments"),
                      ("list", "apps", "deployments"), ("list", "", "pods"), ("patch", "", "pods"),
                      ("get", "cluster.x-k8s.io", "machinedeployments"),
                      ("patch", "cluster.x-k8s.io", "machinedeployments")}
