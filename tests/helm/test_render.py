"""The chart, rendered by Helm's own engine for several value sets: every object is valid Kubernetes
(kubernetes-validate, strict: unknown fields are errors), and each value set renders what it promises.

kubernetes-validate knows the built-in kinds only. The CRD kinds the chart renders, the Gateway API
HTTPRoute and prometheus-operator's ServiceMonitor, PodMonitor and PrometheusRule, are checked against the
JSON Schemas below (CRD_SCHEMAS), written here from the gateway.networking.k8s.io/v1 and monitoring.coreos.com/v1
CRDs for the fields the chart uses (types, patterns, limits, no unknown fields), not the CRDs themselves. A
cluster's own API server is the final word on them.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import kvgate
from kvgate.providers.base import replica_spec_for
from kvgate.providers.k8s_manifests import LABEL_MODEL, DeploymentSettings, deployment_manifest
from kvgate.providers.k8s_pod_template import parse_engine_pod_template
from kvgate.registry import load_registry
from tests.helm.chart import (
    CHART, ENGINE_VALUES, FULLNAME, NAMESPACE, REGISTRY_FILES, VALUE_SETS, containers, engine_pod_template, find,
    manifests, with_registry,
)

K8S_VERSION = "1.30"  # the oldest Kubernetes the chart promises (Chart.yaml's kubeVersion allows older; 1.30 is tested)
_NAME = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_DURATION = "^([0-9]{1,5}(h|m|s|ms)){1,4}$"
HTTPROUTE_V1 = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"}, "kind": {"const": "HTTPRoute"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": _NAME, "maxLength": 253},
            "namespace": {"type": "string"}, "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "parentRefs": {"type": "array", "maxItems": 32, "items": {
                "type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                    "group": {"type": "string"}, "kind": {"type": "string"},
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "namespace": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                    "sectionName": {"type": "string", "pattern": _NAME}, "port": {"type": "integer"}}}},
            "hostnames": {"type": "array", "maxItems": 16, "items": {
                "type": "string", "maxLength": 253,
                "pattern": "^(\\*\\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}},
            "rules": {"type": "array", "maxItems": 16, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "matches": {"type": "array", "maxItems": 64, "items": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "path": {"type": "object", "additionalProperties": False, "properties": {
                                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                "value": {"type": "string", "pattern": "^/", "maxLength": 1024}}}}}},
                    "backendRefs": {"type": "array", "maxItems": 16, "items": {
                        "type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                            "name": {"type": "string"}, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "kind": {"type": "string"}, "group": {"type": "string"}, "weight": {"type": "integer"}}}},
                    "timeouts": {"type": "object", "additionalProperties": False, "properties": {
                        "request": {"type": "string", "pattern": _DURATION},
                        "backendRequest": {"type": "string", "pattern": _DURATION}}}}}}}},
    },
}


# prometheus-operator's Duration (monitoring.coreos.com/v1 CRD, v0.75).
_PROM_DURATION = "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_SECRET_KEY = {"type": "object", "additionalProperties": False, "required": ["key"], "properties": {
    "name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}}}
SERVICEMONITOR_V1 = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": HTTPROUTE_V1["properties"]["metadata"],
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector"], "properties": {
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "endpoints": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                    "interval": {"type": "string", "pattern": _PROM_DURATION},
                    "scrapeTimeout": {"type": "string", "pattern": _PROM_DURATION},
                    "authorization": {"type": "object", "additionalProperties": False, "properties": {
                        "type": {"type": "string"}, "credentials": _SECRET_KEY}}}}}}},
    },
}


_RELABELING = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
    "separator": {"type": "string"}, "targetLabel": {"type": "string"}, "regex": {"type": "string"},
    "modulus": {"type": "integer"}, "replacement": {"type": "string"},
    "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep"]}}}
PODMONITOR_V1 = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": HTTPROUTE_V1["properties"]["metadata"],
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector"], "properties": {
            "selector": SERVICEMONITOR_V1["properties"]["spec"]["properties"]["selector"],
            "namespaceSelector": SERVICEMONITOR_V1["properties"]["spec"]["properties"]["namespaceSelector"],
            "podMetricsEndpoints": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                    "interval": {"type": "string", "pattern": _PROM_DURATION},
                    "scrapeTimeout": {"type": "string", "pattern": _PROM_DURATION},
                    "authorization": {"type": "object", "additionalProperties": False, "properties": {
                        "type": {"type": "string"}, "credentials": _SECRET_KEY}},
                    "relabelings": {"type": "array", "items": _RELABELING}}}}}},
    },
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUSRULE_V1 = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": HTTPROUTE_V1["properties"]["metadata"],
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": _PROM_DURATION},
                    "rules": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["expr"],
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}], "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]},
                            "for": {"type": "string", "pattern": _PROM_DURATION},
                            "keep_firing_for": {"type": "string", "pattern": _PROM_DURATION},
                            "labels": _STRING_MAP, "annotations": _STRING_MAP}}}}}}}},
    },
}
CRD_SCHEMAS = {"HTTPRoute": HTTPROUTE_V1, "ServiceMonitor": SERVICEMONITOR_V1, "PodMonitor": PODMONITOR_V1,
               "PrometheusRule": PROMETHEUSRULE_V1}


def validate(obj: dict[str, Any]) -> None:
    if obj["kind"] in CRD_SCHEMAS:
        jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, manifests(with_registry(VALUE_SETS[request.param]))


def test_every_rendered_object_is_valid_kubernetes(rendered) -> None:
    _, objects = rendered
    assert objects
    for obj in objects:
        validate(obj)
        assert obj["metadata"].get("namespace", NAMESPACE) == NAMESPACE or obj["kind"] in ("Role", "RoleBinding")


def test_the_engine_pod_template_is_a_valid_pod_template_that_kvgate_accepts(rendered) -> None:
    _, objects = rendered
    template = engine_pod_template(objects)
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "engine"},
                                  "template": template}, K8S_VERSION, strict=True)
    parse_engine_pod_template(template, "pod-template.yaml")  # raises on anything kvgate refuses


def test_the_longest_release_name_helm_allows_gives_valid_distinct_names() -> None:
    # Helm allows release names of 53 characters. A StatefulSet's pods get a controller-revision-hash label
    # "<name>-<10-character hash>", so its name must stay within 52; "<redis>-headless" must stay a DNS label.
    release = "a-very-long-release-name-for-a-platform-team-0123456"[:53]
    objects = manifests(with_registry(VALUE_SETS["defaults"]), release=release)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(set(names)) == len(names)  # no two components cut to one name
    assert all(len(name) <= 63 for _, name in names), names
    assert all(len(name) <= 52 for kind, name in names if kind == "StatefulSet"), names
    for obj in objects:
        validate(obj)


def test_the_app_version_is_kvgates_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == kvgate.__version__
    gateway = find(manifests(with_registry({})), "Deployment", f"{FULLNAME}-gateway")
    assert gateway["spec"]["template"]["spec"]["containers"][0]["image"] == f"ghcr.io/kvgate/kvgate:{kvgate.__version__}-gateway"


def test_the_default_install_runs_two_gateways_two_autoscalers_and_redis() -> None:
    objects = manifests(with_registry({}))
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in ("Deployment", "StatefulSet"))
    assert kinds == [("Deployment", f"{FULLNAME}-autoscaler"), ("Deployment", f"{FULLNAME}-gateway"),
                     ("StatefulSet", f"{FULLNAME}-redis")]
    assert find(objects, "Deployment", f"{FULLNAME}-gateway")["spec"]["replicas"] == 2
    assert find(objects, "Deployment", f"{FULLNAME}-autoscaler")["spec"]["replicas"] == 2
    assert find(objects, "PodDisruptionBudget", f"{FULLNAME}-gateway")["spec"]["maxUnavailable"] == 1
    redis = find(objects, "StatefulSet", f"{FULLNAME}-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "--appendonly" in redis["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("drain,pre_stop,expected", [(30, 5, 40), (120, 10, 135), (0, 0, 5)])
def test_the_gateway_grace_period_covers_pre_stop_and_drain(drain: int, pre_stop: int, expected: int) -> None:
    gateway = find(manifests(with_registry({"gateway": {"drainTimeoutSeconds": drain, "preStopSleepSeconds": pre_stop}})),
                   "Deployment", f"{FULLNAME}-gateway")
    pod = gateway["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["terminationGracePeriodSeconds"] == expected
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop)]
    assert container["args"][container["args"].index("--drain-timeout-s") + 1] == str(drain)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_every_kvgate_container_runs_restricted() -> None:
    objects = manifests(with_registry({}))
    for name in ("gateway", "autoscaler"):
        deployment = find(objects, "Deployment", f"{FULLNAME}-{name}")
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for _, container in containers(deployment):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert container["resources"]["requests"]


def test_the_gateway_listens_on_all_addresses_only_with_admin_and_metrics_tokens_from_secrets() -> None:
    objects = manifests(with_registry({}))
    [container] = find(objects, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--host") + 1] == "0.0.0.0"
    assert not [arg for arg in container["args"] if "token" in arg]  # `ps` would show it
    for env, name in (("KVGATE_ADMIN_TOKEN", "admin-token"), ("KVGATE_METRICS_TOKEN", "metrics-token")):
        [token] = [e for e in container["env"] if e["name"] == env]
        assert token["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-{name}", "key": name}
        secret = find(objects, "Secret", f"{FULLNAME}-{name}")
        assert re.fullmatch(r"[A-Za-z0-9+/=]{40,}", secret["data"][name])
    assert not [o for o in objects if o["kind"] in CRD_SCHEMAS]  # their CRDs may be missing: opt in


def test_tenants_api_key_secret_reaches_the_gateway_only_from_a_secret_the_user_names() -> None:
    def key_env(values: dict[str, Any]) -> list[dict[str, Any]]:
        objects = manifests(with_registry(values))
        [container] = find(objects, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]["containers"]
        return [e for e in container["env"] if e["name"] == "KVGATE_KEY_SECRET"]

    assert key_env({}) == []  # never generated: the registry's HMACs must be made with the same secret
    [env] = key_env({"apiKeys": {"existingSecret": "kvgate-keys", "existingSecretKey": "hmac"}})
    assert env["valueFrom"]["secretKeyRef"] == {"name": "kvgate-keys", "key": "hmac"}


def test_the_service_monitor_scrapes_the_gateway_service_with_the_metrics_token() -> None:
    for values, secret, key in ((VALUE_SETS["service-monitor"], f"{FULLNAME}-metrics-token", "metrics-token"),
                                (merged(VALUE_SETS["service-monitor"], VALUE_SETS["existing-secrets"]),
                                 "kvgate-metrics", "scrape-token")):
        objects = manifests(with_registry(values))
        monitor = find(objects, "ServiceMonitor", f"{FULLNAME}-gateway")
        service = find(objects, "Service", f"{FULLNAME}-gateway")
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["port"] in [port["name"] for port in service["spec"]["ports"]]
        assert (endpoint["path"], endpoint["interval"], endpoint["scrapeTimeout"]) == ("/metrics", "15s", "10s")
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": secret, "key": key}}
        [gateway] = find(objects, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]["containers"]
        [token] = [e for e in gateway["env"] if e["name"] == "KVGATE_METRICS_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": secret, "key": key}  # the one the gateway takes


def test_the_service_monitor_check_catches_a_bad_monitor() -> None:
    monitor = find(manifests(with_registry(VALUE_SETS["service-monitor"])), "ServiceMonitor", f"{FULLNAME}-gateway")
    monitor["spec"]["endpoints"][0]["bearerToken"] = "s3cret"  # a plain token field the chart must never write
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


def test_the_autoscaler_serves_metrics_on_the_pod_ip_with_the_metrics_token_from_its_secret() -> None:
    for values, secret, key in (({}, f"{FULLNAME}-metrics-token", "metrics-token"),
                                (VALUE_SETS["existing-secrets"], "kvgate-metrics", "scrape-token")):
        objects = manifests(with_registry(values))
        [container] = find(objects, "Deployment", f"{FULLNAME}-autoscaler")["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert args[args.index("--metrics-host") + 1] == "0.0.0.0"
        assert args[args.index("--metrics-port") + 1] == "9090"
        assert not [arg for arg in args if "token" in arg]  # `ps` would show it
        assert container["ports"] == [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
        # /health takes no token (a probe cannot send one from a Secret); 200 while the control loop runs.
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
        [token] = [e for e in container["env"] if e["name"] == "KVGATE_METRICS_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": secret, "key": key}  # the gateways' metrics token


def test_the_autoscalers_admit_only_scrapes_of_their_metrics_port() -> None:
    for values, peers in (({}, None), (VALUE_SETS["observability"], VALUE_SETS["observability"]["networkPolicy"]["metricsFrom"])):
        policy = find(manifests(with_registry(values)), "NetworkPolicy", f"{FULLNAME}-autoscaler")
        [rule] = policy["spec"]["ingress"]
        assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        assert rule.get("from") == peers


def test_the_pod_monitors_scrape_every_autoscaler_copy_with_the_metrics_token() -> None:
    objects = manifests(with_registry(VALUE_SETS["observability"]))
    monitor = find(objects, "PodMonitor", f"{FULLNAME}-autoscaler")
    pod = find(objects, "Deployment", f"{FULLNAME}-autoscaler")["spec"]["template"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in [port["name"] for port in pod["spec"]["containers"][0]["ports"]]
    assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "30s")
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": f"{FULLNAME}-metrics-token",
                                                                          "key": "metrics-token"}}


def test_the_engine_pod_monitor_finds_the_engines_the_autoscaler_creates(tmp_path) -> None:
    objects = manifests(with_registry(VALUE_SETS["observability"]))
    monitor = find(objects, "PodMonitor", f"{FULLNAME}-engine")
    # An engine Deployment as the autoscaler's Kubernetes provider writes it, for this release's cluster.
    for name, text in REGISTRY_FILES.items():
        (tmp_path / name).write_text(text)
    spec = replica_spec_for(load_registry(tmp_path, environ={}).model("llama-8b"))
    engine = deployment_manifest(spec, cluster="kvg", pool="k8s-gpu",
                                 settings=DeploymentSettings(namespace="gpu-a", image=None, node_selector={}))
    pod = engine["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving", "gpu-a"]}  # rbac.engineNamespaces
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in [port["name"] for port in pod["spec"]["containers"][0]["ports"]]
    assert endpoint["path"] == "/metrics" and "authorization" not in endpoint  # an engine's /metrics is open
    # Prometheus's name for the pod label kvgate.io/model becomes the series' `model`, as the dashboard filters.
    [relabel] = endpoint["relabelings"]
    assert relabel == {"sourceLabels": [f"__meta_kubernetes_pod_label_{re.sub('[^a-zA-Z0-9]', '_', LABEL_MODEL)}"],
                       "targetLabel": "model"}
    assert pod["metadata"]["labels"][LABEL_MODEL] == "llama-8b"


def test_the_pod_monitor_check_catches_a_bad_monitor() -> None:
    monitor = find(manifests(with_registry(VALUE_SETS["observability"])), "PodMonitor", f"{FULLNAME}-autoscaler")
    monitor["spec"]["podMetricsEndpoints"][0]["bearerTokenSecret"] = {"name": "x", "key": "y"}  # not a PodMonitor field
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


def test_the_prometheus_rule_check_catches_a_bad_rule() -> None:
    rule = find(manifests(with_registry(VALUE_SETS["observability"])), "PrometheusRule", f"{FULLNAME}-alerts")
    rule["spec"]["groups"][0]["rules"][0]["for"] = "10 minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate(rule)


def merged(*value_sets: dict[str, Any]) -> dict[str, Any]:
    """Value sets layered as several `-f` files are (a later one wins key by key)."""
    def merge(into: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
        for key, value in values.items():
            into[key] = merge(dict(into.get(key, {})), value) if isinstance(value, dict) else value
        return into
    result: dict[str, Any] = {}
    for values in value_sets:
        merge(result, values)
    return result


def test_existing_secrets_are_referenced_and_none_is_created() -> None:
    objects = manifests(with_registry(VALUE_SETS["existing-secrets"]))
    assert [o for o in objects if o["kind"] == "Secret"] == []
    [gateway] = find(objects, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in gateway["env"] if "valueFrom" in e}
    assert refs == {"KVGATE_ADMIN_TOKEN": {"name": "kvgate-admin", "key": "token"},
                    "KVGATE_METRICS_TOKEN": {"name": "kvgate-metrics", "key": "scrape-token"},
                    "KVGATE_REDIS_PASSWORD": {"name": "kvgate-redis", "key": "password"}}
    redis = find(objects, "StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"][0]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in redis["env"]} == {"kvgate-redis"}


def test_the_redis_password_reaches_kvgate_only_through_the_environment() -> None:
    """Not in the --state URL either: an argument is in every `ps` listing of the container."""
    for values, url, secret in [({}, f"redis://{FULLNAME}-redis:6379/0", True),
                                (VALUE_SETS["external-redis"], "rediss://kvgate@redis.example:6380/2", True),
                                (VALUE_SETS["external-redis-no-auth"], "redis://redis.example:6379/0", False)]:
        objects = manifests(with_registry(values))
        for name in ("gateway", "autoscaler"):
            [container] = find(objects, "Deployment", f"{FULLNAME}-{name}")["spec"]["template"]["spec"]["containers"]
            assert container["args"][container["args"].index("--state") + 1] == url
            has_password = any(e["name"] == "KVGATE_REDIS_PASSWORD" for e in container.get("env", ()))
            assert has_password == secret


def test_external_redis_replaces_the_bundled_one() -> None:
    objects = manifests(with_registry(VALUE_SETS["external-redis"]))
    assert [o["kind"] for o in objects if "-redis" in o["metadata"]["name"]] == []


def test_ingress_and_httproute_send_everything_to_the_gateway_service() -> None:
    objects = manifests(with_registry(VALUE_SETS["ingress-and-httproute"]))
    service = find(objects, "Service", f"{FULLNAME}-gateway")
    ingress = find(objects, "Ingress", f"{FULLNAME}-gateway")
    [path] = ingress["spec"]["rules"][0]["http"]["paths"]
    assert path["backend"]["service"] == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    route = find(objects, "HTTPRoute", f"{FULLNAME}-gateway")
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}]
    assert rule["timeouts"] == {"request": "3600s"}
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways", "sectionName": "https"}]


def test_the_httproute_check_catches_a_bad_route() -> None:
    route = find(manifests(with_registry(VALUE_SETS["ingress-and-httproute"])), "HTTPRoute", f"{FULLNAME}-gateway")
    route["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"  # Ingress's word, not Gateway API's
    with pytest.raises(jsonschema.ValidationError):
        validate(route)


def test_the_engine_pod_template_carries_the_platform_values() -> None:
    objects = manifests(with_registry(VALUE_SETS["gpu-engines"]))
    template = engine_pod_template(objects)
    spec = template["spec"]
    [engine] = spec["containers"]
    assert engine["image"] == "registry.example/kvgate:0.1.0-cuda12"
    assert engine["resources"] == ENGINE_VALUES["resources"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "serviceAccountName", "volumes"):
        assert spec[key] == ENGINE_VALUES[key]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["automountServiceAccountToken"] is False
    assert template["metadata"]["labels"]["team"] == "inference"


def test_a_changed_engine_template_restarts_the_autoscalers_but_not_the_gateways() -> None:
    def annotations(values: dict) -> tuple[dict, dict]:
        objects = manifests(with_registry(values))
        return tuple(find(objects, "Deployment", f"{FULLNAME}-{name}")["spec"]["template"]["metadata"].get("annotations", {})
                     for name in ("autoscaler", "gateway"))
    autoscaler_before, gateway_before = annotations({})
    autoscaler_after, gateway_after = annotations({"engine": {"nodeSelector": {"pool": "h100"}}})
    assert autoscaler_before["checksum/engine-pod-template"] != autoscaler_after["checksum/engine-pod-template"]
    assert gateway_before == gateway_after


def test_the_registry_is_one_configmap_mounted_whole_for_hot_reload() -> None:
    objects = manifests(with_registry({}))
    registry = find(objects, "ConfigMap", f"{FULLNAME}-registry")
    assert {name: yaml.safe_load(text) for name, text in registry["data"].items()} == {
        name: yaml.safe_load(text) for name, text in with_registry({})["registry"]["files"].items()}
    for name in ("gateway", "autoscaler"):
        deployment = find(objects, "Deployment", f"{FULLNAME}-{name}")
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["registry"]["configMap"]["name"] == registry["metadata"]["name"]
        for _, container in containers(deployment):
            [mount] = [m for m in container["volumeMounts"] if m["name"] == "registry"]
            assert "subPath" not in mount  # a subPath mount never sees the ConfigMap's updates


def test_an_existing_registry_configmap_is_mounted_instead() -> None:
    objects = manifests({"registry": {"existingConfigMap": "fleet-registry"}})
    assert not [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-registry")]
    gateway = find(objects, "Deployment", f"{FULLNAME}-gateway")
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert volumes["registry"]["configMap"]["name"] == "fleet-registry"


def test_rbac_covers_every_engine_namespace_and_nodes_only_when_asked() -> None:
    objects = manifests(with_registry(VALUE_SETS["tuned"]))
    assert sorted(o["metadata"]["namespace"] for o in objects if o["kind"] == "Role") == ["gpu-a", "serving"]
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    default = manifests(with_registry({}))
    [cluster_role] = [o for o in default if o["kind"] == "ClusterRole"]
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}]
