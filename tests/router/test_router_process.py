"""The `kvgate router` process itself: what it does on SIGTERM, against a simulated replica on a real socket."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from loadtests.sim_replica import SimReplicaConfig, start_sim_replica
from loadtests.sim_replica_model import SchedulerSpec
from tests.services import free_loopback_port

SLOW_SIM = SchedulerSpec(prefill_tokens_per_s=1e6, decode_tokens_per_s=20.0)  # 40 tokens: a 2 s stream


def kvgate_command() -> list[str]:
    script = Path(sys.executable).with_name("kvgate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvgate.cli"]


async def http_get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


async def test_sigterm_drains_in_flight_streams_refuses_new_requests_and_exits_zero(tmp_path: Path) -> None:
    sim = await start_sim_replica(SimReplicaConfig(model="m", scheduler=SLOW_SIM))
    (tmp_path / "registry.yaml").write_text(f"""apiVersion: kvgate/v1
kind: Model
metadata: {{name: m}}
spec:
  source: builtin:tiny-llama
  routing: {{static_replicas: [{{url: '{sim.url}'}}]}}
""")
    port = free_loopback_port()
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*kvgate_command(), "router", "--registry", str(tmp_path), "--port", str(port),
                                    "--drain-timeout-s", "20"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                if (await http_get(url + "/health"))[0] == 200:
                    break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a long answer"}], max_tokens=40, stream=True)
        chunks = [await anext(aiter(stream))]
        process.send_signal(signal.SIGTERM)
        status, health = await http_get(url + "/health")
        while status != 503:
            await asyncio.sleep(0.01)
            status, health = await http_get(url + "/health")
        assert health["status"] == "draining"  # load balancers stop sending here
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"]
        assert json.loads(refused.value.response.text)["error"]["code"] == "draining"
        chunks += [chunk async for chunk in stream]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"  # not cut short
        assert await asyncio.to_thread(process.wait, 30) == 0
        assert "kvgate router stopped" in log_path.read_text()
    finally:
        await client.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        await sim.close()
