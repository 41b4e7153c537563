"""kvgate's config-as-code registry: Model, Adapter, Pool and Tenant documents in YAML.

`load_registry(dir)` returns an immutable, versioned `Snapshot` or raises `RegistryInvalid` listing
every problem with file and line. `plan` diffs two snapshots; `RegistryWatcher` hot-reloads.
"""

from kvgate.registry.loader import load_registry
from kvgate.registry.plan import Plan, plan
from kvgate.registry.problems import Problem, RegistryInvalid
from kvgate.registry.snapshot import Resolved, Snapshot, UnknownName
from kvgate.registry.watch import RegistryWatcher

__all__ = ["Plan", "Problem", "RegistryInvalid", "RegistryWatcher", "Resolved", "Snapshot", "UnknownName",
           "load_registry", "plan"]
