"""The registry's document kinds: `Model`, `Adapter`, `Pool` and `Tenant`.

Each is a Kubernetes-style document (`apiVersion: kvgate/v1`, `kind`, `metadata.name`, `spec`).
Everything here is frozen and forbids unknown fields, so a typo is an error, not a silently ignored
setting. Checks that need only one document live here as validators; checks across documents (does
the adapter's base model exist?) live in `registry.checks`.

Units are in the names: `_s` seconds, `_ms` milliseconds, `_gib` GiB, `_bytes` bytes (which also
accept "512MiB"-style strings), `_usd_per_hour` US dollars per hour.
"""

from __future__ import annotations

import enum
import re
import unicodedata
from urllib.parse import urlsplit
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Annotated, Literal, Union

from pydantic import ByteSize, Field, field_validator, model_validator

from kvgate.registry.strict import FieldProblem, Strict as _Strict
from kvgate.registry.slurm import SlurmSettings
from kvgate.registry.tenant import RateLimits, StoreOutage, TenantSpec

API_VERSION = "kvgate/v1"
# A GPU kind naming "no accelerator": CPU-only nodes (the local demo pool) offer it with 0 GPUs.
CPU_KIND = "cpu"
BUILTIN_MODELS = ("tiny-llama", "smollm2-135m")
# The engine's built-in demo adapters (engine.lora.builtin) -> the built-in model each is made for.
BUILTIN_ADAPTERS = MappingProxyType({"smollm2-demo-a": "smollm2-135m", "smollm2-demo-b": "smollm2-135m"})

_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")


class Metadata(_Strict):
    name: str = Field(description="Unique per kind; lower-case letters, digits, '-' and '.', at most 63 characters "
                      "(a DNS label, so it can name Kubernetes objects and cloud tags).")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels, shown on the dashboard.")

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a valid name: use lower-case letters, digits, '-' and '.', "
                "starting and ending with a letter or digit, at most 63 characters"
            )
        return name


# Characters no registry value may carry into a file another program parses (a cloud-init document, a shell
# script): control, format and line/paragraph separators. YAML and shells split on them.
UNPRINTABLE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")
# Characters a value written unquoted into a node's shell script may not hold.
SHELL_SPECIAL = "\"'`$\\ "


def unprintable(text: str) -> str:
    """The line breaks and control or format characters in `text`, sorted, once each ("" for none)."""
    return "".join(sorted({ch for ch in text if unicodedata.category(ch) in UNPRINTABLE_CATEGORIES}))


def _check_source(source: str, *, builtins: Collection[str], what: str) -> str:
    """`builtins`: the names `builtin:NAME` may give; `what`: "model" or "adapter", for the message."""
    if unprintable(source):
        raise ValueError(f"{source!r} holds {unprintable(source)!r}: no line break or control character in a source")
    if source.startswith("builtin:"):
        if source.removeprefix("builtin:") not in builtins:
            allowed = ", ".join(f"builtin:{n}" for n in builtins)
            raise ValueError(f"unknown built-in {what} {source!r}; built-ins are {allowed}")
    elif source.startswith("s3://"):
        bucket = source.removeprefix("s3://").split("/", 1)[0]
        if not bucket:
            raise ValueError(f"{source!r} names no bucket; write s3://bucket/prefix")
    elif "://" in source:
        scheme = source.split("://", 1)[0]
        raise ValueError(f"unsupported scheme {scheme!r} in {source!r}; use a local path, s3://bucket/prefix"
                         " or builtin:NAME")
    elif not source.strip():
        raise ValueError("source is empty")
    return source


# ---------------------------------------------------------------------------------------------- Model


class RoutingPolicy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CONSISTENT_HASH = "consistent_hash"
    CACHE_AWARE = "cache_aware"


class Backend(str, enum.Enum):
    """What serves a static replica, which decides how the router reads its load."""

    KVGATE = "kvgate"  # the bundled engine: gRPC WatchState
    VLLM = "vllm"  # Prometheus /metrics, vllm:* names
    SGLANG = "sglang"  # Prometheus /metrics, sglang:* names
    OPENAI = "openai"  # any OpenAI-compatible server: only the gateway's own in-flight counts


class Resources(_Strict):
    gpu_kinds: tuple[str, ...] = Field(
        default=(CPU_KIND,), min_length=1,
        description="GPU kinds the model may run on, any of them (e.g. [H100, A100-80GB]); "
                    "'cpu' means no accelerator.",
    )
    gpu_count: int = Field(default=0, ge=0, le=64, description="GPUs one replica needs; 0 only with gpu_kinds [cpu].")
    min_gpu_memory_gib: float | None = Field(default=None, gt=0, description="Memory each GPU must have, in GiB.")

    @model_validator(mode="after")
    def _cpu_means_no_gpus(self) -> Resources:
        if self.gpu_count == 0 and set(self.gpu_kinds) != {CPU_KIND}:
            raise FieldProblem("gpu_kinds", f"gpu_count is 0 but gpu_kinds is {list(self.gpu_kinds)}; "
                             "a replica without GPUs runs on gpu_kinds [cpu], otherwise set gpu_count >= 1")
        if self.gpu_count > 0 and CPU_KIND in self.gpu_kinds:
            raise FieldProblem("gpu_kinds", f"gpu_kinds includes 'cpu' but gpu_count is {self.gpu_count}; use gpu_count 0 for cpu")
        return self


class EngineSettings(_Strict):
    block_size_tokens: int = Field(default=16, description="Tokens per KV-cache block; a power of two, 1 to 256.")
    max_model_len_tokens: int = Field(default=2048, ge=16, description="Longest prompt plus completion, in tokens.")
    max_batch_tokens: int = Field(default=2048, ge=16, description="Token budget of one engine step (chunked prefill).")
    max_running_requests: int = Field(default=64, ge=1, description="Sequences one replica runs at once.")
    kv_cache_bytes: ByteSize | None = Field(
        default=None, description="KV-cache memory per replica, e.g. 512MiB; unset: sized from free memory.")
    max_loaded_adapters: int = Field(default=4, ge=0, description="LoRA adapters held in memory at once (LRU).")
    max_adapter_rank: int = Field(default=16, ge=1, le=512, description="Largest LoRA rank the engine accepts.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"

    @field_validator("block_size_tokens")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 1 or value > 256 or value & (value - 1):
            raise ValueError(f"got {value}; allowed: a power of two from 1 to 256 (16 is usual)")
        return value


class StaticReplica(_Strict):
    url: str = Field(description="Base URL of an OpenAI-compatible server, e.g. http://10.0.0.5:8000.")
    backend: Backend = Field(default=Backend.OPENAI, description="What serves it: kvgate, vllm, sglang or openai.")
    grpc_target: str | None = Field(default=None, description="host:port of a kvgate engine's ReplicaState stream.")
    api_key_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of an environment variable of the gateway that holds the server's API key (vLLM's and "
                    "SGLang's --api-key), sent as `Authorization: Bearer <key>`; the key itself never goes in the "
                    "registry.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
            raise ValueError(f"{url!r} is not an http(s) URL like http://10.0.0.5:8000")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _one_credential(self) -> StaticReplica:
        if self.api_key_env is not None and urlsplit(self.url).username is not None:
            raise ValueError("give the server's credentials once: in the URL (user:password@) or as api_key_env")
        return self


class Routing(_Strict):
    policy: RoutingPolicy = Field(default=RoutingPolicy.CACHE_AWARE,
                                  description="round_robin, least_load, consistent_hash or cache_aware.")
    prefix_chunk_chars: int = Field(default=256, ge=16, le=65536,
                                    description="Characters per hashed prefix chunk of the canonical prompt.")
    load_epsilon: float = Field(default=0.25, ge=0, le=10,
                                description="Load bound: no replica above (1 + epsilon) x mean load + 1 "
                                            "while another has room.")
    min_match_fraction: float = Field(
        default=0.0, ge=0, le=1,
        description="cache_aware: a held prefix counts (lowers the cost, wins ties, is reported as a prefix hit) "
                    "only when it covers at least this share of the prompt past what every replica holds; raise "
                    "it if a short common opening draws new conversations to whoever holds it.")
    miss_cost_weight: float = Field(
        default=24.0, ge=1, le=1000,
        description="cache_aware: a replica's cost is its pending prefill tokens plus this weight x the prompt "
                    "tokens it does not hold; above 1, a cache miss also counts what it costs those behind it "
                    "and the conversation's later turns.")
    min_load_cap_requests: int = Field(
        default=8, ge=1,
        description="consistent_hash: the load bound never caps a replica below this many requests in flight. "
                    "cache_aware: the same, for a request whose own cached prefix the replica holds (an engine "
                    "batches that few at once, and moving the request costs its prefill); new text and a hot "
                    "prefix see the bound itself.")
    # Why 4: on hot_prefix at 16 simulated vLLM replicas (loadtests/routing_replay.py, 12 seeds) hit / best is
    # 0.965 at 3, 0.975 at 4, 0.983 at 6 and 0.988 at 8, while the busiest replica's requests over the mean
    # (worst seed) go 1.22, 1.36, 1.54, 1.78; live runs at 4 stayed within 1.25x (1.20-1.24). At 64 sims 4
    # gives 0.967 at 2.56x the mean, 2 gives 0.948 at 1.28x. kvgate engines, which compute a prompt shared by
    # requests admitted together once, reached 0.981-0.987 at 8 within 1.20x (0.976-0.978 at 4).
    hot_prefix_requests: int = Field(
        default=4, ge=1,
        description="cache_aware: a prefix that at least this many of the gateway's requests in flight at a "
                    "replica share is hot there, and the load bound holds for it: more requests for it go to "
                    "other replicas, which then hold it too (a burst on one system prompt spreads). Lower "
                    "spreads a burst sooner (2 spreads it evenly where bursts are small beside the fleet), "
                    "higher computes its prompt on fewer replicas (a fleet of kvgate engines may set 8).")
    over_bound_cost_tokens: float = Field(
        default=2000.0, ge=0,
        description="cache_aware: for a request whose own cached prefix a replica over the load bound holds "
                    "(and it is not hot there), each request over the bound (from min_load_cap_requests up) adds "
                    "this many tokens to that replica's cost instead of ruling it out, so a conversation stays "
                    "with its cache until the queue there outweighs prefilling it elsewhere; 1e9 rules such a "
                    "replica out past the floor.")
    working_set_share: float = Field(
        default=0.85, gt=0, le=1,
        description="cache_aware, for replicas that report their KV size: the prefixes "
                    "requests came back for at a replica (a system prompt, conversations' histories) are its "
                    "working set, and a prompt whose uncached part would not fit beside it in this share of "
                    "the replica's KV cache adds miss_cost_weight x the working-set tokens it would push out "
                    "to that replica's cost, so conversations move to a replica with room before they evict "
                    "each other's histories; 1 counts only what the whole cache cannot hold.")
    affinity_depth_chars: int = Field(
        default=1024, ge=1,
        description="Ties (new text on equally loaded replicas) go by rendezvous hash of this many characters "
                    "(whole chunks, at least one) past what every replica holds, the same in every gateway.")
    kv_events: bool = Field(
        default=True,
        description="cache_aware in front of kvgate engines: route on what each engine reports holding (its KV "
                    "block events, prompts tokenized with the engine's own tokenizer), which every gateway sees "
                    "alike; false: on this gateway's own index of what it sent (as for foreign servers), saving "
                    "the tokenizer's CPU at the gateway.")
    max_queued_requests: int = Field(default=256, ge=0,
                                     description="Requests held at a gateway while the model has no ready replica, "
                                                 "or while its replicas are saturated (fair_queueing).")
    fair_queueing: bool = Field(
        default=True,
        description="While every replica is saturated (max_in_flight_per_replica), hold further requests at the "
                    "gateway in queues per tenant and priority, served by weighted fair queuing, and shed the "
                    "lowest priority first (503, Retry-After) when its wait would break slo.ttft_ms; false: send "
                    "every request on at once and let the replicas queue them.")
    max_in_flight_per_replica: int | None = Field(
        default=None, ge=1,
        description="fair_queueing: the requests one replica runs at once (its batch: vLLM's max_num_seqs, "
                    "engine.max_running_requests); unset: learned, the most a replica has reported running while "
                    "it also reported requests waiting (offered one more every 30 s to show a larger batch).")
    max_retries: int = Field(default=2, ge=0, le=10, description="Retries on other replicas before the first byte.")
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    static_replicas: tuple[StaticReplica, ...] = Field(
        default=(), description="Existing servers to front (vLLM, SGLang, ...); such a model is not autoscaled.")


class Scaling(_Strict):
    min_replicas: int = Field(default=1, ge=0, description="Fewest replicas; 0 allows scale to zero.")
    max_replicas: int = Field(default=1, ge=1, description="Most replicas.")
    target_ongoing_requests: float = Field(default=8.0, gt=0,
                                           description="Queued plus running requests each replica should carry.")
    stable_window_s: float = Field(default=60.0, gt=0, description="Averaging window for normal decisions.")
    panic_window_s: float = Field(default=6.0, gt=0, description="Short window that detects bursts.")
    panic_threshold: float = Field(default=2.0, gt=1,
                                   description="Panic when panic-window demand reaches this multiple of capacity.")
    max_scale_up_rate: float = Field(default=10.0, gt=1, description="Most growth per decision, as a factor.")
    max_scale_down_rate: float = Field(default=2.0, gt=1, description="Most shrinkage per decision, as a divisor.")
    scale_up_delay_s: float = Field(default=0.0, ge=0)
    scale_down_delay_s: float = Field(default=30.0, ge=0)
    scale_to_zero_grace_s: float = Field(default=300.0, ge=0, description="Idle time before going to zero.")
    max_queue_wait_s: float | None = Field(
        default=None, gt=0,
        description="How long a request may wait at the gateway for a replica to start; required with min_replicas 0.")
    forecast_enabled: bool = Field(default=True, description="Start replicas one cold start ahead of forecast load.")

    @model_validator(mode="after")
    def _consistent(self) -> Scaling:
        if self.min_replicas > self.max_replicas:
            raise FieldProblem("min_replicas", f"min_replicas ({self.min_replicas}) is greater than max_replicas ({self.max_replicas})")
        if self.panic_window_s > self.stable_window_s:
            raise FieldProblem("panic_window_s", f"panic_window_s ({self.panic_window_s}) is longer than "
                             f"stable_window_s ({self.stable_window_s}); the panic window must be the shorter")
        if self.min_replicas == 0 and self.max_queue_wait_s is None:
            raise FieldProblem("min_replicas", "min_replicas is 0, so requests may arrive while no replica runs: "
                             "set max_queue_wait_s to say how long they may wait (e.g. 120)")
        return self


# The max_tokens cap of a model that fronts servers the registry did not start (routing.static_replicas), whose
# context length it does not know: 2^20 is above every completion a served model writes today (the longest,
# 128k-200k tokens) and far below the 10^12 a client could otherwise reserve against a token budget.
FRONTED_MAX_TOKENS_CAP = 1 << 20


class RequestLimits(_Strict):
    """Caps on what one request may ask for, checked at the gateway (400 naming the field) before any replica
    sees the request. The defaults never refuse what the model's replicas would serve."""

    max_tokens: int | None = Field(
        default=None, ge=1,
        description="Largest max_tokens or max_completion_tokens a request may ask for. Unset: "
                    "engine.max_model_len_tokens for a model whose replicas kvgate starts (prompt and completion "
                    "share that length, so its replicas refuse more anyway); 1048576 (2^20) for a model that "
                    "fronts routing.static_replicas, whose real length the registry does not know.")
    max_n: int = Field(
        default=16, ge=1, le=128,
        description="Largest n (choices per request; best_of too) a request may ask for. Each choice is a "
                    "sequence of its own, so n multiplies what one request costs a replica: 16 serves best-of and "
                    "voting clients while one request cannot fill a replica's batch (64 sequences by default); "
                    "OpenAI's own limit, 128, is the most allowed. (kvgate engines serve n 1 only.)")
    max_prompt_chars: int | None = Field(
        default=None, ge=1,
        description="Longest prompt in characters, counted as the gateway renders it for routing: each "
                    "message's role and content plus 2, tool definitions and non-text parts (an image's data URL) "
                    "as JSON; a completions prompt's text, or its token ids written 'id,' each. Characters, not "
                    "tokens: exact and cheap for every backend, where tokens would be an estimate. Unset: no cap "
                    "but the gateway's --max-body-bytes (no ratio of characters to tokens holds for every prompt, "
                    "so none is guessed from engine.max_model_len_tokens).")


class Placement(_Strict):
    pools: tuple[str, ...] = Field(default=(), description="Pools the model may use; empty means every pool.")
    allow_spot: bool = Field(default=False, description="May replicas run on spot capacity?")
    on_demand_base_replicas: int = Field(default=0, ge=0,
                                         description="Replicas kept on on-demand capacity when spot is allowed.")


class Slo(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0, description="Target time to first token.")
    ttft_attainment: float = Field(default=0.99, gt=0, lt=1,
                                   description="Share of requests that must meet ttft_ms; the autoscaler sizes the "
                                               "prefill queue for it (with performance figures).")
    time_per_output_token_ms: float | None = Field(default=None, gt=0, description="Target time per output token.")


class GpuPerformance(_Strict):
    """How fast one replica of the model runs on one GPU kind: the simulator's service model, and a
    hint for capacity planning. A replica runs in engine steps of `engine.max_batch_tokens`: prefill chunks beside
    the batch's decode (the simulator's `autoscaler/sim/batching.py`)."""

    gpu_kind: str = Field(description="The GPU kind these figures are for, e.g. H100 (one of resources.gpu_kinds).")
    prefill_tokens_per_s: float = Field(gt=0, description="Prompt tokens one replica prefills per second.")
    decode_tokens_per_s: float = Field(gt=0, description="Output tokens one replica generates per second, summed "
                                                         "over a full batch (each sequence gets this / max_batch).")
    max_batch: int | None = Field(default=None, ge=1, description="Sequences decoded at once on this kind; "
                                                                  "unset: engine.max_running_requests.")
    kv_cache_tokens: int | None = Field(default=None, ge=1,
                                        description="Tokens of KV cache one replica holds on this kind: the "
                                                    "simulator's prefix cache for traces with block hashes; unset: "
                                                    "no prefix cache.")


class Performance(_Strict):
    model_load_s: float = Field(default=60.0, ge=0,
                                description="From a usable node to a ready replica: weights fetch, load and warm-up. "
                                            "A cold start on a new node takes the pool's node_boot_s plus this.")
    gpu_kinds: tuple[GpuPerformance, ...] = Field(default=(), description="Throughput and batch limit per GPU kind.")

    @field_validator("gpu_kinds")
    @classmethod
    def _one_entry_per_kind(cls, entries: tuple[GpuPerformance, ...]) -> tuple[GpuPerformance, ...]:
        kinds = [entry.gpu_kind for entry in entries]
        duplicates = sorted({kind for kind in kinds if kinds.count(kind) > 1})
        if duplicates:
            raise ValueError(f"gpu kinds listed more than once: {duplicates}; give one entry per kind")
        return entries


class ModelSpec(_Strict):
    source: str = Field(description="Weights: a local HF directory, s3://bucket/prefix, or builtin:NAME "
                                    f"({', '.join(BUILTIN_MODELS)}).")
    description: str = ""
    resources: Resources = Field(default_factory=Resources)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    routing: Routing = Field(default_factory=Routing)
    scaling: Scaling = Field(default_factory=Scaling)
    placement: Placement = Field(default_factory=Placement)
    slo: Slo = Field(default_factory=Slo)
    performance: Performance = Field(default_factory=Performance)
    limits: RequestLimits = Field(default_factory=RequestLimits,
                                  description="Caps on max_tokens, n and prompt size per request, refused with 400.")

    @field_validator("source")
    @classmethod
    def _source(cls, source: str) -> str:
        return _check_source(source, builtins=BUILTIN_MODELS, what="model")

    @property
    def max_tokens_cap(self) -> int:
        """The max_tokens cap in force: `limits.max_tokens`, else its documented default."""
        if self.limits.max_tokens is not None:
            return self.limits.max_tokens
        return FRONTED_MAX_TOKENS_CAP if self.routing.static_replicas else self.engine.max_model_len_tokens

    @model_validator(mode="after")
    def _base_within_max(self) -> ModelSpec:
        if self.placement.on_demand_base_replicas > self.scaling.max_replicas:
            raise FieldProblem(("placement", "on_demand_base_replicas"), f"placement.on_demand_base_replicas ({self.placement.on_demand_base_replicas}) "
                             f"exceeds scaling.max_replicas ({self.scaling.max_replicas})")
        return self

    @model_validator(mode="after")
    def _max_tokens_within_length(self) -> ModelSpec:
        cap, length = self.limits.max_tokens, self.engine.max_model_len_tokens
        if cap is not None and cap > length and not self.routing.static_replicas:
            raise FieldProblem(("limits", "max_tokens"), f"limits.max_tokens ({cap}) exceeds "
                               f"engine.max_model_len_tokens ({length}), the longest prompt plus completion this "
                               f"model's replicas serve; lower it, or leave it unset to cap at {length}")
        return self


# -------------------------------------------------------------------------------------------- Adapter


class AdapterSpec(_Strict):
    base_model: str = Field(description="The Model this LoRA adapter applies to.")
    source: str = Field(description="A PEFT directory (adapter_config.json, adapter_model.safetensors), "
                                    "s3://bucket/prefix, or builtin:NAME, a demo adapter for builtin:smollm2-135m "
                                    f"({', '.join(BUILTIN_ADAPTERS)}).")
    rank: int = Field(ge=1, le=512, description="LoRA rank; at most the base model's engine.max_adapter_rank.")
    description: str = ""

    @field_validator("source")
    @classmethod
    def _source(cls, source: str) -> str:
        return _check_source(source, builtins=BUILTIN_ADAPTERS, what="adapter")


# ----------------------------------------------------------------------------------------------- Pool


class Provider(str, enum.Enum):
    LOCAL = "local"
    AWS = "aws"
    KUBERNETES = "kubernetes"
    SLURM = "slurm"
    FAKE = "fake"


class CapacityType(str, enum.Enum):
    SPOT = "spot"
    ON_DEMAND = "on_demand"


class Offer(_Strict):
    instance_type: str = Field(description="What the provider sells, e.g. p5.48xlarge, or a node class.")
    gpu_kind: str = Field(description="GPU kind, e.g. H100; 'cpu' for nodes without GPUs.")
    gpu_count: int = Field(ge=0, le=64)
    gpu_memory_gib: float = Field(default=0.0, ge=0, description="Memory per GPU.")
    cpus: int | None = Field(default=None, ge=1)
    memory_gib: float | None = Field(default=None, gt=0)
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    price_usd_per_hour: float = Field(ge=0, description="Price of one node.")
    zones: tuple[str, ...] = Field(default=(), description="Zones it is sold in; empty means any zone of the region.")

    @model_validator(mode="after")
    def _cpu_means_no_gpus(self) -> Offer:
        if (self.gpu_kind == CPU_KIND) != (self.gpu_count == 0):
            raise FieldProblem("gpu_count", f"gpu_kind {self.gpu_kind!r} with gpu_count {self.gpu_count}: "
                             "'cpu' offers have gpu_count 0, GPU offers have gpu_count >= 1")
        return self


class LocalSettings(_Strict):
    host: str = Field(default="127.0.0.1", description="Address engine replicas listen on.")
    work_dir: str = Field(default=".kvgate/local", description="Logs and pid files of local replicas.")


class KvgateInstall(_Strict):
    """Where a new EC2 node gets kvgate: exactly one of `preinstalled`, `wheel_url`, `index_url`.

    kvgate is not published on PyPI, so there is no default: a node that ran `pip install kvgate` from
    PyPI would get nothing (or, worse, whatever someone else published under the name)."""

    preinstalled: str | None = Field(default=None, description="Path of the `kvgate` command on the node's image "
                                     "(aws.image_id), e.g. /opt/kvgate/bin/kvgate: nothing is installed at boot.")
    wheel_url: str | None = Field(default=None, description="URL of a kvgate wheel (https:// or s3 presigned) "
                                  "that nodes pip install with the engine extra; its dependencies come from PyPI.")
    index_url: str | None = Field(default=None, description="A package index that serves kvgate and all its "
                                  "dependencies (a PyPI proxy such as devpi or Artifactory); the only index pip uses.")
    version: str | None = Field(default=None, description="With index_url: the kvgate version to install; "
                                "unset: the version of the autoscaler that buys the node.")

    @model_validator(mode="after")
    def _exactly_one(self) -> KvgateInstall:
        chosen = [name for name in ("preinstalled", "wheel_url", "index_url") if getattr(self, name)]
        if len(chosen) != 1:
            raise FieldProblem("preinstalled" if not chosen else chosen[1],
                               f"set exactly one of preinstalled, wheel_url, index_url (got {chosen or 'none'})")
        if self.version is not None and not self.index_url:
            raise FieldProblem("version", "version goes with index_url; a wheel or an image has its own")
        for name in ("preinstalled", "wheel_url", "index_url", "version"):
            value = getattr(self, name)
            if value is not None and (unprintable(value) or any(ch in value for ch in SHELL_SPECIAL)):
                raise FieldProblem(name, f"{value!r} holds a space, quote, '$', '\\', line break or control "
                                   "character")
        return self


class AwsSettings(_Strict):
    endpoint_url: str | None = Field(default=None, description="EC2 API endpoint override (tests, private APIs).")
    image_id: str | None = Field(default=None, description="AMI with drivers; unset: the provider's default.")
    subnet_ids: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    key_name: str | None = None
    iam_instance_profile: str | None = None
    install: KvgateInstall | None = Field(default=None, description="Where new nodes get kvgate (required to "
                                          "buy nodes): preinstalled on the image, a wheel URL, or a package index.")


class KubernetesSettings(_Strict):
    namespace: str = "default"
    kubeconfig: str | None = Field(default=None, description="Path to a kubeconfig; unset: in-cluster config.")
    context: str | None = None
    image: str | None = Field(default=None, description="Image that runs `kvgate engine`; unset: the engine pod "
                              "template's (`kvgate autoscaler --engine-pod-template`), else ghcr.io/kvgate/kvgate:latest.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="e.g. gpu.nvidia.com/class: H100; "
                                          "added to (and wins over) the engine pod template's nodeSelector.")
    node_pool: str | None = Field(default=None, description="A node-pool object the provider may resize.")


class PoolSpec(_Strict):
    provider: Provider = Field(description="local, aws, kubernetes, slurm or fake.")
    region: str | None = Field(default=None, description="Cloud region; required for aws.")
    offers: tuple[Offer, ...] = Field(default=(), description="What this pool sells, with prices; at least one, "
                                      "except in a slurm pool (its offerings come from sinfo).")
    max_nodes: int | None = Field(default=None, ge=0, description="Quota: most nodes at once.")
    max_gpus: int | None = Field(default=None, ge=0, description="Quota: most GPUs at once.")
    budget_usd_per_hour: float | None = Field(default=None, ge=0, description="Most spend per hour in this pool.")
    node_boot_s: float = Field(default=120.0, ge=0, description="Time from buying a node to it being usable.")
    local: LocalSettings | None = None
    aws: AwsSettings | None = None
    kubernetes: KubernetesSettings | None = None
    slurm: SlurmSettings | None = None

    @model_validator(mode="after")
    def _settings_match_provider(self) -> PoolSpec:
        provider = self.provider.value
        if self.provider is Provider.SLURM:
            if self.slurm is None:
                raise FieldProblem("slurm", "provider 'slurm' needs a slurm block: {partition: NAME, gpu_hour_usd: "
                                   "PRICE, gpu_types: {h100: {kind: H100}}}")
            if self.offers:
                raise FieldProblem("offers", "a slurm pool lists no offers: they come from sinfo, priced at "
                                   "slurm.gpu_hour_usd per GPU")
        elif not self.offers:
            raise FieldProblem("offers", "list at least one offer: what this pool sells, with its price")
        for block in ("local", "aws", "kubernetes", "slurm"):
            if getattr(self, block) is not None and block != provider:
                raise FieldProblem(block, f"has a '{block}' block but provider is {provider!r}; "
                                 f"only a '{provider}' block belongs here")
        if self.provider is Provider.AWS and not self.region:
            raise FieldProblem("provider", "provider 'aws' needs a region, e.g. region: us-east-1")
        if self.provider is Provider.AWS and (self.aws is None or self.aws.install is None):
            raise FieldProblem("aws", "provider 'aws' needs aws.install, where new nodes get kvgate: "
                               "{preinstalled: /opt/kvgate/bin/kvgate} (on the image), {wheel_url: https://...whl} "
                               "or {index_url: https://pypi.internal/simple}; kvgate is not on PyPI")
        return self


# ------------------------------------------------------------------------------------------ Documents


class _Document(_Strict):
    apiVersion: Literal["kvgate/v1"] = Field(description="Always kvgate/v1.")
    metadata: Metadata


class ModelDoc(_Document):
    """A served base model: where its weights are, what it needs, how it is routed and scaled."""

    kind: Literal["Model"]
    spec: ModelSpec


class AdapterDoc(_Document):
    """A LoRA adapter on a base model; clients name it in the request's `model` field."""

    kind: Literal["Adapter"]
    spec: AdapterSpec


class PoolDoc(_Document):
    """One place to buy nodes: a provider, a region, offers with prices, quota and budget."""

    kind: Literal["Pool"]
    spec: PoolSpec


class TenantDoc(_Document):
    """An API key (by hash), the models it may use and its rate limits."""

    kind: Literal["Tenant"]
    spec: TenantSpec


Document = Annotated[Union[ModelDoc, AdapterDoc, PoolDoc, TenantDoc], Field(discriminator="kind")]
DOCUMENT_CLASSES: Mapping[str, type[_Document]] = MappingProxyType({
    "Model": ModelDoc,
    "Adapter": AdapterDoc,
    "Pool": PoolDoc,
    "Tenant": TenantDoc,
})
KINDS = tuple(DOCUMENT_CLASSES)
