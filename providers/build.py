"""`build_provider`: the one place that maps a registry Pool to its `Provider` implementation.

Each implementation module exposes `from_pool(pool_name, spec, *, cluster, clock, **options) -> Provider`.
Modules are imported inside their branch, so a cloud SDK (boto3, kubernetes) is imported only when a
pool uses that cloud.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvgate.clock import Clock
from kvgate.providers.base import Provider, ProviderError
from kvgate.providers.k8s_pod_template import EnginePodTemplate
from kvgate.registry.schema import PoolSpec, Provider as ProviderKind

_MODULES = {
    ProviderKind.FAKE: "kvgate.providers.fake",
    ProviderKind.LOCAL: "kvgate.providers.local",
    ProviderKind.AWS: "kvgate.providers.aws",
    ProviderKind.KUBERNETES: "kvgate.providers.kubernetes",
    ProviderKind.SLURM: "kvgate.providers.slurm",
}


def build_provider(pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock,
                   engine_pod_template: EnginePodTemplate | None = None, **options: Any) -> Provider:
    """The provider for pool `pool_name` of cluster `cluster`, chosen by `spec.provider`.

    `options` go to the implementation's `from_pool` (e.g. `cache_dir` for local, a boto3 `session` for
    aws). `engine_pod_template` (`kvgate autoscaler --engine-pod-template`) goes to the pools whose
    replicas are pods (kubernetes) and is ignored by the others, so one autoscaler can drive pools of
    every kind. Raises ProviderError when the implementation is not installed or not built yet."""
    if engine_pod_template is not None and spec.provider is ProviderKind.KUBERNETES:
        options = {**options, "pod_template": engine_pod_template}
    module_name = _MODULES[spec.provider]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ProviderError(f"pool {pool_name!r}: provider {spec.provider.value!r} cannot be loaded: {exc}") from exc
    return module.from_pool(pool_name, spec, cluster=cluster, clock=clock, **options)
