"""`kvgate up` end to end: one real `kvgate up` process (gateway, embedded autoscaler, local provider)
starting real `kvgate engine` child processes on builtin:tiny-llama, driven by the official `openai` SDK.

The tests run in file order against one process, as a user's session would: the first request scales
tiny-llama from zero, the OpenAI API works through the gateway (chat, completion, streaming, an
adapter), a model whose replica cannot start is reported and retried with back-off, the idle model
scales back to zero, and SIGTERM leaves no process behind. Short windows in the test registry keep the
whole module near 45 s on a 2-core box.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.up_process import UpProcess, alive, start_up, stop_for_sure
from tests.engine.peft_files import write_peft_dir
from tests.eventually import eventually_sync
from tests.services import free_loopback_port

MODEL = "tiny-llama"
ADAPTER = "sql"
BROKEN = "broken"  # its adapter's adapter_config.json has no rank: every engine start fails

REGISTRY = """\
apiVersion: kvgate/v1
kind: Model
metadata: {{name: tiny-llama}}
spec:
  source: builtin:tiny-llama
  engine: {{max_model_len_tokens: 512, kv_cache_bytes: 32MiB, max_loaded_adapters: 2}}
  # Idle for 2 s after the gateway's 10 s arrival window empties -> zero; decisions over 4 s windows.
  scaling: {{min_replicas: 0, max_replicas: 1, max_queue_wait_s: 60, scale_to_zero_grace_s: 2,
            stable_window_s: 4, panic_window_s: 1, scale_down_delay_s: 0, forecast_enabled: false}}
---
apiVersion: kvgate/v1
kind: Adapter
metadata: {{name: sql}}
spec: {{base_model: tiny-llama, source: "{adapters}/sql", rank: 4}}
---
apiVersion: kvgate/v1
kind: Model
metadata: {{name: broken}}
spec:
  source: builtin:tiny-llama
  engine: {{max_model_len_tokens: 256, kv_cache_bytes: 8MiB}}
  scaling: {{min_replicas: 1, max_replicas: 1}}
---
apiVersion: kvgate/v1
kind: Adapter
metadata: {{name: broken-lora}}
spec: {{base_model: broken, source: "{adapters}/broken", rank: 4}}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: local}}
spec:
  provider: local
  max_nodes: 2
  node_boot_s: 0
  offers: [{{instance_type: local-slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}}]
  local: {{host: 127.0.0.1, work_dir: "{work}"}}
"""


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    root = tmp_path_factory.mktemp("up")
    write_peft_dir(root / "adapters" / "sql")
    (root / "adapters" / "broken").mkdir(parents=True)
    (root / "adapters" / "broken" / "adapter_config.json").write_text("{}")
    (root / "registry").mkdir()
    (root / "registry" / "models.yaml").write_text(REGISTRY.format(adapters=root / "adapters", work=root / "work"))
    process = start_up(root / "registry", free_loopback_port(), root / "up.log", root / "work")
    try:
        yield process
    finally:
        stop_for_sure(process)
        print(f"\nkvgate up log: {process.log_path}")


def client(up: UpProcess) -> openai.OpenAI:
    # No SDK retries: a request that fails must fail the test, not be hidden by a second try.
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def model_stats(up: UpProcess, model: str) -> dict:
    return up.get_json("/admin/stats")["models"][model]


def test_the_first_request_waits_while_a_replica_starts_from_zero(up: UpProcess) -> None:
    assert model_stats(up, MODEL)["num_ready"] == 0 and up.replica_records(MODEL) == []
    sent_at = time.time()
    started = time.monotonic()
    reply = client(up).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello from zero"}], max_tokens=8, temperature=0)
    waited_s = time.monotonic() - started
    print(f"\nfirst request from zero: {waited_s:.1f} s")
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    [replica] = up.replica_records(MODEL)
    assert replica["started_at"] >= sent_at  # the replica was started for this request, not before it
    assert model_stats(up, MODEL)["num_ready"] == 1


def test_chat_completion_streaming_and_adapter_requests_through_the_openai_sdk(up: UpProcess) -> None:
    sdk = client(up)
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a chat"}], max_tokens=6)
    assert chat.object == "chat.completion" and chat.usage.completion_tokens > 0

    # Greedy, as the stream below: sampled from random weights, the first token was once end-of-sequence
    # (finish_reason "stop", no text), and six tokens were sometimes byte pieces that decode to one delta.
    completion = sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert completion.object == "text_completion" and completion.choices[0].text

    chunks = list(sdk.chat.completions.create(model=MODEL, stream=True, max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": "a stream"}]))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and streamed and chunks[-1].choices[0].finish_reason in ("length", "stop")

    adapted = sdk.chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "SELECT"}],
                                          max_tokens=6)
    assert adapted.model == ADAPTER and adapted.usage.completion_tokens > 0
    # The replica reports the adapter resident over its gRPC state stream (pushed, so not at once).
    eventually_sync(lambda: ADAPTER in model_stats(up, MODEL)["replicas"][0]["adapters_loaded"],
                    "the replica to report the adapter loaded", poll_s=0.1)


def test_a_replica_that_cannot_start_is_reported_and_retried_with_backoff(up: UpProcess) -> None:
    def failures() -> list[dict]:
        events = (up.get_json("/admin/stats").get("autoscaler") or {}).get("events", [])
        return [e for e in events if e["model"] == BROKEN and e["kind"] in ("replica_start", "replica_failed")]

    # start, fail, (back-off 5 s), start, fail: the autoscaler retries without spinning.
    kinds = ["replica_start", "replica_failed", "replica_start", "replica_failed"]
    events = eventually_sync(lambda: (e := failures()) and [x["kind"] for x in e][:4] == kinds and e,
                             "two failed starts", timeout_s=90, poll_s=0.1)  # two engine starts and the back-off
    first_failed, second_start = events[1], events[2]
    assert "key 'r' must be a positive integer" in first_failed["message"]  # the engine's own reason
    assert "next start in 5s" in first_failed["message"]
    assert second_start["t"] - first_failed["t"] >= 4.0  # backed off, not retried at once
    assert "backed off" in up.get_json("/admin/stats")["autoscaler"]["models"][BROKEN]["reason"]
    log = up.log()
    assert "key 'r' must be a positive integer" in log and f"{BROKEN}: replica_failed" in log
    # The URLs are printed once every model that must run has a replica ready or has failed.
    assert "OpenAI base URL  " + up.url + "/v1" in log and up.url + "/dashboard" in log


def test_the_idle_model_scales_back_to_zero(up: UpProcess) -> None:
    [replica] = up.replica_records(MODEL)
    started = time.monotonic()
    eventually_sync(lambda: up.replica_records(MODEL) == [] and model_stats(up, MODEL)["num_ready"] == 0,
                    "tiny-llama to scale to zero", timeout_s=60, poll_s=0.1)
    print(f"\nscaled to zero {time.monotonic() - started:.1f} s after the last test's requests")
    assert not alive(replica["pid"], replica["start_ticks"])
    assert "tiny-llama: scale_down: 1 -> 0: scale to zero" in up.log()


def test_sigterm_drains_and_stops_every_process(up: UpProcess) -> None:
    # A replica is running again (scaled from zero once more), so SIGTERM has an engine to stop.
    reply = client(up).completions.create(model=MODEL, prompt="again", max_tokens=4)
    assert reply.choices[0].text is not None
    [replica] = up.replica_records(MODEL)
    children = up.descendants()
    assert (replica["pid"], replica["start_ticks"]) in children

    started = time.monotonic()
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(timeout=45) == 0
    print(f"\nSIGTERM to exit: {time.monotonic() - started:.1f} s")
    assert [pid for pid, ticks in children if alive(pid, ticks)] == []
    assert up.replica_records() == [] and list((up.work_dir / "nodes").glob("*.json")) == []
    assert "every replica and node released" in up.log()
