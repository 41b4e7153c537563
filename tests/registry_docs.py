"""Registry documents several tests write (YAML text), so a change to a kind's schema is made once."""

from __future__ import annotations

from pathlib import Path


def local_pool(work_dir: Path, max_nodes: int = 1) -> str:
    """A `local` Pool (replicas are `kvgate engine` processes on this machine) of one free CPU offer."""
    return f"""apiVersion: kvgate/v1
kind: Pool
metadata: {{name: local}}
spec:
  provider: local
  max_nodes: {max_nodes}
  node_boot_s: 0
  offers: [{{instance_type: local-slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}}]
  local: {{host: 127.0.0.1, work_dir: "{work_dir}"}}
"""


def tiny_llama(scaling: str = "min_replicas: 1, max_replicas: 1") -> str:
    """Model `tiny-llama` on builtin weights with a small engine (512 tokens, 32 MiB of KV), `scaling` its
    scaling fields in flow style, ending in a document separator."""
    return f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: tiny-llama}}
spec:
  source: builtin:tiny-llama
  engine: {{max_model_len_tokens: 512, kv_cache_bytes: 32MiB}}
  scaling: {{{scaling}}}
---
"""


def static_model(url: str, name: str = "m") -> str:
    """Model `name` whose one replica is the static replica at `url` (no Pool, no autoscaling)."""
    return f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: {name}}}
spec:
  source: builtin:tiny-llama
  routing: {{static_replicas: [{{url: '{url}'}}]}}
"""
