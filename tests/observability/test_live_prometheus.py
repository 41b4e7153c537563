"""A real Prometheus (Debian's 2.42) scraping a real stack: `kvgate router` and `kvgate autoscaler` processes on a
real redis-server, and the `kvgate engine` replica the autoscaler starts (local pool, builtin:tiny-llama, one LoRA
adapter). Traffic through the official openai SDK, then every query of every Grafana panel is asked through
Prometheus's HTTP API and must return series with numbers, and every alert rule, loaded with `rule_files`, must
evaluate without an error. Nothing here is mocked; Kubernetes is not involved (the chart wraps these same files).

The table of query -> series is written to .test-artifacts/grafana-panels.json (docs/observability.md has it).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kvgate.clock import RealClock
from kvgate.state import RedisStateStore
from tests.engine.peft_files import write_peft_dir
from tests.eventually import eventually_sync
from tests.observability.observability import DASHBOARD, RULES, dashboard_targets
from tests.services import free_loopback_port, http_answers, kvgate_command, running

TOKEN = "scrape-token"
MODEL, ADAPTER = "tiny-llama", "sql"
ARTIFACTS = Path(__file__).resolve().parents[2] / ".test-artifacts"
SCRAPE_S = 1
RATE_WINDOW = "20s"  # what Grafana's $__rate_interval comes to at a 1 s scrape over a short range, rounded up

REGISTRY = """\
apiVersion: kvgate/v1
kind: Model
metadata: {{name: tiny-llama}}
spec:
  source: builtin:tiny-llama
  engine: {{max_model_len_tokens: 512, kv_cache_bytes: 32MiB, max_loaded_adapters: 2}}
  scaling: {{min_replicas: 1, max_replicas: 1, max_queue_wait_s: 60}}
  slo: {{ttft_ms: 5000}}
---
apiVersion: kvgate/v1
kind: Adapter
metadata: {{name: sql}}
spec: {{base_model: tiny-llama, source: "{adapters}/sql", rank: 4}}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: local}}
spec:
  provider: local
  max_nodes: 1
  node_boot_s: 0
  offers: [{{instance_type: local-slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 1.5}}]
  local: {{host: 127.0.0.1, work_dir: "{work}"}}
"""


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is not installed: run `make setup` (apt-get install prometheus)", pytrace=False)
    return path


def get_json(url: str, token: str | None = None) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def answers_ok(url: str) -> bool:
    """GET `url` answers 200 (Prometheus' /-/ready answers 503 while it loads)."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def engine_url(redis_url: str, prefix: str) -> str | None:
    """The URL of the ready replica the autoscaler published, None until there is one."""
    async def read() -> str | None:
        store = RedisStateStore.from_url(redis_url, RealClock(), prefix=prefix)
        try:
            ready = [m.url for m in await store.list_members() if m.state.value == "ready"]
        finally:
            await store.close()
        return ready[0] if ready else None
    return asyncio.run(read())


def prometheus_config(gateway: str, autoscaler: str, engine: str, rules: Path) -> str:
    def job(name: str, target: str, token: bool) -> str:
        auth = f"\n    authorization: {{type: Bearer, credentials: {TOKEN}}}" if token else ""
        return f"  - job_name: {name}\n    static_configs: [{{targets: ['{target}']}}]{auth}\n"
    return (f"global: {{scrape_interval: {SCRAPE_S}s, evaluation_interval: {SCRAPE_S}s}}\n"
            f"rule_files: ['{rules}']\nscrape_configs:\n"
            + job("kvgate-gateway", gateway, True) + job("kvgate-autoscaler", autoscaler, True)
            + job("kvgate-engine", engine, False))


def drive_traffic(base_url: str, seconds: float) -> None:
    """Chat and completions, streamed and not, on the model and its adapter, with a shared prefix so the
    prefix cache hits, and a few requests the gateway refuses: for `seconds`, from four clients."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    system = "You answer questions about the kvgate gateway in one short sentence. " * 6
    deadline = time.monotonic() + seconds

    def worker(index: int) -> None:
        turn = 0
        while time.monotonic() < deadline:
            turn += 1
            model = ADAPTER if turn % 3 == 0 else MODEL
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {index}.{turn}"}]
            if turn % 2:
                for _ in client.chat.completions.create(model=model, messages=messages, max_tokens=8, stream=True,
                                                        stream_options={"include_usage": True}):
                    pass
            else:
                client.chat.completions.create(model=model, messages=messages, max_tokens=8)
            if turn % 5 == 0:  # refused by the gateway: no such model (404), no body (400)
                with pytest.raises(openai.NotFoundError):
                    client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)
                with pytest.raises(openai.BadRequestError):
                    client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(worker, range(4)))


def query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    answer = get_json(url)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def substitute(expr: str) -> str:
    out = expr.replace("$__rate_interval", RATE_WINDOW).replace("$model", MODEL)
    assert "$" not in out, f"a dashboard variable this test does not know: {expr}"
    return out


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    write_peft_dir(tmp_path / "adapters" / "sql")
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "models.yaml").write_text(REGISTRY.format(adapters=tmp_path / "adapters",
                                                                       work=tmp_path / "work"))
    monkeypatch.setenv("KVGATE_METRICS_TOKEN", TOKEN)
    prefix = f"obs-{uuid.uuid4().hex[:8]}:"
    try:
        yield from _running_stack(tmp_path, redis_url, prefix)
    finally:  # `kvgate autoscaler` leaves its replicas running on SIGTERM, for the next autoscaler: release them
        asyncio.run(release_fleet(tmp_path / "registry"))


async def release_fleet(registry: Path) -> None:
    """Stop every replica and release every node the test's autoscaler left in its local pool."""
    from kvgate.providers.local import LocalProvider
    from kvgate.registry.loader import load_registry

    pool = load_registry(registry).pools["local"]
    provider = LocalProvider("local", pool.spec, cluster="default", clock=RealClock())
    try:
        for replica in await provider.list_replicas():
            await provider.stop_replica(replica.id, drain_deadline_s=5.0)
        for node in await provider.list():
            await provider.delete(node.id)
    finally:
        await provider.close()


def _running_stack(tmp_path: Path, redis_url: str, prefix: str) -> Iterator[dict[str, str]]:
    gateway_port, autoscaler_port, prometheus_port = free_loopback_port(), free_loopback_port(), free_loopback_port()
    common = ["--registry", str(tmp_path / "registry"), "--state", redis_url, "--key-prefix", prefix]
    gateway = f"127.0.0.1:{gateway_port}"
    with running([*kvgate_command(), "autoscaler", *common, "--interval-s", "0.5", "--metrics-port",
                  str(autoscaler_port)], name="kvgate autoscaler", timeout_s=60,
                 ready=lambda: http_answers(f"http://127.0.0.1:{autoscaler_port}/health"),
                 log_path=tmp_path / "autoscaler.log"), \
            running([*kvgate_command(), "router", *common, "--port", str(gateway_port)], name="kvgate router",
                    timeout_s=60, ready=lambda: http_answers(f"http://{gateway}/health"),
                    log_path=tmp_path / "router.log"):
        engine = eventually_sync(lambda: engine_url(redis_url, prefix), "the autoscaler's replica is ready", 120,
                                 poll_s=0.5)
        config = tmp_path / "prometheus.yml"
        config.write_text(prometheus_config(gateway, f"127.0.0.1:{autoscaler_port}", engine.split("//")[1], RULES))
        prometheus = f"http://127.0.0.1:{prometheus_port}"
        with running([prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                      f"--web.listen-address=127.0.0.1:{prometheus_port}", "--storage.tsdb.retention.time=1h"],
                     name="prometheus", timeout_s=60, ready=lambda: answers_ok(prometheus + "/-/ready"),
                     log_path=tmp_path / "prometheus.log"):
            yield {"gateway": "http://" + gateway, "prometheus": prometheus}


def test_every_grafana_panel_query_returns_data_from_a_live_stack(stack: dict[str, str]) -> None:
    prometheus = stack["prometheus"]
    eventually_sync(lambda: len([r for r in query(prometheus, "up") if r["value"][1] == "1"]) == 3,
                    "Prometheus scrapes the gateway, the autoscaler and the engine", 60, poll_s=0.5)
    drive_traffic(stack["gateway"], seconds=12)
    time.sleep(3 * SCRAPE_S)  # the last requests' counts scraped

    dashboard = json.loads(DASHBOARD.read_text())
    table, empty = [], []
    for panel, target in dashboard_targets(dashboard):
        expr = substitute(target["expr"])
        result = query(prometheus, expr)
        values = {", ".join(f"{k}={v}" for k, v in sorted(series["metric"].items())): float(series["value"][1])
                  for series in result}
        finite = {labels: round(v, 4) for labels, v in values.items() if math.isfinite(v)}
        table.append({"panel": panel["title"], "ref": target["refId"], "expr": target["expr"],
                      "series": len(result), "finite": len(finite), "values": finite})
        if not finite:
            empty.append(f"{panel['title']} [{target['refId']}]: {expr} -> {result}")
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "grafana-panels.json").write_text(json.dumps(table, indent=1))
    assert not empty, "panel queries with no data:\n" + "\n".join(empty)

    rules = get_json(prometheus + "/api/v1/rules")["data"]["groups"]
    evaluated = [rule for group in rules for rule in group["rules"]]
    assert evaluated and all(rule["health"] == "ok" for rule in evaluated), [
        (rule["name"], rule.get("lastError")) for rule in evaluated if rule["health"] != "ok"]
    quiet = {"KvgateNoReadyReplica", "KvgateServerErrorRatioHigh", "KvgateAutoscalerLeaseNotHeld",
             "KvgateNodeProvisioningStuck", "KvgateStateStoreUnreachable", "KvgateTtftOverSlo"}
    assert quiet <= {rule["name"] for rule in evaluated}
    assert [(rule["name"], rule["state"]) for rule in evaluated if rule["name"] in quiet and rule["state"] != "inactive"
            ] == []  # a healthy stack: none of these even pending
