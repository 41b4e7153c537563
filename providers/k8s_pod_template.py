"""The engine pod template: what a platform engineer adds to the engine pods kvgate creates on Kubernetes.

kvgate builds each engine Deployment itself (`k8s_manifests.deployment_manifest`), but where and how a
GPU pod runs is the platform's business: image pull secrets, affinity, tolerations, priority class,
service account, security context, extra env and volumes, CPU and memory. The Helm chart renders those
into a PodTemplateSpec file (`metadata` + `spec`, the shape of a Deployment's `spec.template`) that
`kvgate autoscaler --engine-pod-template FILE` reads once at start; the provider merges it under what
kvgate owns.

Who owns what, when the two meet (`merge_pod_template`):
- kvgate: the engine container's command, args, ports and probes (they follow the registry Model and
  the engine's CLI; a template that sets them is refused, not silently overridden), the
  `kvgate.io/*` labels the provider finds its pods by, the GPU count (`nvidia.com/gpu` = the Model's
  `resources.gpu_count`, what the planner placed; none for a CPU model, whatever the template says), and
  terminationGracePeriodSeconds (the drain time).
- the Pool's `kubernetes` block, where set: image and node selector keys win over the template's.
- the template: everything else, kept as written; its env, volume mounts, volumes and tolerations are
  added to kvgate's (kvgate's entry wins a name clash, except a volume named `cache`, which replaces
  the default emptyDir so the weights cache can be a PVC); containers other than `engine` are sidecars.

Pure: no I/O, no `kubernetes` import. Reading the file is the caller's (`kvgate autoscaler`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENGINE_CONTAINER = "engine"
GPU_RESOURCE = "nvidia.com/gpu"  # kvgate's: the Model's gpu_count, or none for a CPU model
# Fields of the engine container that kvgate writes from the registry Model and its own CLI.
OWNED_CONTAINER_FIELDS = ("command", "args", "ports", "readinessProbe", "livenessProbe", "startupProbe")
OWNED_POD_FIELDS = ("terminationGracePeriodSeconds",)  # the drain time: kvgate's drain_timeout_s + 5 s
OWNED_LABEL_PREFIX = "kvgate.io/"
# A user volume with this name replaces kvgate's emptyDir for the weights cache (e.g. a PVC).
REPLACEABLE_VOLUMES = ("cache",)
_TOP_LEVEL = ("metadata", "spec")
_METADATA = ("labels", "annotations")


@dataclass(frozen=True, slots=True)
class EnginePodTemplate:
    """A checked engine pod template. `source` names where it came from (for messages); the template
    is kept as canonical JSON text so the value is immutable and hashable."""

    source: str
    template_json: str

    @property
    def template(self) -> dict[str, Any]:
        """A fresh copy of the PodTemplateSpec ({"metadata": ..., "spec": ...})."""
        return json.loads(self.template_json)


def parse_engine_pod_template(data: Any, source: str) -> EnginePodTemplate:
    """Check `data` (a parsed YAML document) as an engine pod template; raises ValueError naming
    `source`, the key and what is allowed. An empty document is an empty template."""
    data = {} if data is None else data
    problems = _problems(data)
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    return EnginePodTemplate(source=source, template_json=json.dumps(data, sort_keys=True))


def _problems(data: Any) -> list[str]:
    if not isinstance(data, Mapping):
        return [f"must be a mapping with metadata and spec (a pod template), got {type(data).__name__}"]
    problems = [f"{key}: unknown key; a pod template has only metadata and spec" for key in data if key not in _TOP_LEVEL]
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        return problems + ["metadata: must be a mapping"]
    problems += [f"metadata.{key}: not allowed; only labels and annotations are used"
                 for key in metadata if key not in _METADATA]
    for key in ("labels", "annotations"):
        values = metadata.get(key) or {}
        if not isinstance(values, Mapping) or not all(isinstance(v, str) for v in values.values()):
            problems.append(f"metadata.{key}: must map names to strings")
    problems += [f"metadata.labels.{name}: the {OWNED_LABEL_PREFIX} labels are kvgate's own"
                 for name in (metadata.get("labels") or {}) if str(name).startswith(OWNED_LABEL_PREFIX)]
    spec = data.get("spec") or {}
    if not isinstance(spec, Mapping):
        return problems + ["spec: must be a mapping (a PodSpec)"]
    problems += [f"spec.{key}: kvgate sets it (the engine's drain time)" for key in OWNED_POD_FIELDS if key in spec]
    for key in ("containers", "initContainers", "volumes", "tolerations", "imagePullSecrets"):
        if key in spec and not (isinstance(spec[key], list) and all(isinstance(i, Mapping) for i in spec[key])):
            problems.append(f"spec.{key}: must be a list of mappings")
    if "nodeSelector" in spec and not isinstance(spec["nodeSelector"], Mapping):
        problems.append("spec.nodeSelector: must map label names to values")
    if spec.get("restartPolicy", "Always") != "Always":
        problems.append(f"spec.restartPolicy: a Deployment's pods restart Always, not {spec['restartPolicy']!r}")
    names: list[str] = []
    for index, container in enumerate(spec.get("containers") or ()):
        if isinstance(container, Mapping):
            problems += _container_problems(f"spec.containers[{index}]", container, seen=names)
    return problems


def _container_problems(where: str, container: Mapping[str, Any], *, seen: list[str]) -> list[str]:
    """What is wrong with one container of the template; `seen` collects the names so far (a second
    container of one name, the engine's above all, would be dropped without a word)."""
    name = container.get("name")
    if not name:
        return [f"{where}.name: required; name the engine's container '{ENGINE_CONTAINER}'"]
    problems = [f"{where}.name: {name!r} is taken by an earlier container"] if name in seen else []
    seen.append(name)
    if name == ENGINE_CONTAINER:
        problems += [f"{where}.{key}: kvgate sets it from the registry Model; remove it"
                     for key in OWNED_CONTAINER_FIELDS if key in container]
    elif not container.get("image"):
        problems.append(f"{where}.image: required for the sidecar {name!r}")
    for key, field in (("env", "name"), ("volumeMounts", "mountPath")):
        entries = container.get(key) or []
        if not isinstance(entries, list) or not all(isinstance(e, Mapping) and e.get(field) for e in entries):
            problems.append(f"{where}.{key}: must be a list of mappings, each with a {field}")
            continue
        keys = [e[field] for e in entries]
        problems += [f"{where}.{key}: {k!r} is given twice" for k in sorted({k for k in keys if keys.count(k) > 1})]
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping) or not all(isinstance(resources.get(k) or {}, Mapping)
                                                     for k in ("requests", "limits")):
        problems.append(f"{where}.resources: must be a mapping whose requests and limits map names to quantities")
    return problems


def merge_pod_template(template: Mapping[str, Any] | None, own: Mapping[str, Any], *,
                       image_override: str | None, node_selector: Mapping[str, str],
                       default_image: str) -> dict[str, Any]:
    """The pod template of an engine Deployment: the user's `template` merged under kvgate's `own`
    ({"metadata": {"labels"}, "spec": {"containers": [engine], ...}}). The engine's image is
    `image_override` (the Pool's), else the template's engine image, else `default_image`; the node
    selector is the template's with `node_selector` (the Pool's) on top. See the module docstring."""
    user = copy.deepcopy(dict(template or {}))
    user_spec: dict[str, Any] = user.get("spec") or {}
    own_spec = own["spec"]
    [own_engine] = [c for c in own_spec["containers"] if c["name"] == ENGINE_CONTAINER]
    user_engine = next((c for c in user_spec.get("containers") or () if c.get("name") == ENGINE_CONTAINER), {})
    engine = _merge_engine(user_engine, own_engine)
    engine["image"] = image_override or user_engine.get("image") or default_image
    sidecars = [c for c in user_spec.get("containers") or () if c.get("name") != ENGINE_CONTAINER]

    spec = {**user_spec, **{k: v for k, v in own_spec.items() if k not in ("volumes", "tolerations")}}
    spec["containers"] = [engine, *sidecars]
    spec["volumes"] = _by_key(own_spec.get("volumes", ()), user_spec.get("volumes") or (),
                              user_wins=REPLACEABLE_VOLUMES)
    tolerations = list(user_spec.get("tolerations") or ())
    spec["tolerations"] = tolerations + [t for t in own_spec.get("tolerations", ()) if t not in tolerations]
    selector = {**(user_spec.get("nodeSelector") or {}), **node_selector}
    spec.pop("nodeSelector", None)
    if selector:
        spec["nodeSelector"] = selector
    if not spec["tolerations"]:
        del spec["tolerations"]

    user_meta = user.get("metadata") or {}
    metadata: dict[str, Any] = {"labels": {**(user_meta.get("labels") or {}), **own["metadata"]["labels"]}}
    if user_meta.get("annotations"):
        metadata["annotations"] = dict(user_meta["annotations"])
    return {"metadata": metadata, "spec": spec}


def _merge_engine(user: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """The engine container: the user's fields, kvgate's on top; env and volume mounts added to
    kvgate's; the GPU count in resources is kvgate's (see `_resources`)."""
    engine = {**copy.deepcopy(dict(user)), **copy.deepcopy(dict(own))}
    engine["env"] = _by_key(own.get("env", ()), user.get("env") or ())
    engine["volumeMounts"] = _by_key(own.get("volumeMounts", ()), user.get("volumeMounts") or (), key="mountPath")
    resources = _resources(user.get("resources") or {}, own.get("resources") or {})
    engine.pop("resources", None)
    if resources:
        engine["resources"] = resources
    return engine


def _resources(user: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """requests/limits: the user's CPU, memory and other resources, with kvgate's GPU count instead of
    any the user gave (a CPU model gets none)."""
    merged: dict[str, Any] = {}
    for key in ("requests", "limits"):
        mine = {name: value for name, value in (user.get(key) or {}).items() if name != GPU_RESOURCE}
        values = {**mine, **(own.get(key) or {})}
        if values:
            merged[key] = values
    merged.update({k: copy.deepcopy(v) for k, v in user.items() if k not in ("requests", "limits")})
    return merged


def _by_key(own: Sequence[Mapping[str, Any]], user: Sequence[Mapping[str, Any]], *, key: str = "name",
            user_wins: Sequence[str] = ()) -> list[dict[str, Any]]:
    """kvgate's entries then the user's, one per `key` (a name; a volume mount's path): kvgate's wins
    a clash unless its key is in `user_wins`."""
    user_by_key = {u.get(key): u for u in user}
    kept = [copy.deepcopy(dict(user_by_key[o[key]] if o[key] in user_wins and o[key] in user_by_key else o))
            for o in own]
    taken = {entry[key] for entry in kept}
    return kept + [copy.deepcopy(dict(entry)) for entry in user if entry.get(key) not in taken]
