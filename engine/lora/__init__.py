"""Multi-LoRA serving: many PEFT adapters on one base model, several of them in one forward pass.

    errors.py    UnknownAdapter (404 upstream), AdapterLoadError (a bad adapter; the engine keeps serving)
    peft.py      adapter_config.json + adapter_model.safetensors -> a validated PeftAdapter (no torch)
    source.py    a local directory, or s3://bucket/prefix downloaded into the cache (s3.py, boto3)
    builtin.py   builtin:smollm2-demo-a/-b, two seeded demo adapters written into the cache
    manager.py   the registry and the slot table: LRU eviction of idle adapters, pins, deferred unloads

Plain Python; the weights live in engine/runner/lora.py, the only torch code of multi-LoRA.
"""

from __future__ import annotations

from kvgate.engine.lora.errors import AdapterLoadError, UnknownAdapter
from kvgate.engine.lora.manager import AdapterInfo, AdapterManager

__all__ = ["AdapterInfo", "AdapterLoadError", "AdapterManager", "UnknownAdapter"]
